"""Fixtures for the tracking tests: a fresh SQLite MLflow store per test.

Creating MLflow's tables takes ~6 s here, so one template database is made per session and copied
(~0.15 s) for each test.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # runs MLflow's migrations once
    return db


@pytest.fixture
def sqlite_uri(tmp_path: Path, mlflow_template: Path) -> str:
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, db)
    return f"sqlite:///{db}"
