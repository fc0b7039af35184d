"""The errors of the TCIA downloader; each message names the series or URL and says what to do."""

from __future__ import annotations


class TciaError(RuntimeError):
    """A download step failed for good; the message names the series or URL and says what to do."""


class IntegrityError(TciaError):
    """A downloaded archive is cut, corrupt, or does not match its MD5 manifest (worth fetching again)."""


class UnsafeArchiveError(TciaError):
    """A zip entry would be written outside its folder (absolute path, drive letter or ``..``)."""
