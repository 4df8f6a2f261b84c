"""Files kept current while a service runs (``duplex.files``): a change is a change of the bytes,
a file gone mid-rotation keeps the last good contents, each problem is logged once."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from duplex.errors import BadRequestError
from duplex.files import WatchedFiles


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_rewrite_the_stat_does_not_show_is_seen(tmp_path: Path) -> None:
    # A certificate replaced in place by one of the same size, its times as before (as within
    # one timestamp tick of an older kernel): only the bytes changed.
    cert = tmp_path / "tls.crt"
    cert.write_bytes(b"A" * 100)
    before = os.stat(cert)
    files = WatchedFiles([cert], what="TLS files")
    assert files.refresh() is False and files.contents == (b"A" * 100,)
    cert.write_bytes(b"B" * 100)
    os.utime(cert, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(cert).st_mtime_ns == before.st_mtime_ns and os.stat(cert).st_ino == before.st_ino
    assert files.refresh() is True and files.contents == (b"B" * 100,)


def test_a_file_that_cannot_be_read_at_start_is_a_config_error(tmp_path: Path) -> None:
    present = tmp_path / "tls.key"
    present.write_bytes(b"k")
    with pytest.raises(BadRequestError) as refused:
        WatchedFiles([present, tmp_path / "missing.crt"], what="TLS files")
    assert refused.value.code == "invalid_config"
    assert "cannot read the TLS files" in refused.value.message and "missing.crt" in refused.value.message


def test_each_problem_is_warned_of_once_not_at_every_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(b"B" * 100)
    key.write_bytes(b"K" * 10)
    files = WatchedFiles([cert, key], what="TLS files")
    caplog.set_level(logging.INFO, "duplex.files")
    # Gone mid-rotation (a server checks at every handshake, which anyone can cause): the last
    # good contents stay, and one warning for any number of checks.
    cert.unlink()
    for _ in range(5):
        assert files.refresh() is False and files.contents == (b"B" * 100, b"K" * 10)
    assert len(_warnings(caplog)) == 1 and "tls.crt" in _warnings(caplog)[0]
    # Back unchanged: nothing to reload, and said so. Gone again later: that is news again.
    cert.write_bytes(b"B" * 100)
    assert files.refresh() is False
    assert sum("readable again" in r.getMessage() for r in caplog.records) == 1
    cert.unlink()
    assert files.refresh() is False and len(_warnings(caplog)) == 2
    # A caller's own problem with new contents (it does not parse): warned of once too.
    cert.write_bytes(b"C" * 100)
    assert files.refresh() is True
    files.warn("line 1 is not a certificate")
    files.warn("line 1 is not a certificate")
    assert len(_warnings(caplog)) == 3 and "line 1" in _warnings(caplog)[-1]
