"""Optuna search (launchers/run/search.py): trials run as cells, values come from MLflow, failures retry,
the journal-file study resumes.

The cell is `_sweep_fakes.fake_run`, whose val_accuracy is fake_accuracy(lr): each trial's value is
checked against that formula, independently of what the driver read from MLflow.
"""
from __future__ import annotations

import io
from pathlib import Path

import optuna
import pytest
from _sweep_fakes import FakeScheduler, fake_accuracy, fake_run, write_sweep
from mlflow import MlflowClient

from launchers.run.search import CELL_ATTR, TRIAL_TAG, load_study, open_storage, run_search
from launchers.run.state import load_state
from launchers.sweepfile.loading import load_sweep

SEARCH = """\
experiment: srch
base:
  train: {steps: 2}
  warmstart: {steps: 0}
search:
  sampler: random
  params:
    optim.lr: {type: float, low: 1.0e-5, high: 1.0e-2, log: true}
  metric: val_accuracy
  direction: maximize
  n_trials: 4
  parallel: 2
  retries: 1
  seed: 0
launcher: {kind: debug}
tracking: {uri: "sqlite:///mlflow.db"}
"""


def go(sweep, **kw) -> tuple[int, str]:
    out = io.StringIO()
    kw.setdefault("run_fn", fake_run)
    return run_search(sweep, out=out, poll_s=0.0, **kw), out.getvalue()


def test_trials_are_cells_whose_values_come_from_mlflow(cwd):
    sweep = load_sweep(write_sweep(cwd, SEARCH))
    rc, text = go(sweep)
    assert rc == 0, text
    study = load_study(sweep)
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(study.trials) == len(trials) == 4
    for t in trials:
        assert t.value == pytest.approx(fake_accuracy(t.params["optim.lr"]), rel=1e-9)
    assert study.best_value == max(t.value for t in trials)
    assert (sweep.folder / "optuna.journal").exists()
    client = MlflowClient(sweep.tracking_uri())
    exp = client.get_experiment_by_name("srch")
    runs = client.search_runs([exp.experiment_id], "tags.`fp8rl.role` = 'cell'")
    assert sorted(r.data.tags["cell_id"] for r in runs) == sorted(t.user_attrs[CELL_ATTR] for t in trials)
    assert sorted(int(r.data.tags[TRIAL_TAG]) for r in runs) == [0, 1, 2, 3]
    parent = client.get_run(load_state(sweep.folder).parent_run_id)
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(study.best_value)
    assert parent.info.status == "FINISHED" and "best trial" in text

    fake = FakeScheduler(kind="debug")  # the study is complete: running it again starts nothing
    assert go(sweep, executor=fake)[0] == 0 and fake.submits == []
    assert len(load_study(sweep).trials) == 4


def test_failed_trials_are_retried_then_failed(cwd):
    body = SEARCH.replace("sampler: random", "sampler: grid").replace(
        "{type: float, low: 1.0e-5, high: 1.0e-2, log: true}", "{type: categorical, choices: [0.001, 0.9]}")
    sweep = load_sweep(write_sweep(cwd, body.replace("  n_trials: 4\n", "")))
    flaky_dirs: set[str] = set()

    def flaky(cfg):  # the first attempt of every cell dies; lr 0.9 always fails
        if cfg.output_dir not in flaky_dirs:
            flaky_dirs.add(cfg.output_dir)
            raise OSError("node lost")
        return fake_run(cfg)

    rc, text = go(sweep, run_fn=flaky)
    assert rc == 1  # one trial failed for good
    states = {t.params["optim.lr"]: t.state for t in load_study(sweep).trials}
    assert states == {0.001: optuna.trial.TrialState.COMPLETE, 0.9: optuna.trial.TrialState.FAIL}
    state = load_state(sweep.folder)
    outcomes = {rec.params["optim.lr"]: [a.outcome for a in rec.attempts] for rec in state.cells.values()}
    assert outcomes == {0.001: ["failed", "finished"], 0.9: ["failed", "failed"]}
    assert "impossible lr 0.9" in text

    # --retry-failed, as for a grid: the failed trial's cell runs again (its failures forgiven)
    import dataclasses

    def fixed(cfg):  # the cell's bug is fixed: it now finishes
        return fake_run(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.001)))

    assert go(sweep, run_fn=fixed)[0] == 1  # without the flag: nothing re-runs
    rc, text = go(sweep, run_fn=fixed, retry_failed=True)
    assert rc == 0, text
    assert "retrying 1 failed trial(s)" in text
    by_state = [(t.params["optim.lr"], t.state) for t in load_study(sweep).trials]
    assert (0.9, optuna.trial.TrialState.COMPLETE) in by_state


def test_storage_is_a_journal_file_or_the_given_url(tmp_path):
    assert open_storage("postgresql://u@h/db") == "postgresql://u@h/db"
    journal = tmp_path / "deep" / "optuna.journal"
    storage = open_storage(str(journal))
    assert isinstance(storage, optuna.storages.JournalStorage) and journal.exists()
    study = optuna.create_study(storage=storage, study_name="s")
    study.tell(study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}), 0.5)
    again = optuna.load_study(study_name="s", storage=open_storage(str(journal)))
    assert [t.value for t in again.trials] == [0.5]


def test_search_status_lists_the_trials(cwd):
    from launchers.run.status import collect

    sweep = load_sweep(write_sweep(cwd, SEARCH.replace("n_trials: 4", "n_trials: 2")))
    assert go(sweep)[0] == 0
    cells, rows, _ = collect(sweep)
    assert len(rows) == 2 and all(r["state"] == "finished" for r in rows)
    assert all(Path(sweep.folder / "cells" / c.id / "metrics.jsonl").exists() for c in cells)
