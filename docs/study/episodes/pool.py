"""Episode rates per arm pooled over sweeps that ran the same arms on other seeds (docs/study/episodes/):

    python docs/study/episodes/pool.py sqlite:///A/mlflow.db:fp8_ablation sqlite:///B/mlflow.db:fp8_episodes \
        > docs/study/episodes/pooled.md

Each argument is URI:SWEEP (the MLflow experiment and the sweep share the sweep file's name). The band and the
accuracy metric are fp8_episodes.yaml's `analysis` block (the same values as fp8_ablation.yaml's). Per arm
(recipe × IS, distinct kernels): k of n runs with an episode (analysis/episodes.py) and the 95% Clopper–Pearson
interval, and the two kinds of episode apart: *accuracy* (a validation more than the band's drop below the run's
best earlier one) and *mismatch* (more than the band's share of steps above its mismatch level). Per recipe,
and over all recipes: IS token against none, Fisher's exact test (two-sided) on the 2×2 table of (episode,
no episode) × (token, none), for any episode and for each kind. Seeds must not repeat across the sweeps (each run is one
replicate); the script refuses a repeat.
"""
from __future__ import annotations

import sys
from pathlib import Path

from scipy import stats

from analysis.config import AnalysisConfig
from analysis.episodes import arm_rates, detect_all
from analysis.fetch import fetch_sweep
from analysis.kernel_match import only_kernels
from fp8rl_core.config.yaml_io import load_mapping_file
from fp8rl_core.tracking import TAG_CPU_FLAGS, TAG_FP8_GEMM, TAG_IS, TAG_RECIPE, TAG_SEED

HERE = Path(__file__).resolve().parent
SWEEP = HERE.parents[2] / "sweeps" / "fp8_episodes.yaml"


def load(spec: str) -> list:
    uri, _, name = spec.rpartition(":")
    runs = only_kernels(fetch_sweep(uri, name, name).runs)
    gemm = sorted({r.tags.get(TAG_FP8_GEMM, "?") for r in runs if r.tags[TAG_RECIPE] != "bf16"})
    cpu = sorted({r.tags.get(TAG_CPU_FLAGS, "?") for r in runs})
    print(f"- `{name}` ({uri}): {len(runs)} distinct-kernel runs, seeds "
          f"{sorted({int(r.tags[TAG_SEED]) for r in runs})}; FP8 GEMM executor (tag): {', '.join(gemm)}; "
          f"CPU flags: {', '.join(cpu)}")
    return runs


KINDS = {"any": lambda e: e.has_episode, "accuracy": lambda e: e.accuracy_episode,
         "mismatch": lambda e: e.mismatch_episode}


def fisher_lines(runs: list, cfg: AnalysisConfig) -> list[str]:
    """Token vs none, per recipe and pooled, per kind of episode: k/n each and the two-sided exact p."""
    eps = dict(zip((r.run_id for r in runs), detect_all(runs, cfg)))
    lines = ["| episode | recipe | IS token | IS none | Fisher exact p (two-sided) |", "|---|---|--:|--:|--:|"]
    for kind, has in KINDS.items():
        for recipe in ("bf16", "fp8_gen", "fp8_e2e", None):
            def count(variant: str, recipe: str | None = recipe) -> tuple[int, int]:
                sel = [has(eps[r.run_id]) for r in runs
                       if r.tags[TAG_IS] == variant and (recipe is None or r.tags[TAG_RECIPE] == recipe)]
                return sum(sel), len(sel)
            (kt, nt), (kn, nn) = count("token"), count("none")
            p = stats.fisher_exact([[kt, nt - kt], [kn, nn - kn]]).pvalue
            lines.append(f"| {kind} | {recipe or 'all recipes'} | {kt}/{nt} | {kn}/{nn} | {p:.3g} |")
    return lines


def kind_lines(runs: list, cfg: AnalysisConfig) -> list[str]:
    """Per recipe (both IS settings): runs with each kind of episode, and their 95% interval."""
    eps = detect_all(runs, cfg)
    lines = ["| recipe | accuracy episodes | mismatch episodes |", "|---|--:|--:|"]
    for recipe in ("bf16", "fp8_gen", "fp8_e2e"):
        sel = [e for r, e in zip(runs, eps) if r.tags[TAG_RECIPE] == recipe]
        cells = []
        for kind in ("accuracy", "mismatch"):
            k, n = sum(KINDS[kind](e) for e in sel), len(sel)
            ci = stats.binomtest(k, n).proportion_ci(0.95, method="exact")
            cells.append(f"{k}/{n} [{ci.low:.0%}, {ci.high:.0%}]")
        lines.append(f"| {recipe} | {cells[0]} | {cells[1]} |")
    return lines


def main(specs: list[str]) -> None:
    cfg = AnalysisConfig.from_dict(load_mapping_file(SWEEP).get("analysis"))
    print("Sweeps pooled:")
    runs = [r for spec in specs for r in load(spec)]
    seen = [(r.tags[TAG_RECIPE], r.tags[TAG_IS], r.tags[TAG_SEED]) for r in runs]
    if len(seen) != len(set(seen)):
        raise SystemExit("pool.py: a (recipe, IS, seed) appears in two sweeps; pool sweeps with distinct seeds")
    b = cfg.episodes
    print(f"\nBand (analysis.episodes): token_mult_prob_error > {b.mismatch_above:g} on more than "
          f"{b.max_flagged_fraction:.0%} of a run's steps, or {cfg.accuracy_metric} more than {b.accuracy_drop:g} pts "
          "below the run's best earlier validation.\n")
    print("| recipe | IS | runs with an episode | 95% interval | flagged runs |\n|---|---|--:|---|---|")
    for arm in arm_rates(runs, cfg):
        lo, hi = arm.rate.ci
        print(f"| {arm.group[TAG_RECIPE]} | {arm.group[TAG_IS]} | {arm.rate.k}/{arm.rate.n} | [{lo:.0%}, {hi:.0%}] | "
              f"{', '.join(arm.flagged) or '–'} |")
    print("\nEach kind of episode per recipe (both IS settings, 95% Clopper–Pearson interval):\n")
    print("\n".join(kind_lines(runs, cfg)))
    print("\nIS token against none (does the arm's IS setting go with episodes?):\n")
    print("\n".join(fisher_lines(runs, cfg)))


if __name__ == "__main__":
    main(sys.argv[1:])
