"""Files that appear whole or not at all: :class:`AtomicFile`.

Why one helper: checkpoint files, checkpoint manifests and backup records are
each read back by a process that may start after a crash, so each must be
either the complete new content or absent (or the complete old content).
The recipe is always the same: write a temporary file beside the target,
flush and ``fsync`` it, then ``os.replace`` it over the target (atomic within
one file system); on any failure remove the temporary file.

The temporary file is ``<path>.tmp-<pid>`` (readers that list a directory skip
``.tmp-`` names). Two writers of one path in one process at once are not
supported: their temporary files would be the same.
"""

from __future__ import annotations

import logging
import os
from types import TracebackType
from typing import IO, Any

logger = logging.getLogger(__name__)


def temporary_name(path: str) -> str:
    """The temporary file :class:`AtomicFile` writes before it replaces ``path``."""
    return f"{path}.tmp-{os.getpid()}"


class AtomicFile:
    """Write ``path`` atomically: ``with AtomicFile(path) as f: f.write(...)``.

    Construction creates (truncates) the temporary file, so an ``OSError`` raised
    by the constructor means nothing was created: the caller can tell "cannot
    create a file there" (no permission, a directory of that name) from a failure
    while writing (a full disk), which the ``with`` block raises.

    On a clean exit of the ``with`` block the file is flushed, fsynced, closed and
    renamed over ``path``. If the block raises (or flushing, fsyncing or renaming
    fails) the temporary file is removed, ``path`` is left as it was, and the
    exception propagates.

    Args:
        path: the file to write; its directory must exist.
        text: open in text mode (``"w"``, for ``json.dump``) instead of binary (``"wb"``).
    """

    def __init__(self, path: str | os.PathLike[str], text: bool = False) -> None:
        self.path = os.fspath(path)
        self.tmp = temporary_name(self.path)
        self.file: IO[Any] = open(self.tmp, "w" if text else "wb")  # closed by __exit__

    def __enter__(self) -> IO[Any]:
        return self.file

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        if not self.file.closed:
            try:
                self.file.close()
            except OSError as e:  # a close that fails on a file being thrown away changes nothing
                logger.debug("closing %s: %s", self.tmp, e)
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
