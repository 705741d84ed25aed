"""Where a study report's numbers came from (the numerics and engine studies' JSON `provenance`): the sweep
file and its sha256, experiment, sweep, tracking URI, parent run, stale runs left out, git commit, date."""
from __future__ import annotations

import datetime as dt
import hashlib
import subprocess
from pathlib import Path

from analysis.fetch import SweepData


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def provenance(data: SweepData | None, sweep_file: str | Path | None, experiment: str | None) -> dict:
    prov: dict = {"sweep_file": str(sweep_file) if sweep_file else None, "sweep_file_sha256": None,
                  "experiment": experiment, "sweep": data.sweep_name if data else None,
                  "tracking_uri": data.uri if data else None, "parent_run_id": data.parent_run_id if data else None,
                  "stale_runs_left_out": data.stale_runs if data else 0,
                  "git_commit": git_commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    if sweep_file and Path(sweep_file).is_file():
        prov["sweep_file_sha256"] = hashlib.sha256(Path(sweep_file).read_bytes()).hexdigest()
    return prov
