"""Where a sweep's report goes and how to open it: the parent run's artifact folder and the MLflow UI
link that lands on the runs table in its "Model training" view. Shared by the claims report (report.py)
and the numerics report (numerics.py), which report.py dispatches to."""
from __future__ import annotations

ARTIFACT_DIR = "report"  # the parent run's artifact folder of the report's files
UI_QUERY = "workflowType=machine_learning"  # MLflow 3.17: open on "Model training", not the GenAI overview
DEFAULT_UI = "http://127.0.0.1:5000"


def ui_link(uri: str, experiment_id: str | None, run_id: str | None = None) -> str:
    """The MLflow UI address of the experiment's runs table (or of one run) in its "Model training" view.
    For an http(s) tracking URI that server's address; otherwise `mlflow ui`'s default address."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_UI
    page = f"{base}/#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    return f"{page}?{UI_QUERY}"
