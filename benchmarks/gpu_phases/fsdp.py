"""Phase 5: FSDP2 on a one-rank mesh against the unsharded engine, and a DCP save + load.

A process group of one rank (NCCL for the device mesh, gloo for the scalar reductions, as
fp8rl_core/distributed/env.py joins it; --cpu: gloo alone) and a 1-D DeviceMesh over it. The native
training engine shards only when its Mesh says `distributed` (world size > 1), so the check hands it a
Mesh that says so at world size 1: the engine then takes its sharded path for real (fully_shard per block
and the root, DTensor parameters, global token counts all-reduced, GatheredWeights), on one rank.
Per recipe in (bf16, fp8_e2e), on models.block_model (8 layers at hidden 1024; --cpu: 2 at 256), one
synthetic right-padded batch, same initial weights:
  FSDP2 vs unsharded   log-probs (max abs diff), loss (relative) and every gradient (|g_s - g| / |g| in the
                       Frobenius norm, the largest over parameters: a BF16 rounding flipped by a 1-ulp FP32
                       difference must not count as a failure) of one train_step; `fail` past the tolerance
                       (GPU BF16 1e-2; --cpu, FP32 compute, 1e-5), the numbers in the note.
  DCP save + load      the sharded engine after its step saved with fp8rl_core.io.checkpoint.save_checkpoint
                       (atomic DCP folder), loaded into a fresh sharded engine and into a fresh unsharded one
                       (DCP reshards DTensor -> plain tensors): weights bit-identical; then two more steps on
                       each: the log-probs after them, which depend on the restored AdamW moments, equal the
                       original's (bit-identical sharded, within the tolerance unsharded).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from gpu_phases import models
from gpu_phases.common import Run, row

PHASE = "fsdp"


def run(run: Run) -> None:
    import torch.distributed as dist

    state: dict = {}
    run.case(PHASE, "one-rank process group", lambda: group_rows(run, state))
    if "mesh" not in state:
        return
    try:
        for recipe in ("bf16", "fp8_e2e"):
            run.case(PHASE, f"FSDP2 vs unsharded [{recipe}]", lambda r=recipe: compare_rows(run, state, r))
            run.case(PHASE, f"DCP save + load [{recipe}]", lambda r=recipe: dcp_rows(run, state, r))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def one_rank_mesh(device_mesh):
    """A Mesh of world size 1 whose `distributed` is True: the engine's sharded path on one rank."""
    from fp8rl_core.distributed.mesh import Mesh

    @dataclass(frozen=True)
    class OneRankMesh(Mesh):
        @property
        def distributed(self) -> bool:
            return True

    return OneRankMesh(world_size=1, rank=0, local_rank=0, device_mesh=device_mesh)


def group_rows(run: Run, state: dict) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fp8rl_core.io.ports import free_port

    t0 = time.perf_counter()
    backend = "gloo" if run.cpu else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    state["mesh"] = one_rank_mesh(init_device_mesh(run.device.type, (1,), mesh_dim_names=("dp",)))
    return [row(PHASE, "one-rank process group", time_ms=(time.perf_counter() - t0) * 1e3,
                note=f"backend {dist.get_backend()}, DeviceMesh on {run.device.type}")]


def engines(run: Run, state: dict, recipe: str, seed: int = 0):
    """(unsharded, sharded) native training engines on the same random weights; the config and batch."""
    import torch

    from fp8rl_core.config import recipe_of, run_config_from_dict
    from fp8rl_core.distributed.mesh import SINGLE
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.model import build_model

    cfg = run_config_from_dict({"recipe": recipe})
    torch.manual_seed(seed)
    model = build_model(models.block_model(run.cpu)).to(run.device)
    dtype = torch.float32 if run.cpu else torch.bfloat16
    kw = dict(recipe=recipe_of(cfg), loss=cfg.loss, optim=cfg.optim, temperature=1.0, compute_dtype=dtype)
    plain = NativeTrainingEngine(copy.deepcopy(model), mesh=SINGLE, **kw)
    sharded = NativeTrainingEngine(model, mesh=state["mesh"], **kw)
    return plain, sharded


def batch(run: Run, vocab: int, seed: int = 1):
    """B right-padded sequences (prompt, then responses of varied lengths) with +-1 advantages."""
    import torch

    from fp8rl_core.engines.base import TrainBatch

    b, t, prompt = (4, 12, 4) if run.cpu else (8, 256, 32)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    lengths = torch.randint(t // 4, t - prompt + 1, (b,), generator=g)
    pos = torch.arange(t)
    attn = pos[None] < prompt + lengths[:, None]
    resp = attn & (pos[None] >= prompt)
    adv = (torch.arange(b) % 2 * 2.0 - 1.0)[:, None].expand(b, t) * resp
    dev = run.device
    return TrainBatch(torch.where(attn, ids, 0).to(dev), attn.to(dev), resp.to(dev),
                      advantages=adv.contiguous().to(dev))


def step_with_grads(engine, b) -> tuple[dict, dict]:
    """train_step's metrics and the gradients it stepped with (full tensors, by parameter name)."""
    grads: dict = {}
    step = engine.optimizer.step

    def capture(*a, **k):
        for name, p in engine.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().float().clone()
        return step(*a, **k)

    engine.optimizer.step = capture
    try:
        return engine.train_step(b).metrics, grads
    finally:
        engine.optimizer.step = step


def compare_rows(run: Run, state: dict, recipe: str) -> list[dict]:
    plain, sharded = engines(run, state, recipe)
    b = batch(run, models.block_model(run.cpu).vocab_size)
    lp_p, lp_s = plain.logprobs(b), sharded.logprobs(b)
    lp_diff = float((lp_p - lp_s).abs().max())
    t0 = time.perf_counter()
    m_p, g_p = step_with_grads(plain, b)
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    m_s, g_s = step_with_grads(sharded, b)
    t_sharded = time.perf_counter() - t0
    loss_diff = abs(m_p["loss"] - m_s["loss"]) / max(abs(m_p["loss"]), 1e-12)
    grad_diff = max(float((g_s[k] - g).norm() / g.norm().clamp_min(1e-30)) for k, g in g_p.items())
    tol = 1e-5 if run.cpu else 1e-2
    worst = max(lp_diff, loss_diff, grad_diff)
    state[recipe] = (sharded, b, m_s)
    return [row(PHASE, f"FSDP2 vs unsharded [{recipe}]", "ok" if worst <= tol else "fail", time_ms=t_sharded * 1e3,
                ratio=t_sharded / t_plain, max_rel_diff=worst,
                note=f"log-probs {lp_diff:.1e}, loss {loss_diff:.1e}, grads {grad_diff:.1e} (tolerance {tol:g}); "
                     f"train_step {t_sharded * 1e3:.0f} ms sharded vs {t_plain * 1e3:.0f} ms",
                data={"logprobs": lp_diff, "loss": loss_diff, "grads": grad_diff, "plain": m_p, "sharded": m_s})]


def dcp_rows(run: Run, state: dict, recipe: str) -> list[dict]:
    import torch

    from fp8rl_core.io.checkpoint import EngineState, load_checkpoint, save_checkpoint

    if recipe not in state:
        return [row(PHASE, f"DCP save + load [{recipe}]", "skipped", note="the comparison above did not finish")]
    sharded, b, _ = state.pop(recipe)
    t0 = time.perf_counter()
    path = save_checkpoint(run.work / f"dcp-{recipe}", 1, {"train": EngineState(sharded)}, {"rank": 0})
    t_save = time.perf_counter() - t0
    want = {k: v.detach().clone() for k, v in sharded.weights().items()}
    fresh_plain, fresh_sharded = engines(run, state, recipe, seed=1)  # other weights: the load must overwrite them
    t0 = time.perf_counter()
    for engine in (fresh_sharded, fresh_plain):
        load_checkpoint(path, {"train": EngineState(engine)})
    t_load = (time.perf_counter() - t0) / 2
    bad = [f"{name} {k}" for name, e in (("sharded", fresh_sharded), ("unsharded", fresh_plain))
           for k, v in e.weights().items() if not torch.equal(v, want[k])]
    after = {name: two_steps(e, b) for name, e in
             (("original", sharded), ("sharded", fresh_sharded), ("unsharded", fresh_plain))}
    diffs = {name: float((lp - after["original"]).abs().max()) for name, lp in after.items() if name != "original"}
    tol = 1e-5 if run.cpu else 1e-2
    ok = not bad and diffs["sharded"] == 0 and diffs["unsharded"] <= tol
    note = (f"save {t_save:.2f} s, load {t_load:.2f} s; weights bit-identical after load (sharded and unsharded)"
            if not bad else f"weights differ after load: {', '.join(bad[:4])}")
    note += (f"; log-probs after two more steps vs the original's: sharded {diffs['sharded']:.1e} (must be 0), "
             f"unsharded {diffs['unsharded']:.1e} (tolerance {tol:g})")
    return [row(PHASE, f"DCP save + load [{recipe}]", "ok" if ok else "fail", time_ms=(t_save + t_load) * 1e3,
                max_rel_diff=max(diffs.values()), note=note,
                data={"save_s": t_save, "load_s": t_load, "logprob_diffs": diffs, "path": str(path)})]


def two_steps(engine, b):
    """Log-probs of `b` after two more train_steps: the second update uses the AdamW moments of the first
    and of the restored state, so they differ unless the optimizer state came back too. (The on-policy
    loss itself is -sum(A)/n whatever the weights: no use here.)"""
    engine.train_step(b)
    engine.train_step(b)
    return engine.logprobs(b)
