"""The sweep's report and its count of finished cells, one home each, for the three places that end a
sweep or report on it: the driver's end (`cell_sources.GridSource.finish`), the SLURM report stage
(`jobs.report_stage`) and `sweep report` (`launchers/cli.py`).

    paths = write_report(uri, "fp8rl", "fp8_ablation", folder / "report", parent, analysis, cell_ids)
    done = finished_count(cell_states(uri, "fp8rl", "fp8_ablation"), cell_ids)
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.config import AnalysisConfig
from fp8rl_core.tracking import FINISHED

if TYPE_CHECKING:
    from analysis.engines import EnginesReport
    from analysis.numerics import NumericsReport
    from analysis.report import ReportPaths

    Report = ReportPaths | NumericsReport | EnginesReport


def write_report(uri: str, experiment: str, sweep_name: str, out_dir: str | Path, parent_run_id: str | None,
                 analysis: Mapping[str, Any] | None, cell_ids: list[str] | None) -> Report:
    """`analysis.report.make_report` with the sweep file's `analysis:` block; `cell_ids`: the file's cells
    (child runs of an earlier version's cells are left out), None for a search (every trial counts)."""
    from analysis.report import make_report  # matplotlib loads when a report is written, not for `sweep plan`

    return make_report(uri, experiment, sweep_name, out_dir, parent_run_id=parent_run_id,
                       config=AnalysisConfig.from_dict(analysis), cell_ids=cell_ids)


def finished_count(states: Mapping[str, str], cell_ids: Collection[str] | None = None) -> int:
    """How many of `cell_ids` (None: every run in `states`) have a FINISHED run; `states`: {cell id:
    MLflow status}. Runs of an earlier file's cells do not count."""
    ids = states.keys() if cell_ids is None else cell_ids
    return sum(states.get(c) == FINISHED for c in ids)
