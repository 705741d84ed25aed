"""The numerics study: each low-precision knob of fp8_e2e against the default recipe, paired by seed.

    python -m analysis.numerics sweeps/fp8_numerics.yaml [--out DIR] [--tracking-uri URI] [--no-log]
    rep = make_numerics_report(uri, experiment, sweep_name, out_dir, parent_run_id=..., config=cfg, cell_ids=...)
    result = analyze(runs, cfg)          # in memory: list[RunHistory] -> NumericsResult (arms, effects)

The report stage of a sweep whose file says `analysis: {kind: numerics}` runs this instead of the
claims (`analysis.report.make_report` hands over).

**Arms.** The knobs are run-config keys, logged as MLflow params of every cell run under their dotted
names (`analysis.fetch` reads them in its one search): `KNOB_DEFAULTS` below. A run's arm is the set of
knobs whose (normalized) value differs from the default, labelled `fp8.format=mxfp8`; a run with every
knob at its default is the `default` arm. Normalization: a missing param is the default (runs logged
before the key existed); `fp8.scale_format` `auto`, or the format's own default scale format
(`fp8rl_core.fp8.formats`, e.g. fp32 for block128), is the default, and the legacy
`fp8.power_of_two_scales: true` reads as `pow2`; layer counts compare as integers. A cell that changes
two knobs at once is not an error: it is its own arm, labelled `fp8.format=mxfp8 + fp8.lm_head=fp8`
and marked "(2 knobs)" in the table, compared with the default like any other arm (its effect is
the two knobs together, not either one). Two runs with the same arm and seed (the cells differ in a
key that is not a knob, e.g. the recipe) make a ValueError naming the differing params: pairing by
seed would be ambiguous. Matched-kernel runs (`analysis.kernel_match`) are left out, as in the claims.

**The reference arm.** By default every arm is paired with the `default` arm. A sweep whose arms all share a
non-default setting (sweeps/fp8_corrections.yaml: NVFP4 generation everywhere) or that compares with another
arm names it in `analysis.reference` (knob -> value, `analysis.config`): the labels then name what differs
from it, the reference arm is labelled `reference`, and "default" below reads "reference"; numerics.json's
config carries the mapping. The default report's files are unchanged without the key.

**Per run** (over its logged steps): `mismatch_median` = median of token_mult_prob_error (robust to
the spikes, as in the claims); `gen_kl` = mean of gen_kl_error (the catalogue's `M_GEN_KL`); the mean
of each tail fraction (`TAIL_FRACTIONS`); the final value (last validation step) of both accuracy
metrics, the deciding one (`analysis.accuracy_metric`) first.

**Per arm vs default, paired by seed** (same seed = same data and sampling stream): per-seed
differences d_i = arm − default, their mean, the (1 − α) paired t interval (`analysis.stats.t_interval`,
95% at the default α) and n. Verdict per metric: `higher` when the interval lies above 0, `lower`
when below, `no detectable difference` when it holds 0, `n/a (n < 2)` with fewer than two pairs.

**Mismatch on a log scale.** token_mult_prob_error sits near 1.00x and a knob moves its excess
(median − 1) by a factor (one format may have 5x the excess of another), so the deciding mismatch
effect is the paired difference of log10(median − 1): the log of the ratio of excess mismatch, shown
as a ratio (x2.0 = twice the excess) with its interval back-transformed. On a difference scale the
largest knob would squeeze every other to zero. A run whose median is <= 1 (no excess: the log is
undefined) leaves that metric's pair out. The plain difference of medians is tabled beside it.
Arms are ordered by the mean mismatch effect, largest increase first (no effect: last, by label).

Figure 3 (`fig3_numerics`, PNG + SVG): one panel per metric (mismatch excess ratio, gen_kl_error, tail
fraction > 0.1 nats, final accuracy in points), one row per arm in that order, its per-seed differences
as dots, the mean as a marker and its interval as a bar, a line at no effect. `numerics.md`: the table
(arm, metric, n, effect, interval, verdict). `numerics.json`: every number (per-run summaries, per-seed
differences, intervals) with its provenance (sweep file and its sha256, experiment, tracking URI,
parent run, run ids per arm and seed, git commit when available, date).

Instability episodes (`analysis.numerics_episodes`, band `analysis.episodes`, as in the claims report):
`analyze` flags every run (`result.episodes`); the report lists the flagged runs and the rates per knob
setting with their Clopper–Pearson intervals (report.md, numerics.md, numerics.json's `episodes`, the
terminal text), crosses the per-seed dots of Figure 3 whose pair holds a flagged run, says whether a
verdict changes without the flagged runs (the sensitivity line), and tags the child runs
`fp8rl.episode` / `fp8rl.episode_steps` when it logs to the parent run.

Modules: this one writes the report (numerics.json, report.md; the entry point); `numerics_effects` the
analysis (per-run summaries from `analysis.aggregate`, arms, paired effects from `analysis.stats`),
`numerics_table` the table and terminal text, `numerics_figure` Figure 3 (`analysis.figures`' styles and
`save`), `numerics_arms` a run's knob setting, `numerics_episodes` its episodes, `provenance` the JSON's
provenance (shared with `analysis.engines`).
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.claims import jsonable
from analysis.config import AnalysisConfig
from analysis.entry import fetch_runs, log_files, sweep_file_main
from analysis.episode_report import tag_runs
from analysis.fetch import SweepData
from analysis.figures import save
from analysis.links import ui_link
from analysis.numerics_arms import KNOB_DEFAULTS
from analysis.numerics_effects import (  # noqa: F401  (the analysis: this module's API too)
    MISMATCH_LOG,
    Arm,
    Effect,
    Metric,
    NumericsResult,
    RunNumerics,
    analyze,
    figure_metrics,
    metrics_for,
    paired_effect,
    summarize_run,
    verdict,
)
from analysis.numerics_figure import FIG3, numerics_figure
from analysis.numerics_table import markdown_table, verdicts_text
from analysis.provenance import provenance

if TYPE_CHECKING:
    from analysis.numerics_episodes import NumericsEpisodes


def result_json(result: NumericsResult, cfg: AnalysisConfig, prov: dict) -> dict:
    """Every number of the report (raw units: accuracy as a fraction, mismatch effect in log10) and where
    it came from."""
    return jsonable({
        "kind": "numerics", "provenance": prov,
        "config": {"alpha": cfg.alpha, "confidence": result.confidence, "accuracy_metric": cfg.accuracy_metric,
                   **({"reference": result.reference, "reference_arm": result.base} if result.reference else {})},
        "knob_defaults": KNOB_DEFAULTS,
        "metrics": [{"key": m.key, "label": m.label, "definition": m.definition,
                     "display": "ratio 10^effect" if m.log_ratio else f"x{m.scale:g}{m.unit}"} for m in result.metrics],
        "order": [a.label for a in result.compared],
        "arms": [{"arm": a.label, "knobs": a.knobs, "n_knobs": a.n_knobs, "run_ids": a.runs,
                  "effects": {k: e.to_dict() | ({"ratio": 10 ** e.mean, "ratio_ci": [10 ** e.ci_low, 10 ** e.ci_high]}
                                                if k == MISMATCH_LOG else {}) for k, e in a.effects.items()}}
                 for a in result.arms],
        "runs": [{"run_id": r.run_id, "run_name": r.run_name, "status": r.status, "seed": r.seed, "arm": r.arm,
                  **r.values} for r in result.runs],
        **({"episodes": result.episodes.to_dict()} if result.episodes else {}),
    })


@dataclass
class NumericsReport:
    """What `make_numerics_report` wrote; duck-typed like `analysis.report.ReportPaths` for the callers of
    `make_report` (`.report`, `.files()`, `.verdicts_text`, `.verdicts`, `.ui_link`, `.logged_to`)."""

    out_dir: Path
    report: Path
    figure: list[Path]  # PNG, SVG
    table_md: Path
    json: Path
    result: NumericsResult
    verdicts_text: str = ""
    verdicts: dict = field(default_factory=dict)
    ui_link: str = ""
    logged_to: str | None = None
    statuses: dict[str, int] = field(default_factory=dict)

    def files(self) -> list[Path]:
        return [self.report, *self.figure, self.table_md, self.json]

    @property
    def episodes(self) -> NumericsEpisodes | None:
        """The flagged runs, rates per knob setting and sensitivity (as `ReportPaths.episodes`)."""
        return self.result.episodes


def _runs_lines(data: SweepData, result: NumericsResult) -> list[str]:
    statuses = Counter(r.status for r in data.runs)
    state = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no runs"
    lines = [f"Tracking URI `{data.uri}`, parent run `{data.parent_run_id}`, {len(data.runs)} child runs ({state}); "
             f"{len(result.runs)} with distinct kernels in {len(result.arms)} arms (the {result.base} and "
             f"{len(result.compared)} knob settings)."]
    left = len(data.runs) - len(result.runs)
    if left:
        lines.append(f"{left} matched-kernel run{'s' * (left != 1)} (the zero-mismatch floor) left out.")
    if data.stale_runs:
        lines.append(f"{data.stale_runs} child run{'s' * (data.stale_runs != 1)} of an earlier version of the sweep "
                     "file left out.")
    return lines


def write_numerics(result: NumericsResult, cfg: AnalysisConfig, out_dir: str | Path, prov: dict,
                   data: SweepData | None = None) -> NumericsReport:
    """Figure 3, numerics.md, numerics.json and report.md under `out_dir`."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = prov.get("sweep")
    figure = save(numerics_figure(result, cfg, sweep), out, FIG3)
    table = markdown_table(result)
    episodes = ["## Instability episodes", "", result.episodes.markdown()] if result.episodes else []
    table_md = out / "numerics.md"
    table_md.write_text("\n".join([f"# Numerics: each knob vs {result.base_text}", "", table, *episodes]))
    js = result_json(result, cfg, prov)
    json_path = out / "numerics.json"
    json_path.write_text(json.dumps(js, indent=2) + "\n")
    text = verdicts_text(result, figure_metrics(cfg)) + (f"\n\n{result.episodes.text()}" if result.episodes else "")
    link = ui_link(data.uri, data.experiment_id, data.parent_run_id) if data else ""
    head = [*_runs_lines(data, result), f"In the MLflow UI: {link}", ""] if data else []
    title = f"Figure 3: numerics knobs vs {result.base_text}"
    report = out / "report.md"
    report.write_text("\n".join([f"# Numerics report: {sweep or '?'}", "", *head, f"## {title}", "",
                                 f"![{title}]({figure[0].name})", "", f"([SVG]({figure[1].name}))", "",
                                 "## Paired effects", "", table,
                                 f"Every number, with the run ids per knob and seed: [numerics.json]({json_path.name})"
                                 ".",
                                 "", *episodes]))
    return NumericsReport(out, report, figure, table_md, json_path, result, text, js, link,
                          statuses=dict(Counter(r.status for r in result.runs)))


def make_numerics_report(uri: str, experiment: str, sweep_name: str, out_dir: str | Path,
                         parent_run_id: str | None = None, log_artifacts: bool = True,
                         config: AnalysisConfig | None = None, cell_ids: Collection[str] | None = None,
                         sweep_file: str | Path | None = None) -> NumericsReport:
    """Fetch the sweep's child runs (one search, histories in bulk), analyze, write, and log the files
    under `report/` of the parent run (as `make_report` does)."""
    cfg = config or AnalysisConfig()
    data = fetch_runs(uri, experiment, sweep_name, parent_run_id, cell_ids)
    result = analyze(data.runs, cfg)
    rep = write_numerics(result, cfg, out_dir, provenance(data, sweep_file, experiment), data)
    if log_artifacts and data.parent_run_id:
        client = log_files(uri, data.parent_run_id, rep.files())
        tag_runs(client, result.episodes.runs if result.episodes else [])  # as the claims report tags them
        rep.logged_to = data.parent_run_id
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m analysis.numerics SWEEP_FILE`: the experiment, tracking URI, parent run, cells and `analysis:`
    block come from the sweep file, as `sweep report` reads them (`analysis.entry`)."""
    return sweep_file_main(argv, "analysis.numerics", __doc__, make_numerics_report)


if __name__ == "__main__":
    sys.exit(main())
