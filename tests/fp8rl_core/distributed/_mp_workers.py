"""Rank workers of test_mixed_precision.py (spawned: they live in an importable module)."""
from __future__ import annotations

import torch
from _workers import CFG, LOSS, OPTIM, global_batch

from fp8rl_core.config.recipe import RECIPES
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.model import build_model


def gathered_dtypes_and_logprobs(mesh, mixed_precision: str) -> dict:
    """One engine on this rank's rows: the dtypes its linears see in forward (FSDP2's gathered
    parameters), its shards' and gradients' dtypes, and the no-grad log-probs of its rows."""
    torch.manual_seed(0)
    engine = NativeTrainingEngine(build_model(CFG), recipe=RECIPES["bf16"], loss=LOSS, optim=OPTIM,
                                  compute_dtype=torch.bfloat16, mesh=mesh, mixed_precision=mixed_precision)
    seen: set[str] = set()
    for m in engine.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.add(str(mod.weight.dtype)))
    batch = global_batch().select(torch.tensor(list(mesh.shard(8, "rows"))))
    old = engine.logprobs(batch)
    batch.old_logprobs, batch.is_weights = old, torch.ones_like(old)
    engine.train_step(batch)
    shards = {str(p.dtype) for p in engine.params}
    return {"gathered": sorted(seen), "shards": sorted(shards), "old_logprobs": old}
