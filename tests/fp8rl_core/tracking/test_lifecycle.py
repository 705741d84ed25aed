"""The one table from outcomes to MLflow statuses (fp8rl_core/tracking/lifecycle.py)."""
from __future__ import annotations

import pytest

from fp8rl_core.tracking import lifecycle as lc
from fp8rl_core.tracking.contract import FAILED, FINISHED, KILLED, RUNNING, SCHEDULED


@pytest.mark.parametrize("error, status", [
    (None, FINISHED), (SystemExit(0), RUNNING), (KeyboardInterrupt(), KILLED), (RuntimeError("x"), FAILED),
    (MemoryError(), FAILED)])
def test_a_run_ends_as_its_exception_says(error, status):
    assert lc.run_status(error) == status


def test_the_cell_job_follows_the_same_table_but_leaves_a_plain_exit_alone():
    assert lc.job_status(SystemExit(0), requeued=True) == RUNNING
    assert lc.job_status(SystemExit(0), requeued=False) is None
    assert lc.job_status(KeyboardInterrupt(), requeued=False) == KILLED
    assert lc.job_status(ValueError("bad"), requeued=True) == FAILED


@pytest.mark.parametrize("status, ends", [(SCHEDULED, KILLED), (RUNNING, KILLED), (FINISHED, None),
                                          (FAILED, None), (KILLED, None), (None, None)])
def test_a_dead_job_kills_only_an_open_run(status, ends):
    assert lc.gone_status(status) == ends


@pytest.mark.parametrize("before, now, ends", [
    (RUNNING, RUNNING, KILLED), (RUNNING, FAILED, KILLED),  # failed while dying of the cancel: still cancelled
    (SCHEDULED, None, KILLED), (RUNNING, FINISHED, None), (FAILED, FAILED, None), (FINISHED, FINISHED, None)])
def test_cancel_kills_what_was_open_and_did_not_finish(before, now, ends):
    assert lc.cancel_status(before, now) == ends


def test_parent_run_rules():
    assert lc.grid_parent_status(3, 3) == FINISHED and lc.grid_parent_status(2, 3) == FAILED
    assert lc.grid_parent_status(0, 0) == FINISHED
    assert lc.search_parent_status(1) == FINISHED and lc.search_parent_status(0) == FAILED
    assert lc.PARENT_STOPPED == lc.PARENT_CANCELLED == KILLED


def test_lifecycle_writes_through_runs(monkeypatch):
    from fp8rl_core.tracking import runs

    calls = []
    monkeypatch.setattr(runs, "end_run", lambda uri, run_id, status, **kw: calls.append((run_id, status, kw)) or True)
    monkeypatch.setattr(runs, "start_run", lambda uri, run_id: calls.append((run_id, RUNNING, {})))
    life = lc.Lifecycle("sqlite:///x.db")
    assert life.job_ended("r1", RuntimeError("boom"), False, "m.jsonl") == FAILED
    assert life.job_ended("r2", SystemExit(0), True, "m.jsonl") == RUNNING
    assert life.job_ended("r3", SystemExit(0), False, "m.jsonl") is None
    assert life.job_gone("r4", FINISHED, "m.jsonl") is False
    assert life.cancelled("r5", RUNNING, FAILED, "m.jsonl") is True
    assert [(c[0], c[1]) for c in calls] == [("r1", FAILED), ("r2", RUNNING), ("r5", KILLED)]
    assert calls[0][2]["error"] == "RuntimeError: boom" and calls[2][2]["only_open"] is False


def test_no_module_writes_a_status_but_the_lifecycle():
    """Outside fp8rl_core/tracking/, a run's status is written only through `Lifecycle` (or the sink's
    close with `run_status`): no direct end_run / finish_run / start_run / set_status / MLflow call."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    writers = {"end_run", "finish_run", "start_run", "set_status", "set_terminated", "update_run"}
    found = []
    for folder in ("launchers", "fp8rl_core"):
        for path in (root / folder).rglob("*.py"):
            if "tracking" in path.relative_to(root).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "attr", getattr(node.func, "id", None))
                    if name in writers:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert found == []
