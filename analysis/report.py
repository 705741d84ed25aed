"""`make_report`: MLflow -> figures + summary table + claim checks, logged back to the parent run.

    paths = make_report("sqlite:///mlflow.db", "fp8rl", "fp8_ablation", "outputs/report", config=cfg,
                        cell_ids=[c.id for c in expand(sweep)])   # the sweep file's cells as it is now
    paths.report         # report.md linking fig1/fig2 (PNG+SVG), summary.md/.csv, claims.md/.json/.txt
    print(paths.verdicts_text)                 # the claims table for the terminal (`sweep report`)
    print(json.dumps(paths.verdicts))          # the same as JSON (`sweep report --json`)

Safe to run at any time, also mid-sweep (unfinished runs contribute the steps they have logged;
the report says how many runs are FINISHED). `cell_ids`: only the runs of these cells are read; child
runs of other cells under the same parent (an earlier version of the sweep file) are left out and
counted in report.md. What reads which runs (`analysis.kernel_match`): Figure 1 all of them (matched-kernel
runs dashed), the floor table the matched ones, everything else the distinct ones. Claims 3–4 decide
on `analysis.accuracy_metric`; the other metric's claims 3–4 follow, marked not deciding; the JSON
verdicts add `not_deciding`, `eval_offset` (analysis.eval_offset), `floor` (analysis.floor),
`stale_runs`, `missing_metrics` (accuracy metrics no run logged) and `episodes`. Artifacts go under
`report/` of the parent run and replace the previous report's files of the same name; the parent run
also gets one tag per deciding claim (`fp8rl.claim.1` = PASS, ...), so the verdicts show in the MLflow
runs table.

Instability episodes (`analysis.episodes`, band `analysis.episodes`: on in every report, defaults when the
sweep file has no such block): the summary table counts them per arm, Figures 1–2 mark the flagged steps,
claims.md/.txt/.json, report.md and the terminal printout list the flagged runs, the rates per arm and
the sensitivity line (the claims re-checked without the flagged runs, `analysis.episode_report`), and
each child run gets the tags `fp8rl.episode` (true/false) and `fp8rl.episode_steps` ("54-76"), written
with the parent's claim tags.

MLflow 3.17's UI opens an experiment on its GenAI "Overview" unless the browser has chosen "Model
training" once (the experiment tag `mlflow.experimentKind` is not read for that): `ui_link` gives the
address that opens the runs table (`?workflowType=machine_learning`).
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.claims import ClaimResult, check_claims, other_accuracy_claims
from analysis.config import ACCURACY_METRICS, ENGINES, NUMERICS, AnalysisConfig
from analysis.episode_report import EpisodeSection, episode_section, tag_runs
from analysis.eval_offset import offset_markdown, offset_rows
from analysis.fetch import SweepData, fetch_sweep
from analysis.figures import make_figures, order_note
from analysis.floor import floor_markdown, floor_rows
from analysis.kernel_match import MATCHED, only_kernels
from analysis.links import ARTIFACT_DIR, ui_link  # noqa: F401  (ARTIFACT_DIR, ui_link: this module's API too)
from analysis.rleval import rleval_markdown
from analysis.summaries import summarize_all, tails_markdown
from analysis.table import markdown_table, summary_rows, write_table
from analysis.verdicts import format_verdicts, verdicts_json, verdicts_markdown
from fp8rl_core.tracking.store import Store

CLAIM_TAG = "fp8rl.claim.{}"

if TYPE_CHECKING:
    from analysis.engines import EnginesReport
    from analysis.numerics import NumericsReport


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
    results: list[ClaimResult] = field(default_factory=list)  # the four deciding verdicts
    aside: list[ClaimResult] = field(default_factory=list)  # claims 3–4 on the other accuracy metric
    verdicts_text: str = ""  # `format_verdicts`: print this in the terminal
    verdicts: dict = field(default_factory=dict)  # `verdicts_json`: json.dumps this for --json
    ui_link: str = ""
    episodes: EpisodeSection | None = None  # flagged runs, rates per arm, sensitivity (analysis.episode_report)

    @property
    def claims_json(self) -> Path:
        return self.claims.with_suffix(".json")

    @property
    def claims_txt(self) -> Path:
        return self.claims.with_suffix(".txt")

    def files(self) -> list[Path]:
        return [self.report, *(p for ps in self.figures.values() for p in ps), self.table_md, self.table_csv,
                self.claims, self.claims_json, self.claims_txt]


@dataclass
class Sections:
    """What report.md shows besides the files: Markdown blocks computed once in `make_report`."""

    claims: str
    table: str
    floor: str
    offset: str
    extra: str
    missing: list[str]  # accuracy metrics no (distinct) run logged
    episodes: str = ""  # `EpisodeSection.markdown()`


def _runs_line(data: SweepData) -> list[str]:
    """'18 child runs (18 FINISHED).' plus what was left out and what the matched runs are for."""
    statuses = Counter(r.status for r in data.runs)
    state = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no runs"
    lines = [f"Tracking URI `{data.uri}`, parent run `{data.parent_run_id}`, {len(data.runs)} child runs ({state})."]
    matched = len(only_kernels(data, MATCHED).runs)
    if matched:
        lines.append(f"{matched} of them ran with matched kernels (`engines.kernels: matched`): the zero-mismatch "
                     "floor, shown in Figure 1 (dashed) and the floor table; no claim, Figure 2 or summary row "
                     "uses them.")
    if data.stale_runs:
        lines.append(f"{data.stale_runs} more child run{'s' * (data.stale_runs != 1)} of this parent "
                     f"{'were' if data.stale_runs != 1 else 'was'} left out as belonging to an earlier version of "
                     "the sweep file (cell ids that are not cells of the file as it is now).")
    return lines


def _report_text(data: SweepData, figures: dict[str, list[Path]], sec: Sections, cfg: AnalysisConfig) -> str:
    out = [f"# Sweep report: {data.sweep_name}", "", *_runs_line(data),
           f"In the MLflow UI: {ui_link(data.uri, data.experiment_id, data.parent_run_id)}", ""]
    for title, key in (("Figure 1: token_mult_prob_error per recipe", "fig1"),
                       (f"Figure 2: validation accuracy ({cfg.accuracy_metric}) per recipe × IS", "fig2")):
        png, svg = figures[key]
        out += [f"## {title}", "", f"![{title}]({png.name})", "", f"([SVG]({svg.name}))", ""]
        order = order_note(data, cfg) if key == "fig1" else ""
        if order:  # Figure 1's "consistently lower", as the paired per-step statistic
            out += [order[0].upper() + order[1:].replace(":\n", ": ") + ".", ""]
        if key == "fig1":
            out += ["### Zero-mismatch floor (matched kernels)", "", sec.floor]
    out += ["## Evaluation engine: step-0 accuracy offset", "", sec.offset]
    out += ["## Claims", "", sec.claims]
    if cfg.other_accuracy_metric in sec.missing:
        out += [f"Claims 3–4 on {cfg.other_accuracy_metric}: not shown, {cfg.other_accuracy_metric} is missing "
                "(not logged by these runs).", ""]
    out += ["## Instability episodes", "", sec.episodes]
    out += ["## Summary", "", sec.table, sec.extra]
    return "\n".join(out)


def _extra_sections(data: SweepData, cfg: AnalysisConfig) -> str:
    sums = summarize_all(data.runs, cfg.trim)
    return "\n".join(["## Mismatch per run: robust summaries and tails", "", tails_markdown(sums),
                      "## RL-evaluation view: IQM and probability of improvement", "", rleval_markdown(sums, cfg)])


def missing_metrics(data: SweepData) -> list[str]:
    """The accuracy metrics (`ACCURACY_METRICS`) that no distinct-kernel run logged."""
    runs = only_kernels(data).runs
    return [m for m in ACCURACY_METRICS if not any(r.series(m)[0].size for r in runs)]


def _write_claims(out: Path, results: list[ClaimResult], aside: list[ClaimResult], cfg: AnalysisConfig,
                  extra: dict, episodes: EpisodeSection) -> tuple[Path, str, str, dict]:
    """claims.md/.txt/.json; each ends with the episodes (flagged runs, rates, sensitivity line). Returns
    (claims.md's path, the verdicts' Markdown without the episodes, the terminal text, the JSON)."""
    md = verdicts_markdown(results, cfg, aside)
    text = format_verdicts(results, cfg, aside) + "\n\n" + episodes.text()
    js = verdicts_json(results, cfg, aside, {**extra, "episodes": episodes.to_dict()})
    path = out / "claims.md"
    path.write_text("# Claim checks\n\n" + md + "\n## Instability episodes\n\n" + episodes.markdown())
    path.with_suffix(".txt").write_text(text + "\n")
    path.with_suffix(".json").write_text(json.dumps(js, indent=2) + "\n")
    return path, md, text, js


def _log_to_parent(uri: str, paths: ReportPaths) -> None:
    client = Store(uri)
    for path in paths.files():
        client.log_artifact(paths.logged_to, str(path), ARTIFACT_DIR)
    for r in paths.results:
        client.set_tag(paths.logged_to, CLAIM_TAG.format(r.number), r.status)
    tag_runs(client, paths.episodes.runs if paths.episodes else [])  # fp8rl.episode, fp8rl.episode_steps


def make_report(uri: str, experiment: str, sweep_name: str, out_dir: str | Path, parent_run_id: str | None = None,
                log_artifacts: bool = True, config: AnalysisConfig | None = None,
                cell_ids: Collection[str] | None = None) -> ReportPaths | NumericsReport | EnginesReport:
    """Write figures, tables, claims and `report.md` to `out_dir`; log them to the sweep's parent run.
    `cell_ids`: the sweep file's current cells (None: every child run). The returned paths carry the
    verdicts: `.verdicts_text` (terminal) and `.verdicts` (JSON-ready). With `config.kind` numerics the
    numerics study's report instead (`analysis.numerics.make_numerics_report`: a `NumericsReport`, which has
    `.report`, `.files()`, `.verdicts_text`, `.verdicts`, `.ui_link` and `.logged_to` too); with `engines` the
    engine study's (`analysis.engines.make_engines_report`: an `EnginesReport`, the same attributes)."""
    cfg = config or AnalysisConfig()
    if cfg.kind == NUMERICS:  # the numerics study: per-knob paired effects, not claims (same duck-typed result)
        from analysis.numerics import make_numerics_report

        return make_numerics_report(uri, experiment, sweep_name, out_dir, parent_run_id=parent_run_id,
                                    log_artifacts=log_artifacts, config=cfg, cell_ids=cell_ids)
    if cfg.kind == ENGINES:  # the engine study: arms are recipe · generation engine (bf16 · vLLM), not recipe × IS
        from analysis.engines import make_engines_report

        return make_engines_report(uri, experiment, sweep_name, out_dir, parent_run_id=parent_run_id,
                                   log_artifacts=log_artifacts, config=cfg, cell_ids=cell_ids)
    data = fetch_sweep(uri, experiment, sweep_name=sweep_name, parent_run_id=parent_run_id, cell_ids=cell_ids)
    if not data.runs:
        stale = f" ({data.stale_runs} of an earlier version of the sweep file left out)" if data.stale_runs else ""
        raise ValueError(f"sweep {sweep_name!r} in experiment {experiment!r} at {uri} has no child runs yet{stale}")
    out = Path(out_dir)
    figures = make_figures(data, out, cfg)
    table_md_path, table_csv_path = write_table(data, out, cfg=cfg)
    results, aside = check_claims(data, cfg), other_accuracy_claims(data, cfg)
    episodes = episode_section(data.runs, results, cfg)
    floor, offsets, missing = floor_rows(data.runs), offset_rows(data.runs), missing_metrics(data)
    extra = {"eval_offset": offsets, "floor": floor, "stale_runs": data.stale_runs, "missing_metrics": missing}
    claims_path, claims_md, text, js = _write_claims(out, results, aside, cfg, extra, episodes)
    sections = Sections(claims_md, markdown_table(summary_rows(data, cfg=cfg)), floor_markdown(floor),
                        offset_markdown(offsets), _extra_sections(data, cfg), missing, episodes.markdown())
    report = out / "report.md"
    report.write_text(_report_text(data, figures, sections, cfg))
    paths = ReportPaths(out, report, figures, table_md_path, table_csv_path, claims_path,
                        statuses=dict(Counter(r.status for r in data.runs)), results=results, aside=aside,
                        verdicts_text=text, verdicts=js, ui_link=ui_link(uri, data.experiment_id, data.parent_run_id),
                        episodes=episodes)
    if log_artifacts and data.parent_run_id:
        paths.logged_to = data.parent_run_id
        _log_to_parent(uri, paths)
    return paths
