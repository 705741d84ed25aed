"""Progress of a sweep's cells without asking MLflow per cell: each cell's `metrics.jsonl` tail.

Every run appends `{"kind": "metrics", "step": s, "time_ms": t, ...}` to
`<sweep folder>/cells/<id>/metrics.jsonl` (fp8rl_core.tracking.sink); reading its last few KB gives
the current step and the step rate. ETA = remaining steps x seconds per step / cells at once.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fp8rl_core.tracking import METRICS_FILE

TAIL_BYTES = 16384
_REPO = Path(__file__).resolve().parents[2]
# Lines a log carries that say nothing about the error: submitit's own logger, tqdm bars.
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_NOISE = re.compile(r"^(submitit (INFO|WARNING|ERROR|DEBUG) |srun: |\s*\d+%\|)")


@dataclass(frozen=True)
class StepInfo:
    step: int  # last logged step (-1: none yet)
    first_ms: int | None = None  # time of the first record in the tail read (for the rate)
    first_step: int | None = None
    last_ms: int | None = None

    def seconds_per_step(self) -> float | None:
        if self.first_ms is None or self.last_ms is None or self.first_step is None:
            return None
        steps = self.step - self.first_step
        return (self.last_ms - self.first_ms) / 1000.0 / steps if steps > 0 else None


def _tail_lines(path: Path, nbytes: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode(errors="replace").split("\n")
    return lines[1:] if size > nbytes else lines  # the first line of a partial read is cut


def cell_step(cell_dir: Path) -> StepInfo:
    """The last step in the cell's metrics.jsonl (reads at most TAIL_BYTES)."""
    step, first = -1, None
    last_ms = None
    for line in _tail_lines(Path(cell_dir) / METRICS_FILE, TAIL_BYTES):
        if '"metrics"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if rec.get("kind") != "metrics":
            continue
        s, t = int(rec.get("step", -1)), rec.get("time_ms")
        if first is None and s > 0 and t is not None:
            first = (s, int(t))
        if s >= step:
            step, last_ms = s, t
    if first is None:
        return StepInfo(step)
    return StepInfo(step, first[1], first[0], None if last_ms is None else int(last_ms))


def error_tail(log_path: str | Path | None, n: int = 3, max_chars: int = 600) -> str | None:
    """What a failed job's stderr log says went wrong, on one line.

    With a Python traceback: its last line (the exception) and where it was raised,
    `RuntimeError: boom (at fp8rl_core/loop/run.py:97 in run)`; else the last `n` meaningful lines."""
    if not log_path:
        return None
    lines = [ln.rstrip() for ln in _tail_lines(Path(log_path), 65536)]
    lines = [ln for ln in lines if ln.strip() and not _NOISE.match(ln)]
    if not lines:
        return None
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if not starts:
        return " | ".join(ln.strip() for ln in lines[-n:])[-max_chars:]
    tb = lines[starts[-1]:]
    exc_i = max((i for i, ln in enumerate(tb) if not ln.startswith(" ") and i > 0), default=len(tb) - 1)
    frames = [_FRAME.match(ln) for ln in tb[:exc_i]]
    where = next((m for m in reversed(frames) if m), None)
    at = f" (at {_short(where.group(1))}:{where.group(2)} in {where.group(3)})" if where else ""
    return (" ".join(ln.strip() for ln in tb[exc_i:exc_i + 2]) + at)[-max_chars:]


def _short(path: str) -> str:
    """A repo-relative path when the file is ours (on this machine), else the file name."""
    try:
        return str(Path(path).relative_to(_REPO))
    except ValueError:
        return Path(path).name


def eta_seconds(remaining_steps: int, rates: list[float], parallel: int) -> float | None:
    """Remaining steps x median seconds per step / cells at once (None without a measured rate)."""
    if remaining_steps <= 0:
        return 0.0
    rates = sorted(r for r in rates if r and r > 0)
    if not rates:
        return None
    return remaining_steps * rates[len(rates) // 2] / max(1, parallel)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
