"""See a small finished sweep in the MLflow UI as a user does: headless Chromium screenshots.

    python scripts/mlflow_screenshot.py [--out outputs/screenshots] [--store DIR]

Builds a small sweep store (the synthetic sweep the analysis tests use: 3 recipes x IS none/token x
2 seeds) with its report logged to the parent run, starts `mlflow server` on 127.0.0.1 over it, and
saves 1600x1000 screenshots (Debian's `chromium`, --headless --no-sandbox; the UI is a JS app, so
each page gets a virtual-time budget to render):
  runs.png        the experiment's runs table (the sweep's parent run, children nested under it)
  parent_run.png  the parent run's page: its child runs, tags (sweep, git commit, host)
  figure1.png     the report's Figure 1 artifact as the UI renders it
  figure2.png     Figure 2
plus `<name>.html`, the page's DOM after rendering (what the test checks).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analysis.links import UI_QUERY  # noqa: E402
from analysis.report import make_report  # noqa: E402
from analysis.synthetic import log_sweep, synthetic_runs  # noqa: E402
from fp8rl_core.tracking.server import start_server  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def _chromium(browser: str, url: str, action: list[str], budget_ms: int, size: tuple[int, int]) -> str:
    profile = tempfile.mkdtemp(prefix="chromium-profile-")  # a fresh profile: no state between pages
    try:
        cmd = [browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
               f"--virtual-time-budget={budget_ms}", *action, url]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"chromium failed ({out.returncode}) on {url}: {out.stderr[-1500:]}")
        return out.stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def capture(browser: str, url: str, png: Path, budget_ms: int = 20000, size: tuple[int, int] = (1600, 1000)) -> Path:
    """Screenshot `url` into `png`, and its rendered DOM into `png.with_suffix('.html')`."""
    dom = _chromium(browser, url, [f"--screenshot={png}", "--dump-dom"], budget_ms, size)  # one page load, both
    png.with_suffix(".html").write_text(dom)
    return png


def make_store(store_dir: Path, seeds: int = 2) -> tuple[str, str, str]:
    """A finished synthetic sweep with its report: `(uri, experiment_id, parent_run_id)`."""
    from fp8rl_core.tracking import FINISHED
    from fp8rl_core.tracking.store import Store

    store_dir.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{store_dir / 'mlflow.db'}"
    parent = log_sweep(uri, "fp8rl", "ui-demo", synthetic_runs(seeds=seeds, steps=31))
    make_report(uri, "fp8rl", "ui-demo", store_dir / "report")
    store = Store(uri)
    store.set_terminated(parent, FINISHED)
    return uri, store.experiment_id("fp8rl"), parent


def take_screenshots(out_dir: Path, store_dir: Path | None = None, browser: str | None = None) -> dict[str, Path]:
    browser = browser or find_chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium found; install it: apt-get install -y --no-install-recommends chromium")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        uri, exp, parent = make_store(Path(store_dir or tmp))
        with start_server(uri, log_path=out_dir / "mlflow-server.log") as server:
            base = f"{server.url}/#/experiments/{exp}"
            # as the link `sweep report` prints (analysis.links.ui_link): "Model training", not GenAI's Overview
            pages = {"runs": f"{base}/runs?{UI_QUERY}",
                     "parent_run": f"{base}/runs/{parent}?{UI_QUERY}",
                     "figure1": f"{base}/runs/{parent}/artifacts/report/fig1_token_mult_prob_error.png?{UI_QUERY}",
                     "figure2": f"{base}/runs/{parent}/artifacts/report/fig2_val_accuracy.png?{UI_QUERY}"}
            return {name: capture(browser, url, out_dir / f"{name}.png") for name, url in pages.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "screenshots")
    ap.add_argument("--store", type=Path, default=None, help="keep the MLflow store here (default: a temp dir)")
    args = ap.parse_args()
    for name, path in take_screenshots(args.out, args.store).items():
        print(f"{name:11} {path}")


if __name__ == "__main__":
    main()
