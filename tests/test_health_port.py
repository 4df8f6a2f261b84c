"""The plaintext health-only listener (``--health-listen``): what Kubernetes gRPC probes reach
when the API port speaks TLS. It must answer health and serve nothing else."""

from __future__ import annotations

from pathlib import Path

import grpc
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duplex.tls import ServerTLS
from duplex.v1 import session_pb2_grpc
from tests.session_helpers import in_process_stack


def _tls(tmp_path: Path) -> ServerTLS:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    return ServerTLS(cert=tmp_path / "tls.crt", key=tmp_path / "tls.key")


async def test_the_health_port_answers_in_plaintext_and_serves_nothing_else(tmp_path: Path) -> None:
    service = {"tls": _tls(tmp_path), "health_listen": "127.0.0.1:0"}
    async with in_process_stack(service=service, worker={"health_listen": "127.0.0.1:0"}) as stack:
        for port in (stack.session.health_port, stack.workers[0].health_port):
            assert port
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                got = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert got.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.session.health_port}") as ch:
            call = session_pb2_grpc.DuplexSessionStub(ch).Converse()
            try:
                await call.read()
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
            else:
                raise AssertionError("the session API answered on the health port")

        # The API port itself speaks TLS only: a plaintext probe there gets nothing.
        async with grpc.aio.insecure_channel(stack.session.address) as ch:
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
            else:
                raise AssertionError("plaintext reached the TLS port")
