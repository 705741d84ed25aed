"""The metric catalogue against a float64 loop reference, the peers' published formulas, and hand-computed values."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from fp8rl_core.algorithms.metrics import token_mult_prob_error
from fp8rl_core.diagnostics import catalogue as C
from fp8rl_core.diagnostics.catalogue import CATALOGUE_METRICS, finalize, partial_sums, step_diagnostics

NAN, INF = float("nan"), float("inf")


def _batch(seed: int = 0, B: int = 5, T: int = 9, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    train = gen + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.35
    mask[:, 0] = True  # every row has a valid token
    mask[2] = False  # ... except one: it must not count as a sequence
    w = torch.exp(train - gen).clamp(max=2.0)
    return train, gen, mask, w


def _advantages(seed: int = 0, B: int = 5):
    """Float64[B]: one advantage per sequence, positive, negative and exactly 0 (in neither sign split)."""
    a = torch.randn(B, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
    a[-1] = 0.0
    return a


def _loop_reference(train, gen, mask, w, adv=None) -> dict[str, float]:
    """Each metric from its docstring formula, one Python float at a time (math module, float64)."""
    toks = [(float(train[b, t]), float(gen[b, t]), float(w[b, t]))
            for b in range(train.shape[0]) for t in range(train.shape[1]) if mask[b, t]]
    sign = [float(adv[b]) if adv is not None else math.nan
            for b in range(train.shape[0]) for t in range(train.shape[1]) if mask[b, t]]
    n = len(toks)
    d = [a - b for a, b, _ in toks]
    p = [math.exp(a) for a, _, _ in toks]
    q = [math.exp(b) for _, b, _ in toks]
    pd = [abs(x - y) for x, y in zip(p, q)]
    seqs = []
    for b in range(train.shape[0]):
        idx = [t for t in range(train.shape[1]) if mask[b, t]]
        if idx:
            seqs.append(([float(train[b, t]) for t in idx], [float(gen[b, t]) for t in idx]))
    lpd = [sum(gs) / len(gs) - sum(ts) / len(ts) for ts, gs in seqs]
    clamp = lambda x: max(-20.0, min(20.0, x))  # noqa: E731
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731

    def jsd(a, b):
        m = math.log(0.5 * math.exp(a) + 0.5 * math.exp(b))
        return 0.5 * k3(a - m) + 0.5 * k3(b - m)

    mp, mq = sum(p) / n, sum(q) / n
    pd_mean = sum(pd) / n
    ws = [x for _, _, x in toks]
    return {
        "token_mult_prob_error": sum(math.exp(abs(x)) for x in d) / n,
        "gen_kl_error": sum(k3(x) for x in d) / n,
        "policy_kl_error": sum(k3(-x) for x in d) / n,
        "js_divergence_error": sum(jsd(a, b) for a, b, _ in toks) / n,
        "rollout_corr_kl": sum(-x for x in d) / n,
        "rollout_corr_k3_kl": sum(k3(clamp(x)) for x in d) / n,
        "rollout_corr_chi2_token": sum(math.exp(2 * clamp(x)) for x in d) / n - 1,
        "rollout_corr_chi2_seq": sum(math.exp(2 * clamp(sum(ts) - sum(gs))) for ts, gs in seqs) / len(seqs) - 1,
        "rollout_corr_training_ppl": sum(math.exp(-sum(ts) / len(ts)) for ts, _ in seqs) / len(seqs),
        "rollout_corr_rollout_ppl": sum(math.exp(-sum(gs) / len(gs)) for _, gs in seqs) / len(seqs),
        "rollout_corr_log_ppl_diff": sum(lpd) / len(lpd),
        "rollout_corr_log_ppl_abs_diff": sum(abs(x) for x in lpd) / len(lpd),
        "rollout_corr_log_ppl_diff_max": max(lpd),
        "rollout_corr_log_ppl_diff_min": min(lpd),
        "rollout_corr_ppl_ratio": sum(math.exp(x) for x in lpd) / len(lpd),
        "rollout_corr_is_eff_sample_size": sum(ws) ** 2 / (n * sum(x * x for x in ws)),
        "rollout_probs_diff_mean": pd_mean,
        "rollout_probs_diff_max": max(pd),
        "rollout_probs_diff_std": math.sqrt(sum((x - pd_mean) ** 2 for x in pd) / (n - 1)),
        "rollout_actor_probs_pearson_corr": sum((x - mp) * (y - mq) for x, y in zip(p, q))
        / math.sqrt(sum((x - mp) ** 2 for x in p) * sum((y - mq) ** 2 for y in q)),
        "logprob_abs_diff_mean": sum(abs(x) for x in d) / n,
        "logprob_abs_diff_max": max(abs(x) for x in d),
        "logprob_abs_diff_frac_gt_0.1": sum(abs(x) > 0.1 for x in d) / n,
        "logprob_abs_diff_frac_gt_1": sum(abs(x) > 1 for x in d) / n,
        "logprob_abs_diff_frac_gt_10": sum(abs(x) > 10 for x in d) / n,
        "num_valid_tokens": float(n),
        **_new_views_reference(d, [x for _, _, x in toks], sign),
    }


def _new_views_reference(d, ws, sign) -> dict[str, float]:
    """Issue 34's views: k2, the order statistics of |d| (miles: statistics.median, sorted[int(0.95 n)];
    the trimmed mean drops the floor(0.05 n) largest) and the splits by advantage sign and IS mask."""
    n = len(d)
    a = sorted(abs(x) for x in d)
    keep = n - math.floor(0.05 * n)
    splits = {"adv_pos": [x for x, s in zip(d, sign) if s > 0], "adv_neg": [x for x, s in zip(d, sign) if s < 0],
              "is_masked": [x for x, w in zip(d, ws) if w == 0], "is_kept": [x for x, w in zip(d, ws) if w != 0]}
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    out = {"rollout_k2_kl": sum(0.5 * x * x for x in d) / n, "logprob_abs_diff_median": statistics.median(a),
           "logprob_abs_diff_p95": a[int(n * 0.95)], "logprob_abs_diff_trimmed_mean_p95": sum(a[:keep]) / keep}
    for name, xs in splits.items():
        out[f"token_mult_prob_error_{name}"] = mean([math.exp(abs(x)) for x in xs])
        out[f"logprob_abs_diff_mean_{name}"] = mean([abs(x) for x in xs])
        out[f"gen_kl_error_{name}"] = mean([math.exp(x) - x - 1 for x in xs])
    known = not math.isnan(sign[0])
    out["token_fraction_adv_pos"] = len(splits["adv_pos"]) / n if known else math.nan
    out["token_fraction_adv_neg"] = len(splits["adv_neg"]) / n if known else math.nan
    out["token_fraction_is_masked"] = len(splits["is_masked"]) / n
    return out


@pytest.mark.parametrize("scale", [0.01, 0.3, 3.0])
def test_every_metric_matches_a_float64_loop_reference(scale):
    train, gen, mask, w = _batch(scale=scale)
    w = w.clone()
    w[:, 1::3] = 0.0  # some tokens masked by the correction (the is_* splits)
    adv = _advantages()
    got = step_diagnostics(train, gen, mask, w, advantages=adv)
    ref = _loop_reference(train, gen, mask, w, adv)
    assert set(got) == set(CATALOGUE_METRICS) == set(ref)
    for key in ref:
        assert got[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12, nan_ok=True), key
    assert got["token_fraction_is_masked"] > 0 and got["token_fraction_adv_pos"] > 0
    assert got["token_fraction_adv_neg"] > 0


# --- the peers' published formulas, written from their code's definitions (masked means over [B, T]) --------
def _masked_mean(x, mask, dim=None):
    m = mask.double()
    return (x * m).sum() / m.sum() if dim is None else (x * m).sum(dim) / m.sum(dim)


def test_matches_nemo_rl_formulas():
    """NeMo RL ClippedPGLossFn: mean exp(|gen - prev| * mask); k3 calculate_kl(gen, ref=prev) and its
    reverse; JSD over the sampled tokens' probabilities with the mixture M = (p + q) / 2."""
    train, gen, mask, w = _batch(1)
    got = step_diagnostics(train, gen, mask, w)
    mult = _masked_mean(torch.exp((gen - train).abs() * mask), mask)
    r = train - gen  # calculate_kl(logprobs=gen, reference=prev, k3): exp(ref - lp) - (ref - lp) - 1
    gen_kl = _masked_mean(torch.exp(r) - r - 1, mask)
    policy_kl = _masked_mean(torch.exp(-r) + r - 1, mask)
    log_m = torch.log(0.5 * torch.exp(train) + 0.5 * torch.exp(gen))
    kl_t = torch.exp(train - log_m) - (train - log_m) - 1
    kl_g = torch.exp(gen - log_m) - (gen - log_m) - 1
    jsd = _masked_mean(0.5 * kl_t + 0.5 * kl_g, mask)
    assert got["token_mult_prob_error"] == pytest.approx(float(mult), rel=1e-12)
    assert got["gen_kl_error"] == pytest.approx(float(gen_kl), rel=1e-9)
    assert got["policy_kl_error"] == pytest.approx(float(policy_kl), rel=1e-9)
    assert got["js_divergence_error"] == pytest.approx(float(jsd), rel=1e-9)


def test_matches_verl_rollout_corr_formulas():
    """verl compute_offpolicy_metrics (old = train, rollout = gen), over the rows with valid tokens,
    and its rollout_probs_diff / IS effective sample size (weights normalised to mean 1)."""
    train, gen, mask, w = _batch(2)
    got = step_diagnostics(train, gen, mask, w)
    rows = mask.any(-1)
    tr, ge, m, ww = train[rows], gen[rows], mask[rows], w[rows]
    log_ratio = tr - ge
    mean_tr, mean_ge = _masked_mean(tr, m, -1), _masked_mean(ge, m, -1)
    lpd = mean_ge - mean_tr
    safe = log_ratio.clamp(-20, 20)
    seq_sum = (log_ratio * m).sum(-1).clamp(-20, 20)
    expect = {
        "rollout_corr_kl": _masked_mean(ge - tr, m),
        "rollout_corr_k3_kl": _masked_mean(torch.exp(safe) - safe - 1, m),
        "rollout_corr_training_ppl": torch.exp(-mean_tr).mean(),
        "rollout_corr_rollout_ppl": torch.exp(-mean_ge).mean(),
        "rollout_corr_log_ppl_diff": lpd.mean(), "rollout_corr_log_ppl_abs_diff": lpd.abs().mean(),
        "rollout_corr_log_ppl_diff_max": lpd.max(), "rollout_corr_log_ppl_diff_min": lpd.min(),
        "rollout_corr_ppl_ratio": torch.exp(lpd).mean(),
        "rollout_corr_chi2_token": _masked_mean(torch.exp(safe).square(), m) - 1,
        "rollout_corr_chi2_seq": torch.exp(2 * seq_sum).mean() - 1,
    }
    pdiff = torch.masked_select((torch.exp(ge) - torch.exp(tr)).abs(), m.bool())
    wn = ww[m] / ww[m].mean()
    pearson = torch.corrcoef(torch.stack([torch.exp(tr)[m], torch.exp(ge)[m]]))[0, 1]
    expect.update({"rollout_probs_diff_max": pdiff.max(), "rollout_probs_diff_mean": pdiff.mean(),
                   "rollout_probs_diff_std": pdiff.std(), "rollout_actor_probs_pearson_corr": pearson,
                   "rollout_corr_is_eff_sample_size": 1.0 / (wn ** 2).mean()})
    for key, value in expect.items():
        assert got[key] == pytest.approx(float(value), rel=1e-9, abs=1e-12), key


def test_matches_trl_logp_difference():
    """TRL GRPOTrainer (vLLM IS): delta = |old - sampling| on the completion mask; its mean and max."""
    train, gen, mask, w = _batch(3)
    got = step_diagnostics(train, gen, mask, w)
    delta = torch.abs(train - gen)[mask.bool()]
    assert got["logprob_abs_diff_mean"] == pytest.approx(float(delta.mean()), rel=1e-12)
    assert got["logprob_abs_diff_max"] == float(delta.max())


# --- hand-made cases ----------------------------------------------------------------------------------
def test_hand_computed_values():
    ln2 = math.log(2.0)
    gen = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    train = gen + torch.tensor([[ln2, 0.0, -ln2]], dtype=torch.float64)
    got = step_diagnostics(train, gen, torch.ones(1, 3, dtype=torch.bool))
    assert got["token_mult_prob_error"] == pytest.approx(5 / 3, rel=1e-12)  # (2 + 1 + 2) / 3
    assert got["rollout_corr_chi2_token"] == pytest.approx(0.75, rel=1e-12)  # (4 + 1 + 1/4) / 3 - 1
    assert got["gen_kl_error"] == pytest.approx(1 / 6, rel=1e-12)  # ((1 - ln2) + 0 + (ln2 - 1/2)) / 3
    assert got["rollout_corr_kl"] == pytest.approx(0.0, abs=1e-15)
    assert got["rollout_corr_chi2_seq"] == pytest.approx(0.0, abs=1e-12)  # the sequence's ratio is 2 * 1 * 1/2
    assert got["rollout_corr_is_eff_sample_size"] == 1.0  # no weights given: all 1
    assert got["logprob_abs_diff_max"] == pytest.approx(ln2, rel=1e-12)


def test_tail_fractions_are_strict_and_named_as_the_statistics_issue_reads_them():
    d = torch.tensor([[0.05, 0.1, 0.5, -1.0, 5.0, -10.0, 50.0, 0.0]], dtype=torch.float64)
    got = step_diagnostics(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool))
    assert got["logprob_abs_diff_frac_gt_0.1"] == 5 / 8  # 0.1 itself is not > 0.1
    assert got["logprob_abs_diff_frac_gt_1"] == 3 / 8
    assert got["logprob_abs_diff_frac_gt_10"] == 1 / 8
    assert got["logprob_abs_diff_max"] == 50.0
    assert got["logprob_abs_diff_mean"] == pytest.approx(66.65 / 8, rel=1e-12)
    assert C.TAIL_METRICS == ("logprob_abs_diff_frac_gt_0.1", "logprob_abs_diff_frac_gt_1",
                              "logprob_abs_diff_frac_gt_10", "logprob_abs_diff_max", "logprob_abs_diff_mean")


def test_identical_engines_and_empty_batches():
    train, _, mask, _ = _batch(4)
    same = step_diagnostics(train, train.clone(), mask)
    assert same["token_mult_prob_error"] == 1.0 and same["gen_kl_error"] == 0.0
    assert same["rollout_corr_chi2_token"] == 0.0 and same["logprob_abs_diff_max"] == 0.0
    assert same["rollout_actor_probs_pearson_corr"] == pytest.approx(1.0, rel=1e-12)
    empty = step_diagnostics(train, train, torch.zeros_like(mask))
    assert empty["num_valid_tokens"] == 0.0
    assert all(math.isnan(v) for k, v in empty.items() if k != "num_valid_tokens")


def test_broken_engine_is_visible_not_hidden():
    train, gen, mask, _ = _batch(5)
    train[0, 0] = -INF  # the trainer gives a sampled token probability 0
    got = step_diagnostics(train, gen, mask)
    assert got["token_mult_prob_error"] == INF and got["logprob_abs_diff_max"] == INF
    assert got["logprob_abs_diff_frac_gt_10"] > 0


def test_agrees_bitwise_with_the_public_token_mult_prob_error():
    train, gen, mask, _ = _batch(6)
    t32, g32 = train.float(), gen.float()
    assert step_diagnostics(t32, g32, mask)["token_mult_prob_error"] == token_mult_prob_error(t32, g32, mask)


def test_partial_sums_reduce_across_ranks_like_one_batch():
    """Split by rows (as data parallelism splits GRPO groups): summed sums + maxed maxima = the whole batch."""
    train, gen, mask, w = _batch(7, B=8)
    parts = [partial_sums(train[i:i + 3], gen[i:i + 3], mask[i:i + 3], w[i:i + 3]) for i in (0, 3, 6)]
    reduced = {k: (torch.stack([p[k] for p in parts]).max() if k.startswith("max_")
                   else torch.stack([p[k] for p in parts]).sum()) for k in parts[0]}
    whole = step_diagnostics(train, gen, mask, w)
    for key, value in finalize(reduced).items():
        if key not in C.ORDER_METRICS:  # not sums: per-rank values, combined (test_order_statistics_...)
            assert value == pytest.approx(whole[key], rel=1e-12, abs=1e-15, nan_ok=True), key


class _TwoRankMesh:
    """Plays rank 0 of two: the other rank's values are known in advance (what a collective would bring)."""

    def __init__(self, other_sums, other_max):
        self.other_sums, self.other_max = other_sums, other_max

    def all_reduce_sum(self, values):
        return values.double() + self.other_sums

    def all_reduce_max(self, values):
        return torch.maximum(values.double(), self.other_max)


def test_reduce_with_a_mesh_gives_the_whole_batch():
    train, gen, mask, w = _batch(9, B=6)
    other = partial_sums(train[4:], gen[4:], mask[4:], w[4:])
    mesh = _TwoRankMesh(torch.stack([other[k] for k in sorted(other) if not k.startswith("max_")]),
                        torch.stack([other[k] for k in sorted(other) if k.startswith("max_")]))
    got = step_diagnostics(train[:4], gen[:4], mask[:4], w[:4], reduce=C.reduce_with(mesh))
    whole = step_diagnostics(train, gen, mask, w)
    for key, value in whole.items():
        if key not in C.ORDER_METRICS:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15, nan_ok=True), key


def test_shape_errors_name_the_tensors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="must be one \\[B, T\\] shape"):
        step_diagnostics(x, x[:, :2], torch.ones(2, 3, dtype=torch.bool))


def _rank_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        train, gen, mask, w = _batch(8, B=6)
        rows = slice(0, 4) if rank == 0 else slice(4, 6)  # unequal shares, as whole GRPO groups split
        got = step_diagnostics(train[rows], gen[rows], mask[rows], w[rows], reduce=C.all_reduce_sums)
        if rank == 0:
            torch.save(got, out)
        dist.barrier()  # meet before tearing gloo down, as fp8rl_core.distributed.shutdown does
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_reduce_sums_gives_global_metrics_over_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_worker, args=(2, f"file://{tmp_path / 'store'}", str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    train, gen, mask, w = _batch(8, B=6)
    whole = step_diagnostics(train, gen, mask, w)
    for key, value in whole.items():
        if key not in C.ORDER_METRICS:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15, nan_ok=True), key


# --- issue 34: prime-rl's and miles' views ---------------------------------------------------------------
def test_matches_prime_rl_masked_and_unmasked_mismatch_kl():
    """prime-rl default_loss_fn: mismatch_kl = ratio - log ratio - 1; masked_/unmasked_mismatch_kl are its
    means over the masked / kept trainable tokens; is_masked their share; kl_loss = (log ratio)^2 (2 k2).
    The mask here is prime-rl's own DPPO rule (0.2), handed to the catalogue as zero IS weights."""
    train, gen, mask, _ = _batch(11, scale=1.0)
    adv = _advantages(11).unsqueeze(-1).expand_as(train)
    pdiff = torch.exp(train) - torch.exp(gen)
    is_masked = torch.where(adv > 0, pdiff > 0.2, pdiff < -0.2)
    w = torch.where(is_masked, 0.0, torch.exp(train - gen))
    got = step_diagnostics(train, gen, mask, w, advantages=adv)
    log_ratio = train - gen
    mismatch_kl = torch.exp(log_ratio) - log_ratio - 1
    lm = mask.bool()
    safe_mean = lambda v, m: v[m].sum() / m.sum().clamp(min=1)  # noqa: E731  (prime-rl's _safe_mean)
    assert (lm & is_masked).any() and (lm & ~is_masked).any()
    assert got["gen_kl_error_is_masked"] == pytest.approx(float(safe_mean(mismatch_kl, lm & is_masked)), rel=1e-9)
    assert got["gen_kl_error_is_kept"] == pytest.approx(float(safe_mean(mismatch_kl, lm & ~is_masked)), rel=1e-9)
    assert got["token_fraction_is_masked"] == pytest.approx(float(safe_mean(is_masked.double(), lm)), rel=1e-12)
    assert got["rollout_k2_kl"] == pytest.approx(0.5 * float(safe_mean(log_ratio ** 2, lm)), rel=1e-12)
    pos = lm & (adv > 0)
    assert got["token_mult_prob_error_adv_pos"] == pytest.approx(
        float(torch.exp(log_ratio.abs())[pos].mean()), rel=1e-12)
    assert got["logprob_abs_diff_mean_adv_neg"] == pytest.approx(float(log_ratio.abs()[lm & (adv < 0)].mean()),
                                                                 rel=1e-12)


def test_matches_miles_median_and_p95():
    """miles logprob_comparator: statistics.median(diffs), sorted_diffs[int(num * 0.95)]."""
    for seed, B in ((12, 5), (13, 8)):
        train, gen, mask, w = _batch(seed, B=B)
        diffs = [abs(float(a) - float(b)) for a, b in zip(train[mask], gen[mask])]
        got = step_diagnostics(train, gen, mask, w)
        assert got["logprob_abs_diff_median"] == pytest.approx(statistics.median(diffs), rel=1e-12)
        assert got["logprob_abs_diff_p95"] == pytest.approx(sorted(diffs)[int(len(diffs) * 0.95)], rel=1e-12)


def test_order_statistics_hand_computed():
    d = torch.arange(1.0, 21.0, dtype=torch.float64)[None]  # |d| = 1..20: n = 20
    got = step_diagnostics(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool))
    assert got["logprob_abs_diff_median"] == 10.5  # (10 + 11) / 2
    assert got["logprob_abs_diff_p95"] == 20.0  # sorted[int(19.0)]
    assert got["logprob_abs_diff_trimmed_mean_p95"] == pytest.approx(sum(range(1, 20)) / 19, rel=1e-15)  # 20 dropped
    one = step_diagnostics(d[:, :1], torch.zeros_like(d[:, :1]), torch.ones(1, 1, dtype=torch.bool))
    assert one["logprob_abs_diff_median"] == one["logprob_abs_diff_p95"] == 1.0
    assert one["logprob_abs_diff_trimmed_mean_p95"] == 1.0


def test_order_statistics_across_ranks_are_per_rank_values_combined_as_documented():
    """Not sums: token-weighted mean of each rank's median / p95; the trimmed mean pools each rank's own
    trimmed tokens. Exact for one rank; for two ranks the documented combination, not the global sort."""
    train, gen, mask, w = _batch(14, B=8)
    halves = [(slice(0, 5)), (slice(5, 8))]
    parts = [partial_sums(train[r], gen[r], mask[r], w[r]) for r in halves]
    reduced = {k: (torch.stack([p[k] for p in parts]).max() if k.startswith("max_")
                   else torch.stack([p[k] for p in parts]).sum()) for k in parts[0]}
    got = finalize(reduced)
    per = [step_diagnostics(train[r], gen[r], mask[r], w[r]) for r in halves]
    n = [p["num_valid_tokens"] for p in per]
    for key in ("logprob_abs_diff_median", "logprob_abs_diff_p95"):
        assert got[key] == pytest.approx((per[0][key] * n[0] + per[1][key] * n[1]) / (n[0] + n[1]), rel=1e-12)
    k = [m - math.floor(0.05 * m) for m in n]
    trimmed = (per[0]["logprob_abs_diff_trimmed_mean_p95"] * k[0] + per[1]["logprob_abs_diff_trimmed_mean_p95"] * k[1])
    assert got["logprob_abs_diff_trimmed_mean_p95"] == pytest.approx(trimmed / sum(k), rel=1e-12)


def test_advantages_per_token_or_per_sequence_and_missing():
    train, gen, mask, w = _batch(15)
    adv = _advantages(15)
    per_seq = step_diagnostics(train, gen, mask, w, advantages=adv)
    per_tok = step_diagnostics(train, gen, mask, w, advantages=adv[:, None].expand_as(train))
    assert {k: v for k, v in per_seq.items() if v == v} == {k: v for k, v in per_tok.items() if v == v}
    none = step_diagnostics(train, gen, mask, w)
    assert math.isnan(none["token_fraction_adv_pos"]) and math.isnan(none["token_mult_prob_error_adv_neg"])
    assert none["token_mult_prob_error_is_kept"] == none["token_mult_prob_error"]  # no weight is 0 here
    with pytest.raises(ValueError, match="advantages has shape"):
        step_diagnostics(train, gen, mask, w, advantages=adv[:3])
