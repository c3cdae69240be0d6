"""Writing files so that a stop never leaves half of one, and the writes the system refused for want of
room or of a writable disk: which those are, in the system's words, and what frees them. The token
cache, a run's files and the outputs of generate.py and export.py each say what is kept and how to go
on; what went wrong, and its fix, are said here."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write text beside path, then rename it into place: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def making_folders(folder: Path):
    """For a block that makes `folder` (with its parents) and writes there: should it fail, the folders it
    made are removed again, innermost first and only while empty, so that a failed write leaves none."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        yield
    except BaseException:
        for made_folder in made:
            try:
                made_folder.rmdir()
            except OSError:
                break
        raise


FIXES = {
    errno.ENOSPC: "free some space",
    errno.EDQUOT: "free some space (or raise the quota)",
    errno.EROFS: "make the folder writable again",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
}
WHAT = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "a file reached the size limit",
}


class RefusedWrite(OSError):
    """A write the system refused for one of the reasons in FIXES; str() says which, in words."""

    def __str__(self) -> str:
        return WHAT[self.errno]

    @property
    def fix(self) -> str:
        return FIXES[self.errno]


def refused_write(err: BaseException | None) -> RefusedWrite | None:
    """The refused write in err or what caused it (a tracker's or a library's own error wraps the
    OSError of its files; safetensors quotes it as "... (os error 28)"); None for any other error."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = err.errno if isinstance(err, OSError) else None
        if code is None and (quoted := re.search(r"\(os error (\d+)\)", str(err))):
            code = int(quoted.group(1))
        if code in FIXES:
            return RefusedWrite(code, os.strerror(code), getattr(err, "filename", None))
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return None
