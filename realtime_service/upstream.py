"""The edge's streams to the session service: one ``ConverseMany`` stream per credential.

The sessions of one credential (WebSockets and WebRTC calls alike) share ONE stream
(``Upstream``): the session service sees one caller with many lanes, and its per-principal limits
hold for the edge's clients as for anyone's. A stream that failed is replaced by a new one for the
next session.
"""

from __future__ import annotations

from dataclasses import dataclass

from duplex.client import DuplexClient, Session
from duplex.client_lanes import Lanes
from duplex.tls import ChannelCredentials, ClientTLS
from realtime_service import metrics
from realtime_service.conversation import Settings


@dataclass
class _Stream:
    client: DuplexClient
    lanes: Lanes
    refs: int = 0
    """Connections holding it."""


class Upstream:
    """One ``ConverseMany`` stream per credential to the session service, shared by that
    credential's connections; closed when its last connection lets it go. A stream that failed
    is replaced (on the same channel) for the next session."""

    def __init__(self, target: str, tls: ClientTLS | None) -> None:
        self.target = target
        self._credentials = ChannelCredentials(tls) if tls is not None else None
        self._streams: dict[str, _Stream] = {}

    def hold(self, token: str) -> None:
        stream = self._streams.get(token)
        if stream is None:
            credentials = self._credentials.current() if self._credentials is not None else None
            client = DuplexClient(self.target, credentials=credentials, token=token or None)
            stream = self._streams[token] = _Stream(client, Lanes(client))
            metrics.STREAMS.set(len(self._streams))
        stream.refs += 1

    def lanes(self, token: str) -> Lanes:
        """The credential's stream (``hold`` it first), a new one if it failed."""
        stream = self._streams[token]
        if not stream.lanes.usable:
            stream.lanes = Lanes(stream.client)
        return stream.lanes

    async def release(self, token: str) -> None:
        stream = self._streams.get(token)
        if stream is None:
            return
        stream.refs -= 1
        if stream.refs <= 0:
            del self._streams[token]
            metrics.STREAMS.set(len(self._streams))
            await _close(stream)

    def source(self, token: str) -> CredentialSource:
        return CredentialSource(self, token)

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await _close(stream)


async def _close(stream: _Stream) -> None:
    await stream.lanes.close(timeout_s=2.0)
    await stream.client.close()


class CredentialSource:
    """A connection's sessions, on its credential's stream (``connection.SessionSource``)."""

    def __init__(self, upstream: Upstream, token: str) -> None:
        self._upstream = upstream
        self._token = token
        self._held = False

    def _lanes(self) -> Lanes:
        if not self._held:
            self._held = True
            self._upstream.hold(self._token)
        return self._upstream.lanes(self._token)

    async def open(self, model: str, settings: Settings) -> Session:
        lanes = self._lanes()
        return await lanes.open_session(
            model=model,
            input_format=settings.input_format,
            output_format=settings.output_format,
            # The edge's settings at open: the API's defaults, or a WebRTC call's session config.
            turn_detection=settings.turn.to_proto(),
            instructions=settings.instructions,
            modalities=settings.output_modalities if settings.output_modalities != ("audio",) else (),
        )

    async def resume(self, session_id: str, resume_token: str) -> Session:
        lanes = self._lanes()
        return await lanes.resume(session_id, resume_token)

    async def release(self) -> None:
        if self._held:
            self._held = False
            await self._upstream.release(self._token)
