"""Micro-batches (train.micro_batch_size, train.logprob_batch_size) give the unsplit step within
tolerance: each micro-batch contributes (its token sum) / (the step's global token count)."""
from __future__ import annotations

import pytest
import torch
from _workers import B, train_step

from fp8rl_core.distributed import SINGLE
from fp8rl_core.engines.native_train import row_chunks

# FP32 compute: reassociation of the gradient sum only. BF16 compute: every CPU matmul rounds its output
# to BF16, and a micro-batch's weight-gradient GEMM is rounded before the accumulation (~2^-8 relative).
UPDATE_RTOL = {"fp32": 1e-4, "bf16": 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """As one rank runs: a single intra-op thread (and no oversubscription of a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def whole(one_thread):
    return {c: train_step(SINGLE, compute=c) for c in ("fp32", "bf16")}


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
@pytest.mark.parametrize("mbs", [1, 4, B])
def test_micro_batches_equal_the_whole_batch(whole, compute, mbs):
    ref = whole[compute]
    r = train_step(SINGLE, compute=compute, micro_batch_size=mbs, logprob_batch_size=3)
    assert torch.equal(r["old_logprobs"], ref["old_logprobs"])  # rows are independent in the forward
    assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-6  # FP32 loss ~0.15, a few ulps
    assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4)
    for key in ("clip_fraction", "ratio_mean", "entropy", "pg_loss"):
        assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
    assert max(_rel(r["delta"][k], ref["delta"][k]) for k in ref["delta"]) <= UPDATE_RTOL[compute]


def test_per_micro_batch_normalization_would_fail(whole):
    """Negative control: normalizing each micro-batch by its own token count (then averaging) is another
    estimator; with unequal lengths its loss is far outside the tolerance above."""
    from fp8rl_core.algorithms import grpo

    ref = whole["fp32"]
    batch_old, m = ref["old_logprobs"], ref["old_logprobs"] != 0
    from _workers import global_batch

    b = global_batch()
    means = [float(grpo.policy_loss(batch_old[i:i + 1], batch_old[i:i + 1], b.advantages[i:i + 1], m[i:i + 1],
                                    ref["is_weights"][i:i + 1])[0]) for i in range(B)]
    assert abs(sum(means) / B - ref["metrics"]["loss"]) > 1e-3


def test_row_chunks_cover_the_batch_once():
    assert row_chunks(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert row_chunks(5, 0) == row_chunks(5, 5) == row_chunks(5, 9) == [slice(0, 5)]


def test_fp8_micro_batches_on_block_boundaries_equal_the_whole_batch(one_thread):
    """fp8_e2e: the weight gradient quantizes activations and gradients in blocks of 128 TOKENS, so a
    micro-batch of 2 rows x T=64 keeps the whole batch's blocks (a 1-row micro-batch would regroup
    them: a different, equally valid FP8 rounding); then only BF16/FP32 rounding remains."""
    ref = train_step(SINGLE, recipe="fp8_e2e")
    r = train_step(SINGLE, recipe="fp8_e2e", micro_batch_size=2)
    assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-6
    assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4)
    assert max(_rel(r["delta"][k], ref["delta"][k]) for k in ref["delta"]) <= UPDATE_RTOL["bf16"]
