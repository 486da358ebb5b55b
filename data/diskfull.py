"""A full disk, said in one line. A writer of the run's big files (the target's samples and kept logits, the
tokenized blocks, the teacher store, the checkpoints) that meets ENOSPC (or a quota: EDQUOT) raises `DiskFull`,
naming what it could not write, where, how much it needs and how much is free there, and what a rerun does. Each of
those writers keeps what it wrote before whole (whole rows, atomic renames, whole records), so nothing written
before is lost and the run continues once space is freed."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from draftsmith.sampling.errors import DraftsmithError

FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(DraftsmithError, OSError):
    """A full disk (or quota): a DraftsmithError whose line says what, where, how much and what a rerun does, and
    an OSError with ENOSPC, so that code written against a plain full disk still sees one."""

    def __init__(self, message: str):
        OSError.__init__(self, errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def free_bytes(path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _full(e: BaseException | None) -> bool:
    """ENOSPC or EDQUOT, raised as an OSError or in the words of a library that writes outside Python (safetensors'
    Rust writer: "I/O error: No space left on device (os error 28)"), also as the cause of another error."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in FULL:
            return True
        if any(f"(os error {n})" in str(e) or os.strerror(n) in str(e) for n in FULL):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def disk_full(what: str, where, then, need=None):
    """Turn ENOSPC / EDQUOT inside the block into `DiskFull`: "disk full: could not write WHAT to WHERE (NEED
    needed, FREE free there); THEN". `then` and `need` may be callables, asked when the disk is full (what was
    written by then)."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if not _full(e):
            raise
        then, need = then() if callable(then) else then, need() if callable(need) else need
        free = free_bytes(where)
        sizes = ", ".join(s for s in (f"about {size(need)} needed" if need else "",
                                      f"{size(free)} free there" if free is not None else "") if s)
        raise DiskFull(f"disk full: could not write {what} to {where}" + (f" ({sizes})" if sizes else "")
                       + f"; {then}") from None
