"""Fixtures for the analysis tests: a real SQLite MLflow store holding a synthetic sweep.

`sweep_store` (session): parent + 18 child runs (bf16 / fp8_gen / fp8_e2e x IS none / token x 3 seeds,
21 steps, with the optional token-fraction tails) logged through `fp8rl_core.tracking.runs`; `.runs` keeps
the exact values that were logged,
the ground truth the tests compare MLflow's answers against.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from analysis.fetch import RunHistory


@dataclass
class SweepStore:
    uri: str
    experiment: str
    sweep: str
    parent: str
    runs: list[RunHistory]


@pytest.fixture(scope="session")
def sweep_store(tmp_path_factory, mlflow_template_db: Path) -> SweepStore:
    from analysis.synthetic import log_sweep, synthetic_runs

    db = tmp_path_factory.mktemp("sweep_store") / "mlflow.db"
    shutil.copy(mlflow_template_db, db)
    uri = f"sqlite:///{db}"
    runs = synthetic_runs(seeds=3, steps=21, tails=True)
    parent = log_sweep(uri, "fp8rl", "synthetic", runs)
    return SweepStore(uri, "fp8rl", "synthetic", parent, runs)
