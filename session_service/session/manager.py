"""Opening, resuming, counting and draining the sessions of this replica.

A resume either re-binds the stream to the live runner of this replica or takes the session
over from another one, rebuilding its settings and runtime config from the signed resume token
(``session_service.trust.resume_tokens``). Resumes of one session id are serialized (a second
waits for the first's takeover, then re-binds): a replica never holds two runners of a session.

Every token names the worker the session lives on (``ResumeClaims.worker_id``), issued once the
session is placed and refreshed when it moved. A takeover attaches the session on that worker
first (``prefer``), fencing the previous owner out where the session lives; only when that
worker is not healthy here does it move, and the placer evicts it from the old one
(``session_service.workers.eviction``); a model-native model's context then starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import re
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from duplex.clock import MONOTONIC, Clock
from duplex.errors import (
    BadRequestError,
    CapacityError,
    DuplexError,
    ErrorCode,
    FencedError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
    echo,
)
from duplex.v1 import session_pb2
from session_service.config import ServiceConfig
from session_service.metrics import ACTIVE_SESSIONS
from session_service.plugin import DuplexModelPlugin, SessionSettings
from session_service.session.lifecycle import ENDED_FOR_GOOD, CloseReason
from session_service.session.runner import RunnerDeps, SessionRunner, WorkerHandle
from session_service.session.settings import settings_from_proto, struct_to_dict
from session_service.trust.auth import ANONYMOUS
from session_service.trust.resume_tokens import (
    DEFAULT_MAX_AGE_S,
    InvalidResumeTokenError,
    ResumeClaims,
    ResumeKeys,
    ResumeTokenTooLargeError,
    SessionProgress,
    claims_for,
    decode,
    issue,
)
from session_service.workers.step_routing import SessionRegistry

log = logging.getLogger(__name__)

#: The epoch a brand-new session starts in (0 is proto3's "unset").
FIRST_EPOCH = 1

#: Sessions that ended here remembered at most (the oldest are forgotten first).
MAX_ENDED_SESSIONS = 65_536


class SessionPlacer(Protocol):
    """A ``Placer`` that takes a preference: ``prefer`` names the worker to try first while it
    is healthy (a resumed session's own: ``placement.WorkerPool.place``,
    ``eviction.Evictor.place``). Runners call it as a plain ``Placer``."""

    def __call__(
        self, session_id: str, epoch: int, takeover: bool, *, prefer: str | None = None
    ) -> Awaitable[tuple[WorkerHandle, int]]: ...


@dataclass(slots=True)
class _SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class SessionManager:
    """Creates runners for opens and resumes; the servicer only adapts the wire to this."""

    def __init__(
        self,
        *,
        plugin: DuplexModelPlugin,
        config: ServiceConfig,
        registry: SessionRegistry,
        placer: SessionPlacer,
        resume_max_age_s: float = DEFAULT_MAX_AGE_S,
        wall_clock: Callable[[], float] = time.time,
        clock: Clock = MONOTONIC,
    ) -> None:
        """``placer``: places this manager's sessions and its runners' (a plain ``Placer`` to them);
        ``wall_clock``: Unix time, for tokens' issue times; ``clock``: the runners'."""
        self._plugin = plugin
        self._cfg = config
        self.registry = registry
        self._placer = placer
        self._keys = config.resume_keys or ResumeKeys.ephemeral()
        self._max_age_s = resume_max_age_s
        self._issued: dict[str, tuple[str, ResumeClaims]] = {}
        """The last token ``_current_token`` issued for each session held, with its claims."""
        self._wall_clock = wall_clock
        self._clock = clock
        self.capabilities = dataclasses.replace(
            plugin.capabilities(max_sessions=config.max_sessions),
            resume_scope="deployment" if self._keys.shared else "replica",
            turn_failover=plugin.replayable and config.runner.turn_failover,
            model_native=plugin.model_native,
            frame_period_ms=round(1000 * plugin.frame_samples / plugin.worker_format.sample_rate_hz),
        )
        self.draining = False
        self._opening = 0
        # Sessions held and being opened, by principal (``max_sessions_per_principal``).
        self._held: Counter[str] = Counter()
        self._opening_by: Counter[str] = Counter()
        # Sessions that ended for good here, until their tokens expire (the worker keeps its own
        # tombstone too; this one holds when the resume would be placed on another worker).
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._locks: dict[str, _SessionLock] = {}
        # The client's validated open extra_body per live session (the base of its tokens).
        self._client_extra: dict[str, dict[str, object]] = {}

    def __len__(self) -> int:
        return len(self.registry)

    @property
    def resumes_in_progress(self) -> int:
        """Session ids with a resume running or waiting on this replica (0 once all settle)."""
        return len(self._locks)

    def _deps(self) -> RunnerDeps:
        return RunnerDeps(
            plugin=self._plugin,
            capabilities=self.capabilities,
            config=self._cfg.runner,
            placer=self._placer,
            on_closed=self._on_closed,
            clock=self._clock,
            issue_token=self.refresh_resume_token,
        )

    def _on_closed(self, runner: SessionRunner) -> None:
        if runner.close_reason in ENDED_FOR_GOOD:
            self._ended[runner.session_id] = self._wall_clock() + self._max_age_s
            self._ended.move_to_end(runner.session_id)
            while len(self._ended) > MAX_ENDED_SESSIONS:
                self._ended.popitem(last=False)
        self._held[runner.principal] -= 1
        if self._held[runner.principal] <= 0:
            del self._held[runner.principal]
        self.registry.remove(runner)
        if self.registry.get(runner.session_id) is None:
            self._client_extra.pop(runner.session_id, None)
            self._issued.pop(runner.session_id, None)
        ACTIVE_SESSIONS.set(len(self.registry))

    def _admit(self, principal: str) -> None:
        if self.draining:
            raise UnavailableError(ErrorCode.DRAINING, "this replica is draining; connect to another")
        if len(self.registry) + self._opening >= self._cfg.max_sessions:
            raise CapacityError(ErrorCode.CAPACITY_EXHAUSTED, f"at most {self._cfg.max_sessions} sessions")
        limit = self._cfg.max_sessions_per_principal
        if limit and self._held[principal] + self._opening_by[principal] >= limit:
            raise CapacityError(
                ErrorCode.CAPACITY_EXHAUSTED, f"at most {limit} sessions per caller on this replica"
            )

    def _check_not_ended(self, session_id: str) -> None:
        expiry = self._ended.get(session_id)
        if expiry is None:
            return
        if expiry < self._wall_clock():
            del self._ended[session_id]  # its tokens have expired anyway
            return
        raise NotFoundError(ErrorCode.SESSION_CLOSED, "the session was closed")

    @contextlib.contextmanager
    def _opening_for(self, principal: str) -> Iterator[None]:
        """Counts a session being opened (or taken over) against the limits until it runs."""
        self._opening += 1
        self._opening_by[principal] += 1
        try:
            yield
        finally:
            self._opening -= 1
            self._opening_by[principal] -= 1
            if self._opening_by[principal] <= 0:
                del self._opening_by[principal]

    def _check_turn_detection(self, settings: SessionSettings) -> None:
        caps = self.capabilities
        if settings.turn_detection.auto_respond and not caps.turn_detection and not caps.model_native:
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG,
                f"{self._plugin.plugin_id!r} has no server turn detection: "
                "set turn_detection.auto_respond=false and commit yourself",
            )

    # ---- resume tokens ---------------------------------------------------------------------

    def _claims(
        self,
        session_id: str,
        settings: SessionSettings,
        runtime: Mapping[str, object],
        client_extra: Mapping[str, object],
        principal: str,
        worker_id: str = "",
        progress: SessionProgress | None = None,
    ) -> ResumeClaims:
        claims = claims_for(
            settings,
            plugin=self._plugin,
            session_id=session_id,
            runtime_config=runtime,
            client_extra=client_extra,
            principal=principal,
            now=self._wall_clock(),
            progress=progress,
        )
        return dataclasses.replace(claims, worker_id=worker_id)

    def _worker_of(self, runner: SessionRunner) -> str:
        """The worker a session lives on: its link's, or, between a lost worker and its next
        placement, the one its token names (the last known)."""
        link = runner.link
        if link is not None and link.worker_id:
            return link.worker_id
        held = self._token_claims(runner.session_id, runner.resume_token, self._max_age_s, self._wall_clock())
        return held.worker_id if held is not None else ""

    def _token_claims(self, session_id: str, token: str, max_age_s: float, now: float) -> ResumeClaims | None:
        """What ``token`` says, if valid for ``session_id`` and at most ``max_age_s`` old (None if
        not). One this replica issued (``_current_token``) is remembered, not opened again."""
        issued = self._issued.get(session_id)
        if issued is not None and issued[0] == token:
            return issued[1] if now - issued[1].issued_at <= max_age_s else None
        try:
            return decode(self._keys, token, session_id=session_id, max_age_s=max_age_s, now=now)
        except InvalidResumeTokenError:
            return None

    def _naming_worker(self, claims: ResumeClaims, token: str, link: WorkerHandle) -> str:
        """``token``, or a new one if it does not say ``claims`` on the worker just placed on; kept
        should the new one not fit (a takeover elsewhere then loses its preference, nothing more)."""
        worker_id = link.worker_id or ""
        try:
            return self._current_token(dataclasses.replace(claims, worker_id=worker_id), token)
        except ResumeTokenTooLargeError as exc:
            log.warning("session %s: resume token does not name its worker: %s", claims.session_id, exc)
            return token

    def _current_token(self, claims: ResumeClaims, token: str) -> str:
        """``token`` if it still says what ``claims`` say and is less than half its life old;
        otherwise a new one (raises ``ResumeTokenTooLargeError``)."""
        held = self._token_claims(claims.session_id, token, self._max_age_s / 2, self._wall_clock())
        if held is not None and held.same_state(claims):
            return token
        token = issue(self._keys, claims)
        self._issued[claims.session_id] = (token, claims)
        return token

    def refresh_resume_token(self, runner: SessionRunner) -> str:
        """Bring ``runner.resume_token`` up to date with its settings, worker and progress (turns,
        events, its last response) and return it; a state too large for a token keeps the last."""
        claims = self._claims(
            runner.session_id,
            runner.settings,
            runner.runtime_config,
            self._client_extra.get(runner.session_id, {}),
            runner.principal,
            self._worker_of(runner),
            runner.progress(),
        )
        try:
            runner.resume_token = self._current_token(claims, runner.resume_token)
        except ResumeTokenTooLargeError as exc:
            log.warning("session %s: resume token not refreshed: %s", runner.session_id, exc)
        return runner.resume_token

    @contextlib.asynccontextmanager
    async def _session_lock(self, session_id: str) -> AsyncIterator[None]:
        """Serializes resumes of one session id on this replica."""
        entry = self._locks.get(session_id)
        if entry is None:
            entry = self._locks[session_id] = _SessionLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[session_id]

    # ---- open and resume -------------------------------------------------------------------

    async def open(self, msg: session_pb2.SessionOpen, *, principal: str = ANONYMOUS) -> SessionRunner:
        """A new session of ``principal``; raises a call-ending DuplexError for a bad open."""
        self._admit(principal)
        if msg.model and msg.model != self._plugin.plugin_id:
            raise BadRequestError(
                ErrorCode.MODEL_MISMATCH,
                f"model {echo(msg.model)} is not served here (this is {self._plugin.plugin_id!r})",
            )
        with self._opening_for(principal):
            session_id = f"sess_{uuid.uuid4().hex}"
            try:
                defaults = self._plugin.default_settings()
                settings = settings_from_proto(
                    msg.config,
                    None,
                    require_input=True,
                    default_turn=defaults.turn_detection,
                    default_modalities=defaults.modalities,
                    capabilities=self.capabilities,
                )
                self._check_turn_detection(settings)
                extra = struct_to_dict(msg.extra_body)
                model = extra.pop("model", None)
                if model is not None and model != self._plugin.plugin_id:
                    raise BadRequestError(
                        ErrorCode.MODEL_MISMATCH,
                        f"extra_body.model {echo(model)} is not served here "
                        f"(this is {self._plugin.plugin_id!r})",
                    )
                self._plugin.validate_client_extra_body(extra)
                runtime = await self._plugin.prepare_runtime_config(settings, extra)
                # Issued before placement too: a session that cannot have a token never starts.
                claims = self._claims(session_id, settings, runtime, extra, principal)
                token = issue(self._keys, claims)
            except DuplexError as err:
                # The same stable code, but fatal: a session that cannot start ends the call.
                raise BadRequestError(err.code, err.message) from err
            except ResumeTokenTooLargeError as exc:
                raise BadRequestError(ErrorCode.INVALID_CONFIG, str(exc)) from exc
            link, epoch = await self._placer(session_id, FIRST_EPOCH, False)
            token = self._naming_worker(claims, token, link)
        return self._start(session_id, principal, settings, runtime, extra, link, epoch, token)

    async def resume(self, msg: session_pb2.SessionResume, *, principal: str = ANONYMOUS) -> SessionRunner:
        """Re-bind to a live runner here, or take the session over from another replica (only its
        principal may: ``not_session_owner``)."""
        claims = decode(
            self._keys,
            msg.resume_token,
            session_id=msg.session_id,
            max_age_s=self._max_age_s,
            now=self._wall_clock(),
        )
        _check_owner(claims.principal, principal)
        self._check_not_ended(msg.session_id)
        async with self._session_lock(msg.session_id):
            runner = self.registry.get(msg.session_id)
            if runner is not None and not runner.closed:
                _check_owner(runner.principal, principal)
                self.refresh_resume_token(runner)
                runner.greet()
                return runner
            return await self._take_over(claims, msg.resume_token, msg.last_event_id)

    async def _restore(
        self, claims: ResumeClaims
    ) -> tuple[SessionSettings, dict[str, object], dict[str, object]]:
        """Settings, client extra_body and runtime config of a session from its token's claims."""
        if claims.settings is None:
            raise InvalidResumeTokenError("the resume token carries no session state")
        if claims.model != self._plugin.plugin_id:
            raise BadRequestError(
                ErrorCode.MODEL_MISMATCH,
                f"the session ran model {claims.model!r}; this replica serves {self._plugin.plugin_id!r}",
            )
        settings = claims.settings
        self._check_turn_detection(settings)
        extra = dict(claims.extra_body)
        try:
            # Signed is not trusted: an older issuer may have let through what this plugin refuses.
            self._plugin.validate_client_extra_body(extra)
        except DuplexError as err:
            raise InvalidResumeTokenError(f"resume token options refused: {err.message}") from err
        try:
            runtime = await self._plugin.prepare_runtime_config(settings, extra)
        except DuplexError as err:
            raise BadRequestError(err.code, err.message) from err
        return settings, extra, runtime

    async def _take_over(self, claims: ResumeClaims, token: str, last_event_id: str = "") -> SessionRunner:
        principal = claims.principal
        self._admit(principal)
        with self._opening_for(principal):
            settings, extra, runtime = await self._restore(claims)
            try:
                # takeover: the worker grants a higher epoch, fencing the previous owner out; on
                # the worker the token names while it is healthy, for the owner is there.
                link, epoch = await self._placer(
                    claims.session_id, FIRST_EPOCH, True, prefer=claims.worker_id or None
                )
            except DuplexError as err:
                if err.code == ErrorCode.SESSION_CLOSED:
                    raise NotFoundError(ErrorCode.SESSION_CLOSED, "the session was closed") from err
                if err.code in (ErrorCode.STALE_EPOCH, ErrorCode.NOT_OWNER, ErrorCode.FENCED):
                    raise FencedError(ErrorCode.FENCED, f"session is fenced: {err.message}") from err
                raise
            # The presented token if it still says all this (kept, too, should a new one not fit).
            now = self._claims(
                claims.session_id, settings, runtime, extra, principal, progress=claims.progress
            )
            token = self._naming_worker(now, token, link)
        progress = dataclasses.replace(
            claims.progress, events=_events_seen(claims.progress.events, last_event_id)
        )
        # Only the worker the token names holds the committed input an interrupted reply answers.
        same_worker = bool(claims.worker_id) and link.worker_id == claims.worker_id
        runner = self._start(
            claims.session_id, principal, settings, runtime, extra, link, epoch, token, progress, same_worker
        )
        if self._plugin.model_native and not same_worker:  # its model state stayed behind
            runner.emitter.emit("context_reset", session_pb2.ContextReset(reason="resumed"))
        return runner

    def _start(
        self,
        session_id: str,
        principal: str,
        settings: SessionSettings,
        runtime: dict[str, object],
        extra: dict[str, object],
        link: WorkerHandle,
        epoch: int,
        token: str,
        progress: SessionProgress | None = None,
        restart_interrupted: bool = False,
    ) -> SessionRunner:
        """Build, register, greet and start the runner of an opened or taken-over session."""
        runner = SessionRunner(
            session_id=session_id,
            principal=principal,
            settings=settings,
            runtime_config=runtime,
            link=link,
            epoch=epoch,
            resume_token=token,
            deps=self._deps(),
            progress=progress,
            restart_interrupted=restart_interrupted,
        )
        self._client_extra[session_id] = extra
        self._held[principal] += 1
        self.registry.add(runner)
        ACTIVE_SESSIONS.set(len(self.registry))
        runner.greet()
        runner.start()
        return runner

    async def drain(self, grace_s: float) -> None:
        """go_away to every client, let active responses finish (bounded), then close all."""
        self.draining = True
        runners = list(self.registry)
        for r in runners:
            # The token must describe the session as it is now (updates may have changed it).
            self.refresh_resume_token(r)
            r.go_away("draining")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await asyncio.gather(*(r.wait_response_idle() for r in runners))
        for r in runners:
            r.close(CloseReason.DRAINING)
        await asyncio.gather(*(r.wait_closed() for r in runners))


_EVENT_ID = re.compile(r"se_([0-9]{1,20})", re.ASCII)

#: How far past its token a client's ``last_event_id`` may move event numbering (a bound on what
#: a client can make the server count from; ids are per session, so it harms no one else).
MAX_EVENTS_AHEAD = 1 << 32


def _events_seen(from_token: int, last_event_id: str) -> int:
    """Events numbered before a takeover: the token's count, or the client's last ``se_N`` when
    it saw later ones (the lost replica numbered events after it issued the token)."""
    match = _EVENT_ID.fullmatch(last_event_id)
    return from_token if match is None else max(from_token, min(int(match[1]), from_token + MAX_EVENTS_AHEAD))


def _check_owner(owner: str, principal: str) -> None:
    """Only the principal a session belongs to may resume it."""
    # compare_digest: how much of another caller's principal matched must not show in the time.
    if not hmac.compare_digest(owner.encode(), principal.encode()):
        raise PermissionDeniedError(ErrorCode.NOT_SESSION_OWNER, "the session belongs to another caller")
