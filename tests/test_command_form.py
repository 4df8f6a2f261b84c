"""``session_service.workers.command_form``: which submissions of a command go in columns, in an
order the worker's (aborts, columns, rows, releases) keeps per session."""

from __future__ import annotations

from duplex.audio import PCM16K_MONO
from duplex.v1 import worker_pb2
from session_service.workers.command_form import build_command, frame_bytes_of
from tests.worker_helpers import APPEND, COMMIT, FRAME, RESPOND, sub

FB = FRAME * 2
ONE, TWO = b"\x01" * FB, b"\x02" * 2 * FB


def test_appends_go_in_columns_unless_a_row_of_their_session_precedes_them() -> None:
    replayed = sub("r3", "s3", APPEND, seq=7, data=ONE, turn=2)
    replayed.replay = True
    subs = [
        sub("r1", "s1", APPEND, seq=1, data=TWO, epoch=4),
        sub("r1", "s1", COMMIT),
        sub("r1", "s1", APPEND, seq=2, data=ONE),  # after s1's COMMIT: a row, in order
        sub("r2", "s2", APPEND, seq=1, data=ONE, params={"silence_ms": 300.0}),  # options: a row
        sub("r2", "s2", APPEND, seq=2, data=ONE),  # after s2's row: a row
        replayed,
        sub("r4", "s4", APPEND, seq=1, data=ONE[:-2]),  # not whole frames: the worker refuses it
        sub("r5", "s5", RESPOND),
    ]
    abort = worker_pb2.Abort(request_id="r9", reason="barge_in")
    release = worker_pb2.Release(request_id="r8")
    cmd = build_command(subs, [abort], [release], frame_bytes=FB)
    cols = cmd.appends
    assert list(cols.request_id) == ["r1", "r3"] and list(cols.session_id) == ["s1", "s3"]
    assert list(cols.epoch) == [4, 1] and list(cols.turn_id) == [0, 2] and list(cols.seq) == [1, 7]
    assert list(cols.frames) == [2, 1] and cols.pcm == TWO + ONE
    assert list(cols.replay) == [False, True]
    assert [(s.request_id, s.kind, s.seq) for s in cmd.submit] == [
        ("r1", COMMIT, 0),
        ("r1", APPEND, 2),
        ("r2", APPEND, 1),
        ("r2", APPEND, 2),
        ("r4", APPEND, 1),
        ("r5", RESPOND, 0),
    ]
    assert list(cmd.abort) == [abort] and list(cmd.release) == [release]


def test_no_replay_column_when_nothing_is_replayed_and_rows_alone_for_a_worker_without_columns() -> None:
    subs = [sub("r1", "s1", APPEND, seq=1, data=ONE), sub("r2", "s2", APPEND, seq=1, data=ONE)]
    cmd = build_command(subs, [], [], frame_bytes=FB)
    assert list(cmd.appends.request_id) == ["r1", "r2"] and not cmd.appends.replay and not cmd.submit
    rows = build_command(subs, [], [], frame_bytes=0)
    assert not rows.HasField("appends") and list(rows.submit) == subs
    controls = build_command([sub("r1", "s1", COMMIT)], [], [], frame_bytes=FB)
    assert not controls.HasField("appends") and len(controls.submit) == 1


def test_a_worker_reads_columns_only_where_it_says_so() -> None:
    desc = worker_pb2.WorkerDescription(frame_samples=FRAME, audio_format=PCM16K_MONO.to_proto())
    assert frame_bytes_of(desc) == 0  # an older worker: it would ignore the columns
    desc.append_columns = True
    assert frame_bytes_of(desc) == FB
