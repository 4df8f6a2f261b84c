"""Model plugins shipped with the session service."""
