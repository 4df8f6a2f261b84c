"""Resume tokens: ``HMAC-SHA256(secret, session_id)``, so any replica with the secret can verify."""

from __future__ import annotations

import hashlib
import hmac


def resume_token(secret: bytes, session_id: str) -> str:
    return hmac.new(secret, session_id.encode(), hashlib.sha256).hexdigest()


def verify_resume_token(secret: bytes, session_id: str, token: str) -> bool:
    # compare_digest: no timing side channel on how much of a guessed token was right.
    return bool(session_id) and hmac.compare_digest(resume_token(secret, session_id), token)
