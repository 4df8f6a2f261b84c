"""The null model (near-zero compute, lockstep) through a real engine and Run stream: input is
acknowledged, COMMIT measures what was consumed, RESPOND replies with a fixed tone one frame per
input frame as typed sparse audio, and its options are checked like any model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplex.errors import BadRequestError
from duplex.v1 import worker_pb2
from tests.worker_helpers import (
    APPEND,
    COMMIT,
    FRAME,
    RESPOND,
    RunClient,
    audio_of,
    error_codes,
    pcm,
    sub,
    updates_of,
    worker,
)
from worker_service.model import StepBatch
from worker_service.models import create_model
from worker_service.models.null import NullModel, tone_frame

REPLY_FRAMES = 3


def _factory(device: torch.device) -> NullModel:
    return NullModel(device, reply_frames=REPLY_FRAMES)


def _frames(n: int) -> bytes:
    return pcm(np.zeros(n * FRAME, np.float32))


async def test_input_commit_and_a_lockstep_reply() -> None:
    async with worker(model_factory=_factory) as (_, stub):
        for s in ("a", "b"):
            await stub.Attach(worker_pb2.AttachRequest(session_id=s, epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        # "a" speaks 4 frames and asks for a reply; "b" only listens.
        run.send(
            sub("ra", "a", APPEND, seq=1, data=_frames(4)),
            sub("ra", "a", COMMIT),
            sub("ra", "a", RESPOND, turn=1),
            sub("rb", "b", APPEND, seq=1, data=_frames(2)),
        )
        msgs = await run.until(lambda m: any(u.request_id == "ra" and u.committed_samples for u in m.updates))
        assert [u.committed_samples for u in updates_of(msgs, "ra") if u.committed_samples] == [4 * FRAME]
        assert audio_of(msgs, "ra") == b""  # the reply starts with the next input frame
        # Lockstep: one input frame, one reply frame (in the step that acknowledges it).
        run.send(sub("ra", "a", APPEND, seq=2, turn=1, data=_frames(1)))
        msgs += await run.until(lambda m: any(u.request_id == "ra" and u.input_seq == 2 for u in m.updates))
        assert audio_of(msgs, "ra") == tone_frame()
        # More input than the reply has frames: the reply ends, the rest is only heard.
        run.send(sub("ra", "a", APPEND, seq=3, turn=1, data=_frames(REPLY_FRAMES + 2)))
        msgs += await run.until(lambda m: any(u.request_id == "ra" and u.input_seq == 3 for u in m.updates))
        msgs += await run.quiet(0.2)
        assert any(u.input_seq == 1 for u in updates_of(msgs, "rb"))
        assert audio_of(msgs, "ra") == tone_frame() * REPLY_FRAMES
        updates = updates_of(msgs, "ra")
        assert sum(u.response_started for u in updates) == 1
        assert sum(u.response_finished for u in updates) == 1
        replying = [m for m in msgs if m.outputs.audio]
        assert len(replying) == REPLY_FRAMES
        for m in replying:
            assert m.outputs.sparse_audio and list(m.outputs.req_id) == ["ra"]
            assert m.outputs.audio[0].format.sample_rate_hz == 16000
        assert not error_codes(msgs, "ra") and not error_codes(msgs, "rb")
        assert audio_of(msgs, "rb") == b""
        run.close()


async def test_respond_without_input_and_bad_options_are_refused() -> None:
    async with worker(model_factory=_factory) as (_, stub):
        await stub.Attach(worker_pb2.AttachRequest(session_id="a", epoch=1, owner="o1"), timeout=5)
        run = RunClient(stub, "o1")
        run.send(sub("ra", "a", RESPOND, turn=1))
        msgs = await run.until(lambda m: bool(error_codes([m], "ra")))
        assert error_codes(msgs, "ra") == ["no_committed_input"]
        run.send(sub("ra", "a", APPEND, seq=1, data=_frames(1), params={"hidden_size": 3}))
        msgs = await run.until(lambda m: bool(error_codes([m], "ra")))
        assert error_codes(msgs, "ra") == ["bad_submission"]
        run.close()


def test_registered_and_checks_its_options() -> None:
    cpu = torch.device("cpu")
    model = create_model("null", cpu, {"reply_frames": 2})
    assert isinstance(model, NullModel) and model.model_id == "null" and model.lockstep
    assert model.frame_samples == FRAME
    with pytest.raises(BadRequestError):
        create_model("null", cpu, {"hidden_size": 8})
    with pytest.raises(BadRequestError):
        create_model("null", cpu, {"reply_frames": 0})


def test_a_step_of_listeners_emits_nothing_and_counts_input() -> None:
    model = NullModel(torch.device("cpu"))
    states = [model.create_state(f"s{i}") for i in range(64)]
    has = np.zeros(64, np.bool_)
    has[::2] = True
    result = model.step(
        StepBatch([f"s{i}" for i in range(64)], states, np.zeros((64, FRAME), np.float32), has)
    )
    assert result.news == [None] * 64
    assert isinstance(result.outputs, worker_pb2.MultimodalOutputs)
    assert result.outputs.sparse_audio and not result.outputs.req_id and not result.outputs.audio
    assert [model.commit(s) for s in states[:2]] == [FRAME, 0]
