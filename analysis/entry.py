"""The `python -m analysis.<study> SWEEP_FILE` entry point that the study reports share.

    sys.exit(sweep_file_main(argv, "analysis.numerics", __doc__, make_numerics_report))

The experiment, tracking URI, parent run, cells and `analysis:` block come from the sweep file, as
`sweep report` reads them; `make(uri, experiment, sweep_name, out_dir, parent, log_artifacts=, config=,
cell_ids=, sweep_file=)` writes the report and returns an object with `.verdicts_text`, `.report` and
`.files()` (`NumericsReport`, `EnginesReport`).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from analysis.config import AnalysisConfig
from fp8rl_core.tracking.runs import find_parent_run
from fp8rl_core.tracking.store import Store


def sweep_file_main(argv: Sequence[str] | None, module: str, doc: str | None, make: Callable[..., Any]) -> int:
    """Parse `SWEEP_FILE [--out DIR] [--tracking-uri URI] [--no-log]`, run `make`, print the verdicts and the
    files; 1 (with the reason on stderr) when the sweep has no runs or `make` raises ValueError."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n\n")[0])
    p.add_argument("file", help="the sweep file")
    p.add_argument("--out", help="output folder (default <sweep folder>/report, as `sweep report`)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default the sweep file's tracking.uri)")
    p.add_argument("--no-log", action="store_true", help="do not log the files to the sweep's parent run")
    args = p.parse_args(argv)
    from launchers.plan.grid import expand_grid
    from launchers.sweepfile.loading import load_sweep

    sweep = load_sweep(args.file)
    uri = args.tracking_uri or sweep.tracking_uri()
    parent = find_parent_run(uri, sweep.experiment, sweep.experiment)
    if parent is None:
        print(f"{module}: no runs of sweep {sweep.experiment!r} at {uri}; run it first", file=sys.stderr)
        return 1
    cell_ids = None if sweep.spec.search is not None else [c.id for c in expand_grid(sweep).cells]
    cfg = AnalysisConfig.from_dict(sweep.spec.analysis)
    try:
        rep = make(uri, sweep.experiment, sweep.experiment, args.out or sweep.folder / "report", parent,
                   log_artifacts=not args.no_log, config=cfg, cell_ids=cell_ids, sweep_file=args.file)
    except ValueError as e:
        print(f"{module}: {e}", file=sys.stderr)
        return 1
    print(rep.verdicts_text)
    print(f"\nreport: {rep.report}")
    for path in rep.files()[1:]:
        print(f"  {path}")
    return 0


def fetch_runs(uri: str, experiment: str, sweep_name: str, parent_run_id: str | None,
               cell_ids: Any = None) -> Any:
    """`analysis.fetch.fetch_sweep`, refusing a sweep without child runs (ValueError, as the reports say it)."""
    from analysis.fetch import fetch_sweep

    data = fetch_sweep(uri, experiment, sweep_name=sweep_name, parent_run_id=parent_run_id, cell_ids=cell_ids)
    if not data.runs:
        raise ValueError(f"sweep {sweep_name!r} in experiment {experiment!r} at {uri} has no child runs yet")
    return data


def log_files(uri: str, parent_run_id: str, files: Sequence[Any]) -> Any:
    """Log `files` under `report/` of the parent run; returns the Store client (for more tags)."""
    from analysis.links import ARTIFACT_DIR

    client = Store(uri)
    for path in files:
        client.log_artifact(parent_run_id, str(path), ARTIFACT_DIR)
    return client
