"""Per-rank bodies of the scale-out tests: one GRPO training step on a slice of a fixed global batch."""
from __future__ import annotations

import collections
import contextlib

import torch

from fp8rl_core.algorithms import grpo
from fp8rl_core.algorithms.importance import compute_importance
from fp8rl_core.config import LossSpec, OptimSpec
from fp8rl_core.config.recipe import RECIPES
from fp8rl_core.engines.base import TrainBatch
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.loop.step import _global_stats
from fp8rl_core.model import ModelConfig, build_model

CFG = ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)  # one 128-wide FP8 block per hidden row
B, T, PROMPT = 8, 64, 4  # T * 2 rows = 128 tokens: FP8 wgrad blocks (128 tokens) align at W = 1, 2, 4
LENGTHS = [60, 12, 33, 60, 5, 47, 21, 58]  # response tokens per row: unequal token counts across ranks
# AdamW with a large eps is SGD-like on the first step (update ~ lr * g), so the weight update shows the
# gradient itself, scale included (with the default eps it would be ~lr * sign(g), blind to scale).
OPTIM = OptimSpec(lr=1e-2, eps=1.0, grad_clip=0.0)
LOSS = LossSpec(importance_sampling="tis")


def global_batch(seed: int = 3) -> TrainBatch:
    """B right-padded rows of one length T: PROMPT prompt tokens, LENGTHS response tokens, gen log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size, (B, T), generator=g)
    pos = torch.arange(T)
    n = torch.tensor(LENGTHS)
    attn = pos[None] < PROMPT + n[:, None]
    resp = attn & (pos[None] >= PROMPT)
    ids = torch.where(attn, ids, torch.zeros_like(ids))
    adv = torch.linspace(-1.0, 1.2, B)[:, None] * resp
    gen = torch.where(resp, -torch.rand(B, T, generator=g) * 3.0 - 2.0, torch.zeros(B, T))
    return TrainBatch(ids, attn, resp, advantages=adv.contiguous(), gen_logprobs=gen)


def _importance(b: TrainBatch) -> torch.Tensor:
    return compute_importance(b.old_logprobs, b.gen_logprobs, b.response_mask, "tis").weights


def _full_weights(engine: NativeTrainingEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.weights().items()}


@contextlib.contextmanager
def count_collectives():
    """{name: calls} of FSDP2's all-gathers and reduce-scatters inside the block (they go through
    torch.distributed.all_gather_single / reduce_scatter_single, looked up at call time)."""
    import torch.distributed as dist

    calls: collections.Counter = collections.Counter()
    saved = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def counted(name):
        def call(*args, **kw):
            calls[name] += 1
            return saved[name](*args, **kw)
        return call

    for name in saved:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def count_weight_quantizations():
    """[calls] of Fp8Linear's Q(W) (fp8rl_core.fp8.linear.quantize_weight) inside the block."""
    from fp8rl_core.fp8 import linear

    calls, saved = [0], linear.quantize_weight

    def counted(*args, **kw):
        calls[0] += 1
        return saved(*args, **kw)

    linear.quantize_weight = counted
    try:
        yield calls
    finally:
        linear.quantize_weight = saved


def train_step(mesh, recipe: str = "bf16", compute: str = "bf16", micro_batch_size: int = 0,
               logprob_batch_size: int = 0, reuse: bool = False, cpu_offload: bool = False,
               activation_checkpointing: bool = False, grad_reduce: str = "micro_batch",
               reshard_after_forward: bool = True, weight_cache: bool = True) -> dict:
    """This rank's rows of global_batch(), one engine step; returns global metrics and the weight update.
    weight_cache False: every Fp8Linear quantizes its weight at every forward (the reference)."""
    torch.manual_seed(0)
    engine = NativeTrainingEngine(build_model(CFG), recipe=RECIPES[recipe], loss=LOSS, optim=OPTIM,
                                  compute_dtype=torch.bfloat16 if compute == "bf16" else torch.float32,
                                  mesh=mesh, micro_batch_size=micro_batch_size, logprob_batch_size=logprob_batch_size,
                                  cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing,
                                  grad_reduce=grad_reduce, reshard_after_forward=reshard_after_forward)
    for name in engine.fp8_modules if not weight_cache else ():
        engine.model.get_submodule(name).cache_weight = False
    rows = torch.tensor(list(mesh.shard(B, "rows")))
    batch = global_batch().select(rows)
    before = _full_weights(engine)
    # counted over the whole step: the log-prob pass (when not reused) and training
    with count_weight_quantizations() as quants, count_collectives() as calls:
        if not reuse:
            batch.old_logprobs = engine.logprobs(batch)
            batch.is_weights = _importance(batch)
        result = engine.train_step(batch, importance=_importance if reuse else None)
    metrics, old = result.metrics, result.old_logprobs
    isw = compute_importance(old, batch.gen_logprobs, batch.response_mask, "tis")
    rewards = rows[:, None].float() * torch.tensor([[1.0, 0.5]])  # [rows, G=2]: global rows' own values
    stats = _global_stats(mesh, rewards, old, batch.gen_logprobs, batch.response_mask, isw)
    # the wrong estimator, for the negative control: the mean over ranks of per-rank token means
    local_mean, _ = grpo.policy_loss(old, old, batch.advantages, batch.response_mask, result.is_weights)
    mean_of_means = float(mesh.all_reduce_sum([float(local_mean)])[0]) / mesh.world_size
    after = _full_weights(engine)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in engine.params)
    refit_equal = _refit_from_shards_is_exact(engine)
    return {"metrics": metrics, "stats": stats, "delta": {k: after[k] - before[k] for k in after},
            "old_logprobs": old, "is_weights": result.is_weights, "rows": rows,
            "mean_of_means": mean_of_means, "local_param_numel": local, "refit_equal": refit_equal,
            "collectives": dict(calls), "weight_quants": quants[0], "fp8_layers": len(engine.fp8_modules)}


def _refit_from_shards_is_exact(engine: NativeTrainingEngine) -> bool:
    """A generation engine refit from engine.weights() (gathered one tensor per read when sharded)
    holds exactly the weights of one refit from a materialized full state dict."""
    from fp8rl_core.distributed import parallel
    from fp8rl_core.engines.native_gen import NativeGenerationEngine

    full = _full_weights(engine)
    lazy, eager = (NativeGenerationEngine(CFG, dtype=torch.float32) for _ in range(2))
    gathers, gather = [], parallel.full_tensor
    parallel.full_tensor = lambda t: (gathers.append(1), gather(t))[1]  # count the refit's all-gathers
    try:
        weights = engine.weights()
        lazy.refit(weights)
    finally:
        parallel.full_tensor = gather
    eager.refit(full)
    ids = global_batch().input_ids[:2, :16]
    once = not engine.mesh.distributed or 0 < len(gathers) <= len(weights)  # one all-gather per tensor, not two
    return bool(torch.equal(lazy.logits(ids), eager.logits(ids))) and once


def train_cases(mesh, cases: list[dict]) -> list[dict]:
    """train_step for each case (keyword dicts) in one process: one spawn serves many comparisons."""
    return [train_step(mesh, **case) for case in cases]


def reference_logprobs(mesh) -> dict:
    """The frozen reference policy (kl_coef > 0) on this rank's rows: its log-probs and what it holds."""
    from fp8rl_core.engines.native_train import ReferencePolicy

    torch.manual_seed(0)
    model = build_model(CFG, dtype=torch.bfloat16)
    ref = ReferencePolicy(model, device="cpu", temperature=1.0, compute_dtype=torch.bfloat16, mesh=mesh,
                          logprob_batch_size=3)
    rows = torch.tensor(list(mesh.shard(B, "rows")))
    lp = ref.logprobs(global_batch().select(rows))
    params = list(ref.model.parameters())
    return {"logprobs": lp, "dtypes": {p.dtype for p in params}, "requires_grad": any(p.requires_grad for p in params),
            "local_param_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)}


def parity_suite(mesh, cases: list[dict]) -> dict:
    """Everything the parity tests compare, in one spawn per world size."""
    return {"train": train_cases(mesh, cases), "reference": reference_logprobs(mesh)}


def stuck_peer(mesh, flag: str) -> str:
    """Rank 1 never joins the collective (it waits for rank 0's flag file); rank 0 must fail with the
    collective timeout instead of waiting for it. Returns what each rank saw."""
    import time
    from pathlib import Path

    if mesh.rank == 1:
        for _ in range(1200):  # at most 120 s, then give up (rank 0 then fails anyway, differently)
            if Path(flag).exists():
                return "released"
            time.sleep(0.1)
        return "gave up"
    try:
        mesh.all_reduce_sum([1.0])
        return "no error"
    except RuntimeError as e:
        return f"error: {e}"
    finally:
        Path(flag).touch()
