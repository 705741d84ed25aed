"""One training step on the same global batch agrees across world sizes, micro-batch sizes and the
old-log-prob reuse path (real gloo ranks; tolerances in FP32/BF16 units, explained per constant).

What is bit-identical and what is not (the tiny model, 1 thread per rank, this CPU):
- the old log-probs of every row are the same bits at W = 1, 2, 4 (a row's forward does not depend
  on the other rows of its batch here), hence token_mult_prob_error and the IS statistics agree to
  float64 summation order (1e-12 relative);
- the loss (a sum of per-token terms over the global token count) agrees to FP32 summation order;
- gradients are summed over ranks (reduce-scatter) instead of inside one GEMM: FP32 reassociation
  (~1e-7 relative) with FP32 compute, but with BF16 compute on the CPU every matmul rounds its output
  to BF16, so each rank's weight-gradient partial sum is rounded before the cross-rank sum (~2^-8).
"""
from __future__ import annotations

import pytest
import torch
from _ranks import run_ranks
from _workers import parity_suite, train_cases

LOSS_ATOL = 1e-6  # FP32 loss of magnitude ~0.15: a few ulps of reassociation (seen: 6e-8)
GRAD_NORM_RTOL = 1e-4  # BF16 compute, global norm over all shards (seen: 1.4e-5; FP32 compute 1e-7)
STATS_RTOL = 1e-12  # float64 sums of identical per-token values in another order
UPDATE_RTOL = {"fp32": 1e-4, "bf16": 2e-2,  # ||dW_W - dW_1|| / ||dW_1|| per tensor (seen: 1e-5, 7e-3)
               # FP8 wgrad with FP32 compute: its [128, 1] blocks along tokens hold other tokens at W = 2
               # (each rank's rows, in chunks of 3) than at W = 1: quantization noise, seen 2.4e-2
               "fp8": 5e-2}
UPDATE_KEY = {6: "fp8", 7: "fp8"}

CASES = [dict(recipe="bf16", compute="bf16"), dict(recipe="fp8_e2e", compute="bf16"),
         dict(recipe="bf16", compute="fp32"), dict(recipe="bf16", compute="bf16", reuse=True),
         dict(recipe="bf16", compute="fp32", micro_batch_size=3, logprob_batch_size=3, cpu_offload=True,
              activation_checkpointing=True),
         # fewer collectives: one reduce-scatter per step, weights kept gathered from forward to backward
         dict(recipe="bf16", compute="fp32", micro_batch_size=3, logprob_batch_size=3, grad_reduce="step",
              reshard_after_forward=False),
         # the same with FP8 training: Q(W) cached for the step (the weights stay gathered anyway), and
         # its reference without the cache
         dict(recipe="fp8_e2e", compute="fp32", micro_batch_size=3, logprob_batch_size=3, grad_reduce="step",
              reshard_after_forward=False),
         dict(recipe="fp8_e2e", compute="fp32", micro_batch_size=3, logprob_batch_size=3, grad_reduce="step",
              reshard_after_forward=False, weight_cache=False)]
REF_CASE = {4: 2}  # a case compared against another's single-process result: offload + AC + micro-batches vs fp32


@pytest.fixture(scope="module")
def suites():
    """{W: per-rank parity_suite results} for W = 1 and 2 (every case)."""
    return {w: run_ranks(w, parity_suite, CASES) for w in (1, 2)}


@pytest.fixture(scope="module")
def by_world(suites):
    """{W: [rank-0 result per case]}."""
    return {w: s[0]["train"] for w, s in suites.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def assert_same_step(r, ref, compute: str) -> None:
    assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) <= LOSS_ATOL
    assert abs(r["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"]) <= GRAD_NORM_RTOL * ref["metrics"]["grad_norm"]
    for key in ("clip_fraction", "ratio_mean", "entropy"):  # token-weighted over the global batch
        assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
    for key, value in ref["stats"].items():
        assert r["stats"][key] == pytest.approx(value, rel=STATS_RTOL, abs=1e-12), key
    worst = max(_rel(r["delta"][k], ref["delta"][k]) for k in ref["delta"])
    assert worst <= UPDATE_RTOL[compute]


IDS = ["bf16", "fp8_e2e", "bf16-fp32compute", "bf16-reuse", "fp32compute-offload-ac-microbatch",
       "fp32compute-microbatch-reduce-per-step-no-reshard", "fp8-fp32compute-microbatch-reduce-per-step-no-reshard",
       "fp8-fp32compute-microbatch-reduce-per-step-no-reshard-no-weight-cache"]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_world_size_2_equals_1(by_world, case):
    ref = by_world[1][REF_CASE.get(case, case)]
    assert_same_step(by_world[2][case], ref, UPDATE_KEY.get(case, CASES[case]["compute"]))
    assert by_world[2][case]["refit_equal"]  # refit from shards, one gathered tensor at a time


def test_reduce_per_step_and_no_reshard_cut_the_collectives(by_world):
    """Same micro-batches (4 rows per rank in chunks of 3: 2 chunks): grad_reduce "step" reduce-scatters
    once per FSDP group instead of once per group and chunk; reshard_after_forward False gathers each
    group once per step (in the log-prob pass, kept to the last chunk's backward), where the defaults
    gather it once per log-prob chunk and twice per training chunk (forward, and again for backward)."""
    per_mb, per_step = by_world[2][4]["collectives"], by_world[2][5]["collectives"]
    groups = per_step["reduce_scatter_single"]
    assert groups >= 2 and per_mb["reduce_scatter_single"] == 2 * groups
    assert per_step["all_gather_single"] == groups
    assert per_mb["all_gather_single"] > 2 * groups
    assert by_world[1][5]["collectives"] == {}  # one process: no collective at all


def test_unresharded_fp8_layers_quantize_each_weight_once_per_step(by_world):
    """reshard_after_forward False: every Fp8Linear's Q(W) is computed once in the step (2 micro-batches:
    the per-forward quantization of resharded layers would do it twice), and a single process's cache
    does the same."""
    for w in (1, 2):
        r = by_world[w][6]
        assert r["fp8_layers"] > 0 and r["weight_quants"] == r["fp8_layers"], (w, r["weight_quants"])
    assert by_world[2][7]["weight_quants"] > by_world[2][6]["weight_quants"]  # the reference: per forward
    for key, delta in by_world[2][7]["delta"].items():  # same bits with and without the cache
        assert torch.equal(by_world[2][6]["delta"][key], delta), key


def test_offload_checkpointing_micro_batches_alone_equal_the_plain_step(by_world):
    assert_same_step(by_world[1][4], by_world[1][2], "fp32")


@pytest.mark.slow  # 4 processes: ~1 min on a loaded 2-core machine
def test_world_size_4_equals_1(by_world):
    r4 = run_ranks(4, train_cases, CASES[:1])[0][0]
    assert_same_step(r4, by_world[1][0], "bf16")
    assert r4["local_param_numel"] <= 0.3 * by_world[1][0]["local_param_numel"]


def test_global_loss_is_not_a_mean_of_rank_means(by_world):
    """Negative control: ranks hold unequal token counts, so the per-rank-means estimator is far off
    (the test above could tell them apart by > 1000 x its tolerance)."""
    ref = by_world[1][0]["metrics"]["loss"]
    assert abs(by_world[2][0]["mean_of_means"] - ref) > 1000 * LOSS_ATOL
    assert by_world[1][0]["mean_of_means"] == pytest.approx(ref, abs=LOSS_ATOL)


def test_optimizer_and_parameters_are_sharded(suites):
    full = suites[1][0]["train"][0]["local_param_numel"]
    for rank in suites[2]:  # dim-0 shards: half each, up to padding
        assert rank["train"][0]["local_param_numel"] <= 0.55 * full


def test_reference_policy_is_frozen_bf16_and_sharded(suites):
    """kl_coef > 0: BF16 weights, no gradients, FSDP shards at W = 2, and the same log-probs per row."""
    one, two = suites[1][0]["reference"], [r["reference"] for r in suites[2]]
    assert one["dtypes"] == {torch.bfloat16} and not one["requires_grad"]
    assert all(r["local_param_numel"] <= 0.55 * one["local_param_numel"] for r in two)
    lp2 = torch.cat([r["logprobs"] for r in two])  # rank r holds rows [r B/2, (r+1) B/2)
    assert torch.allclose(lp2, one["logprobs"], rtol=0, atol=1e-5)  # same BF16 forward per row (seen: equal)


def test_reuse_equals_two_pass(by_world):
    """micro_steps 1: the step that takes its old log-probs from its own forward is the two-pass step."""
    two, one = by_world[1][0], by_world[1][3]
    assert torch.equal(one["old_logprobs"], two["old_logprobs"])  # same forward, same bits (seen on this CPU)
    assert torch.equal(one["is_weights"], two["is_weights"])
    assert one["metrics"]["loss"] == two["metrics"]["loss"]
    assert one["metrics"]["grad_norm"] == pytest.approx(two["metrics"]["grad_norm"], rel=1e-6)
    assert max(_rel(one["delta"][k], two["delta"][k]) for k in two["delta"]) <= 1e-6
