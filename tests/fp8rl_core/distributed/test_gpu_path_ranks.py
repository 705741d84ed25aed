"""The 8B cluster path on real gloo ranks (issue 22): a vLLM refit from FSDP2 shards all-gathers each
tensor once, and rank 0 alone writes the FP8 start checkpoint while the other ranks wait.

Both run two processes (_ranks.run_ranks). The second fakes vLLM at its boundary inside each rank
(`vllm` module and torch.cuda's functions, as tests/fp8rl_core/engines/test_vllm_gen.py does in one
process): the engine's own code, the builder's and the process group's barrier are real.
"""
from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import sys
import time
import types
from pathlib import Path

import torch
from _ranks import run_ranks
from _workers import CFG

from fp8rl_core.config.recipe import RECIPES


def refit_gathers(mesh) -> dict:
    """All-gathers of one vLLM refit (iter_refit_tensors) from a sharded trainer, and how many names it sends."""
    from fp8rl_core.distributed import parallel
    from fp8rl_core.engines import vllm_convert as conv
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.model import build_model

    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True)  # a tied head is listed twice: never gathered twice
    engine = NativeTrainingEngine(build_model(cfg), mesh=mesh, compute_dtype=torch.float32)
    gathers, gather = [], parallel.full_tensor
    parallel.full_tensor = lambda t: (gathers.append(1), gather(t))[1]
    try:
        lazy = []
        it = conv.iter_refit_tensors(engine.weights(), cfg, RECIPES["fp8_gen"], torch.bfloat16)
        checked = len(gathers)  # names and shapes checked before the first pair
        for name, _ in it:
            lazy.append((name, len(gathers)))
    finally:
        parallel.full_tensor = gather
    weights = {n for n, _ in lazy if not n.endswith("_scale_inv")}
    return {"gathers": len(gathers), "tensors": len(weights), "checked": checked, "lazy": lazy}


def test_a_vllm_refit_gathers_each_tensor_once():
    for out in run_ranks(2, refit_gathers):
        assert out["checked"] == 0  # the checks read `shards`: no all-gather
        assert out["gathers"] == out["tensors"]  # one all-gather per tensor (the old refit: two)
        first = out["lazy"][0]
        assert first[1] == 1  # streamed: the first pair is out after one gather, not after all of them


# ---- rank 0 writes the start checkpoint -----------------------------------------------------------------
class _LLM:
    """vllm.LLM at the boundary: records the folder it starts on and whether it was complete then."""

    def __init__(self, **kwargs):
        folder = Path(kwargs["model"])
        self.kwargs = kwargs
        self.complete = (folder / "config.json").exists() and (folder / "model.safetensors").exists()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [["CutlassFp8BlockScaledMMKernel"]]  # _fp8_kernels: the FP8 linears' kernel (W8A8 on a GPU)

    def sleep(self, level=1, mode="abort"):
        self.slept = level  # what the engine asked for (vLLM frees memory here; nothing to free in a fake)


def _fake_vllm_here(rank: int) -> None:
    mod = types.ModuleType("vllm")
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    mod.LLM, mod.SamplingParams = _LLM, dict
    mod.platforms = types.ModuleType("vllm.platforms")
    mod.platforms.current_platform = types.SimpleNamespace(device_type="cuda")
    sys.modules["vllm"], sys.modules["vllm.platforms"] = mod, mod.platforms
    state = {"current": 0}
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 8
    torch.cuda.set_device = lambda d: state.update(current=int(d))
    torch.cuda.current_device = lambda: state["current"]
    torch.cuda.mem_get_info = lambda *a: (70 * 2**30, 80 * 2**30)
    torch.cuda.empty_cache = lambda: None


def start_engine(mesh, folder: str, out_dir: str) -> dict:
    """One rank: the builder's vLLM engine for fp8_gen, started on the BF16 folder (FP8: a checkpoint is written)."""
    _fake_vllm_here(mesh.rank)
    from fp8rl_core.config import run_config_from_dict
    from fp8rl_core.engines import vllm_convert as conv
    from fp8rl_core.loop.builder import resolve_setup, vllm_engine
    from fp8rl_core.model.hf_io import read_model_config

    writes, write = [], conv.write_checkpoint

    def slow_write(*a, **k):  # a write that takes a while: a rank that does not wait would see a partial folder
        writes.append(mesh.rank)
        time.sleep(1.0)
        return write(*a, **k)

    conv.write_checkpoint = slow_write
    cfg = run_config_from_dict({"recipe": "fp8_gen", "output_dir": out_dir, "engines": {"generation": "vllm"}})
    engine = vllm_engine(resolve_setup(cfg, "cpu", mesh), read_model_config(folder))
    engine.start(folder)
    return {"writes": writes, "complete": engine.llm.complete, "model": engine.llm.kwargs["model"],
            "backend": engine.llm.kwargs.get("distributed_executor_backend"), "seed": engine.llm.kwargs["seed"]}


def test_rank_0_writes_the_fp8_start_checkpoint_and_the_others_wait(tmp_path):
    from fp8rl_core.model import build_model, save_pretrained

    torch.manual_seed(0)
    folder = save_pretrained(build_model(CFG), tmp_path / "init")
    out = run_ranks(2, start_engine, str(folder), str(tmp_path / "out"), timeout_s=120.0)
    assert [o["writes"] for o in out] == [[0], []]  # one writer; the old engine: every rank wrote it
    assert all(o["complete"] for o in out)  # every rank's vLLM found the whole folder
    assert {o["model"] for o in out} == {str(tmp_path / "out" / "vllm_checkpoint")}
    assert {o["backend"] for o in out} == {"external_launcher"} and out[0]["seed"] != out[1]["seed"]
    config = json.loads((tmp_path / "out" / "vllm_checkpoint" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
