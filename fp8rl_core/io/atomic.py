"""Durable writes on shared disks: fsync a file or a folder, so that a rename that follows is final."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make a folder's entries (a file created or renamed into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
