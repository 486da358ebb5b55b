"""A corpus' JSONL row files: how many whole rows they hold, and which ones (a digest of the first N)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def line_count(path: Path) -> int:
    """Rows of a JSONL (the file is closed after; a row torn mid-write has no newline and does not count)."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))


def rows_digest(path: Path, rows: int) -> str:
    """sha256 of the first `rows` lines of a JSONL: which samples a run trains on, whatever is appended later."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for _ in range(rows):
            h.update(f.readline())
    return h.hexdigest()
