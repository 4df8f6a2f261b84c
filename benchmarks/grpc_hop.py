"""Why the internal hop carries batches: per-message cost of a grpc.aio bidi stream.

Runs a loopback DuplexWorker whose Run echoes each WorkerCommand's submissions back as one
StepOutput, and drives it from S concurrent streams, either one 1 KiB chunk per message (the
client-facing shape) or K chunks packed per message (the internal hop's shape). Prints chunks/s
for both and their ratio. Client and server share this machine, as in the figures of
docs/design.md ("Worker API, minimum").
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from benchmarks._sys import write_result
from duplex.serving import CHANNEL_OPTIONS, SERVER_OPTIONS
from duplex.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class _Echo(worker_pb2_grpc.DuplexWorkerServicer):
    async def Run(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerCommand], context: object
    ) -> AsyncIterator[worker_pb2.StepOutput]:
        step = 0
        async for cmd in request_iterator:
            step += 1
            out = worker_pb2.StepOutput(step=step)
            out.outputs.output_type = worker_pb2.OUTPUT_TYPE_AUDIO
            out.outputs.sparse_audio = True
            for sub in cmd.submit:
                out.outputs.req_id.append(sub.request_id)
                out.outputs.audio.append(common_pb2.AudioPayload(pcm=sub.pcm))
            yield out


async def _drive(stub: worker_pb2_grpc.DuplexWorkerStub, sid: int, messages: int, per_msg: int) -> int:
    chunk = bytes(1024)

    async def commands() -> AsyncIterator[worker_pb2.WorkerCommand]:
        for i in range(messages):
            cmd = worker_pb2.WorkerCommand(owner="bench" if i == 0 else "")
            for j in range(per_msg):
                cmd.submit.add(request_id=f"s{sid}-{j}", seq=i, pcm=chunk)
            yield cmd

    got = 0
    async for out in stub.Run(commands()):
        got += len(out.outputs.audio)
    return got


async def measure(streams: int, messages: int, per_msg: int) -> float:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    worker_pb2_grpc.add_DuplexWorkerServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            stub = worker_pb2_grpc.DuplexWorkerStub(ch)
            await _drive(stub, -1, 10, per_msg)  # warm up
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(_drive(stub, s, messages, per_msg) for s in range(streams)))
            elapsed = time.perf_counter() - t0
        assert sum(counts) == streams * messages * per_msg
        return sum(counts) / elapsed
    finally:
        await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--chunks", type=int, default=256, help="chunks per stream")
    p.add_argument("--pack", type=int, default=64, help="chunks per message when packed")
    p.add_argument("--json", default="", help="write the results here")
    a = p.parse_args(argv)
    single = asyncio.run(measure(a.streams, a.chunks, 1))
    packed = asyncio.run(measure(a.streams, max(1, a.chunks // a.pack), a.pack))
    print(f"grpc hop, {a.streams} streams, 1 KiB chunks (echoed back), one run:")
    print(f"  1 chunk per message:   {single:>10,.0f} chunks/s")
    print(f"  {a.pack} chunks per message: {packed:>10,.0f} chunks/s")
    print(f"  packed / single:       {packed / single:>10.1f}x")
    write_result(
        a.json,
        "grpc_hop",
        {
            "streams": a.streams,
            "pack": a.pack,
            "single_chunks_per_s": single,
            "packed_chunks_per_s": packed,
            "packed_over_single": packed / single,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
