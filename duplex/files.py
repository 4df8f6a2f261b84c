"""Files a service reads at start and keeps current while it runs: certificates and keys, token
files, JWKS. Kubernetes rotates mounted Secrets in place (an atomic swap of the ``..data``
symlink); an operator may rewrite a file in place."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from duplex.errors import BadRequestError, ErrorCode

log = logging.getLogger("duplex.files")


class WatchedFiles:
    """The bytes of a few files, kept current by ``refresh``.

    A change is a change of the bytes a path resolves to (through symlinks), so a Secret's swap
    and an in-place rewrite are both seen. A stat is not enough: a rewrite that keeps the size,
    within the file system's timestamp tick, leaves it as it was, and a revoked token or
    certificate must not stay in use for that. A file that cannot be read (mid-rotation) keeps
    the last good contents, and is retried at the next ``refresh``. Each problem is logged once,
    not at every check: a TLS server checks before every handshake, which anyone who can connect
    can cause."""

    def __init__(self, paths: Sequence[Path], *, what: str) -> None:
        """Raises ``BadRequestError`` (``invalid_config``: the service refuses to start) when a
        file cannot be read. ``what`` names the files in logs and errors."""
        self.paths = tuple(paths)
        self.what = what
        try:
            self.contents = self._read()
        except OSError as exc:
            raise BadRequestError(
                ErrorCode.INVALID_CONFIG, f"cannot read the {what} {exc.filename}: {exc.strerror or exc}"
            ) from exc
        self._problem: str | None = None
        """The problem logged last (None once the files read well again)."""
        self._unreadable = False

    def _read(self) -> tuple[bytes, ...]:
        return tuple(path.read_bytes() for path in self.paths)

    def refresh(self) -> bool:
        """Read the files again; True when ``contents`` changed."""
        try:
            contents = self._read()
        except OSError as exc:
            self._unreadable = True
            self.warn(f"cannot read {exc.filename}: {exc.strerror or exc}")
            return False
        changed = contents != self.contents
        if self._unreadable and not changed:
            log.info("%s %s readable again, unchanged", self.what, self._names())
        # Read well again: the same problem later (the next rotation) is news again.
        self._unreadable, self._problem = False, None
        if changed:
            self.contents = contents
            log.info("%s %s changed", self.what, self._names())
        return changed

    def warn(self, problem: str) -> None:
        """Log that the files were not reloaded and why (the last good contents stay in use),
        unless this is the problem logged last. For a caller's own check of new contents too."""
        if problem != self._problem:
            self._problem = problem
            log.warning(
                "%s %s not reloaded, the last good one stays in use: %s", self.what, self._names(), problem
            )

    def _names(self) -> str:
        return ", ".join(map(str, self.paths))


__all__ = ["WatchedFiles"]
