"""The FP8 linear forward as plain functions, shared by `Fp8Linear` (training) and the generation engine.

    y[M, N] = blockwise_scaled_mm(Q(x)[1,128], Q(W)[128,128]) + bias        (bias added in FP32)

x [..., K] is quantized dynamically per token and 128-wide K-block; the weight W [N, K] once per
refit into [128, 128] blocks (`quantize_weight`). The output dtype follows x.
`quantize_weight(w, quant=Quantization(...))` (quantization.py) takes its format and scale format from that
one object; other formats (formats.py: tensorwise, mxfp8, nvfp4) give a lowp.QuantWeight, which `fp8_linear`
runs through lowp.py (the emulated GEMM of that format).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp8rl_core.fp8 import fused_cpu, lowp
from fp8rl_core.fp8.emulate import ieee_fp32_matmul
from fp8rl_core.fp8.formats import resolve_scale_format
from fp8rl_core.fp8.gemm import scaled_mm, select_executor
from fp8rl_core.fp8.lowp import QuantWeight
from fp8rl_core.fp8.operand import Operand
from fp8rl_core.fp8.quant import as_2d, quantize_2d
from fp8rl_core.fp8.quantization import BLOCK128, Quantization

ACT_BLOCK = (1, 128)  # activations and output gradients: per token, 128 along the contraction dim
WEIGHT_BLOCK = (128, 128)
COL_BLOCK = (128, 1)  # wgrad operands: 128 tokens per block, per feature


@dataclass
class Fp8Weight:
    """A linear layer's weight in blockwise E4M3: q [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] FP32.

    dequantized: optional FP32 q * scale [N, K], kept for the emulated executor so that decoding does
    not re-expand the weight at every step (None on hardware executors).
    kernel_cache: what executors derive from this quantization and keep with it (cpu_bf16dot: the packed
    BF16 layouts of W for fprop and W^T for dgrad, made on first use): the operands' shared `cache`.
    """

    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    dequantized: torch.Tensor | None = field(default=None, repr=False)
    kernel_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def operand(self) -> Operand:
        return Operand(self.q, self.scale, WEIGHT_BLOCK, self.dequantized, self.kernel_cache)


def needs_dequant(device: torch.device) -> bool:
    """Whether the GEMM executor for `device` consumes dequantized FP32 operands."""
    return select_executor(device) == "emulated"


def quantize_operand(
    x2: torch.Tensor, block: tuple[int, int], *, power_of_two: bool, check_finite: bool, name: str
) -> Operand:
    """Quantize a 2-D tensor into an Operand: the emulated executor wants its FP32 dequantized copy
    (and no E4M3 codes: q None where the fused kernel skipped them), the others the codes."""
    emulated = needs_dequant(x2.device)
    q, scale, deq = quantize_2d(
        x2, block, power_of_two=power_of_two, check_finite=check_finite, name=name,
        want_dequant=emulated, want_q=not emulated,
    )
    return Operand(q, scale, block, deq)


def quantize_weight(w: torch.Tensor, bias: torch.Tensor | None = None, *,
                    quant: Quantization = BLOCK128) -> Fp8Weight | QuantWeight:
    """Quantize a [N, K] weight as `quant` says (done once per refit). Non-finite weights raise.

    block128 (the default) gives the Fp8Weight in [128, 128] blocks (power-of-two scales with scale_format
    pow2); another format gives that format's inference weight (lowp.QuantWeight: the fprop copy only).
    """
    if quant.format != "block128":
        return lowp.quantize_weight(w, bias, format=quant.format, scale_format=quant.scale_format)
    power_of_two = resolve_scale_format("block128", quant.scale_format) == "pow2"
    if w.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [out_features, in_features] tensor, got shape {tuple(w.shape)}")
    w = w.detach()
    q, scale, deq = quantize_2d(w, WEIGHT_BLOCK, power_of_two=power_of_two, check_finite=True, name="weight",
                                want_dequant=needs_dequant(w.device))  # the codes always: refit, checkpoints
    b = None if bias is None else bias.detach()
    return Fp8Weight(q, scale, b, w.shape[0], w.shape[1], deq)


def linear_from_operands(x_op: Operand, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """y[M, N] = GEMM(x [M, K] in [1,128] blocks, w) + bias in FP32, then cast to out_dtype."""
    return scaled_mm(x_op, w.operand(), out_dtype=out_dtype, bias=w.bias)


def fp8_linear(
    x: torch.Tensor, w: Fp8Weight | QuantWeight, *, power_of_two: bool = False, check_finite: bool = False
) -> torch.Tensor:
    """Inference FP8 linear (no autograd): x [..., K] -> y [..., N] in x.dtype.

    x is quantized per token into [1, 128] blocks (dynamic activation scaling, as vLLM does). A QuantWeight
    (another format) quantizes x in its format and scale format (power_of_two is then not read).
    """
    if isinstance(w, QuantWeight):
        return lowp.linear(x, w, check_finite=check_finite)
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x: last dim {x.shape[-1]} != in_features {w.in_features}")
    with torch.no_grad():
        y = _emulated_cpu_linear(as_2d(x), w, power_of_two)
        if y is None:
            y = _bf16dot_cpu_linear(as_2d(x), w, power_of_two)
        if y is None:
            x_op = quantize_operand(as_2d(x), ACT_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="x")
            y = linear_from_operands(x_op, w, x.dtype)
    return y.reshape(*x.shape[:-1], w.out_features)


def _emulated_cpu_linear(x2: torch.Tensor, w: Fp8Weight, power_of_two: bool) -> torch.Tensor | None:
    """The same arithmetic as the general path (fused quantizer's dequantized x, one FP32 GEMM with the
    kept dequantized weight, FP32 bias, cast), without its dispatch: at decode (M = batch rows) the
    general path's Python costs as much as the GEMM. None where it does not apply (not the CPU
    emulation, or a non-finite block, which the fused kernel declines: the general path then raises or
    propagates it, as check_finite says)."""
    if w.dequantized is None or x2.device.type != "cpu" or not needs_dequant(x2.device):
        return None
    fused = fused_cpu.quantize(x2, ACT_BLOCK, power_of_two, want_dequant=True, want_q=False)
    if fused is None:
        return None
    with ieee_fp32_matmul("cpu"):
        y = torch.mm(fused[2], w.dequantized.t())
    if w.bias is not None:
        y += w.bias.to(torch.float32)
    return y.to(x2.dtype)


def _bf16dot_cpu_linear(x2: torch.Tensor, w: Fp8Weight, power_of_two: bool) -> torch.Tensor | None:
    """The general path on the cpu_bf16dot executor without its dispatch (decode-sized M): the fused
    quantizer's codes, the GEMM on the packed weight with bias and cast in its epilogue. None where it
    does not apply (another executor, or a non-finite block: the general path then raises or propagates)."""
    if x2.device.type != "cpu" or select_executor(x2.device) != "cpu_bf16dot":
        return None
    fused = fused_cpu.quantize(x2, ACT_BLOCK, power_of_two, want_dequant=False, want_q=True)
    if fused is None:
        return None
    from fp8rl_core.fp8 import cpu_gemm

    return cpu_gemm.mm(Operand(fused[0], fused[1], ACT_BLOCK), w.operand(), x2.dtype, bias=w.bias)
