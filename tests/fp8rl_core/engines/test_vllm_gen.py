"""The vLLM generation backend: its pure pieces on the CPU (vLLM's outputs faked at the boundary with
plain dataclasses shaped like vllm.outputs.RequestOutput / CompletionOutput / vllm.logprobs.Logprob),
and, where vLLM and a CUDA GPU exist, the real engine against our native training engine.

References are independent of the code under test: block scales from a float64 amax, dequantization
by explicit block expansion, the E4M3 rounding bound |x - q*s| <= 2^-4 |x| + 2^-10 s (3 mantissa bits;
subnormal spacing 2^-9 in scaled units), and hand-written expected tensors for the output conversion.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch

from fp8rl_core.config import Fp8Spec, run_config_from_dict
from fp8rl_core.config.recipe import BF16, RECIPES, resolve_recipe
from fp8rl_core.engines import vllm_convert as conv
from fp8rl_core.engines.base import SamplingParams
from fp8rl_core.model.config import ModelConfig


def vllm_engine(cfg, model_config, recipe=None, output_dir=None, mesh=None):
    """builder.vllm_engine on the config's setup (loop/setup.py, resolved on the CPU; mesh None: SINGLE)."""
    from fp8rl_core.distributed.mesh import SINGLE
    from fp8rl_core.loop import builder

    return builder.vllm_engine(builder.resolve_setup(cfg, "cpu", mesh or SINGLE), model_config, recipe, output_dir)

# hidden 192 and intermediate 320 are not multiples of 128: partial [128, 128] blocks everywhere
ODD = ModelConfig(vocab_size=40, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1)
FP8 = RECIPES["fp8_gen"]  # FP8 generation, default knobs


def fp8_gen(**knobs):
    """The fp8_gen recipe with the run config's `fp8.*` knobs set."""
    return resolve_recipe("fp8_gen", Fp8Spec(**knobs))


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    from fp8rl_core.engines.native_gen import expected_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        t = torch.randn(shape, generator=g) * (0.05 if len(shape) == 2 else 1.0)
        if len(shape) == 2 and shape[0] > 64:
            t[64:70] = 0.0  # an all-zero stretch: its blocks still get a finite scale
        out[name] = t
    return out


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(N/128), ceil(K/128)] -> [N, K], every block's scale repeated over its elements."""
    return scale.double().repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]


def amax_scales(x: torch.Tensor) -> torch.Tensor:
    """Float64 reference: amax over each [128, 128] block / 448 (1 for an all-zero block)."""
    n, k = x.shape
    out = torch.empty(math.ceil(n / 128), math.ceil(k / 128), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            amax = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].double().abs().max()
            out[i, j] = amax / 448 if amax > 0 else 1.0
    return out


# ---- availability ------------------------------------------------------------------------------
def test_availability_error_names_the_fix():
    assert conv.availability_error(True) is None
    no_vllm = conv.availability_error(False)
    assert "cannot run here" in no_vllm and ("fp8rl[gpu]" in no_vllm or "scripts/setup_vllm.sh" in no_vllm)


def test_platform_error_names_the_build_that_fits():
    assert conv.platform_error("cuda", True) is None and conv.platform_error("cpu", False) is None
    assert "install the CPU build (bash scripts/setup_vllm.sh)" in conv.platform_error("cuda", False)
    assert "install the CUDA build (pip install 'fp8rl[gpu]')" in conv.platform_error("cpu", True)
    assert "valid: cuda, cpu" in conv.platform_error("xpu", False)


def test_engine_construction_without_vllm_raises(tmp_path, monkeypatch):
    from fp8rl_core.loop.builder import build_generation_engine, resolve_setup

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))

    cfg = run_config_from_dict({"engines": {"generation": "vllm"}, "output_dir": str(tmp_path)})
    with pytest.raises(RuntimeError, match=r"engines.generation='vllm' cannot run here.*not installed"):
        vllm_engine(cfg, ModelConfig())
    with pytest.raises(RuntimeError, match="cannot run here"):
        build_generation_engine(resolve_setup(cfg, "cpu"), ModelConfig())


# ---- refit tensors -------------------------------------------------------------------------------
def test_refit_tensors_reconstruct_within_the_e4m3_bound():
    weights = random_weights(ODD)
    pairs = conv.refit_tensors(weights, ODD, FP8, dtype=torch.bfloat16)
    got = dict(pairs)
    fp8_names = conv.fp8_weight_names(ODD, FP8)
    assert len(fp8_names) == 2 * 7
    for name in fp8_names:
        q, s = got[name], got[name + "_scale_inv"]
        x = weights[name].to(torch.bfloat16).double()  # quantized from the engine-dtype copy
        n, k = x.shape
        assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
        assert s.dtype == torch.float32 and s.shape == (math.ceil(n / 128), math.ceil(k / 128))
        torch.testing.assert_close(s.double(), amax_scales(x), rtol=1e-6, atol=0)
        sb = expand_blocks(s, (n, k))
        err = (q.double() * sb - x).abs()
        assert bool((err <= 2.0**-4 * x.abs() + 2.0**-10 * sb + 1e-12).all()), name
        assert float(q.double().abs().max()) <= 448.0
    # everything else: the same tensor in the engine dtype, no scale
    for name, t in weights.items():
        if name not in fp8_names:
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16))
            assert name + "_scale_inv" not in got
    assert "lm_head.weight" in got and got["lm_head.weight"].dtype == torch.bfloat16  # head stays BF16


def test_refit_tensors_keep_layers_tied_head_and_order():
    cfg = dataclasses.replace(ODD, tie_word_embeddings=True, num_hidden_layers=3)
    weights = random_weights(cfg)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # trainer state dicts list both
    names = [n for n, _ in conv.refit_tensors(weights, cfg, fp8_gen(bf16_first_layers=1, bf16_last_layers=1))]
    assert "lm_head.weight" not in names
    scaled = {n[: -len("_scale_inv")] for n in names if n.endswith("_scale_inv")}
    assert scaled == {f"model.layers.1.{lin}.weight" for lin in conv.LINEARS}
    assert names.index("model.layers.0.mlp.down_proj.weight") < names.index("model.layers.1.self_attn.q_proj.weight")
    # no FP8 at all (bf16 recipe)
    assert not any(n.endswith("_scale_inv") for n, _ in conv.refit_tensors(weights, cfg, BF16))


def test_refit_tensors_power_of_two_scales():
    pairs = dict(conv.refit_tensors(random_weights(ODD), ODD, fp8_gen(power_of_two_scales=True)))
    s = pairs["model.layers.0.mlp.up_proj.weight_scale_inv"].double()
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)


def test_refit_tensors_reject_bad_state_dicts():
    weights = random_weights(ODD)
    del weights["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        conv.refit_tensors(weights, ODD, FP8)
    weights = random_weights(ODD)
    weights["model.layers.1.mlp.gate_proj.weight"][3, 5] = float("nan")
    with pytest.raises(ValueError, match="model.layers.1.mlp.gate_proj.weight"):
        conv.refit_tensors(weights, ODD, FP8)


def test_write_checkpoint_is_the_blockwise_fp8_format(tmp_path):
    from safetensors.torch import load_file

    from fp8rl_core.model import load_pretrained

    weights = random_weights(ODD)
    path = conv.write_checkpoint(weights, ODD, tmp_path / "ckpt", recipe=fp8_gen(bf16_last_layers=1))
    hf = json.loads((path / "config.json").read_text())
    q = hf["quantization_config"]
    assert {k: q[k] for k in conv.FP8_QUANT_CONFIG} == conv.FP8_QUANT_CONFIG
    stored = load_file(str(path / "model.safetensors"))
    assert stored["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)
    assert stored["model.layers.1.self_attn.k_proj.weight"].dtype == torch.bfloat16  # kept block
    assert "model.layers.1.self_attn.k_proj.weight_scale_inv" not in stored
    # the checkpoint's FP8 tensors are the refit's: one quantization, whichever path loads it
    refit = dict(conv.refit_tensors(weights, ODD, fp8_gen(bf16_last_layers=1)))
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"):
        assert torch.equal(stored[name].view(torch.uint8) if stored[name].dtype == torch.float8_e4m3fn
                           else stored[name], refit[name].view(torch.uint8)
                           if refit[name].dtype == torch.float8_e4m3fn else refit[name])
    back = load_pretrained(path).state_dict()
    x = weights["model.layers.0.mlp.gate_proj.weight"].to(torch.bfloat16).double()
    sb = expand_blocks(refit["model.layers.0.mlp.gate_proj.weight_scale_inv"], tuple(x.shape))
    assert bool(((back["model.layers.0.mlp.gate_proj.weight"].double() - x).abs()
                 <= 2.0**-4 * x.abs() + 2.0**-10 * sb + 1e-12).all())


# ---- engine arguments ----------------------------------------------------------------------------
def test_llm_kwargs_for_fp8_and_bf16(tmp_path):
    from fp8rl_core.config import VllmSpec

    opts = VllmSpec(gpu_memory_utilization=0.25, enforce_eager=True)
    kw = conv.llm_kwargs(tmp_path, ODD, recipe=fp8_gen(bf16_first_layers=1), dtype="bfloat16", seed=7, vllm=opts,
                         max_model_len=40, sleep=True)
    assert kw["quantization"] == "fp8" and kw["skip_tokenizer_init"] and kw["seed"] == 7
    qc = kw["hf_overrides"]["quantization_config"]
    assert {k: qc[k] for k in conv.FP8_QUANT_CONFIG} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert sorted(qc["ignored_layers"]) == sorted(f"model.layers.0.{lin}" for lin in conv.LINEARS)
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["max_model_len"] == 40
    assert kw["enable_sleep_mode"] is True and kw["tensor_parallel_size"] == 1
    assert kw["gpu_memory_utilization"] == 0.25 and "kv_cache_memory_bytes" not in kw
    plain = conv.llm_kwargs(tmp_path, ODD, recipe=BF16, dtype="bfloat16", seed=0, vllm=VllmSpec(),
                            max_model_len=40, kv_cache_bytes=2**24, device="cpu")
    assert "quantization" not in plain and "hf_overrides" not in plain and "enable_sleep_mode" not in plain
    assert plain["kv_cache_memory_bytes"] == 2**24 and "gpu_memory_utilization" not in plain  # never a RAM share
    with pytest.raises(ValueError, match="on a CPU needs the KV cache in bytes"):
        conv.llm_kwargs(tmp_path, ODD, recipe=BF16, dtype="bfloat16", seed=0, vllm=VllmSpec(), max_model_len=40,
                        device="cpu")
    gpu = conv.llm_kwargs(tmp_path, ODD, recipe=BF16, dtype="bfloat16", seed=0, vllm=VllmSpec(), max_model_len=40,
                          kv_cache_bytes=2**24)
    assert gpu["gpu_memory_utilization"] == 0.3 and gpu["kv_cache_memory_bytes"] == 2**24  # the share bounds it
    assert "ignored_layers" not in conv.fp8_quantization_config(ODD, FP8)


def test_llm_kwargs_refuse_fp8_with_fp32(tmp_path):
    from fp8rl_core.config import VllmSpec

    with pytest.raises(ValueError, match="model.dtype: vLLM's FP8 method runs bfloat16 / float16"):
        conv.llm_kwargs(tmp_path, ODD, recipe=FP8, dtype="float32", seed=0, vllm=VllmSpec(), max_model_len=40)
    kv = VllmSpec(kv_cache_memory_bytes=2**30, max_num_seqs=64, tensor_parallel_size=2, enforce_eager=False)
    kw = conv.llm_kwargs(tmp_path, ODD, recipe=BF16, dtype="bfloat16", seed=0, vllm=kv, max_model_len=40,
                         kv_cache_bytes=kv.kv_cache_memory_bytes)
    assert (kw["kv_cache_memory_bytes"], kw["max_num_seqs"], kw["tensor_parallel_size"], kw["enforce_eager"]) \
        == (2**30, 64, 2, False)


@pytest.mark.parametrize("kv_scale", ["trainer", "first_forward", "per_token_head"])
def test_engine_args_never_carry_an_fp8_kv_cache(tmp_path, kv_scale):
    """vLLM never runs with its default 1.0 KV scales unannounced: llm_kwargs emits no kv_cache_dtype (vLLM's
    auto, the compute dtype) and raises, with the design's reason, for a recipe whose fp8.kv_cache is e4m3."""
    from fp8rl_core.config import VllmSpec
    from fp8rl_core.config.recipe import VLLM_KV_CACHE_REFUSALS

    args = dict(dtype="bfloat16", seed=0, vllm=VllmSpec(), max_model_len=40, kv_cache_bytes=2**24)
    for recipe in (BF16, FP8):
        assert "kv_cache_dtype" not in conv.llm_kwargs(tmp_path, ODD, recipe=recipe, **args)
        e4m3 = dataclasses.replace(recipe, kv_cache="e4m3", kv_scale=kv_scale)
        with pytest.raises(ValueError) as err:
            conv.llm_kwargs(tmp_path, ODD, recipe=e4m3, **args)
        assert f"fp8.kv_cache: 'e4m3' with fp8.kv_scale '{kv_scale}' cannot run in engines.generation 'vllm'" \
            in str(err.value) and VLLM_KV_CACHE_REFUSALS[kv_scale] in str(err.value)


def test_the_engine_refuses_an_e4m3_kv_cache_before_vllm_starts(fake_vllm, tmp_path):
    from fp8rl_core.config import RunConfig
    cfg = RunConfig(output_dir=str(tmp_path))
    cfg.fp8.kv_cache = "e4m3"  # built past validation (which refuses it), as a programmatic caller could
    with pytest.raises(ValueError, match="vLLM cannot take new per-layer KV scales at a refit without a patch"):
        vllm_engine(cfg, ODD)


def test_vllm_kv_bytes_are_the_shared_formula_in_the_compute_dtype():
    from fp8rl_core.fp8.kv_bytes import kv_cache_bytes
    for dtype_bytes in (2, 4):
        assert conv.kv_cache_bytes(ODD, 40, 8, dtype_bytes=dtype_bytes) == kv_cache_bytes(
            ODD.num_hidden_layers, 8, ODD.num_key_value_heads, 128, ODD.head_dim, kv_cache="auto",
            dtype_bytes=dtype_bytes)


def _vllm_source(rel: str) -> str:
    spec = importlib.util.find_spec("vllm")  # located, never imported (its import takes seconds)
    if spec is None or not spec.submodule_search_locations:
        # scripts/test.sh installs it (as for test_vllm_real.py): a missing vLLM is a broken setup, not a skip
        pytest.fail("vLLM's CPU build is not installed: bash scripts/setup_vllm.sh (scripts/test.sh runs it)")
    from pathlib import Path
    return (Path(list(spec.submodule_search_locations)[0]) / rel).read_text()


def test_the_kv_refusals_hold_in_the_installed_vllm():
    """The facts VLLM_KV_CACHE_REFUSALS states, checked in the installed vLLM's source: an upgrade that makes
    one false fails here, and the refusal is revisited (docs/design.md "FP8 KV cache")."""
    kv = _vllm_source("model_executor/layers/quantization/kv_cache.py")
    after = kv[kv.index("def process_weights_after_loading"):]
    assert "del layer.k_scale" in after and "del layer.v_scale" in after  # scale parameters gone after load
    assert 'if not hasattr(layer, "q_scale")' in after  # a reload skips the scales
    remap = _vllm_source("model_executor/model_loader/weight_utils.py")
    assert "kv_scale is not loaded" in remap  # a refit's scale names, gone from params_dict, are dropped
    cpu = _vllm_source("v1/attention/backends/cpu_attn.py")
    assert "layer._k_scale_float" in cpu and "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." in cpu
    dtypes = cpu[cpu.index("supported_kv_cache_dtypes"):].split("= [")[1].split("]")[0]
    assert "per_token_head" not in dtypes and "fp8_e4m3" in dtypes
    layer = _vllm_source("model_executor/layers/attention/attention.py")
    assert "calculate_kv_scales" not in layer and "calc_kv_scales" not in layer


def test_vllm_fp8_kv_cache_needs_avx512_or_amx_on_a_cpu():
    """On a CPU, vLLM's FP8 KV cache runs only with AVX-512 or AMX (cpu_attn._get_attn_isa); we never start it
    (the refusals above), and this machine's flags say whether it could."""
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's CPU FP8 KV cache needs the avx512f (AVX-512) or amx_tile (AMX) CPU flag; this CPU has "
                    "neither")
    assert "fp8_e4m3" in _vllm_source("v1/attention/backends/cpu_attn.py")


def test_kv_cache_bytes_from_the_runs_needs():
    # per token: K and V x 2 layers x 1 KV head x head_dim 64 x 2 bytes = 512 B; 40 tokens -> one 128-token block
    assert conv.kv_cache_bytes(ODD, 40, 8, dtype_bytes=2) == 8 * 128 * 2 * 2 * 1 * 64 * 2
    assert conv.kv_cache_bytes(ODD, 129, 1, dtype_bytes=4, block=16) == 144 * 2 * 2 * 1 * 64 * 4


def test_fp8_on_a_cpu_is_refused_without_amx_and_weight_only_only_when_asked():
    from fp8rl_core.config import VllmSpec

    assert conv.fp8_cpu_error(BF16, VllmSpec(), amx_tile=False, amx_fp8=False) is None  # BF16 runs anywhere
    no_amx = conv.fp8_cpu_error(FP8, VllmSpec(fp8_weight_only=True), amx_tile=False, amx_fp8=False)
    assert "amx_tile" in no_amx and "valid: recipe bf16" in no_amx
    w8a16 = conv.fp8_cpu_error(FP8, VllmSpec(), amx_tile=True, amx_fp8=False)
    assert w8a16.startswith("engines.vllm.fp8_weight_only") and "W8A16" in w8a16
    assert conv.fp8_cpu_error(FP8, VllmSpec(fp8_weight_only=True), amx_tile=True, amx_fp8=False) is None
    assert conv.fp8_cpu_error(FP8, VllmSpec(), amx_tile=True, amx_fp8=True) is None  # W8A8 kernel exists there


def test_the_kernels_vllm_chose_are_checked_and_named():
    from fp8rl_core.config import VllmSpec

    assert conv.fp8_activations([]) == "none"
    assert conv.fp8_activations(["CPUFp8BlockScaledMMKernel"]) == "weights"
    assert conv.fp8_activations(["CutlassFp8BlockScaledMMKernel"]) == "weights+activations"
    assert conv.fp8_kernel_error(BF16, VllmSpec(), []) is None
    assert "no FP8 linear kernel" in conv.fp8_kernel_error(FP8, VllmSpec(), [])
    msg = conv.fp8_kernel_error(FP8, VllmSpec(), ["MarlinFP8ScaledMMLinearKernel"])  # a GPU's weight-only fallback
    assert msg.startswith("engines.vllm.fp8_weight_only") and "MarlinFP8ScaledMMLinearKernel" in msg
    assert conv.fp8_kernel_error(FP8, VllmSpec(fp8_weight_only=True), ["CPUFp8BlockScaledMMKernel"]) is None
    assert conv.fp8_kernel_error(FP8, VllmSpec(), ["CutlassFp8BlockScaledMMKernel"]) is None


def test_max_model_len_is_the_longest_prompt_plus_new_tokens():
    from fp8rl_core.config import VllmSpec
    from fp8rl_core.model.tokenizer import char_tokenizer
    from fp8rl_core.tasks.arithmetic import ArithmeticTask

    assert conv.resolve_max_model_len(VllmSpec(), 300, 4096, 131072) == 4396  # not Llama-3.1's 131072
    assert conv.resolve_max_model_len(VllmSpec(max_model_len=8192), 300, 4096, 131072) == 8192
    with pytest.raises(ValueError, match="engines.vllm.max_model_len: 1000 tokens cannot hold"):
        conv.resolve_max_model_len(VllmSpec(max_model_len=1000), 300, 4096, 131072)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        conv.resolve_max_model_len(VllmSpec(), 300, 4096, 2048)
    task, tok = ArithmeticTask(digits=3, min_digits=1), char_tokenizer()
    assert conv.longest_prompt_tokens(task, tok) == len(tok.encode("999+999="))  # BOS + 8 characters


def test_free_memory_check_names_the_knob():
    from fp8rl_core.config import VllmSpec

    gib = 2**30
    assert conv.free_memory_error(60 * gib, 80 * gib, VllmSpec(gpu_memory_utilization=0.5)) is None
    msg = conv.free_memory_error(30 * gib, 80 * gib, VllmSpec(gpu_memory_utilization=0.5))
    assert "engines.vllm.gpu_memory_utilization=0.5" in msg and "valid: <= 0.36" in msg
    # vLLM 0.32 checks the share at start even when the KV cache is given in bytes (request_memory)
    assert "gpu_memory_utilization=0.3" in conv.free_memory_error(1, 80 * gib, VllmSpec(kv_cache_memory_bytes=gib))


def test_run_config_vllm_section_validates_and_fp8_fp32_is_refused():
    from fp8rl_core.config import load_run_config
    from fp8rl_core.config.schema import ConfigError

    cfg = load_run_config(None, ["engines.generation=vllm", "engines.vllm.max_model_len=8192",
                                 "engines.vllm.gpu_memory_utilization=0.4"])
    assert cfg.engines.vllm.max_model_len == 8192 and cfg.engines.vllm.sleep_between_steps is None
    for override, fragment in [("engines.vllm.gpu_memory_utilization=1.5", "engines.vllm.gpu_memory_utilization"),
                               ("engines.vllm.tensor_parallel_size=0", "engines.vllm.tensor_parallel_size"),
                               ("engines.vllm.kv_cache_memory_bytes=0", "engines.vllm.kv_cache_memory_bytes"),
                               ("engines.vllm.max_model_len=1", "engines.vllm.max_model_len")]:
        with pytest.raises(ConfigError, match=fragment):
            load_run_config(None, [override])
    with pytest.raises(ConfigError, match="model.dtype: recipe 'fp8_gen' generates in FP8 with vLLM.*valid: bf16"):
        load_run_config(None, ["engines.generation=vllm", "recipe=fp8_gen", "model.dtype=fp32"])
    load_run_config(None, ["engines.generation=vllm", "recipe=bf16", "model.dtype=fp32"])  # BF16 recipe: fine
    load_run_config(None, ["recipe=fp8_gen", "model.dtype=fp32"])  # native engine: fine


def test_sampling_kwargs_and_seeds():
    kw = conv.sampling_kwargs(SamplingParams(max_new_tokens=5, temperature=0.7), 2)
    assert kw == {"max_tokens": 5, "logprobs": 1, "detokenize": False, "temperature": 0.7, "stop_token_ids": [2]}
    kw = conv.sampling_kwargs(SamplingParams(max_new_tokens=3, top_p=0.9, top_k=4), None)
    assert kw["top_p"] == 0.9 and kw["top_k"] == 4 and "stop_token_ids" not in kw
    greedy = conv.sampling_kwargs(SamplingParams(max_new_tokens=3, greedy=True, top_k=4), 2)
    assert greedy["temperature"] == 0.0 and "top_k" not in greedy
    assert conv.sampling_kwargs(SamplingParams(max_new_tokens=3), 2)["temperature"] == 1.0
    a = conv.request_seeds(torch.Generator().manual_seed(3), 6)
    assert a == conv.request_seeds(torch.Generator().manual_seed(3), 6) and len(set(a)) == 6
    assert all(0 <= s < 2**31 - 1 for s in a)
    assert a != conv.request_seeds(torch.Generator().manual_seed(4), 6)


# ---- output conversion (a boundary fake of vllm.outputs) ------------------------------------------
@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


def fake_output(ids: list[int], lps: list[float], other: int = 31) -> RequestOutput:
    steps = [{t: Logprob(lp, rank=2), other: Logprob(-0.01, rank=1)} for t, lp in zip(ids, lps)]
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", ids, sum(lps), steps, "stop")])


def test_to_generation_output_pads_masks_and_cuts_after_eos():
    EOS, PAD = 2, 0
    outs = [fake_output([5, 6, 2], [-0.5, -1.0, -0.25]),            # ends with EOS
            fake_output([7, 8, 9, 10], [-0.1, -0.2, -0.3, -0.4]),   # hit max_tokens
            fake_output([2], [-2.0]),                               # EOS first
            fake_output([4, 2, 9], [-0.7, -0.8, -0.9])]              # tokens after EOS are dropped
    g = conv.to_generation_output(outs, EOS, PAD)
    assert torch.equal(g.response_ids, torch.tensor([[5, 6, 2, 0], [7, 8, 9, 10], [2, 0, 0, 0], [4, 2, 0, 0]]))
    assert torch.equal(g.response_mask, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]).bool())
    want = torch.tensor([[-0.5, -1.0, -0.25, 0], [-0.1, -0.2, -0.3, -0.4], [-2.0, 0, 0, 0], [-0.7, -0.8, 0, 0]])
    assert g.logprobs.dtype == torch.float32 and torch.equal(g.logprobs, want.float())
    assert torch.equal(g.finished, torch.tensor([True, False, True, True]))
    same = conv.to_generation_output(outs[1:2], None, PAD)  # no EOS configured: nothing is cut
    assert same.response_ids.shape == (1, 4) and not bool(same.finished[0])


def test_to_generation_output_needs_logprobs():
    out = fake_output([5, 6], [-0.5, -1.0])
    out.outputs[0].logprobs = None
    with pytest.raises(RuntimeError, match="logprobs must be set"):
        conv.to_generation_output([out], 2, 0)
    out = fake_output([5, 6], [-0.5, -1.0])
    out.outputs[0].logprobs[1] = {31: Logprob(-0.1)}  # the sampled token 6 missing from its step
    with pytest.raises(RuntimeError, match="row 0, token 1"):
        conv.to_generation_output([out], 2, 0)


# ---- the engine's glue, against a fake vllm module (boundary fake: records calls, returns fakes) ------
class CutlassFp8BlockScaledMMKernel:
    """Named as vLLM 0.32's CUDA block-FP8 kernel (W8A8): the engine reads only the class name."""


class FakeRunner:
    """The worker's model runner: its model holds one FP8 linear (quant_method.fp8_linear) when quantized."""

    def __init__(self, fp8: bool):
        self.model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        if fp8:
            self.model[0].quant_method = type("Fp8LinearMethod", (), {"fp8_linear": CutlassFp8BlockScaledMMKernel()})()

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        raise AssertionError("called through the worker")


class FakeLLM:
    instances: list[FakeLLM] = []
    cache_emptied = False  # torch.cuda.empty_cache() called since the last wake_up (the fixture's fake)
    wakes_without_empty_cache: list[tuple] = []

    def __init__(self, **kwargs):
        self.kwargs, self.reloads, self.resets, self.requests, self.events = kwargs, [], 0, [], []
        self.device_at_start = torch.cuda.current_device()
        self.worker = type("Worker", (), {"model_runner": FakeRunner(kwargs.get("quantization") == "fp8"),
                                          "reload_weights": lambda *a, **k: None})()
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if callable(method):
            return [method(self.worker, *args, **(kwargs or {}))]
        assert method == "reload_weights" and kwargs["is_checkpoint_format"] is True
        self.reloads.append(dict(kwargs["weights_iterator"]))
        self.events.append(("reload",))
        return [None]

    def reset_prefix_cache(self):
        self.resets += 1
        return True

    def sleep(self, level=1, mode="abort"):
        self.events.append(("sleep", level))

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tuple(tags or ())))
        if not FakeLLM.cache_emptied:
            FakeLLM.wakes_without_empty_cache.append(tuple(tags or ()))
        FakeLLM.cache_emptied = False

    def generate(self, prompts, params, use_tqdm=True):
        assert len(prompts) == len(params) and not use_tqdm
        self.events.append(("generate",))
        self.requests.append((prompts, params))
        return [fake_output([3, 4, 2][: 1 + i % 3], [-0.5, -0.25, -0.125][: 1 + i % 3])
                for i in range(len(prompts))]


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch)


def install_fake_vllm(monkeypatch) -> list[FakeLLM]:
    """A fake `vllm` module (FakeLLM) and fake torch.cuda functions; returns the LLMs it will create."""
    import importlib.machinery
    import sys
    import types

    mod = types.ModuleType("vllm")
    mod.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    mod.LLM = FakeLLM
    mod.SamplingParams = lambda **kw: kw
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(device_type="cuda")  # vLLM's CUDA build
    mod.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    fake_cuda(monkeypatch)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import weakref

    from fp8rl_core.engines import vllm_gen
    monkeypatch.setattr(vllm_gen, "_SLEEP_MODE_ENGINES", weakref.WeakSet(), raising=False)
    FakeLLM.instances.clear()
    FakeLLM.wakes_without_empty_cache.clear()
    FakeLLM.cache_emptied = False
    return FakeLLM.instances


def fake_cuda(monkeypatch, devices: int = 8) -> dict:
    """torch.cuda's functions the engine calls, faked at the boundary: `devices` GPUs, a current device
    that set_device changes, and empty_cache recorded for FakeLLM.wake_up."""
    state = {"current": 0}

    def set_device(d):
        state["current"] = int(getattr(d, "index", d))

    def empty_cache():
        FakeLLM.cache_emptied = True

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    return state


def test_engine_glue_against_a_fake_vllm(fake_vllm, tmp_path):
    cfg = run_config_from_dict({"recipe": "fp8_gen", "output_dir": str(tmp_path), "seed": 4})
    engine = vllm_engine(cfg, ODD)
    with pytest.raises(RuntimeError, match="refit"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
    weights = random_weights(ODD)
    engine.refit(weights)  # first refit: checkpoint + LLM, no reload
    (llm,) = fake_vllm
    assert llm.kwargs["model"] == str(tmp_path / "vllm_checkpoint") and llm.kwargs["quantization"] == "fp8"
    assert json.loads((tmp_path / "vllm_checkpoint" / "config.json").read_text())["quantization_config"]
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert engine.tags()["fp8rl.vllm.fp8_kernel"] == "CutlassFp8BlockScaledMMKernel"
    assert engine.tags()["fp8rl.vllm.fp8_quantizes"] == "weights+activations"
    assert llm.reloads == [] and llm.resets == 0
    engine.refit(random_weights(ODD, seed=1))
    (sent,) = llm.reloads
    assert sent["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert sent["model.layers.1.mlp.up_proj.weight_scale_inv"].shape == (3, 2) and llm.resets == 1
    prompts = [[1, 5], [1, 6, 7], [1, 8, 9, 10]]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=11))
    (requests, params) = llm.requests[-1]
    assert requests == [{"prompt_token_ids": p} for p in prompts]
    assert [p["seed"] for p in params] == conv.request_seeds(torch.Generator().manual_seed(11), 3)
    assert params[0]["stop_token_ids"] == [ODD.eos_token_id] and params[0]["max_tokens"] == 3
    assert torch.equal(out.response_mask.sum(1), torch.tensor([1, 2, 3]))
    assert torch.equal(out.finished, torch.tensor([False, False, True]))
    # KV bound: the arithmetic task's longest prompt + max_new_tokens, not max_position_embeddings
    assert llm.kwargs["max_model_len"] == 1 + len("99+99=") + cfg.rollout.max_new_tokens  # BOS + 2-digit prompt
    assert llm.kwargs["enable_sleep_mode"] is True
    # colocation: asleep after each generation (training runs), weights woken for the refit, KV for generating
    llm.events.clear()
    engine.refit(random_weights(ODD, seed=2))
    engine.generate(prompts, SamplingParams(max_new_tokens=3, seed=12))
    assert llm.events == [("wake_up", ("weights",)), ("reload",), ("wake_up", ("kv_cache",)), ("generate",),
                          ("sleep", 2)]
    with pytest.raises(ValueError, match="engines.vllm.max_model_len"):
        engine.generate([[1] * 40], SamplingParams(max_new_tokens=3))
    engine.close()


def test_engine_refuses_fp8_with_fp32_activations(fake_vllm, tmp_path):
    from fp8rl_core.config import RunConfig
    cfg = RunConfig(recipe="fp8_gen", output_dir=str(tmp_path))
    cfg.model.dtype = "fp32"  # built past validation, as a programmatic caller could
    with pytest.raises(ValueError, match="BF16/FP16 activations only"):
        vllm_engine(cfg, ODD)


# ---- colocation order: vLLM starts before the trainer takes the GPU (issue 13) ----------------------
def _checkpoint(tmp_path):
    from fp8rl_core.model import build_model, save_pretrained

    torch.manual_seed(0)
    return save_pretrained(build_model(ODD), tmp_path / "init")


class FakeTrainer:
    """Stands in for the training engine / reference policy: what the builder calls on them."""

    def __init__(self, path):
        from fp8rl_core.model import load_pretrained

        self.state = load_pretrained(path).state_dict()

    def weights(self):
        return self.state


def _record_builds(monkeypatch, events, llms):
    """Patch the builder's trainer/reference builders to log (what, the LLMs' events at that time)."""
    import fp8rl_core.loop.builder as builder

    def fake(what):
        def build(setup, path):
            events.append((what, [list(llm.events) for llm in llms]))
            return FakeTrainer(path)
        return build

    monkeypatch.setattr(builder, "build_training_engine", fake("train"))
    monkeypatch.setattr(builder, "build_reference", fake("ref"))


@pytest.mark.parametrize("recipe", ["bf16", "fp8_gen"])
@pytest.mark.parametrize("sleep", [True, False])
def test_builder_starts_vllm_before_the_trainer(fake_vllm, monkeypatch, tmp_path, recipe, sleep):
    from fp8rl_core.distributed.mesh import SINGLE
    from fp8rl_core.loop.builder import build_context

    path = _checkpoint(tmp_path)
    cfg = run_config_from_dict({"recipe": recipe, "output_dir": str(tmp_path / "out"), "device": "cpu",
                                "model": {"path": str(path), "dtype": "bf16"}, "loss": {"kl_coef": 0.1},
                                "engines": {"generation": "vllm", "vllm": {"sleep_between_steps": sleep}}})
    events: list = []
    _record_builds(monkeypatch, events, fake_vllm)
    ctx = build_context(cfg, progress=False, mesh=SINGLE)
    asleep = [("sleep", 2)] if sleep else []
    # the arm's LLM, the only one (the BF16 evaluation engine is native: vLLM runs one sleep-mode engine per
    # process), already built and asleep when colocated, when the trainer and the reference are built
    assert events == [("train", [asleep]), ("ref", [asleep])]
    llm = fake_vllm[0]
    # FP8: the refit's checkpoint writer converts the initial weights; BF16: vLLM reads the folder as it is
    folder = tmp_path / "out" / "vllm_checkpoint" if recipe == "fp8_gen" else path
    assert llm.kwargs["model"] == str(folder)
    assert ("quantization_config" in json.loads((folder / "config.json").read_text())) == (recipe == "fp8_gen")
    assert ctx.gen.llm is llm and ctx.train.weights() is not None
    # one evaluation engine for every arm, bf16 included: the native engine in BF16, empty until validation
    from fp8rl_core.loop.builder import BF16Evaluator

    assert len(fake_vllm) == 1 and isinstance(ctx.bf16_gen, BF16Evaluator)
    assert not ctx.bf16_gen.fp8 and not ctx.bf16_gen.blocks


def test_first_refit_after_start_wakes_and_reloads(fake_vllm, tmp_path):
    path = _checkpoint(tmp_path)
    cfg = run_config_from_dict({"recipe": "fp8_gen", "output_dir": str(tmp_path / "out"),
                                "engines": {"generation": "vllm"}})
    engine = vllm_engine(cfg, ODD)
    engine.start(path)
    (llm,) = fake_vllm
    assert llm.events == [("sleep", 2)] and engine.asleep == {"weights", "kv_cache"} and engine.discarded
    engine.refit(random_weights(ODD, seed=3))
    assert len(fake_vllm) == 1  # the running engine, no second vllm.LLM
    assert llm.events == [("sleep", 2), ("wake_up", ("weights",)), ("reload",)] and llm.resets == 1
    assert not engine.discarded
    (sent,) = llm.reloads
    assert sent["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert engine.asleep == {"kv_cache"}  # woken by the next generate
    with pytest.raises(RuntimeError, match="already running"):
        engine.start(path)
    engine.close()


def test_start_keeps_the_free_memory_check(fake_vllm, monkeypatch, tmp_path):
    cfg = run_config_from_dict({"output_dir": str(tmp_path / "out"), "engines": {"generation": "vllm"}})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**30, 80 * 2**30))
    with pytest.raises(RuntimeError, match="engines.vllm.gpu_memory_utilization"):
        vllm_engine(cfg, ODD).start(_checkpoint(tmp_path))
    assert fake_vllm == []


def test_builder_native_order_is_unchanged(monkeypatch, tmp_path):
    import fp8rl_core.loop.builder as builder
    from fp8rl_core.distributed.mesh import SINGLE

    class FakeGen:
        def start(self, model_dir):
            raise AssertionError("the native path calls no start()")

        def refit(self, weights):
            events.append(("refit", []))

        def tags(self):
            return {}

    events: list = []
    _record_builds(monkeypatch, events, [])
    monkeypatch.setattr(builder, "build_generation_engine",
                        lambda *a, **k: events.append(("gen", [])) or FakeGen())
    path = _checkpoint(tmp_path)
    cfg = run_config_from_dict({"output_dir": str(tmp_path / "out"), "device": "cpu", "loss": {"kl_coef": 0.1},
                                "model": {"path": str(path)}})
    builder.build_context(cfg, progress=False, mesh=SINGLE)
    assert [what for what, _ in events] == ["train", "ref", "gen", "refit"]


# ---- the real thing (CUDA + vLLM) -----------------------------------------------------------------
def _peaky_model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """A random policy with O(1) logits (the 0.02 init gives a flat distribution: a weak test)."""
    from fp8rl_core.model import build_model

    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_vllm_engine_matches_training_engine_and_refits(recipe, tmp_path):
    pytest.importorskip("vllm")
    from fp8rl_core.algorithms.metrics import token_mult_prob_error
    from fp8rl_core.config import recipe_of
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.loop.rollout import build_train_batch

    mc = ModelConfig()  # the tiny preset: hidden 256, [128, 128] blocks tile every linear
    model = _peaky_model(mc, seed=0).cuda()
    cfg = run_config_from_dict({"recipe": recipe, "output_dir": str(tmp_path), "device": "cuda",
                                "engines": {"generation": "vllm"}})
    train = NativeTrainingEngine(model, recipe=recipe_of(cfg))
    gen = vllm_engine(cfg, mc)
    prompts = [[1, 5, 7, 9], [1, 3], [1, 4, 4, 8, 15, 16], [1, 20, 21]] * 8
    sampling = SamplingParams(max_new_tokens=12, seed=5)
    try:
        gen.refit(train.weights())
        with gen.awake():  # two generations on one refit: no level-2 sleep in between
            out = gen.generate(prompts, sampling)
            batch = build_train_batch(prompts, out, gen.pad_id)
            before = token_mult_prob_error(train.logprobs(batch), batch.gen_logprobs, batch.response_mask)
            again = gen.generate(prompts, sampling)  # same seed, same weights: the same samples
        assert torch.equal(again.response_ids, out.response_ids)
        gen.sleep(level=2)  # as after a rollout: the weights are discarded, vLLM saves its buffers
        torch.manual_seed(1)
        with torch.no_grad():  # a new policy: refit must reach the running engine
            for p in model.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn_like(p) * p.std())
        gen.refit(train.weights())
        out2 = gen.generate(prompts, sampling)
        batch2 = build_train_batch(prompts, out2, gen.pad_id)
        after = token_mult_prob_error(train.logprobs(batch2), batch2.gen_logprobs, batch2.response_mask)
    finally:
        gen.close()
    print(f"{recipe}: token_mult_prob_error before refit {before:.5f}, after {after:.5f} "
          f"({gen.tags()})")
    assert before < 1.05 and after < 1.05
    assert not torch.equal(out2.response_ids, out.response_ids)
