"""``benchmarks.grpc_echo``: the transport's floor the tiers section measures. Its server is a real
process listening on a port, so: loopback only, bounded messages, gone with its parent's stdin."""

from __future__ import annotations

import grpc
import pytest

from benchmarks import grpc_echo


def _same(b: bytes) -> bytes:
    return b


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) with a listening socket on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if int(hex_port, 16) == port and state == "0A":  # LISTEN
                    found.add(addr)
    return found


@pytest.fixture
def echo_server():
    proc, port = grpc_echo.start_server()
    try:
        yield proc, port
    finally:
        grpc_echo.stop_server(proc)


def test_echo_server_listens_on_loopback_only_echoes_and_bounds_messages(echo_server):
    proc, port = echo_server
    # 127.0.0.1 (gRPC may hold it as the v4-mapped ::ffff:127.0.0.1), nothing else.
    addresses = _listening_addresses(port)
    assert addresses and addresses <= {"0100007F", "0000000000000000FFFF00000100007F"}, addresses
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        echo = ch.stream_stream(grpc_echo.METHOD, request_serializer=_same, response_deserializer=_same)
        sent = [b"a", bytes(1024), b"\xff" * 7]
        assert list(echo(iter(sent), timeout=10)) == sent
        # Over the project's receive limit (16 MiB): refused with a status, the server lives on.
        with pytest.raises(grpc.RpcError) as refused:
            list(echo(iter([bytes(16 * 1024 * 1024 + 1)]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert list(echo(iter([b"again"]), timeout=10)) == [b"again"]
    # It stops when its parent closes its stdin (or goes away).
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(15) == 0


def test_measure_gives_cpu_per_message_pair():
    # About 1,600 pairs: well above /proc's 10 ms tick of CPU (2 streams at 32 ms read 0 once).
    r = grpc_echo.measure(8, 5.0, seconds=1.0, warmup_s=0.2)
    assert r["echoed"] > 0 and r["pairs"] > 0
    assert r["cpu_us_per_pair"] > 0 and r["switches"] >= 0
    assert r["cpu_us_per_pair"] == pytest.approx(r["user_us"] + r["kernel_us"])


def test_a_window_without_counted_cpu_is_no_measurement():
    d = {"user_s": 1.0, "system_s": 0.5, "switches": 10.0}
    with pytest.raises(grpc_echo.NoMeasurement, match="no server CPU"):
        grpc_echo.per_pair(d, dict(d), 30.0)
    with pytest.raises(grpc_echo.NoMeasurement, match="no message pair"):
        grpc_echo.per_pair(d, d | {"user_s": 1.01}, 0.0)
