"""Environment variables set for one block, then put back as they were.

    with environ({"MASTER_PORT": "29500"}):
        start_processes()     # children copy os.environ as it is now

Why a context manager on os.environ: the processes we start (submitit's local controllers, a
benchmark's engine reading FP8RL_FUSED) copy or read the environment at that moment, and nothing else
in this process may keep the values afterwards. Stdlib only (the sweep driver imports it without torch).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environ(values: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `values` set inside the block; each key restored (or removed) on the way out."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
