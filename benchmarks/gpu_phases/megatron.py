"""Phase 6: Megatron-Core BF16 training (local layer spec) against the native engine.

Needs megatron-core (the lent GPU machine has none: carry its wheel, benchmarks/README.md); without it one
`skipped` row says "not installed". Transformer Engine is not needed: without it the engine builds
Megatron's local spec (torch RMSNorm, ColumnParallelLinear, DotProductAttention), which runs BF16 only, so
FP8 training through TE is not part of this check.
On a GPU: MegatronTrainingEngine(path) exactly as a run builds it (engines.training=megatron, recipe bf16)
on a random-init models.block_model checkpoint, against NativeTrainingEngine on the same checkpoint; one
synthetic batch: log-probs (max abs diff on response tokens), then one train_step each (loss and
grad_norm, relative), then a second step timed (`x baseline` = Megatron's step / native's). The kernels
differ (fused QKV and gate/up GEMMs), so the tolerances are BF16's: 0.05 on log-probs, 5e-2 relative.
--cpu: the same comparison in FP32 through MegatronTrainingEngine.from_gpt_model on a CPU GPTModel, with
the two CUDA-only calls of Megatron's local spec stubbed for the duration (RoPE's current_device and
attention's CUDA RNG tracker, as tests/fp8rl_core/engines/test_megatron_train.py does); tolerances 2e-5
on log-probs and 1e-5 relative.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from gpu_phases import models
from gpu_phases.common import Run, installed, row
from gpu_phases.fsdp import batch

PHASE = "megatron"


def run(run: Run) -> None:
    if not installed("megatron.core"):
        run.report.add([row(PHASE, "Megatron-Core BF16 vs native", "skipped",
                            note="not installed: megatron-core (carry its wheel in .whl/: benchmarks/README.md)")])
        return
    run.case(PHASE, "Megatron-Core BF16 vs native", lambda: compare_rows(run))


class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """One gloo rank, Megatron's parallel state, and its two CUDA-only calls stubbed until the block ends."""
    import warnings

    import torch
    import torch.distributed as dist

    from fp8rl_core.engines.megatron_train import init_distributed, init_model_parallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state, tensor_parallel
    saved = torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker
    init_distributed("gloo")
    init_model_parallel(seed=0)
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoRngTracker()
    try:
        yield
    finally:
        torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker = saved
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def megatron_on_gpu() -> Iterator[None]:
    import torch.distributed as dist

    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def build(run: Run):
    """(megatron engine, native engine) on the same random-init weights."""
    import warnings

    import torch

    from fp8rl_core.config import recipe_of, run_config_from_dict
    from fp8rl_core.engines.megatron_train import MegatronTrainingEngine, build_gpt_model
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.model.hf_io import load_pretrained

    cfg = models.block_model(run.cpu)
    path, _, _ = models.random_checkpoint(cfg, run.work / "megatron-model", run.device)
    run_cfg = run_config_from_dict({"recipe": "bf16", "engines": {"training": "megatron"}})
    dtype = torch.float32 if run.cpu else torch.bfloat16
    args = dict(recipe=recipe_of(run_cfg), megatron=run_cfg.engines.megatron, loss=run_cfg.loss, optim=run_cfg.optim,
                temperature=1.0, compute_dtype=dtype)
    native = NativeTrainingEngine(load_pretrained(path).to(run.device), **{k: v for k, v in args.items()
                                                                          if k != "megatron"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if run.cpu:
            gpt = build_gpt_model(cfg, use_te=False, device="cpu")
            mega = MegatronTrainingEngine.from_gpt_model(gpt, cfg, load_pretrained(path).state_dict(), **args)
        else:
            mega = MegatronTrainingEngine(path, seed=0, **args)
    return mega, native


def compare_rows(run: Run) -> list[dict]:
    with megatron_on_cpu() if run.cpu else megatron_on_gpu():
        mega, native = build(run)
        b = batch(run, models.block_model(run.cpu).vocab_size)
        lp_m, lp_n = mega.logprobs(b), native.logprobs(b)
        lp_diff = float((lp_m - lp_n).abs()[b.response_mask].max())
        m_m, m_n = mega.train_step(b).metrics, native.train_step(b).metrics
        rel = {k: abs(m_m[k] - m_n[k]) / max(abs(m_n[k]), 1e-12) for k in ("loss", "grad_norm")}
        times = {}
        for name, engine in (("megatron", mega), ("native", native)):
            sync()
            t0 = time.perf_counter()
            engine.train_step(b)
            sync()
            times[name] = time.perf_counter() - t0
    lp_tol, rel_tol = (2e-5, 1e-5) if run.cpu else (0.05, 5e-2)
    ok = lp_diff <= lp_tol and max(rel.values()) <= rel_tol
    spec = "local spec, FP32 on the CPU (CUDA calls stubbed)" if run.cpu else "local spec, BF16"
    return [row(PHASE, "Megatron-Core BF16 vs native", "ok" if ok else "fail", time_ms=times["megatron"] * 1e3,
                ratio=times["megatron"] / times["native"], max_rel_diff=max(rel.values()),
                note=f"{spec}: log-probs {lp_diff:.1e} (tolerance {lp_tol:g}), loss {rel['loss']:.1e}, grad_norm "
                     f"{rel['grad_norm']:.1e} (tolerance {rel_tol:g}); train_step {times['megatron'] * 1e3:.0f} ms vs "
                     f"native {times['native'] * 1e3:.0f} ms",
                data={"logprobs": lp_diff, **rel, "times": times, "megatron": m_m, "native": m_n})]


def sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
