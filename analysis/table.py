"""The summary table: one row per group (recipe × IS), Markdown for people and CSV for programs.

Rows: distinct-kernel runs only (`analysis.kernel_match`; the matched-kernel floor has its own table,
`analysis.floor`). Per run a number is reduced from its history, then mean ± 95% CI (Student t) is
taken over seeds:
- final_val_accuracy: `val_accuracy` at the run's last validation step (a fraction; Markdown shows %);
- final_val_accuracy_bf16_eval: `val_accuracy_bf16_eval` there (one BF16 evaluation engine for every
  arm; empty for runs that did not log it);
- mismatch: the median over steps of `token_mult_prob_error` (as claims 1–2: a few spikes in the
  hundreds make a mean over steps meaningless; the report's tails table has mean, p99 and max);
- is_weight_mean, step_time_s, tokens_per_s: the mean over steps (means over seeds, no CI);
  `tokens_per_s` is blank when runs did not log it;
- episodes: how many of the group's runs had an instability episode (`analysis.episodes`, the band
  `analysis.episodes` of the AnalysisConfig: on by default), of `seeds` runs, with the rate's 95%
  Clopper–Pearson interval; Markdown `1/3 [1%, 91%]`.
CSV: plain numbers (empty when undefined), `*_ci95` columns are the CI half-widths.
"""
from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from analysis.aggregate import DEFAULT_GROUP_KEYS, final_value, group_estimates, group_runs, mean_value, median_value
from analysis.config import AnalysisConfig
from analysis.episodes import Rate, detect_all, episode_rate
from analysis.fetch import SweepData
from analysis.kernel_match import only_kernels
from fp8rl_core.tracking import (
    M_IS_WEIGHT,
    M_MISMATCH,
    M_STEP_TIME,
    M_TOKENS_PER_S,
    M_VAL_ACC,
    M_VAL_ACC_BF16_EVAL,
    TAG_IS,
    TAG_RECIPE,
)

COLUMNS = (TAG_RECIPE, TAG_IS, "seeds", "final_val_accuracy", "final_val_accuracy_ci95",
           "final_val_accuracy_bf16_eval", "final_val_accuracy_bf16_eval_ci95",
           "mismatch", "mismatch_ci95", M_IS_WEIGHT, M_STEP_TIME, M_TOKENS_PER_S,
           "episodes", "episode_rate", "episode_rate_ci95_lo", "episode_rate_ci95_hi")


def _episode_cells(rate: Rate) -> dict:
    return dict(episodes=rate.k, episode_rate=rate.rate, episode_rate_ci95_lo=rate.ci[0],
                episode_rate_ci95_hi=rate.ci[1])


def summary_rows(data: SweepData, by: Sequence[str] = DEFAULT_GROUP_KEYS,
                 cfg: AnalysisConfig | None = None) -> list[dict]:
    """One dict per group of distinct-kernel runs with the COLUMNS (group keys beyond recipe/IS in front);
    the episode columns under `cfg.episodes` (default: the default band)."""
    cfg = cfg or AnalysisConfig()
    runs = only_kernels(data.runs)
    acc = group_estimates(runs, M_VAL_ACC, final_value, by)
    acc_bf16 = group_estimates(runs, M_VAL_ACC_BF16_EVAL, final_value, by)
    mm = group_estimates(runs, M_MISMATCH, median_value, by)
    isw = group_estimates(runs, M_IS_WEIGHT, mean_value, by)
    st = group_estimates(runs, M_STEP_TIME, mean_value, by)
    tps = group_estimates(runs, M_TOKENS_PER_S, mean_value, by)
    rows = []
    for group, members in group_runs(runs, by).items():
        row: dict = dict(zip(by, group))
        row.update(seeds=len(members),
                   final_val_accuracy=acc[group].mean, final_val_accuracy_ci95=acc[group].half,
                   final_val_accuracy_bf16_eval=acc_bf16[group].mean,
                   final_val_accuracy_bf16_eval_ci95=acc_bf16[group].half,
                   mismatch=mm[group].mean, mismatch_ci95=mm[group].half)
        row.update({M_IS_WEIGHT: isw[group].mean, M_STEP_TIME: st[group].mean, M_TOKENS_PER_S: tps[group].mean})
        row.update(_episode_cells(episode_rate(detect_all(members, cfg))))
        rows.append(row)
    return rows


def _num(x: float, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _pm(mean: float, half: float, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    if not math.isfinite(mean):
        return "–"
    text = format(mean * scale, fmt)
    if math.isfinite(half):
        text += f" ± {format(half * scale, fmt)}"
    return text + unit


def markdown_table(rows: Sequence[dict], by: Sequence[str] = DEFAULT_GROUP_KEYS) -> str:
    """A GitHub-style Markdown table; accuracy in % when the values are fractions."""
    accs = [r[k] for r in rows for k in ("final_val_accuracy", "final_val_accuracy_bf16_eval")]
    pct = all(not math.isfinite(a) or a <= 1.0 for a in accs)
    scale, unit = (100.0, " %") if pct else (1.0, "")
    head = [*by, "seeds", "final val accuracy", "final val accuracy (BF16 eval)", "mismatch (median over steps)",
            "mean IS weight", "step time (s)", "tokens/s", "instability episodes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(by) + ["--:"] * 8) + "|"]
    for r in rows:
        cells = [str(r[k]) for k in by] + [
            str(r["seeds"]),
            _pm(r["final_val_accuracy"], r["final_val_accuracy_ci95"], ".1f", scale, unit),
            _pm(r["final_val_accuracy_bf16_eval"], r["final_val_accuracy_bf16_eval_ci95"], ".1f", scale, unit),
            _pm(r["mismatch"], r["mismatch_ci95"], ".4f"),
            _num(r[M_IS_WEIGHT], ".3f") or "–",
            _num(r[M_STEP_TIME], ".2f") or "–",
            _num(r[M_TOKENS_PER_S], ".0f") or "–",
            Rate(r["episodes"], r["seeds"], (r["episode_rate_ci95_lo"], r["episode_rate_ci95_hi"])).text(),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    note = ("Mean ± 95% CI half-width over seeds (Student t); no ± with one seed. Distinct-kernel runs; "
            "BF16 eval: the same validation samples through one BF16 engine (– where not logged). Instability "
            "episodes: runs with an episode of the group's runs (analysis.episodes), 95% Clopper–Pearson interval.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def write_table(data: SweepData, out_dir: str | Path, stem: str = "summary",
                by: Sequence[str] = DEFAULT_GROUP_KEYS, cfg: AnalysisConfig | None = None) -> tuple[Path, Path]:
    """`summary.md` and `summary.csv` under `out_dir` (episodes under `cfg.episodes`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(data, by, cfg)
    md, cs = out / f"{stem}.md", out / f"{stem}.csv"
    md.write_text(markdown_table(rows, by))
    columns = list(by) + [c for c in COLUMNS if c not in (TAG_RECIPE, TAG_IS)]
    with open(cs, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (_num(v, ".6g") if isinstance(v, float) else v) for k, v in r.items()})
    return md, cs
