"""The FP8 GEMM preflight (fp8rl_core/fp8/preflight.py) on the CPU: the shapes a model's config gives, the
bound and its float64 reference, and a wrong executor for one shape refused with an error naming it."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.fp8 import gemm_bound
from fp8rl_core.fp8 import preflight as pf
from fp8rl_core.fp8.operand import Operand
from fp8rl_core.model.config import ModelConfig

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "model_type": "llama"}
SMALL = ModelConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=40)


def keyed(shapes):
    return {(s.pass_name, s.m, s.k, s.n): s for s in shapes}


def test_model_shapes_of_llama_8b():
    shapes = pf.model_shapes(LLAMA_8B, (256, 4160))
    got = keyed(shapes)
    assert len(got) == len(shapes)  # distinct
    kn = {(s.k, s.n) for s in shapes if s.pass_name == "wgrad"}
    assert kn == {(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)}  # q/o, k/v, gate/up, down
    assert got[("fprop", 256, 4096, 4096)].layer == "q_proj/o_proj"
    assert got[("fprop", 256, 4096, 6144)].layer == "qkv_proj(fused)"  # generation: [q|k|v], 4096 + 2 x 1024
    assert got[("fprop", 256, 4096, 28672)].layer == "gate_up_proj(fused)"
    assert ("dgrad", 256, 4096, 6144) not in got  # the fused layers only run forward (generation)
    assert len(shapes) == 2 * (4 * 3 + 2)
    for s in shapes:
        assert (s.block_a, s.block_b) == (((1, 128), (1, 128)) if s.pass_name == "wgrad" else ((1, 128), (128, 128)))
    assert got[("wgrad", 4160, 4096, 14336)].gemm_dims() == (14336, 4160, 4096)  # tokens are the contraction


def test_model_shapes_sides_head_and_kept_blocks():
    gen_only = pf.model_shapes(SMALL, (3,), training=False)
    assert {s.pass_name for s in gen_only} == {"fprop"}
    # fused shards padded to 128 rows: q 256, k 128, v 128 -> 512; gate|up 384 + 384 = 768
    assert {(s.layer, s.n) for s in gen_only} >= {("qkv_proj(fused)", 512), ("gate_up_proj(fused)", 768)}
    with_head = keyed(pf.model_shapes(SMALL, (3,), lm_head=True))
    assert with_head[("wgrad", 3, 256, 40)].layer == "lm_head"
    head_only = pf.model_shapes(SMALL, (3,), lm_head=True, blocks=False, generation=False)
    assert {s.layer for s in head_only} == {"lm_head"} and len(head_only) == 3


def test_every_executor_here_passes_with_room():
    shapes = pf.model_shapes(SMALL, pf.CPU_MS)
    for executor in ("emulated", "emulated_blockwise", None):  # None: what select_executor picks on this CPU
        result = pf.run_preflight(shapes, "cpu", executor=executor)
        assert result.shapes_checked == len(shapes) and 0 < result.worst_ratio < 2**-6
        assert result.worst_shape in shapes and not result.compiled
    metrics = result.as_metrics()
    assert set(metrics) == set(pf.METRICS) and metrics["fp8_preflight_shapes"] == len(shapes)
    params = result.as_params()
    assert params[pf.TAG] == "passed" and params[f"{pf.TAG}.executor"] == result.executor
    assert "2^-9" in params[f"{pf.TAG}.bound"]
    assert pf.metrics_from_params(params) == metrics
    assert pf.metrics_from_params({pf.TAG: "skipped"}) == {}


def test_operands_take_the_layouts_linear_py_passes():
    g = torch.Generator().manual_seed(0)
    dgrad = pf.GemmShape("x", "dgrad", 5, 256, 384, (1, 128), (128, 128))
    a, b = pf.make_operands(dgrad, torch.device("cpu"), g)
    assert tuple(b.q.shape) == (256, 384) and not b.q.is_contiguous()  # W^T: a transposed view
    assert tuple(b.scale.shape) == (2, 3) and b.block == (128, 128)
    wgrad = pf.GemmShape("x", "wgrad", 130, 256, 384, (1, 128), (1, 128))
    a, b = pf.make_operands(wgrad, torch.device("cpu"), g)
    assert tuple(a.q.shape) == (384, 130) and tuple(b.q.shape) == (256, 130)  # dY^T, X^T
    assert tuple(a.scale.shape) == (384, 2) and a.block == (1, 128)  # quantized (128, 1) along the tokens


def _ops(m=7, k=384, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return pf.make_operands(pf.GemmShape("x", "fprop", m, k, n, (1, 128), (128, 128)), torch.device("cpu"), g)


def test_the_bound_catches_a_wrong_scale_a_dropped_block_and_a_nan():
    a, b = _ops()
    exact = a.dequantized().double() @ b.dequantized().double().t()
    assert pf.bound_ratio(exact.float(), a, b)[0] < 2**-10
    assert pf.bound_ratio(exact.to(torch.bfloat16).float(), a, b)[0] <= 1.0  # one BF16 rounding fits
    wrong_scale = Operand(a.q, torch.cat([a.scale[:, 1:2], a.scale[:, 1:]], 1), a.block)  # block 0 read from 1
    assert pf.bound_ratio(wrong_scale.dequantized() @ b.dequantized().t(), a, b)[0] > 1
    dropped = a.dequantized()[:, 128:] @ b.dequantized()[:, 128:].t()
    assert pf.bound_ratio(dropped, a, b)[0] > 1
    nan = exact.float().clone()
    nan[3, 4] = float("nan")
    assert pf.bound_ratio(nan, a, b) == (float("inf"), (3, 4))
    with pytest.raises(ValueError, match="shape"):
        pf.bound_ratio(exact.float()[:, :-1], a, b)


def test_the_reference_is_chunked_without_changing_it(monkeypatch):
    a, b = _ops(m=300, k=384, n=260)
    c = a.dequantized() @ b.dequantized().t()
    whole = pf.bound_ratio(c, a, b)
    monkeypatch.setattr(gemm_bound, "_CHUNK_ELEMENTS", 128 * 384)  # 128-row chunks of A and B
    ratio, where = pf.bound_ratio(c, a, b)
    # the same worst element; the ratio up to float64 summation order (the BLAS blocks a chunk's GEMM
    # differently with other shapes and thread counts: K * 2**-53 relative, far below 1e-9)
    assert where == whole[1] and abs(ratio - whole[0]) <= 1e-9 * whole[0]


def test_a_wrong_executor_for_one_shape_is_refused_naming_it(monkeypatch):
    shapes = pf.model_shapes(SMALL, (5,))
    real = pf.blockwise_scaled_mm

    def wrong_for_down_proj(qa, sa, qb, sb, **kw):  # a layout bug that only one (K, N) and layout hits
        c = real(qa, sa, qb, sb, **kw)
        return c * 2 if (qa.shape[1], qb.shape[0]) == (384, 256) and qb.is_contiguous() else c

    monkeypatch.setattr(pf, "blockwise_scaled_mm", wrong_for_down_proj)
    with pytest.raises(pf.PreflightError) as info:
        pf.run_preflight(shapes, "cpu", executor="emulated")
    text = str(info.value)
    assert "down_proj fprop M=5 K=384 N=256 blocks A(1, 128) x B(128, 128)" in text
    assert "executor 'emulated'" in text and "2^-9 * C_abs" in text and "1 of 14 shapes failed" in text
    assert [s.describe() for s, _ in info.value.failures] == [
        "down_proj fprop M=5 K=384 N=256 blocks A(1, 128) x B(128, 128)"]


def test_an_executor_that_raises_fails_its_shape(monkeypatch):
    def broken(qa, sa, qb, sb, **kw):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(pf, "blockwise_scaled_mm", broken)
    with pytest.raises(pf.PreflightError, match="CUBLAS_STATUS_NOT_SUPPORTED") as info:
        pf.run_preflight(pf.model_shapes(SMALL, (5,), generation=False), "cpu", executor="emulated")
    assert len(info.value.failures) == 12


def test_compiled_runs_the_gemm_through_torch_compile(monkeypatch):
    monkeypatch.setattr(pf, "COMPILE_BACKEND", "eager")  # dynamo's tracing without Inductor's C++ build
    compiled = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or real(fn, **kw))
    shape = pf.GemmShape("x", "wgrad", 5, 256, 128, (1, 128), (1, 128))
    result = pf.run_preflight([shape], "cpu", executor="emulated", compiled=True)
    assert result.compiled and result.worst_ratio <= 1 and compiled == [{"backend": "eager"}]


def test_a_hardware_executor_that_failed_its_probe_fails_the_preflight(monkeypatch):
    from fp8rl_core.fp8.cuda_exec import ScaledMmProbeError

    def probe_failed(device, override=None):
        raise ScaledMmProbeError("cuda:0: blockwise scaled_mm probe (M, K, N = (6, 384, 256)) is 3x the bound")

    monkeypatch.setattr(pf, "select_executor", probe_failed)
    shapes = pf.model_shapes(SMALL, (5,), generation=False)
    with pytest.raises(pf.PreflightError, match="no executor to check .*probe.*No FP8 step ran") as info:
        pf.run_preflight(shapes, "cpu")
    assert isinstance(info.value.__cause__, ScaledMmProbeError) and len(info.value.failures) == len(shapes)


def test_cuda_ms_cover_the_prompt_length_the_run_allows_and_native_fp8_prefill():
    """Issue 31, M8/M9: the training M counts the allowed prompt (max_model_len - max_new_tokens, not 64), and
    a native FP8-generating cell checks its largest rollout GEMM: the prefill of the rank's distinct prompts."""
    from fp8rl_core.config import load_run_config
    from fp8rl_core.loop.builder import preflight_ms

    vllm = load_run_config(None, ["recipe=fp8_e2e", "engines.generation=vllm", "engines.vllm.max_model_len=4608",
                                  "rollout.max_new_tokens=4096", "rollout.prompts_per_step=64",
                                  "rollout.samples_per_prompt=32", "train.micro_batch_size=1"])
    assert preflight_ms(vllm, 8, "cuda") == (256, 4608)  # 64 x 32 / 8 rows decoded; 1 x (512 + 4096) tokens
    native = load_run_config(None, ["recipe=fp8_gen", "rollout.prompts_per_step=64", "rollout.samples_per_prompt=4",
                                    "rollout.max_new_tokens=32", "train.micro_batch_size=2"])
    assert preflight_ms(native, 8, "cuda") == (32, 2 * (64 + 32), 8 * 64)  # + 8 prompts x 64 tokens of prefill
    assert preflight_ms(native, 8, "cpu") == pf.CPU_MS
