"""The fault-and-load run (``tests/fault_load.py``) at CI size: 16 sessions talking for 30 s
through three worker processes and two session-service replicas while one worker is SIGKILLed,
another SIGSTOPped for 5 s and resumed, and the replica holding half the sessions SIGKILLed (its
callers resume on the other one).

Every fault must have happened (the killed processes are gone, the replica's callers resumed),
and under it all: every turn spoken is answered with a complete reply of its own utterance (no
exception for turns still in flight at the end: after T each turn gets 15 s more, far more than a
reply takes), no reply reaches the wrong session, no acknowledged input is lost, no worker holds a
session after all are closed, nothing failed closed, and no conversation stays behind real time
after a fault (its turns' end of speech -> first audio back near what it was before any).
``make soak`` runs the same at 64 sessions for 120 s. About 50 s on a 2-core machine.

The harness's content check itself (which reply is whose) is checked without processes, on replies
made the way the parrot makes them.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests.fault_load import PHRASES, PITCH, Matcher, Options, judge, run, speech_span, summary
from tests.procs import pid_alive
from worker_service.models.parrot import parrot_reply

FAULTS = ["SIGKILL worker", "SIGSTOP worker", "SIGCONT worker", "SIGKILL session replica"]


@pytest.mark.process
@pytest.mark.timeout(240)
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
        for key in (
            "wrong_session_replies",
            "lost_acked_turns",
            "worker_state_left",
            "fail_closed_steps",
            "lagging_turns",
        )
        if report[key] != 0
    }
    if report["turns_answered"] != report["turns_spoken"]:
        problems["turns spoken but not answered"] = report["turns_spoken"] - report["turns_answered"]
    assert not problems, f"{problems}\n{text.getvalue()}"


def _reply(matcher: Matcher, phrase: int, lead: int, tail: int) -> np.ndarray:
    """The parrot's reply to ``phrase`` when its VAD committed the speech span widened by ``lead``
    samples before and ``tail`` after (as it does, on its frame grid)."""
    voice = np.pad(matcher.voices[phrase], (4096, 4096))
    start, end = speech_span(matcher.voices[phrase])
    return parrot_reply(voice[4096 + start - lead : 4096 + end + tail], PITCH)


def test_replies_are_told_apart_by_content() -> None:
    matcher = Matcher()
    rng = np.random.default_rng(7)
    for phrase in range(PHRASES):
        other = (phrase + 1 + int(rng.integers(PHRASES - 1))) % PHRASES
        lead, tail = int(rng.integers(-500, 1500)), int(rng.integers(0, 3000))
        own = _reply(matcher, phrase, lead, tail)
        verdict = judge(matcher, own, phrase, completed=True)
        assert verdict.answers and not verdict.wrong, (phrase, verdict)
        # Another session's reply: wrong, whether it completed or was cut short.
        theirs = _reply(matcher, other, lead, tail)
        verdict = judge(matcher, theirs, phrase, completed=True)
        assert verdict.wrong and not verdict.matches and verdict.other_phrase == other, (phrase, verdict)
        verdict = judge(matcher, theirs[: len(theirs) // 2], phrase, completed=False)
        assert verdict.wrong and not verdict.answers, (phrase, verdict)
        # The own reply of only part of the utterance (input lost) does not answer the turn.
        start, end = speech_span(matcher.voices[phrase])
        verdict = judge(
            matcher, _reply(matcher, phrase, lead, tail - (end - start) // 2), phrase, completed=True
        )
        assert not verdict.answers and not verdict.wrong, (phrase, verdict)
        # Nor does a reply that did not complete.
        assert not judge(matcher, own, phrase, completed=False).answers
