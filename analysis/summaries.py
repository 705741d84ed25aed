"""Per-run robust summaries, and the paired cells the claims compare.

Per run (over its logged steps t = 1..S of `token_mult_prob_error` x_t):
- `mismatch_median` = median_t x_t: what claims 1–2 use. A few tokens on which the two engines
  disagree by > 10 nats make per-step spikes in the hundreds; one spike moves a mean over steps by
  spike/S, never the median;
- `mismatch_trimmed` = the mean of x_t after cutting `trim` (10%) of the steps from each end
  (scipy.stats.trim_mean): a second view, shown next to the median;
- tails: `mismatch_p99` (99th percentile over steps), `mismatch_max`, and the per-run means over steps
  of `logprob_abs_diff_frac_gt_{0.1,1,10}` (the fraction of tokens with |Δ log-prob| above 0.1, 1, 10
  nats; optional: NaN, shown as n/a, for runs that did not log them);
- `final_accuracy` = `val_accuracy` at the run's last validation step, `final_accuracy_bf16_eval` =
  `val_accuracy_bf16_eval` there (NaN for runs that did not log it); claims 3–4 read the one named by
  `analysis.accuracy_metric` (`ACCURACY_ATTR`).

Only runs with distinct kernels are summarized by default (`analysis.kernel_match`): a matched-kernel cell
has the recipe, IS setting and seed of a distinct one, so the two would collide in every pairing.

Pairs: runs that differ only in recipe share a seed and an IS setting, hence the prompts.
`paired(summaries, a, b, field, isv)` → one difference per seed, b − a; with `isv=None` the
differences of a seed's IS settings are averaged first, so the seed stays the unit of replication.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from analysis.aggregate import IS_ORDER, RECIPE_ORDER, final_value
from analysis.fetch import RunHistory
from analysis.kernel_match import DISTINCT, only_kernels
from fp8rl_core.tracking import M_MISMATCH, M_VAL_ACC, M_VAL_ACC_BF16_EVAL, TAG_IS, TAG_RECIPE, TAG_SEED, TAIL_FRACTIONS

FRAC_METRICS = TAIL_FRACTIONS  # the MLflow contract's per-step tail fractions (fp8rl_core/tracking)
NAN = float("nan")
ACCURACY_ATTR = {M_VAL_ACC: "final_accuracy", M_VAL_ACC_BF16_EVAL: "final_accuracy_bf16_eval"}  # metric -> field


@dataclass(frozen=True)
class RunSummary:
    recipe: str
    importance_sampling: str
    seed: str
    run_id: str = ""
    mismatch_median: float = NAN
    mismatch_trimmed: float = NAN
    mismatch_mean: float = NAN
    mismatch_p99: float = NAN
    mismatch_max: float = NAN
    frac_gt: tuple[float, float, float] = (NAN, NAN, NAN)  # FRAC_METRICS, in order
    final_accuracy: float = NAN
    final_accuracy_bf16_eval: float = NAN

    @property
    def cell(self) -> tuple[str, str, str]:
        return self.recipe, self.importance_sampling, self.seed


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def _mean_of(run: RunHistory, key: str) -> float:
    v = _finite(run.series(key)[1])
    return float(v.mean()) if v.size else NAN


def summarize(run: RunHistory, trim: float = 0.1) -> RunSummary:
    """The run's robust summaries (NaN where it logged no steps of a metric)."""
    mm = _finite(run.series(M_MISMATCH)[1])
    robust: dict[str, float] = {}
    if mm.size:
        robust = dict(mismatch_median=float(np.median(mm)), mismatch_trimmed=float(stats.trim_mean(mm, trim)),
                      mismatch_mean=float(mm.mean()), mismatch_p99=float(np.percentile(mm, 99)),
                      mismatch_max=float(mm.max()))
    return RunSummary(run.get(TAG_RECIPE) or "?", run.get(TAG_IS) or "?", run.get(TAG_SEED) or "?",
                      run.run_id, frac_gt=tuple(_mean_of(run, k) for k in FRAC_METRICS),
                      final_accuracy=final_value(run, M_VAL_ACC),
                      final_accuracy_bf16_eval=final_value(run, M_VAL_ACC_BF16_EVAL), **robust)


def summarize_all(runs: Iterable[RunHistory], trim: float = 0.1, kernels: str = DISTINCT) -> list[RunSummary]:
    """The summaries of the runs with `kernels` (default: distinct, the study's cells)."""
    return [summarize(r, trim) for r in only_kernels(list(runs), kernels)]


def accuracy_logged(summaries: Sequence[RunSummary], metric: str) -> bool:
    """Did any run log `metric` (an `ACCURACY_ATTR` key)? Older runs have no val_accuracy_bf16_eval."""
    return any(np.isfinite(getattr(s, ACCURACY_ATTR[metric])) for s in summaries)


def select(summaries: Sequence[RunSummary], recipe: str, isv: str | None = None) -> list[RunSummary]:
    return [s for s in summaries if s.recipe == recipe and (isv is None or s.importance_sampling == isv)]


def paired(summaries: Sequence[RunSummary], a: str, b: str, attr: str, isv: str | None = None,
           isv_b: str | None = None) -> tuple[np.ndarray, list[str]]:
    """Per-seed differences `b − a` of `attr` over cells paired by (seed, IS setting).

    `isv`: only that IS setting (None: every setting both recipes ran, averaged within the seed).
    `isv_b`: b's IS setting when it differs from a's (e.g. fp8_e2e + token against bf16 + none).
    Returns `(d [n], seeds)`, seeds in sorted order; cells with a NaN summary are left out."""
    value = {s.cell: getattr(s, attr) for s in summaries}
    by_seed: dict[str, list[float]] = defaultdict(list)
    for (recipe, setting, seed), va in value.items():
        if recipe != a or (isv is not None and setting != isv):
            continue
        vb = value.get((b, isv_b or setting, seed))
        if vb is not None and np.isfinite(va) and np.isfinite(vb):
            by_seed[seed].append(vb - va)
    seeds = sorted(by_seed)
    return np.array([np.mean(by_seed[s]) for s in seeds], dtype=np.float64), seeds


def step_order_fractions(runs: Sequence[RunHistory], low: str, high: str, key: str = M_MISMATCH) -> np.ndarray:
    """Per seed: the fraction of the steps both paired runs logged where `low`'s value < `high`'s,
    averaged over the seed's IS settings (Figure 1's "consistently lower", paired step by step).
    Distinct-kernel runs only (a matched cell shares its distinct twin's recipe, IS and seed)."""
    cells = {(r.get(TAG_RECIPE), r.get(TAG_IS), r.get(TAG_SEED)): r for r in only_kernels(runs)}
    by_seed: dict[str, list[float]] = defaultdict(list)
    for (recipe, setting, seed), run_low in cells.items():
        run_high = cells.get((high, setting, seed))
        if recipe != low or run_high is None:
            continue
        s1, v1 = run_low.series(key)
        s2, v2 = run_high.series(key)
        common, i1, i2 = np.intersect1d(s1, s2, return_indices=True)
        if common.size:
            by_seed[seed].append(float(np.mean(v1[i1] < v2[i2])))
    return np.array([np.mean(by_seed[s]) for s in sorted(by_seed)], dtype=np.float64)


def _agg(values: Sequence[float], how: str = "mean") -> float:
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=np.float64)
    return NAN if v.size == 0 else float(v.max() if how == "max" else v.mean())


def _cell(x: float, fmt: str) -> str:
    return "n/a" if not np.isfinite(x) else format(x, fmt)


def _group_rank(group: tuple[str, str]) -> tuple:
    recipe, isv = group
    return (RECIPE_ORDER.index(recipe) if recipe in RECIPE_ORDER else len(RECIPE_ORDER), recipe,
            IS_ORDER.index(isv) if isv in IS_ORDER else len(IS_ORDER), isv)


def tails_markdown(summaries: Sequence[RunSummary]) -> str:
    """Per recipe × IS: the robust mismatch summaries and the tail statistics (means over runs; max: the
    largest step of any run). The token fractions show n/a for runs that did not log them."""
    head = ("| recipe | IS | runs | median | trimmed mean | mean | p99 | max | "
            "frac \\|Δ\\| > 0.1 | > 1 | > 10 |")
    lines = [head, "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    groups: dict[tuple[str, str], list[RunSummary]] = defaultdict(list)
    for s in summaries:
        groups[(s.recipe, s.importance_sampling)].append(s)
    for (recipe, isv), members in sorted(groups.items(), key=lambda kv: _group_rank(kv[0])):
        def col(attr: str, how: str = "mean", members=members) -> float:
            return _agg([getattr(m, attr) for m in members], how)
        fracs = [_agg([m.frac_gt[i] for m in members]) for i in range(len(FRAC_METRICS))]
        lines.append(f"| {recipe} | {isv} | {len(members)} | {_cell(col('mismatch_median'), '.4f')} | "
                     f"{_cell(col('mismatch_trimmed'), '.4f')} | {_cell(col('mismatch_mean'), '.4f')} | "
                     f"{_cell(col('mismatch_p99'), '.4g')} | {_cell(col('mismatch_max', 'max'), '.4g')} | "
                     + " | ".join(_cell(f, '.2e') for f in fracs) + " |")
    note = ("token_mult_prob_error per run over its steps: median (claims 1–2 use it: robust to the spikes a few "
            "tokens > 10 nats apart make), trimmed mean (10% cut per end), mean, p99, max; then the mean over steps "
            "of the fraction of tokens with |Δ log-prob| > 0.1 / 1 / 10 nats (n/a: not logged by these runs).")
    return "\n".join(lines) + "\n\n" + note + "\n"
