"""Blockwise FP8 (E4M3) numerics: quantization, the blockwise-scaled GEMM, Fp8Linear, conversion.

Conventions (docs/design.md): scale = amax/448 per block in FP32 (the dequant multiplier), weights in
[128,128] blocks, activations and gradients in [1,128] blocks along the contraction dim.
Files: quant.py (quantize/dequantize), kernels.py (the reference block kernels, optional torch.compile),
fused_cpu.py + fused_cpu.c (the CPU default: the same bits in one fused C pass, built once per machine),
gemm.py (blockwise_scaled_mm + executor choice), emulate.py (CPU/any-device executors),
cuda_exec.py (Hopper scaled_mm), functional.py (inference linear), linear.py (Fp8Linear),
convert.py (swap nn.Linear layers).
Env: FP8RL_GEMM=<executor> forces a GEMM executor; FP8RL_COMPILE=1 compiles the quantization kernels;
FP8RL_FUSED=0 turns the fused CPU kernels off; FP8RL_WEIGHT_CACHE=0 re-quantizes Fp8Linear weights at
every forward (linear.py).
"""
from fp8rl_core.fp8.convert import convert_linear_layers
from fp8rl_core.fp8.functional import Fp8Weight, fp8_linear, quantize_weight
from fp8rl_core.fp8.gemm import EXECUTORS, blockwise_scaled_mm, select_executor
from fp8rl_core.fp8.kernels import compile_enabled, set_compile
from fp8rl_core.fp8.linear import Fp8Linear
from fp8rl_core.fp8.quant import E4M3_MAX, FP8_DTYPE, dequantize_blockwise, quantize_blockwise

__all__ = [
    "E4M3_MAX",
    "EXECUTORS",
    "FP8_DTYPE",
    "Fp8Linear",
    "Fp8Weight",
    "blockwise_scaled_mm",
    "compile_enabled",
    "convert_linear_layers",
    "dequantize_blockwise",
    "fp8_linear",
    "quantize_blockwise",
    "quantize_weight",
    "select_executor",
    "set_compile",
]
