"""MegatronTrainingEngine: a real Megatron-Core GPTModel (local layer spec, CPU, FP32) against our model
and the native training engine; the clear error without CUDA; torch.distributed from submitit; and,
with a GPU, the full constructor (TE layers, BF16 and blockwise FP8) against the native engine.

Megatron-Core's GPTModel is built for CUDA, but its local spec runs on a CPU once two hard-coded CUDA
calls are stubbed for the test (fixture `megatron_cpu`): RoPE moves its frequencies to
torch.cuda.current_device() on the first forward, and attention forks the CUDA RNG tracker around its
dropout (p = 0 here, so no random numbers are drawn). Megatron's default causal mask is allocated on
CUDA too; gpt_logits passes an explicit one on a CPU (part of the engine, not a stub).
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _train_batches import B, T, make_batch

from fp8rl_core.config import recipe_of, run_config_from_dict
from fp8rl_core.engines.megatron_convert import hf_to_megatron, load_megatron_state, megatron_to_hf
from fp8rl_core.engines.megatron_train import (
    MegatronTrainingEngine,
    apply_env,
    build_gpt_model,
    gpt_logits,
    init_distributed,
    init_model_parallel,
)
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.model import ModelConfig, build_model

LLAMA = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
QWEN2_TIED = ModelConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, model_type="qwen2", attention_bias=True,
                         tie_word_embeddings=True, rope_theta=1000000.0)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")


def engine_args(run) -> dict:
    """MegatronTrainingEngine's keyword arguments taken from a run config (as loop/builder.py passes them)."""
    from fp8rl_core.loop.builder import compute_dtype

    return dict(recipe=recipe_of(run), megatron=run.engines.megatron, loss=run.loss, optim=run.optim,
                temperature=run.rollout.temperature, compute_dtype=compute_dtype(run))


def random_model(cfg: ModelConfig, seed: int = 0):
    """Our model with every parameter random (norm weights and biases too, so that a misplaced norm
    or bias changes the logits)."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model




class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@pytest.fixture
def megatron_cpu(monkeypatch):
    """torch.distributed (gloo, one process, through init_distributed) + Megatron's parallel state on a CPU."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state, tensor_parallel
    for key in ("SUBMITIT_EXECUTOR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    assert init_distributed("gloo") == (0, 1, 0)
    init_model_parallel(seed=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: _NoRngTracker())
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def cpu_gpt(cfg: ModelConfig):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gpt_model(cfg, use_te=False, device="cpu")


# ---- the real GPTModel on a CPU ---------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [LLAMA, QWEN2_TIED], ids=["llama-gqa", "qwen2-bias-tied"])
def test_gpt_model_logits_equal_our_model_fp32(megatron_cpu, cfg):
    ours = random_model(cfg)
    gpt = cpu_gpt(cfg)
    load_megatron_state(gpt, hf_to_megatron(ours.state_dict(), cfg))  # raises unless every weight is covered
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in gpt.parameters())
    batch = make_batch(cfg.vocab_size)
    with torch.no_grad():
        ref = ours(batch.input_ids, batch.attention_mask)
        got = gpt_logits(gpt, batch.input_ids, batch.attention_mask)
    assert got.shape == ref.shape == (B, T, cfg.vocab_size)
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-5, f"Megatron vs our logits: max relative difference {rel:.2e}"
    # and back: the Megatron state_dict converts to exactly our weights
    back = megatron_to_hf(gpt.state_dict(), cfg)
    assert sorted(back) == sorted(ours.state_dict())
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_gpt_logits_refuses_left_padding(megatron_cpu):
    gpt = cpu_gpt(LLAMA)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        gpt_logits(gpt, ids, torch.tensor([[0, 1, 1, 1]]))


def _engines(cfg: ModelConfig, dtype: str, **overrides):
    run = run_config_from_dict({"model": {"dtype": dtype}, "engines": {"training": "megatron"},
                                "rollout": {"temperature": 0.7}, **overrides})
    ours = random_model(cfg)
    native = NativeTrainingEngine(copy.deepcopy(ours), loss=run.loss, optim=run.optim, temperature=0.7,
                                  compute_dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    mega = MegatronTrainingEngine.from_gpt_model(cpu_gpt(cfg), cfg, ours.state_dict(), **engine_args(run))
    return native, mega


def test_engine_logprobs_and_gradients_equal_native_engine_fp32(megatron_cpu):
    """Same weights, same batch: the same log-probs, loss, metrics and (converted back to HF names) the
    same gradients as the native engine, in FP32 (the shared loss; only the kernels differ)."""
    native, mega = _engines(LLAMA, "fp32", optim={"grad_clip": 0.0})
    batch = make_batch(LLAMA.vocab_size)
    lp_n, lp_m = native.logprobs(batch), mega.logprobs(batch)
    assert float((lp_n - lp_m).abs().max()) <= 2e-5
    assert (lp_m[~batch.response_mask] == 0).all()
    batch.old_logprobs = lp_n

    grads: dict[str, dict[str, torch.Tensor]] = {}
    native.optimizer.step = lambda: grads.update(n={k: p.grad.clone() for k, p in native.model.named_parameters()})
    mega.inner.optimizer.step = lambda: grads.update(m={k: p.grad.clone() for k, p in mega.gpt.named_parameters()})
    m_n, m_m = native.train_step(batch).metrics, mega.train_step(batch).metrics
    assert m_n.keys() == m_m.keys()
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "ratio_mean", "clip_fraction"):
        assert abs(m_n[key] - m_m[key]) <= 1e-5 * max(1.0, abs(m_n[key])), (key, m_n[key], m_m[key])
    g_m = megatron_to_hf(grads["m"], LLAMA)
    assert sorted(g_m) == sorted(grads["n"])
    for key, g in grads["n"].items():
        err = float((g_m[key] - g).abs().max())
        assert err <= 1e-4 * float(g.abs().max()) + 1e-9, f"{key}: gradient differs by {err:.2e}"


def test_engine_bf16_autocast_logprobs_near_native(megatron_cpu):
    """BF16 autocast through Megatron's layers: log-probs near the native BF16 engine's (the kernels
    differ: fused QKV and gate/up GEMMs round differently, so not equal). Training under autocast is
    GPU-only: Megatron's linear autograd functions re-enter autocast in backward for CUDA only
    (custom_bwd(device_type="cuda")), so a CPU BF16 backward meets FP32 weights; the GPU test covers it."""
    native, mega = _engines(QWEN2_TIED, "bf16")
    batch = make_batch(QWEN2_TIED.vocab_size)
    lp_n, lp_m = native.logprobs(batch), mega.logprobs(batch)
    diff = float((lp_n - lp_m).abs()[batch.response_mask].max())
    assert 0 < diff <= 0.05, f"BF16 log-probs differ by {diff:.3e}"
    assert all(p.dtype == torch.float32 for p in mega.gpt.parameters())  # FP32 masters, BF16 compute


def test_engine_state_dict_round_trip_is_bit_exact(megatron_cpu):
    _, mega = _engines(LLAMA, "fp32", optim={"lr": 1e-3})
    batch = make_batch(LLAMA.vocab_size)
    mega.train_step(batch)
    buf = io.BytesIO()
    torch.save(mega.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert sorted(state["model"]) == sorted(random_model(LLAMA).state_dict())  # HF names: portable
    mega.train_step(batch)
    after_two = {k: v.clone() for k, v in mega.weights().items()}
    mega.load_state_dict(state)
    assert mega.step == 1 and all(torch.equal(mega.weights()[k], v) for k, v in state["model"].items())
    mega.train_step(batch)
    assert all(torch.equal(mega.weights()[k], v) for k, v in after_two.items()), "resume is not bit-exact"


# ---- environment and errors ------------------------------------------------------------------------

def _cfg(recipe: str = "bf16"):
    return run_config_from_dict({"recipe": recipe, "engines": {"training": "megatron"}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_without_cuda_the_engine_says_what_to_install(tmp_path, recipe):
    with pytest.raises(RuntimeError) as info:
        MegatronTrainingEngine(tmp_path, **engine_args(_cfg(recipe)), seed=0)
    msg = str(info.value)
    assert "engines.training=megatron" in msg and "CUDA" in msg and "pip install 'fp8rl[megatron]'" in msg
    assert "engines.training=native" in msg


def test_missing_megatron_core_is_named(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    absent = ("megatron", "transformer_engine")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.startswith(absent) else real(n, *a))
    with pytest.raises(RuntimeError, match=r"megatron-core.*transformer-engine.*pip install 'fp8rl\[megatron\]'"):
        MegatronTrainingEngine(tmp_path, **engine_args(_cfg("fp8_e2e")), seed=0)


def test_apply_env_refuses_once_transformer_engine_is_imported(monkeypatch):
    """TE reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES at import: setting it afterwards would silently do nothing."""
    key = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
    monkeypatch.delenv(key, raising=False)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    apply_env({key: "1"})
    assert os.environ[key] == "1"
    monkeypatch.setitem(sys.modules, "transformer_engine", object())
    apply_env({key: "1"})  # already the value asked for: fine
    with pytest.raises(RuntimeError, match=f"{key}=0 must be set before transformer_engine is imported"):
        apply_env({key: "0"})


def _run_child(*args: str, env: dict[str, str] | None = None, timeout: int = 60) -> dict:
    """Run this file as a script in a fresh interpreter (own torch.distributed, own TE import)."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_init_distributed_reads_submitit_slurm_environment():
    """In a submitit SLURM task, rank/world/master come from TorchDistributedEnvironment (gloo here)."""
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": "0"}
    out = _run_child("dist", env=env)
    assert out == {"rank": 0, "world": 1, "local": 0, "master": "localhost", "WORLD_SIZE": "1", "backend": "gloo"}


# ---- on a GPU: the full constructor (TE layers, BF16 and FP8) ----------------------------------------

CUDA_CFG = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe,dtype,bound", [("bf16", "fp32", 1.001), ("bf16", "bf16", 1.03),
                                                ("fp8_e2e", "bf16", 1.10)])
def test_cuda_engine_matches_native_engine(tmp_path, recipe, dtype, bound):
    if recipe == "fp8_e2e":
        pytest.importorskip("transformer_engine")  # installs only where CUDA is (the megatron extra)
    out = _run_child("cuda", recipe, dtype, str(tmp_path), timeout=300)
    assert out["mult_prob_error"] <= bound, out
    assert out["weights_keys_match"] and out["grad_norm_finite"] and out["logprobs_moved"], out
    assert out["metric_keys"] == out["native_metric_keys"], out


def _cuda_child(recipe: str, dtype: str, folder: str) -> dict:
    from fp8rl_core.algorithms.metrics import token_mult_prob_error
    from fp8rl_core.model import load_pretrained, save_pretrained

    path = Path(folder)
    save_pretrained(random_model(CUDA_CFG), path)
    run = run_config_from_dict({"recipe": recipe, "device": "cuda", "model": {"dtype": dtype},
                                "engines": {"training": "megatron"}, "optim": {"lr": 1e-3}})
    mega = MegatronTrainingEngine(path, **engine_args(run), seed=run.seed)
    native = NativeTrainingEngine(load_pretrained(path).cuda(), recipe=recipe_of(run), loss=run.loss, optim=run.optim,
                                  compute_dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    batch = make_batch(CUDA_CFG.vocab_size)
    lp_m, lp_n = mega.logprobs(batch).cpu(), native.logprobs(batch).cpu()
    batch.old_logprobs = lp_m
    metrics = mega.train_step(batch).metrics
    moved = float(((mega.logprobs(batch).cpu() - lp_m) * batch.response_mask).abs().sum()) > 0
    return {"mult_prob_error": token_mult_prob_error(lp_m, lp_n, batch.response_mask),
            "max_abs_diff": float((lp_m - lp_n).abs().max()),
            "weights_keys_match": sorted(mega.weights()) == sorted(native.weights()),
            "grad_norm_finite": bool(torch.isfinite(torch.tensor(metrics["grad_norm"]))), "logprobs_moved": moved,
            "metric_keys": sorted(metrics), "native_metric_keys": sorted(native.train_step(batch).metrics)}


def _dist_child() -> dict:
    import torch.distributed as dist

    rank, world, local = init_distributed("gloo")
    out = {"rank": rank, "world": world, "local": local, "master": os.environ["MASTER_ADDR"],
           "WORLD_SIZE": os.environ["WORLD_SIZE"], "backend": dist.get_backend()}
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "dist":
        if os.environ.get("MASTER_PORT") == "0":  # pick a free port, as a job script would
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        print(json.dumps(_dist_child()))
    else:
        print(json.dumps(_cuda_child(*sys.argv[2:5])))
