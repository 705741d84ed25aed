"""What every phase of the device check shares: rows, the clock, the output files, the run's settings.

A row is one measured case: {phase, case, status, time_ms, ratio, tflops, max_rel_diff, tmpe, peak_gib,
plan_gib, note, data}. status: ok | fail (it ran and a check failed: a tolerance, an expectation) |
error (it raised: the traceback goes to stderr) | skipped (never started; the note says why).
`Report` appends every row to OUT_DIR/device_check.jsonl and OUT_DIR/device_check.md the moment it is
made (flushed and fsynced), so a run killed at any instant leaves every finished row on disk, and a run
started with --resume after a crashed one (device_check.sh does that) appends to the same files.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COLUMNS = ("phase", "case", "status", "time_ms", "ratio", "tflops", "max_rel_diff", "tmpe", "peak_gib", "plan_gib",
           "note")
STATUSES = ("ok", "fail", "error", "skipped")
MIN_START_S = 5.0  # a case needs at least this much time left (in its phase and overall) to start
JSONL, MARKDOWN, CURRENT = "device_check.jsonl", "device_check.md", "device_check.current"
ABORT_ENV = "FP8RL_DEVICE_CHECK_ABORT_AT"  # "<phase>/<case>": os.abort() there (tests device_check.sh's resume)
GiB = 2**30


def row(phase: str, case: str, status: str = "ok", data: dict | None = None, **fields: Any) -> dict[str, Any]:
    """One row; `fields` are the numeric columns and the note (unknown names are an error)."""
    unknown = set(fields) - set(COLUMNS[3:])
    if unknown or status not in STATUSES:
        raise ValueError(f"row: unknown fields {sorted(unknown)} or status {status!r}; "
                         f"valid: {COLUMNS[3:]}, {STATUSES}")
    return {"phase": phase, "case": case, "status": status, **{k: fields.get(k) for k in COLUMNS[3:]},
            "data": data or {}}


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:240]}"


class Clock:
    """The overall deadline and the per-phase budgets (seconds from construction / from a phase's start)."""

    def __init__(self, deadline_s: float, budgets: dict[str, float], now: Callable[[], float] = time.monotonic,
                 t0: float | None = None):
        """t0: when the deadline's time started (default: now; gpu_check passes its process's start)."""
        self.deadline_s, self.budgets, self.now = deadline_s, budgets, now
        self.t0 = now() if t0 is None else t0
        self.phase_t0: dict[str, float] = {}

    def left(self) -> float:
        return self.deadline_s - (self.now() - self.t0)

    def phase_left(self, phase: str) -> float:
        start = self.phase_t0.setdefault(phase, self.now())
        return self.budgets.get(phase, float("inf")) - (self.now() - start)

    def why_not(self, phase: str) -> str | None:
        """Why a new case of `phase` may not start now, or None."""
        overall, own = self.left(), self.phase_left(phase)
        if overall < MIN_START_S:
            return f"overall deadline: {max(overall, 0):.0f} s left of {self.deadline_s:.0f} s (--deadline)"
        if own < MIN_START_S:
            return (f"phase {phase} budget: {max(own, 0):.0f} s left of {self.budgets[phase]:.0f} s "
                    f"(--budgets {phase}=...)")
        return None


class Report:
    """The two output files, appended row by row (see the module docstring); also echoes each row to stdout."""

    HEAD = ("| phase | case | status | time ms | x baseline | TFLOP/s | max rel diff | tmpe | peak GiB | plan GiB "
            "| note |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")

    def __init__(self, out_dir: Path | None, title: str, preamble: str = "", resume: bool = False) -> None:
        """preamble: text between the title and the table; resume: keep the files and the rows already in
        them (a run that goes on after a crashed one: its table goes on)."""
        self.rows: list[dict] = []
        self.out_dir = out_dir
        if out_dir is not None and resume and (out_dir / JSONL).exists():
            self.rows = [json.loads(ln) for ln in (out_dir / JSONL).read_text().splitlines() if _whole(ln)]
            print(f"# {title} (resumed: {len(self.rows)} rows kept)", flush=True)
            return
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / CURRENT).unlink(missing_ok=True)
            (out_dir / JSONL).write_text("")
            (out_dir / MARKDOWN).write_text(f"# {title}\n\n{preamble}\n\n{self.HEAD}\n")
        print(f"# {title}\n{preamble}\n{self.HEAD}", flush=True)

    def add(self, rows: list[dict]) -> list[dict]:
        for r in rows:
            self.rows.append(r)
            line = markdown_row(r)
            print(line, flush=True)
            if self.out_dir is not None:
                _append(self.out_dir / JSONL, json.dumps(r, default=str) + "\n")
                _append(self.out_dir / MARKDOWN, line + "\n")
        return rows

    def started(self, phase: str, case: str) -> None:
        """Record the case now running in OUT_DIR/device_check.current (what a crash or a kill interrupted)."""
        if self.out_dir is not None:
            (self.out_dir / CURRENT).write_text(f"{phase}/{case}\n")

    def running(self) -> tuple[str, str] | None:
        """(phase, case) that was running when the last process stopped, or None."""
        path = None if self.out_dir is None else self.out_dir / CURRENT
        if path is None or not path.exists() or "/" not in path.read_text():
            return None
        phase, _, case = path.read_text().strip().partition("/")
        return phase, case

    def text(self, text: str) -> None:
        """Free text after the table (the totals, the skipped list)."""
        print(text, flush=True)
        if self.out_dir is not None:
            _append(self.out_dir / MARKDOWN, text + "\n")


def _whole(line: str) -> bool:
    """A complete JSON line (a process killed mid-write leaves at most one torn last line)."""
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown_row(r: dict) -> str:
    note = (r["note"] or "").replace("|", "/").replace("\n", " ")
    return (f"| {r['phase']} | {r['case']} | {r['status']} | {_fmt(r['time_ms'], '.2f')} | {_fmt(r['ratio'], '.2f')} "
            f"| {_fmt(r['tflops'], '.3g')} | {_fmt(r['max_rel_diff'], '.2e')} | {_fmt(r['tmpe'], '.5f')} "
            f"| {_fmt(r['peak_gib'], '.2f')} | {_fmt(r['plan_gib'], '.2f')} | {note} |")


@dataclass
class Run:
    """What a phase gets: the settings, the device, the clock, the report, a scratch folder."""

    args: Any  # gpu_check's parsed arguments
    device: Any  # torch.device
    clock: Clock
    report: Report
    work: Path
    shared: dict[str, Any] = field(default_factory=dict)  # handed from one phase to the next (the model's path)

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"

    def case(self, phase: str, case: str, fn: Callable[[], list[dict]]) -> list[dict]:
        """fn()'s rows (reported at once) if the clock lets a case of `phase` start; else one skipped row.
        An exception becomes one error row (traceback to stderr) and the check goes on."""
        why = self.clock.why_not(phase)
        if why:
            return self.report.add([row(phase, case, "skipped", note=f"not started: {why}")])
        self.report.started(phase, case)
        if os.environ.get(ABORT_ENV) == f"{phase}/{case}":  # fault injection: a crash in this case
            os.abort()
        try:
            rows = fn()
        except Exception as exc:  # noqa: BLE001  (a check reports every failure and goes on)
            traceback.print_exc(file=sys.stderr)
            rows = [row(phase, case, "error", note=first_line(exc))]
        return self.report.add(rows)


def rel_diff(a: Any, b: Any) -> float:
    """max|a - b| / max|b| (normwise: elementwise ratios blow up where b ~ 0)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def installed(module: str) -> bool:
    """find_spec(module) without importing it; a finder that refuses (an import blocker) counts as absent,
    a module already in sys.modules as present."""
    import importlib.util

    if sys.modules.get(module) is not None:
        return True
    try:
        return all(importlib.util.find_spec(m) is not None
                   for m in [module.split(".")[0], module] if m)
    except (ImportError, ValueError):
        return False
