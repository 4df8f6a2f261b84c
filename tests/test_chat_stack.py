"""A language model in the loop as a user runs it: ``duplex up --pipeline chat --realtime-port``
(ASR, chat and TTS workers, the session service and the Realtime edge, all processes) with the
scripted chat server (``tests.chat_server``, a real HTTP server process) as the language model,
and the official ``openai`` SDK as the client: a spoken question reaches the chat server with the
right history, a tool call round-trips and the spoken answer uses its result; a reply barged into
after one sentence is in the next request cut to that sentence; a chat server that hangs fails
the turn ``upstream_unavailable`` and the session goes on; the conversation survives the loss of
the session replica that held it (the client resumes on another with its token, gRPC)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from duplex.client import DuplexClient
from duplex.serving import health_check
from duplex.stack import LocalStack
from duplex.v1 import session_pb2
from realtime_service.session_config import PCM24K
from tests.chat_helpers import ChatServer, chat_server, user_texts
from tests.procs import ServiceProcess, start_all, start_service
from tests.realtime_helpers import audio_of, read_until, sdk, sending, types
from tests.session_helpers import metric_value, metrics_text
from tests.test_cascade_stack import espeak_wav, heard, rms, utterance

pytestmark = pytest.mark.process
__all__ = ["chat_server"]

ASKED = "what is the weather in paris"
AGAIN = "open the door please"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
INSTRUCTIONS = "You are a weather assistant. Answer in one sentence."
FIRST = "The first sentence is short."
SECOND = (
    "The second sentence goes on and on for a good long while, so that the user has plenty of time "
    "to talk over it before it ends."
)


@pytest.fixture(scope="module")
def stack(chat_server: ChatServer) -> Iterator[LocalStack]:
    llm = ["--llm-url", chat_server.url, "--llm-model", "scripted-llm", "--llm-timeout-s", "2"]
    with LocalStack(pipeline="chat", realtime_port=0, stage_args={"chat": llm}) as s:
        yield s


@pytest.fixture(scope="module")
def wavs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("speech")
    return {text: espeak_wav(tmp / f"{i}.wav", text) for i, text in enumerate((ASKED, AGAIN))}


@pytest.fixture
def llm(chat_server: ChatServer) -> ChatServer:
    chat_server.reset()
    return chat_server


def transcript_of(events: list[Any]) -> str:
    done = [e for e in events if e.type == "conversation.item.input_audio_transcription.completed"]
    assert done, types(events)
    return str(done[-1].transcript)


async def test_a_tool_call_round_trips_through_the_sdk_and_the_spoken_answer_uses_its_result(
    stack: LocalStack, llm: ChatServer, wavs: dict[str, Path]
) -> None:
    async with sdk(stack.realtime_url).realtime.connect(model="chat") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        session = {
            "type": "realtime",
            "instructions": INSTRUCTIONS,
            "tools": [WEATHER],
            "tool_choice": "auto",
        }
        await conn.session.update(session=session)
        updated = (await read_until(conn, lambda e: e.type in ("session.updated", "error")))[-1]
        assert updated.type == "session.updated", updated
        assert updated.session.tools[0].name == "get_weather"
        llm.script(
            {
                "text": "Let me look that up.",
                "tool_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        )
        async with sending(conn, utterance(wavs[ASKED]), PCM24K):
            first = await read_until(conn, lambda e: e.type == "response.done", timeout_s=40)
        done = first[-1].response
        assert done.status == "completed", done
        # The call: an output item after the message, its arguments streamed, then whole.
        (call,) = [o for o in done.output if o.type == "function_call"]
        assert (call.name, call.arguments, call.status) == ("get_weather", '{"city": "Paris"}', "completed")
        deltas = [e for e in first if e.type == "response.function_call_arguments.delta"]
        assert "".join(e.delta for e in deltas) == call.arguments and len(deltas) >= 2
        (args_done,) = [e for e in first if e.type == "response.function_call_arguments.done"]
        assert (args_done.call_id, args_done.item_id, args_done.output_index) == (call.call_id, call.id, 1)
        added = [
            e for e in first if e.type == "response.output_item.added" and e.item.type == "function_call"
        ]
        assert added and added[0].item.id == call.id
        # The chat server got the instructions, the user's words and the tools.
        (asked,) = llm.requests()
        said = transcript_of(first)
        # (PocketSphinx words this eSpeak NG voice a little differently from run to run.)
        assert heard(said, ASKED) >= 2, said
        assert asked["messages"] == [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": said},
        ]
        assert (
            asked["tools"]
            == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
            and asked["tool_choice"] == "auto"
        )
        # The client runs the tool and answers; the model goes on from its result, spoken.
        result = '{"temperature_c": 21, "sky": "sunny"}'
        item = {"type": "function_call_output", "call_id": call.call_id, "output": result}
        await conn.conversation.item.create(item=item)
        await conn.response.create()
        second = await read_until(conn, lambda e: e.type == "response.done", timeout_s=40)
    assert second[-1].response.status == "completed", second[-1]
    spoken = second[types(second).index("response.output_audio_transcript.done")].transcript
    assert "21" in spoken and "sunny" in spoken, spoken
    answer = audio_of(second, second[-1].response.id)
    assert PCM24K.duration_ms(len(answer)) > 1000 and rms(answer) > 0.02
    requests = llm.requests()
    assert len(requests) == 2
    assert requests[1]["messages"] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": said},
        {
            "role": "assistant",
            "content": "Let me look that up.",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]


async def test_a_reply_barged_into_after_one_sentence_is_in_the_next_request_cut_to_it(
    stack: LocalStack, llm: ChatServer, wavs: dict[str, Path]
) -> None:
    llm.script({"text": f"{FIRST} {SECOND}", "pieces": 3})
    async with sdk(stack.realtime_url).realtime.connect(model="chat") as conn:
        assert (await conn.recv()).type == "session.created"
        events: list[Any] = []
        async with sending(conn, utterance(wavs[ASKED], trailing_silence_ms=700), PCM24K):
            # The first sentence's text comes with its first audio: the user hears it begin...
            await read_until(
                conn, lambda e: e.type == "response.output_audio_transcript.delta", seen=events, timeout_s=40
            )
        cut = events[-1].response_id
        assert events[-1].delta == FIRST
        async with sending(conn, utterance(wavs[AGAIN]), PCM24K):  # ...and talks over it
            await read_until(
                conn,
                lambda e: e.type == "response.done" and e.response.id != cut,
                seen=events,
                timeout_s=40,
            )
    cancelled = next(e for e in events if e.type == "response.done" and e.response.id == cut)
    assert cancelled.response.status == "cancelled", cancelled
    assert events[-1].response.status == "completed", events[-1]
    requests = llm.requests()
    assert len(requests) == 2, [r["messages"] for r in requests]
    first_said, again_said = user_texts(requests[1])
    assert first_said == user_texts(requests[0])[0] and heard(again_said, AGAIN) >= 2, again_said
    # The model is told it said what the user heard: the first sentence, not the second.
    assert requests[1]["messages"] == [
        {"role": "user", "content": first_said},
        {"role": "assistant", "content": FIRST},
        {"role": "user", "content": again_said},
    ]


async def test_a_chat_server_that_hangs_fails_the_turn_with_its_code_and_the_session_goes_on(
    stack: LocalStack, llm: ChatServer, wavs: dict[str, Path]
) -> None:
    chat_worker = stack.stage_workers("chat")[0]
    before = metric_value(
        metrics_text(chat_worker.metrics), "duplex_worker_llm_requests_total", 'result="timeout"'
    )
    llm.script({"hang": True})
    async with sdk(stack.realtime_url).realtime.connect(model="chat") as conn:
        assert (await conn.recv()).type == "session.created"
        async with sending(conn, utterance(wavs[ASKED]), PCM24K):
            failed = await read_until(conn, lambda e: e.type == "response.done", timeout_s=40)
            # The error event follows the response it failed.
            await read_until(conn, lambda e: e.type == "error", seen=failed, timeout_s=5)
        done = next(e for e in failed if e.type == "response.done").response
        assert done.status == "failed" and done.status_details.error.code == "upstream_unavailable", done
        errors = [e for e in failed if e.type == "error"]
        assert errors and errors[0].error.code == "upstream_unavailable"
        assert errors[0].error.type == "server_error"  # the server's fault: try again
        # The session goes on: the next turn is answered (the server answers again).
        async with sending(conn, utterance(wavs[AGAIN]), PCM24K):
            answered = await read_until(conn, lambda e: e.type == "response.done", timeout_s=40)
    assert answered[-1].response.status == "completed", answered[-1]
    spoken = answered[types(answered).index("response.output_audio_transcript.done")].transcript
    assert spoken.startswith("You said:") and audio_of(answered, answered[-1].response.id)
    after = metric_value(
        metrics_text(chat_worker.metrics), "duplex_worker_llm_requests_total", 'result="timeout"'
    )
    assert (after or 0) == (before or 0) + 1
    # The second request has the first turn's words, and no reply to them (none was heard).
    requests = llm.requests()
    assert [m["role"] for m in requests[1]["messages"]] == ["user", "user"], json.dumps(requests[1])


def serving(address: str, timeout_s: float = 30.0) -> None:
    """Until the session service at ``address`` answers SERVING to a health check."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        check = health_check(channel)
        while True:
            try:
                if (
                    check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{address} is not SERVING"
            time.sleep(0.1)


async def test_the_conversation_survives_the_loss_of_its_session_replica(
    stack: LocalStack, llm: ChatServer, wavs: dict[str, Path]
) -> None:
    """Two session replicas of one deployment (one resume secret) on the stack's workers; the
    one holding the session is SIGKILLed after a turn; the client resumes on the other with the
    token it last got, and the model is sent the conversation as it was."""
    workers = {m: stack.stage_workers(m)[0].grpc for m in ("asr", "chat", "tts")}
    args = [
        "session",
        "--plugin",
        "session_service.plugins.chat:ChatPlugin",
        "--workers",
        workers["asr"],
        "--stage-workers",
        f"chat={workers['chat']}",
        "--stage-workers",
        f"tts={workers['tts']}",
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "0",
    ]
    env = {"DUPLEX_RESUME_SECRET": "one-deployment-s-resume-secret-of-40-bytes"}
    replicas: list[ServiceProcess] = []
    try:
        first, second = start_all([args, args], replicas, start=lambda a: start_service(a, env=env))
        for replica in (first, second):  # listening first, SERVING once its worker links are up
            await asyncio.to_thread(serving, replica.grpc)
        async with DuplexClient(first.grpc) as client:
            session = await client.open_session(
                input_format=PCM24K, output_format=PCM24K, instructions=INSTRUCTIONS, auto_resume=False
            )
            await session.stream_audio([utterance(wavs[ASKED])], fmt=PCM24K)
            said = (await session.wait_for("input_transcribed", timeout_s=30)).input_transcribed.transcript
            done = await session.wait_for("response_done", timeout_s=30)
            assert done.response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done
            token = session.resume_token
        first.proc.send_signal(signal.SIGKILL)  # the replica is lost: no go_away, no drain
        first.proc.wait(10)
        async with DuplexClient(second.grpc) as client:
            resumed = await client.resume(session.session_id, token)
            assert resumed.session_id == session.session_id
            await resumed.stream_audio([utterance(wavs[AGAIN])], fmt=PCM24K)
            again = (await resumed.wait_for("input_transcribed", timeout_s=30)).input_transcribed.transcript
            done = await resumed.wait_for("response_done", timeout_s=30)
            assert done.response_done.status == session_pb2.RESPONSE_STATUS_COMPLETED, done
    finally:
        for replica in replicas:
            replica.terminate()
    requests = llm.requests()
    assert len(requests) == 2 and said and again, requests
    assert requests[1]["messages"] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": said},
        {"role": "assistant", "content": f"You said: {said}."},
        {"role": "user", "content": again},
    ]
