"""Analysis: MLflow -> aligned histories -> mean and 95% CI over seeds -> figures, table, claim checks.

    from analysis import make_report
    make_report("sqlite:///mlflow.db", "fp8rl", "fp8_ablation", "outputs/report")

Modules, in the order data flows: `fetch` (histories out of MLflow), `aggregate` (align steps, group
by recipe × IS, Student-t CIs), `figures` (Figures 1 and 2), `table` (summary Markdown/CSV),
`claims` (PASS/FAIL/INCONCLUSIVE), `report` (all of it, logged to the sweep's parent run).
`synthetic` makes a sweep with known numbers for tests and demos.
"""
from __future__ import annotations

from typing import Any


def make_report(*args: Any, **kwargs: Any):
    """See `analysis.report.make_report` (imported lazily: MLflow and matplotlib load on first use)."""
    from analysis.report import make_report as _make_report

    return _make_report(*args, **kwargs)
