"""The fault-and-load run (``tests/fault_load.py``) at CI size: 16 sessions talking for 30 s
through three worker processes and two session-service replicas while one worker is SIGKILLed,
another SIGSTOPped for 5 s and resumed, and the replica holding half the sessions SIGKILLed (its
callers resume on the other one).

Every fault must have happened (the killed processes are gone, the replica's callers resumed),
and under it all: every turn spoken is answered with a complete reply of its own utterance (no
exception for turns still in flight at the end: after T each turn gets 15 s more, far more than a
reply takes), no reply reaches the wrong session, no acknowledged input is lost, no worker holds a
session after all are closed, and nothing failed closed. ``make soak`` runs the same at 64 sessions
for 120 s. About 50 s on a 2-core machine.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.fault_load import Options, run, summary
from tests.procs import pid_alive

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

FAULTS = ["SIGKILL worker", "SIGSTOP worker", "SIGCONT worker", "SIGKILL session replica"]


def test_sessions_come_through_killed_and_hung_processes(tmp_path: Path) -> None:
    report = run(Options(sessions=16, seconds=30.0, log_dir=tmp_path))
    text = io.StringIO()
    summary(report, text)
    print(text.getvalue())  # shown with a failure

    # The faults happened.
    assert [f["fault"] for f in report["faults"]] == FAULTS, text.getvalue()
    killed = [f["pid"] for f in report["faults"] if f["fault"].startswith("SIGKILL")]
    assert not any(pid_alive(pid) for pid in killed), text.getvalue()
    assert report["sessions_resumed"] > 0, text.getvalue()
    assert report["turns_answered"] > 0, text.getvalue()

    # Nothing went wrong under them.
    problems = {
        key: report[key]
        for key in ("wrong_session_replies", "lost_acked_turns", "worker_state_left", "fail_closed_steps")
        if report[key] != 0
    }
    if report["turns_answered"] != report["turns_spoken"]:
        problems["turns spoken but not answered"] = report["turns_spoken"] - report["turns_answered"]
    assert not problems, f"{problems}\n{text.getvalue()}"
