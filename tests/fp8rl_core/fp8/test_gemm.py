"""blockwise_scaled_mm against a float64 reference built from the per-K-block products.

Reference: P_kb = qa_kb.double() @ qb_kb.double().T is EXACT in float64 (each product of two E4M3
values has an 8-bit significand and lies in [2**-18, 448**2]; 128 of them sum within 41 < 53 bits),
so C_ref = sum_kb P_kb * sa * sb in float64 is the exact blockwise result up to 2**-53.

Tolerances (Higham's bound for any FP32 summation order), u = 2**-24,
C_abs = sum_kb |sa||sb| (|qa_kb| @ |qb_kb|^T):
- "emulated_blockwise" (DeepSeek order): FP32 accumulation of bk = 128 exact products, two scale
  multiplications and the sum over Kb blocks: |C - C_ref| <= (bk + Kb + 2) u C_abs.
- "emulated" (one FP32 GEMM of the dequantized operands): each operand element rounded once
  (2u), products rounded at most once and K FP32 additions: |C - C_ref| <= (K + 4) u C_abs.
Both are what "products accumulated in FP32" allows, and far below a BF16 rounding (2**-8 |C|).
"""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.fp8 import blockwise_scaled_mm, quantize_blockwise, select_executor
from fp8rl_core.fp8.gemm_bound import BOUND  # the one bound of every executor (docs/design.md)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def row_scales(scale: torch.Tensor, br: int, rows: int) -> torch.Tensor:
    return scale.repeat_interleave(br, 0)[:rows].double()


def reference_mm(qa, sa, qb, sb, block_a, block_b):
    """(C_ref, C_abs) in float64; see the module docstring."""
    (m, k), n, bk = qa.shape, qb.shape[0], block_a[1]
    sa_r, sb_r = row_scales(sa, block_a[0], m), row_scales(sb, block_b[0], n)
    c = torch.zeros(m, n, dtype=torch.float64)
    c_abs = torch.zeros(m, n, dtype=torch.float64)
    for kb, k0 in enumerate(range(0, k, bk)):
        a, b = qa[:, k0 : k0 + bk].double(), qb[:, k0 : k0 + bk].double()
        s = sa_r[:, kb, None] * sb_r[None, :, kb]
        c += (a @ b.T) * s
        c_abs += (a.abs() @ b.abs().T) * s.abs()
    return c, c_abs


def tolerance(c_abs: torch.Tensor, k: int, executor: str = "emulated", bk: int = 128) -> torch.Tensor:
    terms = bk + -(-k // bk) + 2 if executor == "emulated_blockwise" else k + 4
    return terms * 2.0**-24 * c_abs


EMULATORS = ["emulated", "emulated_blockwise"]


def make_operands(m, n, k, block_b, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)[None, :].flip(1)  # varied K-block scales
    b = torch.randn(n, k, generator=g) * 0.02
    qa, sa = quantize_blockwise(a.to(device), (1, 128))
    qb, sb = quantize_blockwise(b.to(device), block_b)
    return qa, sa, qb, sb


@pytest.mark.parametrize("executor", EMULATORS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (5, 7, 128), (130, 129, 300), (64, 256, 1024)])
@pytest.mark.parametrize("block_b", [(128, 128), (1, 128)])
def test_emulated_matches_float64(m, n, k, block_b, executor):
    qa, sa, qb, sb = make_operands(m, n, k, block_b, seed=m + n + k)
    c = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=block_b, executor=executor)
    c_ref, c_abs = reference_mm(qa, sa, qb, sb, (1, 128), block_b)
    assert c.dtype == torch.float32 and c.shape == (m, n)
    err, tol = (c.double() - c_ref).abs(), tolerance(c_abs, k, executor)
    assert torch.all(err <= tol), f"max err/tol {(err / tol).max().item()}"


@pytest.mark.parametrize("executor", EMULATORS)
def test_reference_detects_a_one_step_operand_change(executor):
    """The tolerance is tight: changing one E4M3 operand by one step must fail it."""
    qa, sa, qb, sb = make_operands(16, 16, 256, (128, 128))
    c = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128), executor=executor)
    qa2 = qa.clone()
    qa2[3, 5] = (qa2[3, 5].float() * (1 + 2.0**-3)).clamp(-448, 448).to(torch.float8_e4m3fn)  # one E4M3 step
    if qa2[3, 5].float() == qa[3, 5].float():
        qa2[3, 5] = (qa[3, 5].float() * (1 - 2.0**-4)).to(torch.float8_e4m3fn)
    c_ref, c_abs = reference_mm(qa2, sa, qb, sb, (1, 128), (128, 128))
    assert not torch.all((c.double() - c_ref).abs() <= tolerance(c_abs, 256, executor))


def test_emulation_ignores_reduced_precision_matmul_settings():
    """A global "medium" float32 matmul precision (oneDNN BF16 / TF32) must not leak into the emulation:
    the result is bit-identical to the one under "highest" (a plain FP32 matmul does change here)."""
    qa, sa, qb, sb = make_operands(64, 64, 512, (128, 128))
    want = {e: blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128), executor=e) for e in EMULATORS}
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        for executor in EMULATORS:
            c = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128), executor=executor)
            assert torch.equal(c, want[executor]), executor
    finally:
        torch.set_float32_matmul_precision(old)


def test_bf16_output_is_rounded_fp32_result():
    qa, sa, qb, sb = make_operands(32, 48, 256, (128, 128))
    c32 = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128))
    c16 = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128), out_dtype=torch.bfloat16)
    assert c16.dtype == torch.bfloat16 and torch.equal(c16, c32.to(torch.bfloat16))


def test_select_executor(monkeypatch):
    monkeypatch.delenv("FP8RL_GEMM", raising=False)
    monkeypatch.setenv("FP8RL_CPU_FLAGS_OFF", "amx_bf16 avx512_bf16")  # cpu_bf16dot: test_cpu_gemm.py
    assert select_executor("cpu") == "emulated"
    assert select_executor("cpu", "emulated") == "emulated"
    monkeypatch.setenv("FP8RL_GEMM", "emulated")
    assert select_executor("cuda") == "emulated"
    monkeypatch.setenv("FP8RL_GEMM", "bogus")
    with pytest.raises(ValueError, match="valid: emulated"):
        select_executor("cpu")


def test_hardware_executors_refuse_cpu_tensors():
    qa, sa, qb, sb = make_operands(4, 4, 128, (128, 128))
    with pytest.raises(ValueError, match="CUDA"):
        blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128), executor="scaled_mm")
    with pytest.raises(ValueError, match="unknown executor 'te'"):  # removed: TE runs inside Megatron only
        blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128), executor="te")


def test_operand_validation():
    qa, sa, qb, sb = make_operands(4, 4, 256, (128, 128))
    with pytest.raises(ValueError, match="sb"):
        blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(1, 128))
    with pytest.raises(ValueError, match="qa"):
        blockwise_scaled_mm(qa.float(), sa, qb, sb, block_a=(1, 128), block_b=(128, 128))
    with pytest.raises(ValueError, match="contraction"):
        blockwise_scaled_mm(qa[:, :128], sa[:, :1], qb, sb, block_a=(1, 128), block_b=(128, 128))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("block_b", [(128, 128), (1, 128)])
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (130, 384, 512), (512, 1024, 2048)])
def test_cuda_executors_match_float64(m, n, k, block_b):
    """Every executor available on this GPU is within its bound of the float64 result.

    Hopper tensor cores accumulate FP8 products with only ~14 bits inside a 128-wide K-block
    (DeepSeek-V3 section 3.3.2), so hardware executors get 2**-9 * C_abs: 16x below one E4M3 step
    (2**-4), so a wrong scale layout or a missing K-block still fails."""
    qa, sa, qb, sb = make_operands(m, n, k, block_b, device="cuda")
    c_ref, c_abs = reference_mm(qa.cpu(), sa.cpu(), qb.cpu(), sb.cpu(), (1, 128), block_b)
    from fp8rl_core.fp8 import cuda_exec

    for name in [*EMULATORS, *cuda_exec.available_executors(torch.device("cuda"))]:
        c = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=block_b, executor=name)
        err = (c.double().cpu() - c_ref).abs()
        tol = tolerance(c_abs, k, name) if name.startswith("emulated") else BOUND * c_abs + 1e-30
        assert torch.all(err <= tol), f"{name}: max err/tol {(err / tol).max().item()}"


@pytest.mark.cuda
@needs_cuda
def test_scaled_mm_executor_is_selected_on_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise scaled_mm is SM90-only")
    assert select_executor("cuda") == "scaled_mm"


@pytest.fixture
def unpinned():
    from fp8rl_core.fp8.gemm import pin_executor

    yield pin_executor
    pin_executor(None)  # the pin is process-wide: leave none behind for other tests


def test_a_pinned_executor_wins_over_the_automatic_choice(monkeypatch, unpinned):
    monkeypatch.delenv("FP8RL_GEMM", raising=False)
    unpinned("emulated_blockwise")
    assert select_executor("cpu") == "emulated_blockwise"
    assert select_executor("cpu", "emulated") == "emulated"  # an explicit per-call override still wins
    qa, sa, qb, sb = make_operands(8, 16, 256, (128, 128))
    pinned = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128))
    literal = blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=(128, 128), executor="emulated_blockwise")
    assert torch.equal(pinned, literal)
    unpinned("auto")
    monkeypatch.setenv("FP8RL_CPU_FLAGS_OFF", "amx_bf16 avx512_bf16")
    assert select_executor("cpu") == "emulated"


def test_a_pin_refuses_what_it_cannot_honour(monkeypatch, unpinned):
    monkeypatch.setenv("FP8RL_GEMM", "emulated")
    with pytest.raises(ValueError, match=r"pins 'emulated_blockwise' but \$FP8RL_GEMM='emulated'"):
        unpinned("emulated_blockwise")
    unpinned("emulated")  # agreeing with the environment is fine
    monkeypatch.delenv("FP8RL_GEMM")
    with pytest.raises(ValueError, match="'scaled_mm' runs on a CUDA device"):
        unpinned("scaled_mm", "cpu")
    with pytest.raises(ValueError, match="unknown executor 'bogus'"):
        unpinned("bogus")
