"""Every report of a grid sweep (`sweep report`, the end of `sweep run`, the SLURM report stage) reads only
the cells of the sweep file as it is now: child runs of cells an earlier version of the file had are left
out and counted in report.md. Real SQLite MLflow store, `fake_run` cells, the real analysis."""
from __future__ import annotations

import io

from _sweep_fakes import FakeScheduler, fake_run, write_sweep

from launchers.cli import main
from launchers.plan.grid import expand
from launchers.run.driver import run_sweep
from launchers.run.jobs import report_stage
from launchers.run.state import load_state
from launchers.sweepfile.loading import load_sweep

SWEEP = """\
experiment: wire
base:
  train: {{steps: 3}}
  warmstart: {{steps: 0}}
grid:
  seed: {seeds}
launcher: {{kind: {kind}, retries: 0}}
tracking: {{uri: "sqlite:///mlflow.db"}}
"""
LEFT_OUT = "1 more child run of this parent was left out as belonging to an earlier version of the sweep file"


def _edited(cwd, kind: str = "debug"):
    """Run 3 seeds, then edit the file down to 2: the third seed's run stays under the parent."""
    path = write_sweep(cwd, SWEEP.format(seeds="[0, 1, 2]", kind=kind))
    assert run_sweep(load_sweep(path), run_fn=fake_run, out=io.StringIO(), poll_s=0.0, report=False) == 0
    path.write_text(SWEEP.format(seeds="[0, 1]", kind=kind))
    return path, load_sweep(path)


def test_sweep_report_and_the_end_of_sweep_run_leave_out_cells_of_an_earlier_file(cwd, capsys):
    path, sweep = _edited(cwd)
    assert main(["report", str(path), "--out", str(cwd / "cli")]) == 0
    text = (cwd / "cli" / "report.md").read_text()
    assert "2 child runs (2 FINISHED)" in text and LEFT_OUT in text
    printed = capsys.readouterr().out  # the instability episodes follow the claims in the printout
    assert "Instability episodes: " in printed and "\nSensitivity: no run is flagged (analysis.episodes)" in printed
    # `sweep run` again: nothing to run, and its report (none yet in the sweep folder) reads the same cells
    assert run_sweep(sweep, run_fn=fake_run, out=io.StringIO(), poll_s=0.0, report=True) == 0
    text = (sweep.folder / "report" / "report.md").read_text()
    assert "2 child runs (2 FINISHED)" in text and LEFT_OUT in text


def test_the_slurm_report_stage_gets_the_cells_it_was_submitted_with(cwd):
    path, sweep = _edited(cwd)
    cells = [c.id for c in expand(sweep)]
    parent = load_state(sweep.folder).parent_run_id
    out = report_stage(sweep.tracking_uri(), "wire", "wire", str(cwd / "stage"), parent, len(cells), {}, cells)
    text = (cwd / "stage" / "report.md").read_text()
    assert out == str(cwd / "stage" / "report.md") and LEFT_OUT in text
    # what `sweep run --detach` on SLURM submits: the report stage's task carries the current cell ids
    slurm = load_sweep(write_sweep(cwd, SWEEP.format(seeds="[0, 1, 3]", kind="slurm")))
    fake = FakeScheduler(delay=100)
    assert run_sweep(slurm, executor=fake, run_fn=fake_run, out=io.StringIO(), poll_s=0.0, detach=True) == 0
    (task,) = [t for t in fake.tasks.values() if t.name == "report"]
    assert task.args[-1] == [c.id for c in expand(slurm)]
