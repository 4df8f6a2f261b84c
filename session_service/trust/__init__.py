"""Who a caller is and what they may resume: ``auth`` (bearer tokens, JWTs, client
certificates: the principal) and ``resume_tokens`` (encrypted, authenticated resume tokens)."""
