"""A call's audio: the model's reply as a track paced in real time (``ReplyTrack``), and the
browser's microphone read into the session's input format (``read_microphone``).

aiortc encodes what a track gives it to Opus (resampling to 48 kHz stereo itself) and decodes the
browser's Opus to 48 kHz stereo s16 frames of 960 samples; the session is in the edge's Realtime
format, 16-bit mono at 24 kHz, and the session service converts to and from the model's rate.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections.abc import Callable
from typing import Final

from aiortc import MediaStreamTrack, RTCRtpReceiver
from aiortc.jitterbuffer import JitterBuffer
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame, AudioResampler

from realtime_service.protocol import PCM24K
from realtime_service.webrtc.playout import Notice, Playout

#: Samples of one 20 ms frame at the session's rate (WebRTC's packetization of audio).
FRAME_SAMPLES: Final = PCM24K.sample_rate_hz // 50
FRAME_BYTES: Final = FRAME_SAMPLES * PCM24K.frame_bytes
_TIME_BASE: Final = fractions.Fraction(1, PCM24K.sample_rate_hz)

#: A track this far behind its schedule (the event loop was busy) starts a new one rather than
#: sending the frames it missed in a burst.
MAX_LAG_S: Final = 0.2


class ReplyTrack(MediaStreamTrack):
    """The model's audio (``Playout``) as an audio track: a 20 ms frame every 20 ms, silence
    when nothing plays. ``on_notices`` hears when a reply starts and stops playing."""

    kind = "audio"

    def __init__(self, playout: Playout, on_notices: Callable[[list[Notice]], None]) -> None:
        super().__init__()
        self.playout = playout
        self.on_notices = on_notices
        self._start: float | None = None
        self._pts = 0
        self.resyncs = 0

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            self._pts += FRAME_SAMPLES
            wait = self._start + self._pts / PCM24K.sample_rate_hz - now
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -MAX_LAG_S:
                self._start = now - self._pts / PCM24K.sample_rate_hz
                self.resyncs += 1
        pcm, notices = self.playout.take(FRAME_BYTES)
        if notices:
            self.on_notices(notices)
        frame = AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(pcm)
        frame.pts = self._pts
        frame.sample_rate = PCM24K.sample_rate_hz
        frame.time_base = _TIME_BASE
        return frame


#: Frames of the browser's audio aiortc holds before decoding the first (its default: 4, 80 ms
#: added to every turn's end of speech). One: a packet is decoded as soon as the next arrives; a
#: packet later than that is dropped (Opus hides the gap), as on a link that does not reorder.
MIC_PREFETCH: Final = 1
_JITTER_BUFFER = "_RTCRtpReceiver__jitter_buffer"


def low_latency(receiver: RTCRtpReceiver) -> bool:
    """Give an audio receiver a jitter buffer of ``MIC_PREFETCH`` frames (aiortc has no setting
    for it); False where this aiortc keeps it elsewhere (then its default stays)."""
    buffer = getattr(receiver, _JITTER_BUFFER, None)
    if not isinstance(buffer, JitterBuffer) or receiver.track is None or receiver.track.kind != "audio":
        return False
    setattr(receiver, _JITTER_BUFFER, JitterBuffer(capacity=buffer.capacity, prefetch=MIC_PREFETCH))
    return True


async def read_microphone(track: MediaStreamTrack, put: Callable[[bytes], None]) -> None:
    """Each frame of the browser's track as 24 kHz mono s16 PCM, to ``put``, until the track
    ends."""
    resampler = AudioResampler(format="s16", layout="mono", rate=PCM24K.sample_rate_hz)
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if not isinstance(frame, AudioFrame):
            continue
        for out in resampler.resample(frame):
            pcm = out.to_ndarray().tobytes()
            if pcm:
                put(pcm)
