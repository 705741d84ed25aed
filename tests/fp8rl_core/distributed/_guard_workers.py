"""Per-rank body of the mismatch-guard tests on real ranks: one guarded step on this rank's rows of the fixed
global batch of _workers, with gen log-probs `gap[row]` below the training engine's on every response token."""
from __future__ import annotations

import torch
from _workers import CFG, B, _full_weights, _importance, global_batch

from fp8rl_core.algorithms.metrics import token_mult_prob_error
from fp8rl_core.config import LossSpec, MismatchGuardSpec, OptimSpec
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.model import build_model

GUARD_METRICS = ("guard_skipped", "guard_masked_fraction", "guard_mismatch", "guard_sequence_mismatch_max",
                 "guard_skip_mismatch", "guard_skip_grad_norm", "guard_skip_all_masked", "grad_norm", "loss")


def guarded_step(mesh, guard: dict, gap: list[float], micro_batch_size: int = 0) -> dict:
    """One reuse-path step (old log-probs from the training forward) under MismatchGuardSpec(**guard).
    Returns the guard's metrics, this rank's own (local) mismatch and whether the weights changed."""
    assert len(gap) == B
    torch.manual_seed(0)
    engine = NativeTrainingEngine(build_model(CFG), loss=LossSpec(importance_sampling="tis"),
                                  optim=OptimSpec(lr=1e-2, grad_clip=1.0), compute_dtype=torch.float32, mesh=mesh,
                                  micro_batch_size=micro_batch_size, guard=MismatchGuardSpec(**guard))
    rows = torch.tensor(list(mesh.shard(B, "rows")))
    batch = global_batch().select(rows)
    now = engine.logprobs(batch)
    m = batch.response_mask
    batch.gen_logprobs = torch.where(m, now - torch.tensor(gap)[rows][:, None], torch.zeros_like(now))
    before = _full_weights(engine)
    result = engine.train_step(batch, importance=_importance)
    metrics = result.metrics
    after = _full_weights(engine)
    return {"metrics": {k: metrics[k] for k in GUARD_METRICS}, "step": engine.step,
            "changed": any(not torch.equal(before[k], after[k]) for k in before),
            "local_mismatch": token_mult_prob_error(result.old_logprobs, batch.gen_logprobs, m)}


def guarded_cases(mesh, cases: list[dict]) -> list[dict]:
    """guarded_step for each case (keyword dicts) in one process: one spawn serves every case."""
    return [guarded_step(mesh, **case) for case in cases]
