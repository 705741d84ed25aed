"""launchers.run.sweep_report: the one count of finished cells (the driver's end and the SLURM report stage)."""
from __future__ import annotations

from fp8rl_core.tracking import FAILED, FINISHED, RUNNING
from launchers.run.sweep_report import finished_count


def test_finished_count_counts_the_current_cells_only():
    states = {"a": FINISHED, "b": FAILED, "c": FINISHED, "old": FINISHED}  # "old": a cell of an earlier file
    assert finished_count(states, ["a", "b", "c"]) == 2
    assert finished_count(states, ["a", "b", "c", "never-run"]) == 2
    assert finished_count(states) == 3  # no cell ids (a search): every run counts
    assert finished_count({"a": RUNNING}, ["a"]) == 0 and finished_count({}, []) == 0
