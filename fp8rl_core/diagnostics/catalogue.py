"""The mismatch-metric catalogue: every framework's generation/training mismatch number, in one pass.

NeMo RL, verl and TRL each report a different statistic of the same two tensors, so a number from one
paper does not line up with another's. Each function below states its formula and who reports it
under which name; `step_diagnostics` computes them all from one |Δ| pass.

Notation (shapes: B sequences x T tokens): train = log π_train(y_t), gen = log π_gen(y_t) of the
sampled token, mask = the n valid response tokens, d_t = train_t − gen_t (the log IS ratio), w_t the
IS weights the loss used, p_t = exp(train_t), q_t = exp(gen_t). Per sequence b with n_b > 0 valid
tokens: mean_b(x) = (1/n_b) Σ_t x_t. Token means are global token-weighted means (NeMo RL's
`global_normalization_factor`), never means of per-rank or per-sequence means unless stated.

Data parallel: `partial_sums` returns sums, counts and maxima that a caller all-reduces (SUM for every
key, MAX for keys starting with "max_"), `finalize` turns them into the metrics; `all_reduce_sums`
does it with torch.distributed's default group, `reduce_with(mesh)` over a data-parallel Mesh.
Every metric is exact across ranks except the order statistics (ORDER_METRICS: median, p95 and
p95-trimmed mean of |Δ|), which are not sums: each rank computes its own exactly and the ranks'
values are combined through the same SUM (token-weighted mean of the per-rank median and p95; the
trimmed mean pools each rank's own trimmed tokens). With one rank (or `reduce=None`) they are exact;
with several they are that documented approximation (exact when every rank's |Δ| has the same
distribution, close when each rank holds many tokens), never a gathered global sort.
Everything is float64: exp(10 nats) sums over 10^6 tokens stay exact enough, and the cost is a few
elementwise ops on the n valid values (benchmarks/diagnostics.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fp8rl_core.algorithms.metrics import k2_terms, mult_prob_error_terms  # the one formula of each metric
from fp8rl_core.tracking import M_MISMATCH, TAIL_FRACTIONS

# --- metric names (MLflow keys; a later refactor moves them into fp8rl_core/tracking) -----------------
M_TOKEN_MULT_PROB_ERROR = M_MISMATCH  # NeMo RL: token_mult_prob_error (the study's Figure 1)
M_GEN_KL = "gen_kl_error"  # NeMo RL: gen_kl_error (k3 KL(gen || train))
M_POLICY_KL = "policy_kl_error"  # NeMo RL: policy_kl_error (k3 KL(train || gen))
M_JSD = "js_divergence_error"  # NeMo RL: js_divergence_error
M_K1_KL = "rollout_corr_kl"  # verl: rollout_corr/kl (k1)
M_K3_KL = "rollout_corr_k3_kl"  # verl: rollout_corr/k3_kl (k3, log ratio clamped to ±20)
M_CHI2_TOKEN = "rollout_corr_chi2_token"  # verl: rollout_corr/chi2_token
M_CHI2_SEQ = "rollout_corr_chi2_seq"  # verl: rollout_corr/chi2_seq
M_TRAINING_PPL = "rollout_corr_training_ppl"  # verl: rollout_corr/training_ppl
M_ROLLOUT_PPL = "rollout_corr_rollout_ppl"  # verl: rollout_corr/rollout_ppl
M_LOG_PPL_DIFF = "rollout_corr_log_ppl_diff"  # verl: rollout_corr/log_ppl_diff
M_LOG_PPL_ABS_DIFF = "rollout_corr_log_ppl_abs_diff"  # verl: rollout_corr/log_ppl_abs_diff
M_LOG_PPL_DIFF_MAX = "rollout_corr_log_ppl_diff_max"  # verl: rollout_corr/log_ppl_diff_max
M_LOG_PPL_DIFF_MIN = "rollout_corr_log_ppl_diff_min"  # verl: rollout_corr/log_ppl_diff_min
M_PPL_RATIO = "rollout_corr_ppl_ratio"  # verl: rollout_corr/ppl_ratio
M_ESS = "rollout_corr_is_eff_sample_size"  # verl: rollout_corr/rollout_is_eff_sample_size
M_PROBS_DIFF_MEAN = "rollout_probs_diff_mean"  # verl: training/rollout_probs_diff_mean
M_PROBS_DIFF_MAX = "rollout_probs_diff_max"  # verl: training/rollout_probs_diff_max
M_PROBS_DIFF_STD = "rollout_probs_diff_std"  # verl: training/rollout_probs_diff_std
M_PROBS_PEARSON = "rollout_actor_probs_pearson_corr"  # verl: training/rollout_actor_probs_pearson_corr
M_ABS_DIFF_MEAN = "logprob_abs_diff_mean"  # TRL: sampling/sampling_logp_difference/mean
M_ABS_DIFF_MAX = "logprob_abs_diff_max"  # TRL: sampling/sampling_logp_difference/max
TAIL_THRESHOLDS = (0.1, 1.0, 10.0)  # nats; the statistics issue's tail fractions
M_FRAC_GT = dict(zip(TAIL_THRESHOLDS, TAIL_FRACTIONS, strict=True))  # the MLflow contract's ..._gt_0.1, _gt_1, _gt_10
M_NUM_VALID = "num_valid_tokens"  # n (the denominator of every token mean above)
M_K2_KL = "rollout_k2_kl"  # prime-rl: kl_loss = (log ratio)² (its loss term), here ½ d² (the k2 estimator)
# miles (utils/debug_utils/run_megatron/logprob_comparator.py): median_abs_diff, p95_abs_diff; the trimmed
# mean is ours (miles reports none): the mean of |Δ| without the top 5% (scipy.stats.trim1, tail "right")
M_ABS_DIFF_MEDIAN = "logprob_abs_diff_median"
M_ABS_DIFF_P95 = "logprob_abs_diff_p95"
M_ABS_DIFF_TRIMMED = "logprob_abs_diff_trimmed_mean_p95"
ORDER_METRICS = (M_ABS_DIFF_MEDIAN, M_ABS_DIFF_P95, M_ABS_DIFF_TRIMMED)  # per-rank exact (module docstring)
TRIM_FRACTION = 0.05  # the trimmed mean drops the floor(0.05 n) largest |Δ|
# Splits (prime-rl's masked_/unmasked_mismatch_kl and masked_advantage_positive/negative): the valid tokens
# with a positive / negative advantage (zero-advantage tokens are in neither), and those whose IS weight is
# 0 (masked by the correction: icepop, seq_mask, dppo, a non-finite ratio) / not 0 (kept).
SPLITS = ("adv_pos", "adv_neg", "is_masked", "is_kept")
M_SPLIT = {s: {"mult": f"{M_TOKEN_MULT_PROB_ERROR}_{s}", "abs": f"{M_ABS_DIFF_MEAN}_{s}",
               "k3": f"{M_GEN_KL}_{s}"} for s in SPLITS}  # prime-rl's mismatch_kl is the k3 of gen_kl_error
M_FRACTION = {s: f"token_fraction_{s}" for s in ("adv_pos", "adv_neg", "is_masked")}  # of the valid tokens
SPLIT_METRICS = (*(name for s in SPLITS for name in M_SPLIT[s].values()), *M_FRACTION.values())

CATALOGUE_METRICS = (
    M_TOKEN_MULT_PROB_ERROR, M_GEN_KL, M_POLICY_KL, M_JSD, M_K1_KL, M_K3_KL, M_CHI2_TOKEN, M_CHI2_SEQ,
    M_TRAINING_PPL, M_ROLLOUT_PPL, M_LOG_PPL_DIFF, M_LOG_PPL_ABS_DIFF, M_LOG_PPL_DIFF_MAX, M_LOG_PPL_DIFF_MIN,
    M_PPL_RATIO, M_ESS, M_PROBS_DIFF_MEAN, M_PROBS_DIFF_MAX, M_PROBS_DIFF_STD, M_PROBS_PEARSON,
    M_ABS_DIFF_MEAN, M_ABS_DIFF_MAX, *M_FRAC_GT.values(), M_NUM_VALID,
    M_K2_KL, *ORDER_METRICS, *SPLIT_METRICS,
)
TAIL_METRICS = (*M_FRAC_GT.values(), M_ABS_DIFF_MAX, M_ABS_DIFF_MEAN)  # read by analysis/ (statistics issue)

Reduce = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]  # global sums from one rank's sums
SAFETY_BOUND = 20.0  # verl clamps log ratios to ±20 nats before exp in chi² (and k3): exp(40) stays finite


# --- per-token terms (pure, elementwise; d = train - gen) --------------------------------------------
def k3_terms(d: torch.Tensor) -> torch.Tensor:
    """exp(d) − d − 1 ≥ 0: the k3 estimate of KL(π_gen || π_train) at a token sampled from π_gen.

    NeMo RL gen_kl_error = mean (calculate_kl(gen, ref=train), k3); verl rollout_corr/k3_kl = mean of the
    same with d clamped to ±SAFETY_BOUND (pass the clamped d).
    """
    return torch.expm1(d) - d


def policy_k3_terms(d: torch.Tensor) -> torch.Tensor:
    """exp(−d) + d − 1: NeMo RL's policy_kl_error per token (k3 with the roles of the engines swapped)."""
    return torch.expm1(-d) + d


def jsd_terms(train: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
    """NeMo RL's js_divergence_error per token, on the sampled token's probabilities only:
    log m = log((p + q) / 2); JSD_t = ½ k3(train − log m) + ½ k3(gen − log m), with k3(x) = eˣ − x − 1."""
    log_m = torch.logaddexp(train, gen) - math.log(2.0)
    a, b = train - log_m, gen - log_m
    return 0.5 * (torch.expm1(a) - a) + 0.5 * (torch.expm1(b) - b)


def order_statistics(abs_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(median, p95, trimmed sum, trimmed count k) of the n values abs_d Float[n] (one rank's |Δ|); 0-d
    tensors on abs_d's device (no host sync), k an int.

    sorted ascending v_0 ≤ … ≤ v_{n−1}: median = v_{(n−1)/2} (n odd) or (v_{n/2−1} + v_{n/2}) / 2 (n even,
    Python's statistics.median, as miles); p95 = v_{⌊0.95 n⌋} (miles' `sorted_diffs[int(num * 0.95)]`);
    trimmed = Σ_{i < k} v_i over the k = n − ⌊0.05 n⌋ smallest (the p95-trimmed mean is trimmed / k).
    n = 0 gives zeros and k = 0. NaN sorts last (as the largest), inf as itself.
    """
    n = abs_d.numel()
    if n == 0:
        zero = abs_d.new_zeros(())
        return zero, zero, zero, 0
    v = torch.sort(abs_d).values
    median = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    k = n - math.floor(TRIM_FRACTION * n)
    return median, v[min(int(n * 0.95), n - 1)], v[:k].sum(), k


def _split_sums(d: torch.Tensor, abs_d: torch.Tensor, masks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """n, Σ exp(|d|), Σ |d|, Σ k3(d) of each split's tokens (masks: Bool[n] over the valid tokens)."""
    out: dict[str, torch.Tensor] = {}
    for name, sel in masks.items():
        out[f"n_{name}"] = sel.sum().double()
        out[f"s_exp_abs_{name}"] = mult_prob_error_terms(abs_d[sel]).sum()
        out[f"s_abs_{name}"] = abs_d[sel].sum()
        out[f"s_k3_{name}"] = k3_terms(d[sel]).sum()
    return out


# --- the one pass ------------------------------------------------------------------------------------
def _check(train: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, w: torch.Tensor | None) -> None:
    shapes = {tuple(t.shape) for t in (train, gen, mask) + ((w,) if w is not None else ())}
    if len(shapes) != 1 or train.dim() != 2:
        raise ValueError(f"train_logprobs {tuple(train.shape)}, gen_logprobs {tuple(gen.shape)}, mask "
                         f"{tuple(mask.shape)} and is_weights {None if w is None else tuple(w.shape)} must be "
                         "one [B, T] shape")


def partial_sums(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
                 is_weights: torch.Tensor | None = None,
                 advantages: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sums, counts and maxima of one rank's tokens, from which `finalize` computes every metric.

    train_logprobs, gen_logprobs: Float[B, T]; mask: Bool[B, T] (valid response tokens); is_weights:
    Float[B, T] (None: all 1); advantages: Float[B] or Float[B, T] (None: the adv_* splits are nan).
    Returns 0-d float64 tensors: add them across ranks, except the "max_*" keys (take the max). Sequences
    are never split across ranks (GRPO groups stay together), so the per-sequence terms are complete on
    each rank. The order statistics enter as per-rank values times the rank's n (module docstring).
    """
    _check(train_logprobs, gen_logprobs, mask, is_weights)
    if advantages is not None and advantages.shape not in (mask.shape, mask.shape[:1]):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected [B] or [B, T] with "
                         f"[B, T] = {tuple(mask.shape)}")
    with torch.no_grad():
        m = mask.bool()
        t2, g2 = train_logprobs.detach().double(), gen_logprobs.detach().double()
        train, gen = t2[m], g2[m]  # [n]: the valid tokens, flattened
        d = train - gen
        abs_d = d.abs()  # |Δ| once; everything token-level reads it or d
        d_safe = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        w = torch.ones_like(d) if is_weights is None else is_weights.detach().double()[m]
        p, q = torch.exp(train), torch.exp(gen)
        pd = (p - q).abs()
        # per sequence: n_b, Σ_t d, Σ_t train, Σ_t gen (zeros off-mask, so row sums are masked sums)
        zero = torch.zeros((), dtype=torch.float64, device=t2.device)
        n_b = m.sum(-1).double()
        has = n_b > 0
        sum_d_b = torch.where(m, t2 - g2, zero).sum(-1)[has]
        mean_train_b = torch.where(m, t2, zero).sum(-1)[has] / n_b[has]
        mean_gen_b = torch.where(m, g2, zero).sum(-1)[has] / n_b[has]
        lpd_b = mean_gen_b - mean_train_b  # verl's per-sequence log-perplexity difference
        neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=t2.device)
        top = lambda x: x.max() if x.numel() else neg_inf  # noqa: E731  (max of nothing: -inf, MAX-reducible)
        sums = {
            "n_tok": torch.tensor(float(d.numel()), dtype=torch.float64, device=t2.device), "n_seq": has.sum().double(),
            "s_exp_abs": mult_prob_error_terms(abs_d).sum(), "s_abs": abs_d.sum(), "max_abs": top(abs_d),
            "s_d": d.sum(), "s_k3": k3_terms(d).sum(), "s_k3_safe": k3_terms(d_safe).sum(),
            "s_policy_k3": policy_k3_terms(d).sum(), "s_jsd": jsd_terms(train, gen).sum(),
            "s_rho2": torch.exp(2.0 * d_safe).sum(),
            "s_seq_rho2": torch.exp(2.0 * sum_d_b.clamp(-SAFETY_BOUND, SAFETY_BOUND)).sum(),
            "s_train_ppl": torch.exp(-mean_train_b).sum(), "s_gen_ppl": torch.exp(-mean_gen_b).sum(),
            "s_lpd": lpd_b.sum(), "s_lpd_abs": lpd_b.abs().sum(), "max_lpd": top(lpd_b), "max_neg_lpd": top(-lpd_b),
            "s_ppl_ratio": torch.exp(lpd_b).sum(), "s_w": w.sum(), "s_w2": (w * w).sum(),
            "s_pd": pd.sum(), "s_pd2": (pd * pd).sum(), "max_pd": top(pd),
            "s_p": p.sum(), "s_q": q.sum(), "s_p2": (p * p).sum(), "s_q2": (q * q).sum(), "s_pq": (p * q).sum(),
        }
        for t in TAIL_THRESHOLDS:
            sums[f"c_gt_{t:g}"] = (abs_d > t).sum().double()  # nan never counts: it fails every comparison
        sums["s_k2"] = k2_terms(d).sum()
        median, p95, trim_sum, trim_n = order_statistics(abs_d)
        sums.update({"s_median_w": median * d.numel(), "s_p95_w": p95 * d.numel(), "s_trim": trim_sum,
                     "n_trim": torch.tensor(float(trim_n), dtype=torch.float64, device=t2.device)})
        kept = w != 0
        splits = {"is_masked": ~kept, "is_kept": kept}
        if advantages is not None:
            a = advantages.detach().to(t2.device, torch.float64)
            a = (a.unsqueeze(-1).expand(mask.shape) if a.dim() == 1 else a)[m]
            splits.update(adv_pos=a > 0, adv_neg=a < 0)
        sums["n_adv"] = torch.tensor(float(d.numel() if advantages is not None else 0), dtype=torch.float64,
                                     device=t2.device)
        sums.update(_split_sums(d, abs_d, splits))
        for name in ("adv_pos", "adv_neg"):  # without advantages: the keys are there (ranks stack alike), 0
            for key in (f"n_{name}", f"s_exp_abs_{name}", f"s_abs_{name}", f"s_k3_{name}"):
                sums.setdefault(key, torch.zeros((), dtype=torch.float64, device=t2.device))
    return {k: v.to(torch.float64) for k, v in sums.items()}


def all_reduce_sums(sums: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """Global sums over the ranks of `group` (torch.distributed): SUM for sums/counts, MAX for "max_*".

    Two collectives (one stacked tensor each); a no-op when torch.distributed is not initialized.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return sums
    keys = sorted(sums)
    add = [k for k in keys if not k.startswith("max_")]
    big = [k for k in keys if k.startswith("max_")]
    a = torch.stack([sums[k] for k in add])
    b = torch.stack([sums[k] for k in big])
    dist.all_reduce(a, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(b, op=dist.ReduceOp.MAX, group=group)
    return {**dict(zip(add, a.unbind())), **dict(zip(big, b.unbind()))}


def reduce_with(mesh) -> Reduce:
    """A `reduce` over a data-parallel mesh (fp8rl_core.distributed.Mesh, or anything with
    `all_reduce_sum(values) -> Float64[k]` and `all_reduce_max(values)`): one collective of each kind."""

    def reduce(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        add = sorted(k for k in sums if not k.startswith("max_"))
        big = sorted(k for k in sums if k.startswith("max_"))
        a = mesh.all_reduce_sum(torch.stack([sums[k].cpu() for k in add]))
        b = mesh.all_reduce_max(torch.stack([sums[k].cpu() for k in big]))
        return {**dict(zip(add, a.unbind())), **dict(zip(big, b.unbind()))}

    return reduce


def _div(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def finalize(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The catalogue's metrics (names: CATALOGUE_METRICS) from (global) `partial_sums`. nan without data.

    Token means over the n valid tokens:
      token_mult_prob_error = Σ exp(|d|)/n; gen_kl_error = Σ (eᵈ − d − 1)/n; policy_kl_error =
      Σ (e⁻ᵈ + d − 1)/n; js_divergence_error = Σ JSD_t/n; rollout_corr_kl = Σ (gen − train)/n (k1 of
      KL(gen || train)); rollout_corr_k3_kl = gen_kl_error with d clamped to ±20; rollout_corr_chi2_token =
      Σ exp(2 clamp(d, ±20))/n − 1; logprob_abs_diff_mean = Σ |d|/n, logprob_abs_diff_max = max |d|;
      logprob_abs_diff_frac_gt_X = #{|d| > X}/n; rollout_probs_diff_{mean,max,std} of |p − q| (std with
      Bessel's correction, as torch.std); rollout_actor_probs_pearson_corr = Pearson r of (p, q);
      rollout_corr_is_eff_sample_size = (Σ w)² / (n Σ w²) (1 when all weights are equal).
    Sequence means over the S sequences with a valid token:
      rollout_corr_chi2_seq = (1/S) Σ_b exp(2 clamp(Σ_t d, ±20)) − 1; rollout_corr_training_ppl =
      (1/S) Σ_b exp(−mean_b(train)), rollout_ppl likewise of gen; log_ppl_diff_b = mean_b(gen) −
      mean_b(train), reported as mean, mean |.|, max, min; rollout_corr_ppl_ratio = (1/S) Σ_b exp(log_ppl_diff_b).
    Added (issue 34): rollout_k2_kl = Σ ½ d²/n; logprob_abs_diff_{median, p95, trimmed_mean_p95} (order
    statistics, order_statistics; per rank across ranks); per split X of SPLITS, over its n_X tokens:
    token_mult_prob_error_X = Σ_X exp(|d|)/n_X, logprob_abs_diff_mean_X = Σ_X |d|/n_X, gen_kl_error_X =
    Σ_X (eᵈ − d − 1)/n_X (nan when n_X = 0); token_fraction_X = n_X / n (adv_*: nan without advantages).
    """
    f = {k: float(v) for k, v in sums.items()}
    n, s = f["n_tok"], f["n_seq"]
    mean = lambda key: _div(f[key], n)  # noqa: E731
    seq = lambda key: _div(f[key], s)  # noqa: E731
    pd_mean = mean("s_pd")
    pd_var = _div(f["s_pd2"] - n * pd_mean * pd_mean, n - 1) if n > 1 else math.nan
    cov = f["s_pq"] - f["s_p"] * f["s_q"] / n if n else math.nan
    var_p = f["s_p2"] - f["s_p"] ** 2 / n if n else math.nan
    var_q = f["s_q2"] - f["s_q"] ** 2 / n if n else math.nan
    out = {
        M_TOKEN_MULT_PROB_ERROR: mean("s_exp_abs"),
        M_GEN_KL: mean("s_k3"),
        M_POLICY_KL: mean("s_policy_k3"),
        M_JSD: mean("s_jsd"),
        M_K1_KL: -mean("s_d"),
        M_K3_KL: mean("s_k3_safe"),
        M_CHI2_TOKEN: mean("s_rho2") - 1.0,
        M_CHI2_SEQ: seq("s_seq_rho2") - 1.0,
        M_TRAINING_PPL: seq("s_train_ppl"),
        M_ROLLOUT_PPL: seq("s_gen_ppl"),
        M_LOG_PPL_DIFF: seq("s_lpd"),
        M_LOG_PPL_ABS_DIFF: seq("s_lpd_abs"),
        M_LOG_PPL_DIFF_MAX: f["max_lpd"] if s else math.nan,
        M_LOG_PPL_DIFF_MIN: -f["max_neg_lpd"] if s else math.nan,
        M_PPL_RATIO: seq("s_ppl_ratio"),
        M_ESS: _div(f["s_w"] ** 2, n * f["s_w2"]) if n else math.nan,
        M_PROBS_DIFF_MEAN: pd_mean,
        M_PROBS_DIFF_MAX: f["max_pd"] if n else math.nan,
        M_PROBS_DIFF_STD: math.sqrt(max(pd_var, 0.0)) if pd_var == pd_var else math.nan,
        M_PROBS_PEARSON: _div(cov, math.sqrt(var_p * var_q)) if n and var_p * var_q > 0 else math.nan,
        M_ABS_DIFF_MEAN: mean("s_abs"),
        M_ABS_DIFF_MAX: f["max_abs"] if n else math.nan,
        **{M_FRAC_GT[t]: mean(f"c_gt_{t:g}") for t in TAIL_THRESHOLDS},
        M_NUM_VALID: n,
        M_K2_KL: mean("s_k2"),
        M_ABS_DIFF_MEDIAN: mean("s_median_w"),
        M_ABS_DIFF_P95: mean("s_p95_w"),
        M_ABS_DIFF_TRIMMED: _div(f["s_trim"], f["n_trim"]),
    }
    for name in SPLITS:
        k = M_SPLIT[name]
        out[k["mult"]] = _div(f[f"s_exp_abs_{name}"], f[f"n_{name}"])
        out[k["abs"]] = _div(f[f"s_abs_{name}"], f[f"n_{name}"])
        out[k["k3"]] = _div(f[f"s_k3_{name}"], f[f"n_{name}"])
    out[M_FRACTION["adv_pos"]] = _div(f["n_adv_pos"], f["n_adv"])
    out[M_FRACTION["adv_neg"]] = _div(f["n_adv_neg"], f["n_adv"])
    out[M_FRACTION["is_masked"]] = mean("n_is_masked")
    return out


def step_diagnostics(train_lp: torch.Tensor, gen_lp: torch.Tensor, mask: torch.Tensor,
                     is_weights: torch.Tensor | None = None, reduce: Reduce | None = None,
                     advantages: torch.Tensor | None = None) -> dict[str, float]:
    """Every catalogue metric of one step: finalize(reduce(partial_sums(...))).

    train_lp, gen_lp: Float[B, T] (training engine's old log-probs, generation engine's); mask: Bool[B, T];
    is_weights: Float[B, T] or None; advantages: Float[B] or Float[B, T] or None (the adv_* splits: nan).
    reduce: e.g. `all_reduce_sums` under data parallelism, so that the metrics are global and token-weighted
    (None: this process's tokens are the whole batch).
    """
    sums = partial_sums(train_lp, gen_lp, mask, is_weights, advantages)
    return finalize(reduce(sums) if reduce is not None else sums)
