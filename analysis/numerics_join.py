"""Figure 3 joined: the rows of several numerics reports in one figure and one table, each block paired with its
own reference arm (the linears' knobs vs the default recipe, the FP8 KV cache's designs vs the BF16 cache, the
mismatch corrections vs per-token IS under NVFP4 generation).

    python -m analysis.numerics_join [LABEL=]numerics.json ... --out DIR [--stem fig3_joined]

Reads each report's `numerics.json` (written by `analysis.numerics`; the runs' MLflow store is not needed, so
reports made on other machines join), checks that they share the deciding accuracy metric and the confidence
level, and writes `<stem>.png` / `.svg` (one block of rows per report, its header the LABEL, default the sweep
name, and the reference arm), `<stem>.md` (each report's table under its header) and `<stem>.json` (each source
file's path, sha256 and provenance, and this join's commit and date). The numbers are the reports' own: no
effect is recomputed, so a block is what its report says.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from analysis.config import AnalysisConfig
from analysis.figures import save
from analysis.kernel_match import DISTINCT
from analysis.numerics_arms import reference_label, reference_text
from analysis.numerics_effects import Arm, Effect, NumericsResult, RunNumerics, figure_metrics, metrics_for
from analysis.numerics_episodes import CROSSES, pair_seeds
from analysis.numerics_figure import sections_figure
from analysis.numerics_table import markdown_table
from analysis.provenance import git_commit

STEM = "fig3_joined"
EFFECT_FIELDS = ("arm", "metric", "seeds", "differences", "mean", "ci_low", "ci_high", "sd", "p_value", "verdict")


@dataclass
class JsonMarks:
    """The episode marks of a report read back from its JSON (`NumericsEpisodes.to_dict`): which seeds' pairs
    hold a flagged distinct-kernel run, and the per-arm rate text under a row label."""

    base: str
    flagged_seeds: dict[str, set[str]] = field(default_factory=dict)
    rates: dict[str, str] = field(default_factory=dict)  # arm -> '1/6 runs flagged'

    def pair_seeds(self, arm: str) -> set[str]:
        return pair_seeds(self.flagged_seeds, arm, self.base)

    def tick(self, arm: str) -> str:
        return f"\n{self.rates[arm]}" if arm in self.rates else ""

    def figure_note(self) -> str:
        return CROSSES if self.flagged_seeds else ""


@dataclass
class Source:
    label: str
    path: Path
    data: dict
    result: NumericsResult
    marks: JsonMarks | None

    @property
    def header(self) -> str:
        return f"{self.label}: vs {self.result.base_text}"


def _marks(js: dict, base: str) -> JsonMarks | None:
    eps = js.get("episodes")
    if not eps:
        return None  # a report made before episodes were flagged
    seeds: dict[str, set[str]] = defaultdict(set)
    for run in eps["runs"]:  # RunEpisodes.to_dict, labelled '<arm>/seed <s>' (analysis.numerics_episodes)
        if run["has_episode"] and run["kernels"] == DISTINCT:
            seeds[run["label"].partition("/seed ")[0]].add(str(run["seed"]))
    rates = {a["arm"]: f"{a['k']}/{a['n']} runs flagged" for a in eps["arms"] if a["k"]}  # ArmRate.to_dict
    return JsonMarks(base, dict(seeds), rates)


def load_source(spec: str) -> Source:
    """`[LABEL=]PATH` -> the report's result rebuilt from its JSON (arms, effects, runs, reference)."""
    label, _, path = spec.rpartition("=")
    p = Path(path)
    try:
        js = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{p}: cannot read a numerics report's JSON ({e})") from None
    if js.get("kind") != "numerics":
        raise SystemExit(f"{p}: kind is {js.get('kind')!r}; expected a numerics report's numerics.json")
    conf = js["config"]
    reference = conf.get("reference", {})
    cfg = AnalysisConfig(kind="numerics", alpha=conf["alpha"], accuracy_metric=conf["accuracy_metric"],
                         reference=reference)
    arms = [Arm(a["arm"], a["knobs"], a["run_ids"],
                {k: Effect(**{f: e[f] for f in EFFECT_FIELDS}) for k, e in a["effects"].items()}) for a in js["arms"]]
    base = reference_label(reference)
    order = {label: i for i, label in enumerate(js["order"])}
    arms.sort(key=lambda a: -1 if a.label == base else order.get(a.label, len(order)))
    keys = {m.key for m in metrics_for(cfg)}
    runs = [RunNumerics(r["run_id"], r["run_name"], r["status"], r["seed"], r["arm"], {},
                        {k: v for k, v in r.items() if k in keys}) for r in js["runs"]]
    result = NumericsResult(arms, runs, metrics_for(cfg), conf["confidence"], reference=reference)
    return Source(label or js["provenance"].get("sweep") or p.parent.name, p, js, result, _marks(js, base))


def check_joinable(sources: Sequence[Source]) -> None:
    """One accuracy metric and one confidence level for every block, or an error naming the odd file."""
    first = sources[0].data["config"]
    for s in sources[1:]:
        conf = s.data["config"]
        for key in ("accuracy_metric", "confidence"):
            if conf[key] != first[key]:
                raise SystemExit(f"{s.path}: config.{key} is {conf[key]!r}, {sources[0].path} has {first[key]!r}; "
                                 "joined rows must share it")


def write_joined(sources: Sequence[Source], out_dir: str | Path, stem: str = STEM) -> list[Path]:
    """The figure (PNG, SVG), the tables and the provenance under `out_dir`."""
    check_joinable(sources)
    out = Path(out_dir)
    first = sources[0].result
    keys = figure_metrics(AnalysisConfig(accuracy_metric=sources[0].data["config"]["accuracy_metric"]))
    metrics = [next(m for m in first.metrics if m.key == k) for k in keys]
    notes = sorted({s.marks.figure_note() for s in sources if s.marks and s.marks.figure_note()})
    title = (f"Figure 3 · each block's arms vs its reference arm, paired by seed ({len(sources)} sweeps)\n"
             f"diamond: mean difference (knob − ref., the block's reference arm); bar: {first.confidence:.0%} "
             "paired t interval; dots: seeds; rows ordered within a block by their effect on the mismatch"
             + "".join(f"\n{n}" for n in notes))
    sections = [(s.header, s.result.compared, s.marks) for s in sources]
    figure = save(sections_figure(sections, metrics, title, "ref."), out, stem)
    md = [f"# Figure 3 joined: {len(sources)} numerics reports", ""]
    for s in sources:
        prov = s.data["provenance"]
        md += [f"## {s.header}", "", f"From `{s.path}` (sweep `{prov.get('sweep')}`, commit "
               f"`{prov.get('git_commit')}`, {prov.get('date')}).", "", markdown_table(s.result)]
    (out / f"{stem}.md").write_text("\n".join(md))
    js = {"kind": "numerics_join", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
          "git_commit": git_commit(),
          "sources": [{"label": s.label, "path": str(s.path), "sha256": hashlib.sha256(s.path.read_bytes()).hexdigest(),
                       "reference": s.result.reference, "reference_text": reference_text(s.result.reference),
                       "order": [a.label for a in s.result.compared], "provenance": s.data["provenance"]}
                      for s in sources]}
    (out / f"{stem}.json").write_text(json.dumps(js, indent=2) + "\n")
    return [*figure, out / f"{stem}.md", out / f"{stem}.json"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.numerics_join", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", metavar="[LABEL=]NUMERICS_JSON")
    ap.add_argument("--out", required=True, help="the folder for the joined figure, table and JSON")
    ap.add_argument("--stem", default=STEM, help=f"the files' name stem (default {STEM})")
    args = ap.parse_args(argv)
    paths = write_joined([load_source(s) for s in args.sources], args.out, args.stem)
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
