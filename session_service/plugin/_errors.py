"""The plugin contract's errors: what a plugin raises for bad client options or a bad load."""

from __future__ import annotations

from collections.abc import Mapping

from duplex.errors import BadEventError, BadRequestError, ErrorCode


class RuntimeConfigError(BadEventError):
    """A plugin rejected client-visible runtime configuration (an error event, or a bad open)."""

    def __init__(self, message: str, *, code: ErrorCode | str = ErrorCode.INVALID_RUNTIME_CONFIG) -> None:
        super().__init__(code, message)


class PluginLoadError(BadRequestError):
    """The plugin path cannot be loaded or the plugin breaks its contract."""

    def __init__(self, message: str, *, code: ErrorCode | str = ErrorCode.INVALID_CONFIG) -> None:
        super().__init__(code, message)


def reject_private_runtime_keys(extra_body: Mapping[str, object], private_keys: frozenset[str]) -> None:
    """Refuse keys the plugin reserves for itself (code ``private_runtime_key``)."""
    found = sorted(private_keys.intersection(extra_body))
    if found:
        raise RuntimeConfigError(
            "extra_body may not set private runtime keys: " + ", ".join(found),
            code=ErrorCode.PRIVATE_RUNTIME_KEY,
        )
