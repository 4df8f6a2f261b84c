"""``benchmarks.worker_ceiling``: its pre-built commands are what the worker parses, and a tiny
ramp against a real worker process writes a result with sane values (no claim about speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.worker_ceiling import AppendColumnCommands, AppendCommands, _bracket, main, varint
from duplex.v1 import worker_pb2


def test_varint_is_protobufs() -> None:
    for n in (0, 1, 127, 128, 300, 2**21, 2**35 + 7):
        msg = worker_pb2.Submission(seq=n).SerializeToString()
        assert msg == (b"\x20" + varint(n) if n else b"")


def test_replayed_commands_parse_with_each_ticks_seq() -> None:
    ids = [f"c001-{i:06d}" for i in range(5)]
    pcm = bytes(range(256)) * 4
    commands = AppendCommands(ids, pcm)
    for seq in (1, 127, 128, 16_384, 10**9):
        cmd = worker_pb2.WorkerCommand.FromString(commands.build(seq))
        assert [s.request_id for s in cmd.submit] == ids
        for s in cmd.submit:
            assert s.seq == seq and s.pcm == pcm and s.kind == worker_pb2.SUBMISSION_KIND_APPEND
            assert (s.fence.session_id, s.fence.epoch, s.fence.turn_id) == (s.request_id, 1, 0)
    with pytest.raises(ValueError):
        AppendCommands(["a", "bb"], pcm)


def test_replayed_column_commands_parse_with_each_ticks_seq() -> None:
    ids = [f"c001-{i:06d}" for i in range(5)]
    pcm = bytes(range(256)) * 4
    commands = AppendColumnCommands(ids, pcm)
    for seq in (1, 127, 128, 16_384, 10**9):
        cols = worker_pb2.WorkerCommand.FromString(commands.build(seq)).appends
        assert list(cols.request_id) == ids and list(cols.session_id) == ids
        assert list(cols.seq) == [seq] * 5 and list(cols.frames) == [1] * 5 and cols.pcm == pcm * 5
        assert list(cols.epoch) == [1] * 5 and list(cols.turn_id) == [0] * 5


def test_ceiling_is_the_last_real_time_step_before_the_first_miss() -> None:
    def rows(*flags: tuple[int, bool]) -> list[dict[str, object]]:
        return [{"sessions": n, "real_time": ok} for n, ok in flags]

    assert _bracket(rows((64, True), (128, True), (256, False), (512, True))) == (128, 256)
    assert _bracket(rows((64, False))) == (0, 64)
    assert _bracket(rows((64, True), (32, True))) == (64, None)


@pytest.mark.process
def test_a_tiny_ramp_against_a_real_worker(tmp_path: Path) -> None:
    code = main(
        ["--steps", "4,8", "--seconds", "1", "--warmup", "0.3", "--refine", "0", "--out", str(tmp_path)]
    )
    assert code == 0
    result = json.loads((tmp_path / "worker_ceiling.json").read_text())
    assert result["section"] == "worker_ceiling" and result["model"] == "null"
    assert result["ceiling_sessions"] in (0, 4, 8)
    assert result["us_per_session_frame"] == {}  # 64, 256 and 1024 were not in the ramp
    rows = result["rows"]
    assert [r["sessions"] for r in rows] == [4, 8]
    for row in rows:
        n = row["sessions"]
        assert row["errors"] == {} and row["stream_ended"] is None
        assert row["frames_acked"] > 0 and 0 < row["consumed_fraction"] <= 1.5
        assert row["frames_submitted"] % n == 0
        assert row["us_per_session_frame"] is None or row["us_per_session_frame"] >= 0
        assert row["mean_batch"] is not None and 1 <= row["mean_batch"] <= n
        assert row["driver"]["commands_per_tick"] == 1
        assert row["tick_ack_ms"]["n"] > 0
