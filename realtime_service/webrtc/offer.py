"""A browser's SDP offer, checked before anything is set up for it (no I/O).

What OpenAI's ``POST /v1/realtime/calls`` takes: the offer as the body (``application/sdp``), or
a form (``multipart/form-data``, or URL-encoded) with the offer in ``sdp`` and the session config (JSON) in
``session``. An offer must be SDP, carry an audio section that is not inactive and offer Opus;
anything else is refused (400) with a stable code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

from duplex.errors import echo

#: Largest offer taken (a browser's is a few KB).
MAX_SDP_BYTES: Final = 64 * 1024

#: A form (``sdp`` and ``session`` fields): what a browser's ``FormData`` sends, and the URL-encoded kind.
FORM_TYPES: Final = ("multipart/form-data", "application/x-www-form-urlencoded")

_MEDIA = re.compile(r"m=(\w+) (\d+) (\S+)(?: (.*))?")
_OPUS = re.compile(r"a=rtpmap:(\d+) opus/48000(?:/2)?", re.IGNORECASE)


class OfferError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Offer:
    sdp: str
    session: dict[str, Any] | None = None
    """The session config sent with it (a form's ``session`` field), if any."""

    @property
    def has_data_channel(self) -> bool:
        return any(line.startswith("m=application ") for line in self.sdp.splitlines())


def check_sdp(sdp: str) -> str:
    """``sdp`` if it is an offer the edge can answer; raises ``OfferError``."""
    if len(sdp.encode()) > MAX_SDP_BYTES:
        raise OfferError("invalid_sdp", f"the offer is over {MAX_SDP_BYTES} bytes")
    lines = [line.strip() for line in sdp.strip().splitlines()]
    if not lines or lines[0] != "v=0" or not any(line.startswith("o=") for line in lines):
        raise OfferError("invalid_sdp", "the body is not an SDP offer (it starts with v=0, then o=...)")
    sections: list[list[str]] = []
    for line in lines:
        if line.startswith("m="):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
    audio = []
    for section in sections:
        m = _MEDIA.fullmatch(section[0])
        if m is None:
            raise OfferError("invalid_sdp", f"unreadable media line {echo(section[0])}")
        if m.group(1) == "audio" and m.group(2) != "0" and "a=inactive" not in section:
            audio.append(section)
    if not audio:
        raise OfferError(
            "offer_without_audio", "the offer has no audio to send or receive (add a microphone track)"
        )
    if not any(_OPUS.fullmatch(line) for line in audio[0]):
        raise OfferError("unsupported_codec", "the offer's audio does not offer Opus (opus/48000/2)")
    return sdp


def parse_offer(content_type: str, body: bytes | None, form: dict[str, str] | None) -> Offer:
    """The offer of a ``/calls`` request: ``body`` for ``application/sdp``, ``form`` (its text
    fields) for a form; raises ``OfferError``."""
    if content_type == "application/sdp":
        try:
            text = (body or b"").decode("utf-8")
        except UnicodeDecodeError:
            raise OfferError("invalid_sdp", "the offer is not UTF-8 text") from None
        return Offer(check_sdp(text))
    if content_type in FORM_TYPES:
        fields = form or {}
        if "sdp" not in fields:
            raise OfferError("missing_required_parameter", "the form has no 'sdp' field", param="sdp")
        session: dict[str, Any] | None = None
        if fields.get("session"):
            try:
                value = json.loads(fields["session"])
            except ValueError:
                raise OfferError("invalid_json", "the 'session' field is not JSON", param="session") from None
            if not isinstance(value, dict):
                raise OfferError("invalid_type", "'session' must be a JSON object", param="session")
            session = value
        return Offer(check_sdp(fields["sdp"]), session)
    raise OfferError(
        "invalid_content_type",
        f"send the SDP offer as application/sdp (or a multipart/form-data form), not {echo(content_type)}",
    )
