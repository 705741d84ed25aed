"""`make_report`: MLflow -> figures + summary table + claim checks, logged back to the parent run.

    paths = make_report("sqlite:///mlflow.db", "fp8rl", "fp8_ablation", "outputs/report")
    paths.report  # report.md linking fig1/fig2 (PNG+SVG), summary.md/.csv, claims.md

Safe to run at any time, also mid-sweep (unfinished runs contribute the steps they have logged;
the report says how many runs are FINISHED). Artifacts go under `report/` of the parent run and
replace the previous report's files of the same name.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from analysis.claims import check_claims, claims_markdown
from analysis.fetch import SweepData, fetch_sweep
from analysis.figures import make_figures
from analysis.table import markdown_table, summary_rows, write_table

ARTIFACT_DIR = "report"


@dataclass
class ReportPaths:
    out_dir: Path
    report: Path
    figures: dict[str, list[Path]]
    table_md: Path
    table_csv: Path
    claims: Path
    logged_to: str | None = None  # the parent run id the files were logged to
    statuses: dict[str, int] = field(default_factory=dict)

    def files(self) -> list[Path]:
        return [self.report, *(p for ps in self.figures.values() for p in ps), self.table_md, self.table_csv, self.claims]


def _report_text(data: SweepData, figures: dict[str, list[Path]], claims_md: str, table_md: str) -> str:
    statuses = Counter(r.status for r in data.runs)
    state = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no runs"
    out = [f"# Sweep report: {data.sweep_name}", "",
           f"Tracking URI `{data.uri}`, parent run `{data.parent_run_id}`, {len(data.runs)} child runs ({state}).", ""]
    for title, key in (("Figure 1: token_mult_prob_error per recipe", "fig1"),
                       ("Figure 2: validation accuracy per recipe × IS", "fig2")):
        png, svg = figures[key]
        out += [f"## {title}", "", f"![{title}]({png.name})", "", f"([SVG]({svg.name}))", ""]
    out += ["## Summary", "", table_md, "## Claims", "", claims_md]
    return "\n".join(out)


def make_report(uri: str, experiment: str, sweep_name: str, out_dir: str | Path, parent_run_id: str | None = None,
                log_artifacts: bool = True) -> ReportPaths:
    """Write figures, table, claims and `report.md` to `out_dir`; log them to the sweep's parent run."""
    data = fetch_sweep(uri, experiment, sweep_name=sweep_name, parent_run_id=parent_run_id)
    if not data.runs:
        raise ValueError(f"sweep {sweep_name!r} in experiment {experiment!r} at {uri} has no child runs yet")
    out = Path(out_dir)
    figures = make_figures(data, out)
    table_md_path, table_csv_path = write_table(data, out)
    claims_md = claims_markdown(check_claims(data))
    claims_path = out / "claims.md"
    claims_path.write_text("# Claim checks\n\n" + claims_md)
    report = out / "report.md"
    report.write_text(_report_text(data, figures, claims_md, markdown_table(summary_rows(data))))
    paths = ReportPaths(out, report, figures, table_md_path, table_csv_path, claims_path,
                        statuses=dict(Counter(r.status for r in data.runs)))
    if log_artifacts and data.parent_run_id:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        for path in paths.files():
            client.log_artifact(data.parent_run_id, str(path), ARTIFACT_DIR)
        paths.logged_to = data.parent_run_id
    return paths
