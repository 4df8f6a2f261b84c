"""The benchmark harness's own logic (``benchmarks/``): parsing, statistics, judging a load step,
the capacity ramp, the profile summary, the report. No timings are asserted and no process is
started: the benchmarks' figures are for reading, never thresholds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks import _load, _profile, _services, _sys, capacity, grpc_echo, loadgen, report, run, tiers


def test_proc_stat_cpu_counts_fields_after_the_command_name():
    # utime 250 and stime 50 ticks; the command name holds spaces and parentheses.
    stat = "4242 (python (my) thing) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 7 0 100 0"
    assert _sys.parse_stat_cpu(stat, 100) == pytest.approx(3.0)


def test_proc_times_split_user_and_kernel_and_count_switches():
    stat = "4242 (python (my) thing) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 7 0 100 0"
    assert _sys.parse_stat_times(stat, 100) == pytest.approx((2.5, 0.5))
    status = "Name:\tpython\nvoluntary_ctxt_switches:\t120\nnonvoluntary_ctxt_switches:\t7\n"
    assert _sys.parse_status_switches(status) == 127
    here = _sys.proc_detail(os.getpid())
    assert here is not None and here["user_s"] > 0 and here["switches"] >= 1
    assert _sys.proc_detail(2**31 - 1) is None


def test_tiers_detail_is_per_session_frame():
    detail = {"session": {"user_s": 0.5, "system_s": 0.25, "switches": 11000.0}, "worker": None}
    per = tiers.per_frame_detail(detail, 1000.0)
    assert per["session"] == pytest.approx({"user_us": 500.0, "kernel_us": 250.0, "switches": 11.0})
    assert per["worker"] is None
    assert tiers.per_frame_detail(detail, 0.0)["session"] is None  # nothing measured is no figure


def test_the_worker_is_split_into_its_event_loop_and_its_other_threads():
    here = _sys.proc_detail(os.getpid())
    assert here is not None and 0 < here["main_s"] <= here["user_s"] + here["system_s"] + 0.02
    detail = {"worker": {"user_s": 0.1, "system_s": 0.05, "switches": 10.0, "main_s": 0.04}}
    per = tiers.per_frame_detail(detail, 1000.0)["worker"]
    assert per is not None and per["main_thread_us"] == pytest.approx(40.0)
    split = tiers.worker_split(per, 150.0, 70.0)
    assert split == pytest.approx({"event_loop": 40.0, "other_threads": 110.0, "other_beyond_model": 40.0})
    # Without a main-thread reading (or a worker figure) there is no split to report.
    assert tiers.worker_split({"user_us": 1.0, "kernel_us": 1.0, "switches": 1.0}, 150.0, 70.0) is None
    assert tiers.worker_split(per, None, 70.0) is None


def _worker_metrics(batch_sum: float, batches: float, step_s: float | None, helpers_s: float) -> str:
    """A worker's /metrics text with what the tiers read of it."""
    text = f"duplex_worker_batch_size_sum {batch_sum}\nduplex_worker_batch_size_count {batches}\n"
    if step_s is not None:
        text += (
            f'duplex_worker_model_cpu_seconds_total{{part="step"}} {step_s}\n'
            f'duplex_worker_model_cpu_seconds_total{{part="helpers"}} {helpers_s}\n'
        )
    return text


def test_tiers_mean_batch_and_cpu_per_frame_refuse_an_empty_window():
    a, b = _worker_metrics(10.0, 5.0, 1.0, 0.5), _worker_metrics(90.0, 15.0, 1.2, 0.6)
    assert tiers._mean_batch({"a": a, "b": b}) == (8.0, 10.0)
    with pytest.raises(_sys.NoMeasurement, match="no step"):
        tiers._mean_batch({"a": a, "b": a})
    with pytest.raises(_sys.NoMeasurement, match="could not be read"):
        tiers._mean_batch({"a": a})
    per = tiers._per_frame({"session": 0.4, "worker": None, "generator": 0.2, "other": 9.0}, 1000.0)
    assert per == pytest.approx({"session": 400.0, "worker": None, "generator": 200.0})


def test_the_model_in_place_and_the_worker_s_serving_beside_it():
    a, b = _worker_metrics(10.0, 5.0, 1.0, 0.5), _worker_metrics(90.0, 15.0, 1.2, 0.6)
    # 0.2 s of steps and 0.1 s of helper threads over 1,000 session-frames.
    in_place = tiers.model_in_place({"a": a, "b": b}, 1000.0)
    assert in_place == pytest.approx({"step": 200.0, "helpers": 100.0})
    assert tiers.serving(450.0, in_place) == pytest.approx(150.0)
    assert tiers.serving(None, in_place) is None and tiers.serving(450.0, None) is None
    # A worker without the counter (an older build) or a window not read: no figure, never zero.
    old = _worker_metrics(10.0, 5.0, None, 0.0)
    assert tiers.model_in_place({"a": old, "b": old}, 1000.0) is None
    assert tiers.model_in_place({"a": a}, 1000.0) is None
    assert _services.sample_value(a, "duplex_worker_batch_size_count") == 5.0
    assert _services.sample_value(a, "duplex_worker_model_cpu_seconds_total", 'part="helpers"') == 0.5
    assert _services.sample_value(a, "duplex_worker_model_cpu_seconds_total", 'part="other"') is None


def _session_metrics(commands: float, made: float | None, missed: float | None) -> str:
    text = (
        f"duplex_session_worker_command_items_sum {commands * 40}\n"
        f"duplex_session_worker_command_items_count {commands}\n"
    )
    for outcome, n in (("made", made), ("missed", missed)):
        if n is not None:
            text += (
                f'duplex_session_worker_tick_commands_total{{outcome="{outcome}",worker="127.0.0.1:1"}} {n}\n'
            )
    return text


def test_the_worker_links_commands_per_step_and_the_share_too_late_for_their_tick():
    a, b = _worker_metrics(10.0, 5.0, 1.0, 0.5), _worker_metrics(90.0, 105.0, 1.2, 0.6)  # 100 steps
    sa, sb = _session_metrics(50.0, 40.0, 0.0), _session_metrics(150.0, 137.0, 3.0)
    link = tiers.link_commands({"a": a, "b": b, "sa": sa, "sb": sb})
    assert link == pytest.approx({"per_step": 1.0, "missed_fraction": 0.03})
    # A worker that does not say which commands made its ticks: no share, never a zero.
    old = _session_metrics(50.0, None, None), _session_metrics(250.0, None, None)
    assert tiers.link_commands({"a": a, "b": b, "sa": old[0], "sb": old[1]}) == pytest.approx(
        {"per_step": 2.0}
    )
    assert tiers.link_commands({"a": a, "b": b}) is None  # the session service not read
    assert "1.00 commands per worker step, 3.0 %" in tiers._commands_note(link)
    assert tiers._commands_note(None) == ""


def test_the_model_paced_at_a_frame_period_steps_once_per_period():
    import torch

    from benchmarks.model_steps import ParrotLoop

    loop = ParrotLoop(torch.device("cpu"))
    with torch.inference_mode():
        paced = loop.measure(2, seconds=0.0, min_steps=5, pace_s=0.05)
    assert paced["steps"] == 5 and paced["ms_per_step"] >= 40.0  # four waits of 50 ms over five steps
    assert paced["cpu_us_per_frame"] > 0
    # Replies the same way: one per period, idle between.
    t0 = time.perf_counter()
    replies = loop.reply_synthesis(2, seconds=0.0, min_replies=4, pace_s=0.05)
    assert replies["replies"] == 4 and time.perf_counter() - t0 >= 0.15  # three waits of 50 ms
    assert replies["cpu_us_per_reply_frame"] > 0


def test_the_overhead_over_the_model_as_served_counts_its_paced_step_and_replies():
    row = {"reply_per_input": 0.5, "cpu_us_per_frame": {"worker": 300.0}}
    tiers.add_model_as_served(row, {"cpu_us_per_frame": 60.0}, {"cpu_us_per_reply_frame": 80.0})
    assert row["model_as_served_us_per_frame"] == pytest.approx(100.0)  # 60 + 80 x 0.5
    assert row["worker_overhead_as_served_us_per_frame"] == pytest.approx(200.0)
    row = {"reply_per_input": 0.5, "cpu_us_per_frame": {"worker": None}}
    tiers.add_model_as_served(row, {"cpu_us_per_frame": 60.0}, {"cpu_us_per_reply_frame": 80.0})
    assert row["worker_overhead_as_served_us_per_frame"] is None  # no worker CPU, no figure


def test_grpc_echo_floor_is_per_message_pair_and_refuses_an_empty_window():
    d0 = {"user_s": 1.0, "system_s": 0.5, "switches": 100.0}
    d1 = {"user_s": 1.2, "system_s": 0.6, "switches": 900.0}
    r = grpc_echo.per_pair(d0, d1, 1000.0)
    assert r == pytest.approx(
        {"cpu_us_per_pair": 300.0, "user_us": 200.0, "kernel_us": 100.0, "switches": 0.8}
    )
    with pytest.raises(_sys.NoMeasurement):
        grpc_echo.per_pair(d0, d1, 0.0)


def test_reply_synthesis_is_per_reply_frame_and_refuses_no_utterance():
    import torch

    from benchmarks.model_steps import ParrotLoop

    loop = ParrotLoop(torch.device("cpu"))
    r = loop.reply_synthesis(8, seconds=0.0, min_replies=2)
    assert r["utterance_frames"] == 8 and r["replies"] >= 2 and r["ms_per_reply"] > 0
    assert r["cpu_us_per_reply_frame"] == pytest.approx(1000.0 * r["ms_per_reply"] / 8)
    with pytest.raises(_sys.NoMeasurement, match="no utterance"):
        loop.reply_synthesis(0, seconds=0.0)


def test_cpu_seconds_of_this_process_and_of_none():
    assert _sys.cpu_seconds() is not None
    assert _sys.cpu_seconds(2**31 - 1) is None


def test_percentiles_are_observed_values_and_none_when_empty():
    values = list(range(1, 101))
    assert _sys.pct(values, 50) == 50
    assert _sys.pct(values, 99) == 99
    assert _sys.pct(values, 100) == 100
    assert _sys.pct([7.0], 99) == 7.0
    assert _sys.pct([], 99) is None
    s = _sys.summary_ms([])
    assert s["n"] == 0 and s["p99"] is None and s["max"] is None


def test_tape_is_whole_appends_and_speech_mode_pauses_for_the_reply():
    utterances = [bytes(2 * 16000), bytes(2 * 8000)]  # 1 s and 0.5 s
    for ms in (20, 40):
        ab = loadgen.append_bytes_for(ms)
        assert ab == 32 * ms
        for mode in ("speech", "duplex"):
            tape = loadgen.build_tape(utterances, mode=mode, append_bytes=ab, silence_ms=500, margin_ms=1000)
            assert len(tape) % ab == 0
    duplex = loadgen.build_tape(utterances, mode="duplex", append_bytes=640)
    assert len(duplex) == 2 * 24000  # back to back, already whole appends
    speech = loadgen.build_tape(utterances, mode="speech", append_bytes=640, silence_ms=500, margin_ms=1000)
    # each utterance + (silence + its own length + margin)
    assert len(speech) == 2 * (16000 + 40000 + 8000 + 32000)
    assert loadgen.pause_ms(2 * 16000, silence_ms=500, margin_ms=1000) == 2500


def test_fixture_utterances_are_the_sixteen_phrases():
    utterances = loadgen.fixture_utterances()
    assert len(utterances) == 16
    assert all(len(u) % 2 == 0 and len(u) > 16000 for u in utterances)


def test_sessions_split_over_generators():
    assert _load.split(10, 3) == [4, 3, 3]
    assert _load.split(2, 4) == [1, 1, 0, 0]
    assert sum(_load.split(161, 2)) == 161


def _merged(**over):
    m = {
        "sessions": 4,
        "append_ms": 20,
        "window_s": 8.0,
        "ack_ms": [1.0] * 990 + [20.0] * 10,
        "late_ms": [0.5] * 100,
        "first_audio_ms": [30.0],
        "turns": 10,
        "answered": 10,
        "unanswered": {},
        "reply_frames": 100.0,
        "per_session": [{"index": i, "sent": 400, "acked": 400, "unacked_at_end": 1} for i in range(4)],
        "errors": {},
        "closed": {},
        "failures": [],
        "failed_sessions": 0,
        "cancelled": 0,
    }
    m.update(over)
    return m


def test_a_clean_step_holds():
    assert _load.judge(_merged()) == []


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"ack_ms": [1.0] * 95 + [40.0] * 5}, "ack p99"),
        ({"ack_ms": []}, "no append was acknowledged"),
        ({"late_ms": [50.0] * 10}, "behind its schedule"),
        ({"per_session": [{"index": 0, "sent": 400, "acked": 300, "unacked_at_end": 1}]}, "acks behind"),
        ({"per_session": [{"index": 0, "sent": 400, "acked": 400, "unacked_at_end": 20}]}, "unacknowledged"),
        ({"per_session": [{"index": 0, "sent": 0, "acked": 0, "unacked_at_end": 0}]}, "sent nothing"),
        ({"errors": {"internal": 1}}, "error events"),
        ({"closed": {"slow_consumer": 1}}, "closed"),
        ({"failed_sessions": 1, "failures": ["session 3: UNAVAILABLE"]}, "stream(s) failed"),
        ({"turns": 0, "answered": 0}, "no turn ended"),
        ({"answered": 9, "unanswered": {"CANCELLED barge_in": 1}}, "1 of 10 turns unanswered"),
    ],
)
def test_a_step_fails_with_its_reason(over, needle):
    why = _load.judge(_merged(**over))
    assert why and any(needle in w for w in why), why


def test_turns_are_not_required_where_none_are_expected():
    assert _load.judge(_merged(turns=0, answered=0), turns=False) == []


def test_merge_joins_latencies_and_sums_counts():
    a = _merged()
    b = _merged(turns=3, answered=2, unanswered={"x": 1}, errors={"e": 2})
    m = _load.merge([a, b])
    assert len(m["ack_ms"]) == 2000
    assert m["turns"] == 13 and m["answered"] == 12
    assert m["unanswered"] == {"x": 1} and m["errors"] == {"e": 2}
    assert len(m["per_session"]) == 8


def _runner(holds_up_to):
    ran = []

    def run_step(n):
        ran.append(n)
        return {"sessions": n, "pass": n <= holds_up_to, "why": [] if n <= holds_up_to else ["too many"]}

    return ran, run_step


def test_ramp_stops_at_the_first_step_that_does_not_hold():
    ran, step = _runner(48)
    cap, rows, stopped = capacity.ramp([16, 32, 48, 64, 96], step, confirm=False)
    assert cap == 48 and not stopped
    assert ran == [16, 32, 48, 64]
    assert [r["pass"] for r in rows] == [True, True, True, False]


def test_a_failing_step_is_confirmed_once_and_a_passing_repeat_counts():
    ran, step = _runner(48)
    cap, rows, _ = capacity.ramp([16, 32, 48, 64], step)
    assert cap == 48 and ran == [16, 32, 48, 64, 64]  # 64 failed twice
    verdicts = iter([True, False, True, False, False])

    def flaky(n):
        ok = next(verdicts)
        return {"sessions": n, "pass": ok, "why": [] if ok else ["spike"]}

    cap, rows, _ = capacity.ramp([16, 32, 48], flaky)
    # 32 failed once (a spike), held on the repeat; 48 failed twice
    assert cap == 32
    assert [(r["sessions"], r["attempt"], r["pass"]) for r in rows] == [
        (16, 1, True),
        (32, 1, False),
        (32, 2, True),
        (48, 1, False),
        (48, 2, False),
    ]


def test_ramp_halves_below_a_first_step_that_fails():
    ran, step = _runner(5)
    cap, _, _ = capacity.ramp([16, 32], step, confirm=False)
    assert cap == 4
    assert ran == [16, 8, 4]


def test_ramp_reports_none_when_not_even_one_session_holds():
    ran, step = _runner(0)
    cap, rows, _ = capacity.ramp([4, 8], step)
    assert cap is None
    assert ran == [4, 4, 2, 2, 1, 1]
    assert not rows[-1]["pass"]


def test_ramp_stops_when_the_time_budget_is_spent():
    ran, step = _runner(1000)
    budget = iter([False, False, True])
    cap, rows, stopped = capacity.ramp([16, 32, 48, 64], step, lambda: next(budget), confirm=False)
    assert (cap, ran, stopped) == (32, [16, 32], True)
    assert len(rows) == 2


_ENTRY = (
    "_run_module_as_main (<frozen runpy>:198);main (session_service/api/cli.py:332);"
    "run (session_service/api/server.py:248);run_forever (asyncio/base_events.py:607)"
)
COLLAPSED = "\n".join(
    [
        f"thread (0x1): MainThread;{_ENTRY};Handle._run (asyncio/events.py:80);"
        "SessionRunner._on_append (session_service/session/runner.py:417);"
        "Emitter.acks (session_service/session/emitter.py:64) 6",
        f"thread (0x1): MainThread;{_ENTRY};EpollSelector.select (selectors.py:468) 3",
        "thread (0x2): Thread-1 (_poll_wrapper);Thread._bootstrap (threading.py:1002);"
        "Thread.run (threading.py:982) 1",
    ]
)


def test_profile_top_functions_own_inclusive_and_threads():
    top = _profile.top_functions(COLLAPSED, n=5)
    assert top["samples"] == 10
    assert top["own"][0] == {
        "function": "session_service/session/emitter.py:Emitter.acks",
        "samples": 6,
        "share": 0.6,
    }
    inclusive = [t["function"] for t in top["inclusive"]]
    # project code only, the entry chain (cli main, server run) left out
    assert inclusive[:2] == [
        "session_service/session/emitter.py:Emitter.acks",
        "session_service/session/runner.py:SessionRunner._on_append",
    ] or set(inclusive[:2]) == {
        "session_service/session/emitter.py:Emitter.acks",
        "session_service/session/runner.py:SessionRunner._on_append",
    }
    assert not any("cli.py" in f or "server.py" in f or "asyncio" in f for f in inclusive)
    assert top["threads"] == {"MainThread": 9, "Thread-1 (_poll_wrapper)": 1}


NATIVE = "\n".join(
    [
        "thread (0x1): MainThread;Handle._run (asyncio/events.py:80);0x7f2bbc0f3b13 "
        "(grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so);sendmsg (libc.so.6) 4",
        "thread (0x1): MainThread;Handle._run (asyncio/events.py:80);"
        "0x7f2bbbd7cc26 (grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so) 2",
        "thread (0x1): MainThread;SessionRunner._run (session_service/session/runner.py:271);"
        "AckWindow.consumed (session_service/session/ack_window.py:90) 2",
        "thread (0x1): MainThread;EpollSelector.select (selectors.py:468) 2",
    ]
)


def test_profile_areas_with_native_frames():
    top = _profile.top_functions(NATIVE, n=3)
    assert top["samples"] == 10
    own = {t["function"]: t["samples"] for t in top["own"]}
    # unresolved Cython addresses are one function per library
    assert own["libc.so.6:sendmsg"] == 4 and own["_cython/cygrpc.cpython-311-x86_64-linux-gnu.so:?"] == 2
    areas = top["areas"]
    assert areas["libc (syscalls: sendmsg, write, getpid...; malloc)"] == pytest.approx(0.4)
    assert areas["gRPC (C core, Cython, grpc.aio)"] == pytest.approx(0.2)
    assert areas["project code (duplex, session_service)"] == pytest.approx(0.2)
    assert areas["asyncio event loop"] == pytest.approx(0.2)
    assert top["through_grpc"] == pytest.approx(0.6)


def test_every_model_section_gets_the_device_and_threads():
    for quick in (False, True):
        for module, _title, argv, timeout in run.sections("cuda:1", 2, quick=quick):
            assert timeout > 0
            if module == "grpc_hop":  # no model, no worker
                continue
            i = argv.index("--device")
            assert argv[i + 1] == "cuda:1", module
            assert argv[argv.index("--torch-threads") + 1] == "2", module


def test_cuda_runs_are_recorded_apart_from_the_cpu_record():
    cpu, gpu = run.artifacts("cpu"), run.artifacts("cuda")
    assert cpu["latest"].name == gpu["latest"].name == "latest.json"
    assert cpu["latest"] != gpu["latest"] and gpu["latest"].parent.name == "gpu"
    assert cpu["markdown"].name == "BENCHMARKS.md"


def _sections():
    step = {
        "sessions": 16,
        "append_ms": 20,
        "ack_ms": {"n": 10, "p50": 1.0, "p90": 2.0, "p99": 12.5, "max": 20.0},
        "first_audio_ms": {"n": 3, "p50": 30.0, "p90": 35.0, "p99": 40.0, "max": 40.0},
        "late_ms": {"n": 10, "p50": 0.1, "p90": 0.2, "p99": 0.3, "max": 1.0},
        "turns": 3,
        "answered": 3,
        "unanswered": {},
        "cpu_pct": {"session": 40.0, "worker": 30.0, "generator": 20.0, "other": 5.0},
        "pass": True,
        "why": [],
    }
    failing = {**step, "sessions": 24, "pass": False, "why": ["ack p99 40.0 ms >= 32 ms"]}
    ramp = {"append_ms": 20, "max_batch": None, "capacity": 16, "steps": [step, failing], "at_capacity": step}
    lanes_fail = {
        **step,
        "sessions": 128,
        "pass": False,
        "why": ["ack p99 35.0 ms >= 32 ms"],
        "cpu_pct": {"session": 70.0, "worker": 60.0, "generator": 40.0, "other": 5.0},
    }
    ceiling_row = {
        "sessions": 256,
        "real_time": True,
        "us_per_session_frame": 18.0,
        "worker_cpu_pct": 14.5,
        "mean_batch": 256.0,
        "mean_step_ms": 0.44,
        "tick_ack_ms": {"n": 93, "p50": 5.5, "p90": 6.5, "p99": 7.9, "max": 7.9},
        "lag_frames_max": 0.0,
        "consumed_fraction": 1.0,
        "other_cpu_pct": 0.0,
        "driver": {"us_per_session_frame": 2.9},
    }
    behind = {
        **ceiling_row,
        "sessions": 320,
        "real_time": False,
        "us_per_session_frame": 24.8,
        "worker_cpu_pct": 24.5,
        "tick_ack_ms": {"n": 93, "p50": 7.7, "p90": 60.0, "p99": 156.9, "max": 156.9},
        "lag_frames_max": 4.0,
        "consumed_fraction": 0.9893,
        "other_cpu_pct": 81.0,
    }
    ceiling = {
        "model": "null",
        "seconds": 2.0,
        "warmup_s": 1.0,
        "max_lag_frames": 3.0,
        "min_consumed_fraction": 0.95,
        "ceiling_sessions": 256,
        "first_behind_sessions": 320,
        "us_per_session_frame": {"64": 28.5, "256": 18.0, "1024": 22.8},
        "rows": [{**ceiling_row, "sessions": 64, "us_per_session_frame": 28.5}, ceiling_row, behind],
    }
    return {
        "worker_ceiling": ceiling,
        "worker_ceiling_parrot": {
            **ceiling,
            "model": "parrot",
            "ceiling_sessions": 512,
            "first_behind_sessions": None,
            "us_per_session_frame": {"64": 82.0, "256": 47.0},
            "rows": [{**ceiling_row, "sessions": 64, "us_per_session_frame": 82.0}],
        },
        "capacity": {
            "floor": {
                "append_ms": 20,
                "echo": {"streams": 16, "cpu_us_per_pair": 200.0, "user_us": 90.0, "kernel_us": 110.0},
                "floor_sessions": 100.0,
                "capacity": 16,
                "capacity_fraction_of_floor": 0.16,
            },
            "ramps": {
                "20ms": ramp,
                "20ms_lanes": {**ramp, "lanes": True, "capacity": 96, "steps": [step, lanes_fail]},
                "40ms": {**ramp, "append_ms": 40, "capacity": 24},
                "40ms_batch1": {**ramp, "append_ms": 40, "max_batch": 1, "capacity": 8},
            },
            "batching_gain": 3.0,
            "profile": {
                "sessions": 16,
                "seconds": 8,
                "samples": 10,
                "own": [{"function": "a.py:f", "samples": 6, "share": 0.6}],
                "inclusive": [{"function": "session_service/x.py:g", "samples": 6, "share": 0.6}],
                "all_threads": {"threads": {"MainThread": 9}},
            },
        },
        "tiers": {
            "sessions": 64,
            "append_ms": 32,
            "window_s": 8.0,
            "frames": 8000.0,
            "reply_per_input": 0.95,
            "mean_batch": 1.2,
            "steps_in_window": 500.0,
            "cpu_us_per_frame": {"session": 700.0, "worker": 1000.0, "generator": 400.0},
            "cpu_detail_per_frame": {
                "session": {"user_us": 500.0, "kernel_us": 200.0, "switches": 11.25},
                "worker": None,
                "generator": {"user_us": 300.0, "kernel_us": 100.0, "switches": 8.0},
            },
            "model_at_mean_batch": {"batch": 1, "cpu_us_per_frame": 400.0},
            "model_at_n": {"batch": 32, "cpu_us_per_frame": 60.0},
            "model_paced_at_mean_batch": {"batch": 1, "cpu_us_per_frame": 700.0},
            "reply_synthesis": {
                "utterance_frames": 32,
                "replies": 9,
                "ms_per_reply": 3.2,
                "cpu_us_per_reply_frame": 105.0,
            },
            "model_reply_us_per_frame": 100.0,
            "grpc_echo": {"cpu_us_per_pair": 175.0, "user_us": 85.0, "kernel_us": 90.0, "switches": 8.0},
            "held_real_time": True,
            "why": [],
            "separate_acks": False,
            "separate_acks_compared": {
                "cpu_us_per_frame": {"session": 810.0, "worker": 1010.0, "generator": 480.0},
                "frames": 8000.0,
                "held_real_time": True,
                "why": [],
            },
            "load": {"ack_ms": {"p50": 3.0, "p99": 21.5}},
            "step_interval_compared": {
                "step_interval_ms": 8.0,
                "frames": 8000.0,
                "mean_batch": 8.1,
                "cpu_us_per_frame": {"session": 640.0, "worker": 720.0, "generator": 390.0},
                "ack_p99_ms": 24.25,
                "held_real_time": True,
                "why": [],
            },
            "lanes_compared": {
                "flush_ms": 8.0,
                "frames": 8000.0,
                "mean_batch": 60.8,
                "model_at_mean_batch": {"batch": 61, "cpu_us_per_frame": 50.0},
                "model_reply_us_per_frame": 25.0,
                "model_whole_us_per_frame": 75.0,
                "worker_overhead_us_per_frame": 625.0,
                "model_in_place_us_per_frame": {"step": 95.0, "helpers": 40.0},
                "worker_serving_us_per_frame": 565.0,
                "model_as_served_us_per_frame": 120.0,
                "worker_overhead_as_served_us_per_frame": 580.0,
                "link_commands": {"per_step": 1.02, "missed_fraction": 0.011},
                "cpu_us_per_frame": {"session": 280.0, "worker": 700.0, "generator": 90.0},
                "ack_p99_ms": 15.5,
                "held_real_time": True,
                "why": [],
            },
        },
        "against_baseline": {
            "base_commit": "48d51cc881316bace4a10fd3b9b80c44a1464c89",
            "sessions": 32,
            "window_s": 6.0,
            "rounds": [
                {
                    "base_first": True,
                    "base": {"session_us": 600.0, "held_real_time": True},
                    "streams": {"session_us": 480.0, "held_real_time": True},
                    "lanes": {"session_us": 270.0, "held_real_time": True},
                    "streams_over_base": 0.8,
                    "lanes_over_base": 0.45,
                },
                {
                    "base_first": False,
                    "base": {"session_us": 650.0, "held_real_time": True},
                    "streams": {"session_us": 500.0, "held_real_time": True},
                    "lanes": {"session_us": 300.0, "held_real_time": True},
                    "streams_over_base": 500.0 / 650.0,
                    "lanes_over_base": 300.0 / 650.0,
                },
            ],
            "target": 0.5,
            "streams_over_base": 0.7846,
            "lanes_over_base": 0.4558,
            "held_real_time": True,
        },
        "hop_latency": {
            "rows": [
                {
                    "sessions": 1,
                    "hop_ms": {"p50": 2.0, "p90": 3.0, "p99": 4.0, "max": 5.0},
                    "appends": 100,
                    "cpu_pct": {},
                },
                {
                    "sessions": 64,
                    "hop_ms": {"p50": 3.0, "p90": 5.0, "p99": 9.0, "max": 12.0},
                    "appends": 100,
                    "cpu_pct": {},
                },
            ]
        },
        "e2e_bench": {
            "cycle": 32,
            "rows": [
                {
                    "model": "parrot",
                    "batch": 64,
                    "alone_in_fps": 10.0,
                    "e2e_in_fps": 4.0,
                    "e2e_out_fps": 4.0,
                    "in_ratio": 0.4,
                    "x_realtime": 2.0,
                    "min_share": 0.9,
                },
                {
                    "model": "synthetic",
                    "batch": 64,
                    "alone_in_fps": 10.0,
                    "e2e_in_fps": 2.0,
                    "e2e_out_fps": 2.0,
                    "in_ratio": 0.2,
                    "x_realtime": 1.0,
                    "min_share": 0.9,
                },
            ],
        },
        "model_steps": {
            "device": "cpu",
            "torch_threads": 1,
            "rows": [{"batch": 1, "ms_per_step": 0.5, "cpu_us_per_frame": 450.0, "frames_per_s": 2000.0}],
            "bisect": [],
            "largest_batch_within_frame": 512,
            "first_batch_over_frame": 1024,
        },
        "grpc_hop": {
            "streams": 64,
            "pack": 64,
            "single_chunks_per_s": 10000.0,
            "packed_chunks_per_s": 90000.0,
            "packed_over_single": 9.0,
        },
    }


def test_headline_figures_and_targets():
    h = report.headline(_sections())
    assert h["capacity_sessions"] == 16
    assert h["capacity_p99_ack_ms"] == 12.5
    assert h["capacity_sessions_40ms"] == 24
    assert h["session_cpu_us_per_frame"] == 700.0
    assert h["model_cpu_us_per_frame"] == 400.0
    assert h["session_over_model"] == pytest.approx(1.75)
    # The model's whole share counts its reply synthesis (helper threads) beside its step.
    assert h["model_reply_us_per_frame"] == 100.0
    assert h["worker_over_model_whole"] == pytest.approx(2.0)
    assert h["hop_p99_ms_64"] == 9.0
    assert h["e2e_ratio_parrot_b64"] == 0.4
    assert h["batching_gain"] == 3.0
    met = {t["key"]: t["met"] for t in report.targets(h)}
    assert met == {
        "capacity_sessions": False,
        "session_cpu_us_per_frame": False,
        "batching_gain": False,
        "hop_p99_ms_64": False,
        "e2e_ratio_parrot_b64": True,
        "e2e_ratio_synthetic_b64": False,
        # Against the baseline's code measured in the same minutes: the target is half.
        "session_over_baseline_now": False,
        "lanes_over_baseline_now": True,
        # The frame clock's targets.
        "capacity_sessions_lanes_20ms": False,
        "capacity_fraction_of_floor_streams_20ms": False,
        "mean_batch_fraction_64_streams": False,
        "mean_batch_fraction_64_lanes": True,
        "worker_overhead_us_per_frame_streams": False,
        "worker_overhead_us_per_frame_lanes": False,
        "worker_ceiling_sessions": False,
    }


def test_frame_clock_figures_mean_batch_overhead_ceiling_capacity_floor():
    h = report.headline(_sections())
    # The mean batch over the sessions with input (all 64 stream), in both client modes.
    assert h["mean_batch_fraction_64_streams"] == pytest.approx(1.2 / 64)
    assert h["mean_batch_fraction_64_lanes"] == pytest.approx(60.8 / 64)
    # Worker overhead: the worker's CPU minus the model's whole share at its batch (step + replies),
    # computed from the parts where the window has no figure of its own.
    assert h["worker_overhead_us_per_frame_streams"] == pytest.approx(1000.0 - 400.0 - 100.0)
    assert h["worker_overhead_us_per_frame_lanes"] == 625.0
    assert h["model_whole_us_per_frame_lanes"] == 75.0
    # ... and over the model as a frame clock runs it (paced plain loop), where the window has one.
    assert h["model_as_served_us_per_frame_lanes"] == 120.0
    assert h["worker_overhead_as_served_us_per_frame_lanes"] == 580.0
    assert h["worker_overhead_as_served_us_per_frame_streams"] is None  # the streams window has none
    assert h["worker_ceiling_sessions"] == 256 and h["worker_ceiling_first_behind"] == 320
    assert h["worker_ceiling_is_lower_bound"] is False
    assert h["worker_ceiling_us_per_frame_64"] == 28.5 and h["worker_ceiling_us_per_frame_1024"] == 22.8
    assert h["worker_ceiling_sessions_parrot"] == 512 and h["worker_ceiling_parrot_us_per_frame_64"] == 82.0
    assert h["worker_ceiling_parrot_us_per_frame_512"] is None  # not in the parrot's ramp: no figure
    assert h["capacity_sessions_lanes_20ms"] == 96 and h["capacity_lanes_is_lower_bound"] is False
    assert h["capacity_fraction_of_floor_streams_20ms"] == 0.16 and h["capacity_floor_sessions_20ms"] == 100.0
    # No step at 64 sessions in the 20 ms ramp: no first-audio figure at 64.
    assert h["first_audio_p99_ms_64"] is None and h["first_audio_64_held"] is None


def test_first_audio_at_64_is_the_last_attempt_at_64_in_the_20ms_ramp():
    sections = _sections()
    ramp = sections["capacity"]["ramps"]["20ms"]
    first = {**ramp["steps"][0], "sessions": 64, "pass": False, "first_audio_ms": {"p50": 90.0, "p99": 300.0}}
    again = {**first, "pass": True, "attempt": 2, "first_audio_ms": {"p50": 80.0, "p99": 120.0}}
    ramp["steps"] = [*ramp["steps"], first, again]
    h = report.headline(sections)
    assert h["first_audio_p99_ms_64"] == 120.0 and h["first_audio_64_held"] is True


def test_ramp_halves_no_lower_than_its_smallest():
    tried: list[int] = []

    def run_step(n: int) -> dict:
        tried.append(n)
        return {"sessions": n, "pass": False}

    cap, _rows, stopped = capacity.ramp([64, 128], run_step, confirm=False, smallest=16)
    assert cap is None and not stopped and tried == [64, 32, 16]


def test_floor_sessions_are_one_core_over_the_echo_per_append():
    # 200 µs per message pair, 50 appends a second per session: 10 ms of a core per session.
    assert capacity.floor_sessions(200.0, 20) == pytest.approx(100.0)
    assert capacity.floor_sessions(200.0, 40) == pytest.approx(200.0)
    with pytest.raises(_sys.NoMeasurement):
        capacity.floor_sessions(0.0, 20)


def test_tiers_model_share_and_overhead_of_a_compared_window():
    row = {
        "mean_batch": 48.0,
        "reply_per_input": 0.5,
        "cpu_us_per_frame": {"worker": 300.0},
        "model_in_place_us_per_frame": {"step": 90.0, "helpers": 50.0},
    }
    tiers.add_model_share(row, {"batch": 48, "cpu_us_per_frame": 40.0}, {"cpu_us_per_reply_frame": 60.0}, 64)
    assert row["model_reply_us_per_frame"] == pytest.approx(30.0)
    assert row["model_whole_us_per_frame"] == pytest.approx(70.0)
    assert row["worker_overhead_us_per_frame"] == pytest.approx(230.0)
    assert row["worker_serving_us_per_frame"] == pytest.approx(160.0)  # beside the model in place
    assert row["mean_batch_fraction"] == pytest.approx(0.75)
    assert tiers.overhead(None, 70.0) is None  # no worker CPU, no figure


def test_a_missing_section_is_none_never_zero():
    h = report.headline({})
    for key in (
        "capacity_sessions",
        "capacity_p99_ack_ms",
        "session_cpu_us_per_frame",
        "worker_cpu_us_per_frame",
        "model_cpu_us_per_frame",
        "batching_gain",
        "hop_p99_ms_64",
        "e2e_ratio_parrot_b64",
        "e2e_ratio_synthetic_b64",
        "session_over_baseline_now",
        "lanes_over_baseline_now",
        "mean_batch_fraction_64_streams",
        "mean_batch_fraction_64_lanes",
        "worker_overhead_us_per_frame_streams",
        "worker_overhead_us_per_frame_lanes",
        "worker_ceiling_sessions",
        "capacity_sessions_lanes_20ms",
        "capacity_fraction_of_floor_streams_20ms",
        "first_audio_p99_ms_64",
    ):
        assert key in h and h[key] is None, key
    assert all(t["met"] is None for t in report.targets(h))


def test_report_writes_latest_markdown_and_plots(tmp_path: Path):
    results = tmp_path / "results"
    results.mkdir()
    for name, data in _sections().items():
        (results / f"{name}.json").write_text(json.dumps(data))
    (results / "run.json").write_text(
        json.dumps(
            {
                "started": "2026-11-30T00:00:00+00:00",
                "git": {"commit": "abc123", "subject": "s", "dirty": False},
                "machine": {"cpu_model": "Test CPU", "cores": 2},
                "device": "cpu",
                "sections": {"capacity": {"seconds": 10, "ok": True, "reason": ""}},
            }
        )
    )
    dest = tmp_path / "out"
    baseline = tmp_path / "baseline.json"
    paths = {
        "markdown": dest / "BENCHMARKS.md",
        "latest": dest / "latest.json",
        "baseline": baseline,
        "plots": dest / "plots",
    }
    first = report.write_all(results, paths, notes_path=tmp_path / "none.md")
    md = paths["markdown"].read_text()
    assert "No `baseline.json` yet" in md and "Test CPU" in md and "**missed**" in md
    latest = json.loads(paths["latest"].read_text())
    assert latest["capacity_sessions"] == 16 and latest["run"]["git"]["commit"] == "abc123"
    # The tiers' second window (an input_ack event per append) is a figure and a table of its own.
    assert latest["session_cpu_us_per_frame"] == 700.0
    assert latest["session_cpu_us_per_frame_separate_acks"] == 810.0
    assert "| session service | 700 | 810 |" in md
    # Where the tiers' CPU goes: user space, the kernel, context switches (a process not measured
    # has no row, rather than zeros).
    assert "| session service | 500 | 200 | 11.2 |" in md
    assert "| load generator (client) | 300 | 100 | 8.0 |" in md
    assert "| worker | 1000 | 2.0x |" in md and "| worker | —" not in md
    assert "| model alone: its reply synthesis (helper threads, once per turn) | 100 | — |" in md
    assert "| model alone: its whole share | 500 | 1x |" in md
    # The worker's step interval beside the default: its own table and figures.
    assert "| worker's mean batch | 1.2 | 8.1 |" in md
    assert "| session service µs per session-frame | 700 | 640 |" in md
    assert "| worker µs per session-frame | 1000 | 720 |" in md and "| ack p99 ms | 21.5 | 24.2 |" in md
    assert latest["session_cpu_us_per_frame_step_interval"] == 640.0
    assert latest["worker_cpu_us_per_frame_step_interval"] == 720.0
    # Clients on lanes of one ConverseMany stream beside one stream per session: a table and figures.
    assert "| lanes, sent every 8 ms |" in md
    assert "| session service µs per session-frame | 700 | 280 |" in md
    assert "| load generator µs per session-frame | 400 | 90 |" in md and "| ack p99 ms | 21.5 | 15.5 |" in md
    assert (
        latest["session_cpu_us_per_frame_lanes"] == 280.0 and latest["worker_cpu_us_per_frame_lanes"] == 700.0
    )
    assert latest["lanes_flush_ms"] == 8.0 and latest["lanes_ack_p99_ms"] == 15.5
    assert latest["session_kernel_us_per_frame"] == 200.0 and latest["session_switches_per_frame"] == 11.25
    # The transport's floor beside the model's.
    assert "| bare gRPC echo, same message rate (per message pair) | 175 |" in md
    assert "| bare gRPC echo (per message pair) | 85 | 90 | 8.0 |" in md
    assert latest["grpc_echo_us_per_pair"] == 175.0 and latest["session_over_grpc_echo"] == pytest.approx(4.0)
    # Against the baseline's code, measured in turn: every round, its order and ratios, the medians.
    assert latest["lanes_over_baseline_now"] == 0.4558 and latest["session_over_baseline_now"] == 0.7846
    assert "commit `48d51cc88131`" in md
    assert "| 1 | baseline | 600 | 480 | 270 | 0.80x | 0.45x |" in md
    assert "| 2 | this tree | 650 | 500 | 300 | 0.77x | 0.46x |" in md
    assert "| median |  |  |  |  | 0.78x | 0.46x |" in md
    # The frame clock's figures: overhead rows, the worker's ceiling, the lanes' capacity, the floor.
    assert "| worker overhead: the worker minus the model's whole share | 500 | 1.0x |" in md
    assert "| worker overhead µs per session-frame | 500 | 625 |" in md
    # The overhead's parts: the model as served against its plain loop, and serving beside it.
    assert latest["model_in_place_us_per_frame_lanes"] == 135.0
    assert latest["model_paced_us_per_frame"] == 700.0
    assert latest["worker_serving_us_per_frame_lanes"] == 565.0
    assert latest["worker_serving_us_per_frame_streams"] is None  # the streams window had no counter
    assert (
        "the model as served (its own CPU counter) spent 95 µs in its steps and 40 in its helper threads "
        "against 50 and 25 in its plain loop (its step once a frame period in a plain loop: 700" in md
    )
    assert "serving beside it cost the worker 565 µs" in md
    # The worker link's commands per worker step, where the window read them.
    assert latest["worker_commands_per_step_lanes"] == 1.02
    assert latest["worker_tick_missed_fraction_lanes"] == 0.011
    assert latest["worker_commands_per_step_streams"] is None
    assert "the worker link wrote 1.02 commands per worker step (1.1 % too late for their tick)" in md
    assert "| worker's mean batch / sessions with input | 0.02 | 0.95 |" in md
    assert "| near-zero (`null`) | **256** | 320 | 28.5 | 18.0 | 22.8 |" in md
    assert "| parrot | ≥ **512** | none | 82.0 | 47.0 | — |" in md
    assert "| 320 | **no** | 24.8 | 24 | 256 | 0.44 | 157 | 4.0 | 98.9 | 81 | 2.9 |" in md
    assert "lanes of one `ConverseMany` stream: capacity **96**" in md
    assert "one core could hold at most 100 sessions" in md and "**0.16** of it" in md
    # What bounds a missed target, from the run's own data.
    assert "- worker ceiling: first behind at 320 sessions with the worker at 24 % of a core" in md
    assert "- lanes capacity: 96 held; at 128: ack p99 35.0 ms >= 32 ms (CPU % session" in md
    assert "the floor allows 100 per core" in md
    assert latest["worker_ceiling_sessions"] == 256 and latest["capacity_sessions_lanes_20ms"] == 96
    for png in ("capacity.png", "tiers.png", "hop.png", "e2e.png", "model_steps.png"):
        path = paths["plots"] / png
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size < 150_000
    # The next run compares with the baseline.
    base = {k: v for k, v in dict(first, capacity_sessions=8).items() if not k.endswith("_lanes")}
    baseline.write_text(json.dumps(base))
    report.write_all(results, paths, notes_path=tmp_path / "none.md")
    md = paths["markdown"].read_text()
    assert "Compared with the baseline" in md and "2.00x better" in md
    # The lanes' figures are compared with the baseline's one-stream-per-session figures.
    assert (
        "| session service CPU per session-frame, sessions as lanes of one ConverseMany stream "
        "| 700.0 | 280.0 | 0.40x better |" in md
    )
    assert "| session service over the baseline's (one stream per session) | 1.00x | 0.40x |" in md


def test_e2e_refuses_a_stalled_measurement():
    from benchmarks import e2e_bench

    with pytest.raises(_sys.NoMeasurement, match="no input acknowledged"):
        e2e_bench.check_flow("parrot", 2, [10, 0], 100, [])
    with pytest.raises(_sys.NoMeasurement, match="no reply audio"):
        e2e_bench.check_flow("parrot", 2, [10, 10], 0, [])
    e2e_bench.check_flow("parrot", 2, [10, 10], 100, [])


def test_a_run_beside_other_work_is_flagged():
    run_meta = {
        "sections": {
            "tiers": {"seconds": 20, "ok": True, "other_cores": 0.1},
            "capacity": {"seconds": 200, "ok": True, "other_cores": 1.3},
            "e2e_bench": {"seconds": 50, "ok": True, "other_cores": None},
        }
    }
    assert report.contended(run_meta) == {"capacity": 1.3}
    md = report.markdown({"run": run_meta, "targets": [], "sections": {}}, None, {}, "")
    assert "busy with other work" in md and "capacity 1.30" in md


def test_against_baseline_alternates_and_judges_each_round_by_its_own_baseline():
    from benchmarks import against_baseline as ab

    assert [ab.base_first(i) for i in range(4)] == [True, False, True, False]

    def window(us: float, held: bool = True) -> dict:
        return {"session_us": us, "held_real_time": held}

    rounds = [
        {"base": window(600), "streams": window(480), "lanes": window(240)},
        {"base": window(700), "streams": window(490), "lanes": window(420)},
        {"base": window(500), "streams": window(400), "lanes": window(200)},
    ]
    v = ab.judge(rounds)
    assert [r["lanes_over_base"] for r in rounds] == pytest.approx([0.4, 0.6, 0.4])
    assert v["lanes_over_base"] == pytest.approx(0.4) and v["lanes_met"]
    assert v["streams_over_base"] == pytest.approx(0.8) and not v["streams_met"]
    assert v["held_real_time"]
    rounds[1]["lanes"] = window(420, held=False)
    assert not ab.judge(rounds)["held_real_time"]
    with pytest.raises(_sys.NoMeasurement, match="no round"):
        ab.judge([])


def test_against_baseline_refuses_a_window_without_session_cpu_and_a_record_without_a_commit(tmp_path: Path):
    from benchmarks import against_baseline as ab

    figures = ab.window_figures(
        {"cpu_us_per_frame": {"session": 610.0, "worker": 700.0}, "mean_batch": 2.4, "held_real_time": True},
        "x",
    )
    assert figures["session_us"] == 610.0 and figures["worker_us"] == 700.0 and figures["mean_batch"] == 2.4
    with pytest.raises(_sys.NoMeasurement, match="the baseline's window measured no session-service CPU"):
        ab.window_figures({"cpu_us_per_frame": {"session": None}}, "the baseline's")
    record = tmp_path / "baseline.json"
    record.write_text(json.dumps({"run": {"git": {"commit": "abc123"}}}))
    assert ab.baseline_commit(record) == "abc123"
    record.write_text(json.dumps({"run": {}}))
    with pytest.raises(_sys.NoMeasurement, match="names no commit"):
        ab.baseline_commit(record)


def test_against_baseline_checks_out_a_commit_of_a_real_repository(tmp_path: Path):
    import subprocess

    from benchmarks import against_baseline as ab

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("VALUE = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    first = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (repo / "pkg" / "mod.py").write_text("VALUE = 2\n")
    subprocess.run([*git, "commit", "-q", "-am", "two"], check=True)
    dest = tmp_path / "tree"
    dest.mkdir()
    ab.checkout(first, dest, repo=repo)
    assert (dest / "pkg" / "mod.py").read_text() == "VALUE = 1\n"  # that commit's, not the work tree's
    with pytest.raises(_sys.NoMeasurement, match="is not in this clone"):
        ab.checkout("0" * 40, tmp_path / "none", repo=repo)
    # A name that git would take for an option is only ever a revision (there is none such).
    with pytest.raises(_sys.NoMeasurement, match="is not in this clone"):
        ab.checkout("--output=/tmp/x", tmp_path / "none", repo=repo)
    not_a_clone = tmp_path / "plain"
    not_a_clone.mkdir()
    with pytest.raises(_sys.NoMeasurement, match="is not a git clone"):
        ab.checkout(first, tmp_path / "none", repo=not_a_clone)


def test_command_forms_measures_both_forms_of_a_command_the_worker_queues_whole() -> None:
    from benchmarks import command_forms

    rows = command_forms.measure(4)
    assert [r["form"] for r in rows] == ["rows", "columns"]
    assert all(r["session_us_per_session"] > 0 and r["worker_us_per_session"] > 0 for r in rows)
    assert rows[1]["bytes_per_session"] < rows[0]["bytes_per_session"]  # one PCM field, no message each


def test_step_forms_measures_both_forms_and_columns_are_smaller_on_the_wire() -> None:
    from benchmarks import step_forms

    rows = step_forms.measure(4)
    assert [(r["form"], r["audio"]) for r in rows] == [
        ("rows", False),
        ("columns", False),
        ("rows", True),
        ("columns", True),
    ]
    assert all(r["worker_us_per_session"] > 0 and r["session_us_per_session"] > 0 for r in rows)
    # The columns carry the same fences and acks in fewer bytes (no message per request).
    assert rows[1]["bytes_per_session"] < rows[0]["bytes_per_session"]
    assert rows[3]["bytes_per_session"] < rows[2]["bytes_per_session"]
