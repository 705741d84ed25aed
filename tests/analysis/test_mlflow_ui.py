"""Seen as a user sees it: the MLflow UI (real server, headless Chromium) shows the sweep's parent run
with its child runs, renders the report's figures, and the report's link opens on the runs table
(not MLflow 3's GenAI overview). Screenshots land in the test's tmp_path (printed);
`python scripts/mlflow_screenshot.py` makes the same ones under outputs/screenshots/."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import matplotlib.image
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.mlflow_server]


def _script():
    spec = importlib.util.spec_from_file_location("mlflow_screenshot", REPO / "scripts" / "mlflow_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parent_run_children_and_figures_in_the_ui(tmp_path):
    shots = _script()
    if shots.find_chromium() is None:
        pytest.fail("no Chromium: apt-get install -y --no-install-recommends chromium (scripts/test.sh does), "
                    "or deselect with -m 'not browser'")
    paths = shots.take_screenshots(tmp_path / "screenshots", tmp_path / "store")
    print(f"\nscreenshots: {tmp_path / 'screenshots'}")
    for png in paths.values():
        image = matplotlib.image.imread(png)
        assert image.shape[:2] == (1000, 1600) and image[..., :3].std() > 0.05
    dom = {name: png.with_suffix(".html").read_text() for name, png in paths.items()}
    assert "ui-demo" in dom["runs"]
    assert not [w for w in GENAI_OVERVIEW if w in dom["runs"]]  # opened as the report's link: "Model training"
    children = {f"{r}-{i}-s{s}" for r in ("bf16", "fp8_gen", "fp8_e2e") for i in ("none", "token") for s in (0, 1)}
    shown = {c for c in children if c in dom["parent_run"]}
    assert "Child runs" in dom["parent_run"] and len(shown) >= 8, shown  # the UI lists 10, then "Load more"
    for name, stem in (("figure1", "fig1_token_mult_prob_error"), ("figure2", "fig2_val_accuracy")):
        assert re.search(rf'<img[^>]*alt="report/{stem}.png"[^>]*src="blob:', dom[name]), f"{name} not rendered"
    _check_landing(shots, tmp_path)


GENAI_OVERVIEW = ("Detect Issues", "Token Usage", "Latency")  # widgets of MLflow's GenAI "Overview" page


def _check_landing(shots, tmp_path):
    """A fresh browser opened on the link the report gives (`ui_link`) lands on the runs table in the
    "Model training" view. MLflow 3.17 picks the view from the browser (URL `workflowType`, else local
    storage, default GenAI), not from the experiment's `mlflow.experimentKind` tag, which we set anyway
    (it is what older MLflow 3 releases read): the bare experiment address still opens the GenAI overview."""
    from mlflow import MlflowClient

    from analysis.links import ui_link
    from fp8rl_core.tracking.server import start_server

    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    exp = MlflowClient(uri).get_experiment_by_name("fp8rl")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    with start_server(uri, log_path=tmp_path / "landing-server.log") as server:
        link = ui_link(server.url, exp.experiment_id)
        png = shots.capture(shots.find_chromium(), link, tmp_path / "screenshots" / "landing.png")
    dom = png.with_suffix(".html").read_text()
    assert "ui-demo" in dom and "Runs" in dom, link  # the sweep's parent run in the runs table
    assert not [w for w in GENAI_OVERVIEW if w in dom], link
