"""Shared fixtures: the in-process stack (workers and a session-service replica in the test's
own event loop; see ``tests.session_helpers.in_process_stack``).

Options come from ``stack`` markers on the test and its module (the test's win, key by key),
their keyword arguments those of ``in_process_stack``::

    @pytest.mark.stack(n_workers=2, runner={"idle_timeout_s": 20})
    async def test_x(stack: InProcessStack) -> None: ...

Tests that need more than one stack, or to start one mid-test, use ``in_process_stack`` (or
``worker_server`` / ``session_server``) directly as an async context manager.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.session_helpers import InProcessStack, in_process_stack


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stack(**options): options of the in-process `stack` fixture (see in_process_stack)"
    )


@pytest.fixture
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[InProcessStack]:
    """Workers and one session-service replica in this process, all on free ports of 127.0.0.1,
    every worker linked and healthy; stopped afterwards (the replica first, then the workers)."""
    options: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers("stack"))):  # the closest one wins
        options.update(marker.kwargs)
    async with in_process_stack(**options) as s:
        yield s
