"""Scan results keyed by content hash, so a re-run only parses what changed.

A result is stored under a digest of the file's project path and bytes (the path matters: relative
imports resolve against it), in a file named after the
:class:`~pgregistry._source.config.ScanConfig` fingerprint, which covers the scanner version and
every setting that changes what it reports. So a cached result is reused exactly when a fresh scan
would produce the same result; anything unreadable, truncated or of the wrong shape is ignored and
rescanned, never trusted. Writes are atomic (temporary file, then rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

from pgregistry._source.config import ScanConfig
from pgregistry._source.files import read_regular_file
from pgregistry._source.scanner import FileResult, decode_result, encode_result
from pgregistry._source.storage import atomic_write

__all__ = ["ScanCache", "content_key"]

#: Entries kept from earlier runs beyond the ones this run used; past it, only this run's entries
#: are kept.
MAX_ENTRIES = 20_000


def content_key(path: str, data: bytes) -> str:
    """The cache key of one file's contents at one project path."""
    digest = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=16)
    digest.update(b"\0")
    digest.update(data)
    return digest.hexdigest()


class ScanCache:
    """The results cached for one scan configuration under ``directory``."""

    def __init__(self, directory: Path, config: ScanConfig) -> None:
        self.directory = directory
        self.fingerprint = config.fingerprint()
        self.file = directory / f"allowlist-scan-{self.fingerprint}.json"
        self._stored = self._load_entries()
        self._used: dict[str, list[Any]] = {}
        self._added = False

    def _load_entries(self) -> dict[str, list[Any]]:
        try:
            payload = json.loads(read_regular_file(self.file)[0])  # a FIFO there is not waited on
        except (OSError, ValueError, RecursionError):  # nested past the recursion limit too
            return {}
        if not isinstance(payload, dict) or payload.get("fingerprint") != self.fingerprint:
            return {}
        entries = payload.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str, path: str) -> FileResult | None:
        """The cached result for ``key`` (from :func:`content_key`), or None."""
        row = self._stored.get(key)
        if row is None:
            return None
        try:
            result = decode_result(path, row)
        except (TypeError, ValueError):
            return None
        self._used[key] = row
        return result

    def put(self, key: str, result: FileResult) -> None:
        self._used[key] = encode_result(result)
        self._added = True

    def save(self) -> None:
        """Write the cache if this run added to it; an unwritable cache directory is no error."""
        if not self._added:
            return
        entries = {**self._stored, **self._used}
        if len(entries) > len(self._used) + MAX_ENTRIES:
            entries = self._used
        payload = json.dumps(
            {"fingerprint": self.fingerprint, "entries": entries}, separators=(",", ":")
        )
        with contextlib.suppress(OSError):  # StorageError is an OSError
            self.directory.mkdir(parents=True, exist_ok=True)
            ignore = self.directory / ".gitignore"
            if not ignore.exists():
                ignore.write_text(
                    "# Created by pgregistry allowlist: a cache, never commit it.\n*\n"
                )
            atomic_write(self.file, payload.encode("utf-8"), durable=False)
        self._stored, self._added = entries, False
