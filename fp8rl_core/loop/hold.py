"""A test hook: hold a run after one step until a file appears, so that tests which act on a run in
flight (requeue, preemption, cancel) find it there on any machine, however fast.

    FP8RL_HOLD_AFTER_STEP="<step>:<release file>[:<max seconds>]"

After step <step> is logged and checkpointed, the run waits until <release file> exists (at most
<max seconds>, default 600, so a test that dies never leaves a job waiting forever). Signals still
arrive while it waits (SIGINT, submitit's USR2), so a held run can be cancelled or preempted; the wait
also ends when `until()` turns true (the time-limit flag, fp8rl_core/loop/preempt.py). Unset —
the normal case — it costs one dictionary lookup per step.

Each waiting process first writes `<release file>.held.<pid>` (`holders` counts them): a test acts
once every process it expects is inside the wait, never on a metric line that precedes the
checkpoint (a preemption that lands mid-checkpoint resumes one step early).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ENV_VAR = "FP8RL_HOLD_AFTER_STEP"
HELD_SUFFIX = ".held."


def hold_spec(value: str) -> tuple[int, Path, float]:
    """Parse the variable: (step, release file, max seconds)."""
    parts = value.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1]:
        raise ValueError(f"{ENV_VAR}={value!r}: expected '<step>:<release file>[:<max seconds>]'")
    return int(parts[0]), Path(parts[1]), float(parts[2]) if len(parts) == 3 else 600.0


def hold_after(step: int, env: Mapping[str, str] | None = None, poll_s: float = 0.1,
               until: Callable[[], bool] | None = None) -> bool:
    """Wait here if the environment asks to hold after `step`; True when it held. `until`: ends the
    wait early when it returns True."""
    value = (os.environ if env is None else env).get(ENV_VAR)
    if not value:
        return False
    at, release, max_s = hold_spec(value)
    if step != at:
        return False
    marker = release.with_name(f"{release.name}{HELD_SUFFIX}{os.getpid()}")
    marker.write_text(f"{step}\n")  # after the checkpoint: this process is now inside the wait
    deadline = time.monotonic() + max_s
    while not release.exists() and time.monotonic() < deadline and not (until and until()):
        time.sleep(poll_s)
    return True


def holders(release: Path) -> int:
    """How many processes have entered the hold of `release` (one marker each, kept after release)."""
    release = Path(release)
    return sum(1 for _ in release.parent.glob(f"{release.name}{HELD_SUFFIX}*"))
