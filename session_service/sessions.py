"""Opening, resuming, counting and draining the sessions of this replica."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from duplex.errors import (
    BadRequestError,
    CapacityError,
    DuplexError,
    ErrorCode,
    FencedError,
    UnauthenticatedError,
    UnavailableError,
)
from duplex.v1 import session_pb2
from session_service.config import ServiceConfig
from session_service.metrics import ACTIVE_SESSIONS
from session_service.plugin import DuplexModelPlugin
from session_service.resume import resume_token, verify_resume_token
from session_service.routing import SessionRegistry
from session_service.runner import Placer, RunnerDeps, SessionRunner, settings_from_proto, struct_to_dict

log = logging.getLogger(__name__)

#: The epoch a brand-new session starts in (0 is proto3's "unset").
FIRST_EPOCH = 1


class SessionManager:
    """Creates runners for opens and resumes; the servicer only adapts the wire to this."""

    def __init__(
        self,
        *,
        plugin: DuplexModelPlugin,
        config: ServiceConfig,
        registry: SessionRegistry,
        placer: Placer,
    ) -> None:
        self._plugin = plugin
        self._cfg = config
        self._registry = registry
        self._placer = placer
        self._secret = config.resume_secret
        self.capabilities = plugin.capabilities(max_sessions=config.max_sessions)
        self.draining = False
        self._opening = 0

    def __len__(self) -> int:
        return len(self._registry)

    def _deps(self) -> RunnerDeps:
        return RunnerDeps(
            plugin=self._plugin,
            capabilities=self.capabilities,
            config=self._cfg.runner,
            placer=self._placer,
            on_closed=self._on_closed,
        )

    def _on_closed(self, runner: SessionRunner) -> None:
        self._registry.remove(runner)
        ACTIVE_SESSIONS.set(len(self._registry))

    def _admit(self) -> None:
        if self.draining:
            raise UnavailableError(ErrorCode.DRAINING, "this replica is draining; connect to another")
        if len(self._registry) + self._opening >= self._cfg.max_sessions:
            raise CapacityError(ErrorCode.CAPACITY_EXHAUSTED, f"at most {self._cfg.max_sessions} sessions")

    async def open(self, msg: session_pb2.SessionOpen) -> SessionRunner:
        """A new session; raises a call-ending DuplexError for a bad open."""
        self._admit()
        if msg.model and msg.model != self._plugin.plugin_id:
            raise BadRequestError(
                ErrorCode.MODEL_MISMATCH,
                f"model {msg.model!r} is not served here (this is {self._plugin.plugin_id!r})",
            )
        self._opening += 1
        try:
            try:
                defaults = self._plugin.default_settings()
                settings = settings_from_proto(
                    msg.config, None, require_input=True, default_turn=defaults.turn_detection
                )
                if settings.turn_detection.auto_respond and not self.capabilities.turn_detection:
                    raise BadRequestError(
                        ErrorCode.INVALID_CONFIG,
                        f"{self._plugin.plugin_id!r} has no server turn detection: "
                        "set turn_detection.auto_respond=false and commit yourself",
                    )
                extra = struct_to_dict(msg.extra_body)
                model = extra.pop("model", None)
                if model is not None and model != self._plugin.plugin_id:
                    raise BadRequestError(ErrorCode.MODEL_MISMATCH, f"model {model!r} is not served here")
                self._plugin.validate_client_extra_body(extra)
                runtime = await self._plugin.prepare_runtime_config(settings, extra)
            except DuplexError as err:
                # The same stable code, but fatal: a session that cannot start ends the call.
                raise BadRequestError(err.code, err.message) from err
            session_id = f"sess_{uuid.uuid4().hex}"
            link, epoch = await self._placer(session_id, FIRST_EPOCH, False)
            runner = SessionRunner(
                session_id=session_id,
                settings=settings,
                runtime_config=runtime,
                link=link,
                epoch=epoch,
                resume_token=resume_token(self._secret, session_id),
                deps=self._deps(),
            )
        finally:
            self._opening -= 1
        self._start(runner)
        return runner

    async def resume(self, msg: session_pb2.SessionResume) -> SessionRunner:
        """Re-bind to a live runner here, or take the session over from another replica."""
        if not verify_resume_token(self._secret, msg.session_id, msg.resume_token):
            raise UnauthenticatedError(ErrorCode.INVALID_RESUME_TOKEN, "invalid resume token")
        runner = self._registry.get(msg.session_id)
        if runner is not None and not runner.closed:
            runner.greet()
            return runner
        self._admit()
        self._opening += 1
        try:
            settings = self._plugin.default_settings()
            runtime = await self._plugin.prepare_runtime_config(settings, {})
            try:
                # takeover: the worker grants a higher epoch, fencing the previous owner out.
                link, epoch = await self._placer(msg.session_id, FIRST_EPOCH, True)
            except DuplexError as err:
                if err.code in (ErrorCode.STALE_EPOCH, ErrorCode.NOT_OWNER, ErrorCode.FENCED):
                    raise FencedError(ErrorCode.FENCED, f"session is fenced: {err.message}") from err
                raise
            runner = SessionRunner(
                session_id=msg.session_id,
                settings=settings,
                runtime_config=runtime,
                link=link,
                epoch=epoch,
                resume_token=msg.resume_token,
                deps=self._deps(),
            )
        finally:
            self._opening -= 1
        self._start(runner)
        return runner

    def _start(self, runner: SessionRunner) -> None:
        self._registry.add(runner)
        ACTIVE_SESSIONS.set(len(self._registry))
        runner.greet()
        runner.start()

    async def drain(self, grace_s: float) -> None:
        """go_away to every client, let active responses finish (bounded), then close all."""
        self.draining = True
        runners = list(self._registry)
        for r in runners:
            r.go_away("draining")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await asyncio.gather(*(r.wait_response_idle() for r in runners))
        for r in runners:
            r.close("draining")
        await asyncio.gather(*(r.wait_closed() for r in runners))
