"""Resume tokens: encrypted, authenticated, versioned, expiring carriers of a session's state.

A replica that takes a session over (after ``go_away``, or when the client reconnects
elsewhere) never saw its ``open``. The token therefore carries what it needs to rebuild the
session: the principal it belongs to, the effective settings (formats, turn detection,
instructions, modalities, idle timeout), the client-visible runtime options (``extra_body``,
e.g. ``pitch_semitones``), the plugin id and the issue time. Layout (ASCII, URL-safe)::

    v2.<kid>.<box>
    box = base64url(nonce[12] || AES-256-GCM(key(kid), nonce, compact JSON claims,
                                              aad="duplex.resume.v2." + kid)), no padding
    key(kid) = HKDF-SHA256(secret of kid, info="duplex.resume.v2." + kid), 32 bytes

The claims are encrypted, so a token shows nothing of the session (instructions included) to
whoever holds it, and authenticated by GCM: any replica holding the key named by ``kid``
decrypts and verifies it before reading a single claim. Keys rotate (``ResumeKeys``): the first
key encrypts new tokens, every key still listed verifies. A token older than the max age, issued
in the future, over ``MAX_TOKEN_CHARS``, of an unknown version or key, or for another session is
refused with ``UNAUTHENTICATED/invalid_resume_token``. The taking-over replica re-validates
``extra_body`` through its plugin, so even a valid token cannot smuggle private keys in.

Claims: ``sid`` session id, ``iat`` issue time (Unix seconds), ``p`` principal, ``m`` plugin
id, ``s`` settings (``i``/``o`` input/output format as ``[encoding, rate, channels]``, ``td``
turn detection as ``[auto_respond, silence_ms, barge_in]``, ``ins`` instructions, ``mod``
modalities, ``idle`` idle timeout), ``x`` client ``extra_body``, ``w`` the worker the session
lives on (its ``worker_id``; absent in older tokens), ``g`` the session's progress (``[turn id,
server events numbered, last response id, its status]``: what a replica that takes the session
over continues from, and tells the resumed caller).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from duplex.audio import PcmFormat
from duplex.errors import DuplexError
from duplex.v1 import common_pb2
from session_service.plugin import DuplexModelPlugin, SessionSettings, TurnDetection
from session_service.session.history import ChatHistory, HistoryPolicy
from session_service.trust.resume_keys import (
    MIN_SECRET_BYTES,
    VERSION,
    InvalidResumeTokenError,
    ResumeKeys,
)

DEFAULT_MAX_AGE_S = 86_400.0
"""How long a token is accepted after it was issued."""
MAX_CLOCK_SKEW_S = 60.0
"""How far in the future an issue time may lie (replica clocks differ a little)."""
MAX_TOKEN_CHARS = 8192
"""Upper bound of a token's length: longer ones are neither issued nor parsed."""


class ResumeTokenTooLargeError(ValueError):
    """The session's state does not fit in ``MAX_TOKEN_CHARS`` (very long instructions)."""


@dataclass(frozen=True, slots=True)
class SessionProgress:
    """How far a session had got when its token was issued (claim ``g``)."""

    turn_id: int = 0
    """The highest turn id used."""
    events: int = 0
    """An upper bound of the server events numbered so far (``se_1`` .. ``se_<events>``; the
    events a stream has yet to take are counted too): a replica taking the session over numbers
    from it, so no id is given twice."""
    last_response_id: str = ""
    """The session's last response ("" before the first)."""
    last_response_status: int = 0
    """Its ``ResponseStatus`` (UNSPECIFIED: it had not ended)."""
    history: tuple[object, ...] = ()
    """The conversation a chat stage sees (``ChatHistory.records``), oldest first: as much of it,
    newest first, as fits in the token with everything else (claim ``h``)."""


@dataclass(frozen=True, slots=True)
class ResumeClaims:
    """What a resume token says about its session."""

    session_id: str
    issued_at: int
    """Unix seconds."""
    principal: str = ""
    """Who opened the session: only the same principal may resume it."""
    model: str = ""
    """The plugin id of the replica that issued it."""
    settings: SessionSettings | None = None
    """None only in a bare token (``resume_token``), which cannot take a session over."""
    extra_body: Mapping[str, object] = field(default_factory=dict)
    """Client-visible runtime options, as a client would send them in ``open.extra_body``."""
    worker_id: str = ""
    """The worker the session lived on when the token was issued (its ``worker_id``): a replica
    taking the session over attaches there first, fencing the previous owner out on it, and
    moves the session only when that worker is not healthy. "" (older tokens): no preference."""
    progress: SessionProgress = field(default_factory=SessionProgress)
    """Turn and event numbering and the last response, as they were at issue."""

    def same_state(self, other: ResumeClaims) -> bool:
        """Whether both describe the same session state (the issue time aside, and the event
        count: a lower bound is enough, the client names its last event when it resumes)."""
        if self.worker_id != other.worker_id:
            return False  # the session moved: a token must name its worker now
        return (
            self.session_id,
            self.principal,
            self.model,
            self.settings,
            dict(self.extra_body),
            dataclasses.replace(self.progress, events=0),
        ) == (
            other.session_id,
            other.principal,
            other.model,
            other.settings,
            dict(other.extra_body),
            dataclasses.replace(other.progress, events=0),
        )


class RunnerLike(Protocol):
    """What ``resume_token_for`` reads from a session runner."""

    session_id: str
    settings: SessionSettings
    runtime_config: dict[str, object]


# ---- encoding ----------------------------------------------------------------------------------


def _fmt(f: PcmFormat) -> list[int]:
    return [f.encoding, f.sample_rate_hz, f.channels]


def _settings_claim(s: SessionSettings) -> dict[str, object]:
    td = s.turn_detection
    return {
        "i": _fmt(s.input_format),
        "o": _fmt(s.output_format),
        "td": [td.auto_respond, td.silence_ms, td.barge_in],
        "ins": s.instructions,
        "mod": list(s.modalities),
        "idle": s.idle_timeout_s,
    }


def issue(keys: ResumeKeys, claims: ResumeClaims) -> str:
    """Seal ``claims``; raises ``ResumeTokenTooLargeError`` past ``MAX_TOKEN_CHARS``."""
    body: dict[str, object] = {"sid": claims.session_id, "iat": int(claims.issued_at)}
    if claims.principal:
        body["p"] = claims.principal
    if claims.model:
        body["m"] = claims.model
    if claims.settings is not None:
        body["s"] = _settings_claim(claims.settings)
    if claims.extra_body:
        body["x"] = dict(claims.extra_body)
    if claims.worker_id:
        body["w"] = claims.worker_id
    g = claims.progress
    if g != SessionProgress():
        body["g"] = [g.turn_id, g.events, g.last_response_id, g.last_response_status]
    history = list(g.history)
    while True:
        if history:
            body["h"] = history
        else:
            body.pop("h", None)
        raw = json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)
        if not history or _sealed_chars(keys, len(raw.encode())) <= MAX_TOKEN_CHARS:
            break
        # The conversation is what gives way: its oldest records go until the rest fits.
        del history[: max(1, len(history) // 8)]
    token = keys.seal(raw.encode())
    if len(token) > MAX_TOKEN_CHARS:
        raise ResumeTokenTooLargeError(
            f"the session state needs a {len(token)}-character resume token (at most {MAX_TOKEN_CHARS}): "
            "shorten the instructions"
        )
    return token


def _sealed_chars(keys: ResumeKeys, plaintext_bytes: int) -> int:
    """The length of a token sealing ``plaintext_bytes`` (``v2.<kid>.`` and the base64url, no
    padding, of the nonce, the ciphertext and the tag)."""
    box = 12 + plaintext_bytes + 16
    return len(VERSION) + len(keys.signing_kid) + 2 + (box * 4 + 2) // 3


# ---- decoding ----------------------------------------------------------------------------------


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an integer, got {type(v).__name__}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected a boolean, got {type(v).__name__}")
    return v


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


def _list(v: object, n: int | None = None) -> list[object]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise ValueError("expected a list" + (f" of {n}" if n is not None else ""))
    return v


def _parse_fmt(v: object) -> PcmFormat:
    enc, rate, ch = (_int(x) for x in _list(v, 3))
    # The wire validation: only formats an open could have set.
    encoding = common_pb2.AudioEncoding.ValueType(enc)
    return PcmFormat.from_proto(common_pb2.AudioFormat(encoding=encoding, sample_rate_hz=rate, channels=ch))


def _parse_settings(v: object) -> SessionSettings:
    if not isinstance(v, dict):
        raise ValueError("settings must be an object")
    auto, silence, barge = _list(v["td"], 3)
    modalities = tuple(_str(m) for m in _list(v["mod"]))
    if not modalities or any(m not in ("audio", "text") for m in modalities):
        raise ValueError("bad modalities")
    return SessionSettings(
        input_format=_parse_fmt(v["i"]),
        output_format=_parse_fmt(v["o"]),
        instructions=_str(v["ins"]),
        turn_detection=TurnDetection(
            auto_respond=_bool(auto), silence_ms=_int(silence), barge_in=_bool(barge)
        ),
        modalities=modalities,
        idle_timeout_s=_int(v["idle"]),
    )


def decode(
    keys: ResumeKeys,
    token: str,
    *,
    session_id: str,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    now: float | None = None,
) -> ResumeClaims:
    """Verify ``token`` for ``session_id`` and return its claims; raises ``InvalidResumeTokenError``."""
    if not session_id or not token or len(token) > MAX_TOKEN_CHARS or not token.isascii():
        raise InvalidResumeTokenError()
    plaintext = keys.open(token)  # authenticated before a single claim is read
    try:
        body = json.loads(plaintext)
        if not isinstance(body, dict):
            raise ValueError("claims must be an object")
        claims = ResumeClaims(
            session_id=_str(body["sid"]),
            issued_at=_int(body["iat"]),
            principal=_str(body.get("p", "")),
            model=_str(body.get("m", "")),
            settings=_parse_settings(body["s"]) if "s" in body else None,
            extra_body=_extra(body.get("x", {})),
            worker_id=_str(body.get("w", "")),
            progress=dataclasses.replace(
                _parse_progress(body["g"]) if "g" in body else SessionProgress(),
                history=_parse_history(body.get("h", [])),
            ),
        )
    except (ValueError, KeyError, TypeError, DuplexError) as exc:
        # Authentic but unreadable: a bug or an incompatible issuer, never the client's doing.
        raise InvalidResumeTokenError(f"unreadable resume token: {exc}") from exc
    if not hmac.compare_digest(claims.session_id.encode(), session_id.encode()):
        raise InvalidResumeTokenError()
    t = time.time() if now is None else now
    if claims.issued_at > t + MAX_CLOCK_SKEW_S:
        raise InvalidResumeTokenError("resume token issued in the future")
    if t - claims.issued_at > max_age_s:
        raise InvalidResumeTokenError("resume token expired")
    return claims


def _parse_progress(v: object) -> SessionProgress:
    turn, events, response_id, status = _list(v, 4)
    progress = SessionProgress(_int(turn), _int(events), _str(response_id), _int(status))
    if min(progress.turn_id, progress.events, progress.last_response_status) < 0:
        raise ValueError("negative progress")
    return progress


def _parse_history(v: object) -> tuple[object, ...]:
    records = tuple(_list(v))
    ChatHistory.from_records(records, HistoryPolicy())  # the records' shape (raises ValueError)
    return records


def _extra(v: object) -> dict[str, object]:
    if not isinstance(v, dict):
        raise ValueError("extra_body must be an object")
    return dict(v)


# ---- what a session's token says ---------------------------------------------------------------


def _json_value(v: object) -> bool:
    if v is None or isinstance(v, str | bool | int):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list | tuple):
        return all(_json_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _json_value(x) for k, x in v.items())
    return False


def client_extra_body(
    plugin: DuplexModelPlugin,
    runtime_config: Mapping[str, object],
    base: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The ``extra_body`` that rebuilds ``runtime_config`` through ``prepare_runtime_config``.

    ``base`` is the client's validated ``extra_body`` of the open; over it go the runtime
    options a client could have set itself (the key is not private, the value is plain JSON and
    the plugin accepts it as ``extra_body``), which reflects later updates. A runtime option
    that is None now is unset, and leaves the result too.
    """
    out: dict[str, object] = dict(base or {})
    out.pop("model", None)
    private = plugin.private_runtime_config_keys
    for key, value in runtime_config.items():
        if key == "model" or key in private:
            continue
        if value is None:
            out.pop(key, None)
            continue
        if not _json_value(value):
            continue
        try:
            plugin.validate_client_extra_body({key: value})
        except DuplexError:
            continue  # server-derived state, not a client option
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def claims_for(
    source: RunnerLike | SessionSettings,
    *,
    plugin: DuplexModelPlugin,
    session_id: str = "",
    runtime_config: Mapping[str, object] | None = None,
    client_extra: Mapping[str, object] | None = None,
    principal: str = "",
    now: float | None = None,
    progress: SessionProgress | None = None,
) -> ResumeClaims:
    """The claims describing a session now (``source``: its runner, or its settings)."""
    if isinstance(source, SessionSettings):
        settings, sid, runtime = source, session_id, runtime_config or {}
    else:
        settings, sid = source.settings, source.session_id
        runtime = source.runtime_config if runtime_config is None else runtime_config
    if not sid:
        raise ValueError("a resume token needs the session id")
    return ResumeClaims(
        session_id=sid,
        issued_at=int(time.time() if now is None else now),
        principal=principal,
        model=plugin.plugin_id,
        settings=settings,
        extra_body=client_extra_body(plugin, runtime, client_extra),
        progress=progress or SessionProgress(),
    )


def resume_token_for(
    source: RunnerLike | SessionSettings,
    *,
    keys: ResumeKeys,
    plugin: DuplexModelPlugin,
    session_id: str = "",
    runtime_config: Mapping[str, object] | None = None,
    client_extra: Mapping[str, object] | None = None,
    principal: str = "",
    now: float | None = None,
) -> str:
    """A fresh token for the session's current settings and runtime options (see ``claims_for``);
    raises ``ResumeTokenTooLargeError``."""
    return issue(
        keys,
        claims_for(
            source,
            plugin=plugin,
            session_id=session_id,
            runtime_config=runtime_config,
            client_extra=client_extra,
            principal=principal,
            now=now,
        ),
    )


# ---- bare tokens -------------------------------------------------------------------------------


def resume_token(keys: ResumeKeys, session_id: str, *, now: float | None = None) -> str:
    """A token that proves knowledge of the session but carries no state (cannot take over)."""
    return issue(
        keys, ResumeClaims(session_id=session_id, issued_at=int(time.time() if now is None else now))
    )


def verify_resume_token(
    keys: ResumeKeys,
    session_id: str,
    token: str,
    *,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    now: float | None = None,
) -> bool:
    """Whether ``token`` is valid for ``session_id`` (signature, session, age)."""
    try:
        decode(keys, token, session_id=session_id, max_age_s=max_age_s, now=now)
    except InvalidResumeTokenError:
        return False
    return True


__all__: list[str] = [
    "DEFAULT_MAX_AGE_S",
    "MAX_TOKEN_CHARS",
    "MIN_SECRET_BYTES",
    "VERSION",
    "InvalidResumeTokenError",
    "ResumeClaims",
    "ResumeKeys",
    "ResumeTokenTooLargeError",
    "claims_for",
    "client_extra_body",
    "decode",
    "issue",
    "resume_token",
    "resume_token_for",
    "verify_resume_token",
]
