"""Blockwise FP8 (E4M3) numerics: quantization, the blockwise-scaled GEMM, Fp8Linear, conversion.

Conventions (docs/design.md): scale = amax/448 per block in FP32 (the dequant multiplier), weights in
[128,128] blocks, activations and gradients in [1,128] blocks along the contraction dim.
Files: quant.py (quantize/dequantize), kernels.py (the reference block kernels, optional torch.compile),
fused_cpu.py + fused_cpu.c (the CPU default: the same bits in one fused C pass, built once per machine),
gemm.py (blockwise_scaled_mm + executor precedence), calibrate.py + choice.py (the CPU executor chosen by
measurement, once per machine, and shared by a sweep's cells), emulate.py (CPU/any-device executors),
cpu_gemm.py + cpu_gemm.c (the exact GEMM on AMX / AVX512_BF16 dot products), cpu_features.py (the CPU
flags that pick kernel paths), cbuild.py (builds the C files), cuda_exec.py (Hopper scaled_mm),
gemm_bound.py (the one error bound of every executor), preflight.py (every GEMM shape checked before a
cell's first step), functional.py (inference linear), linear.py (Fp8Linear), convert.py (swap nn.Linear layers),
quantization.py (`Quantization`, torch-free: the one configuration of Fp8Linear and quantize_weight).
Formats (issue 23): formats.py is the registry (FORMATS: block128 | tensorwise | mxfp8 | nvfp4, their scale
formats, storage costs, block shapes, kernel modules); tensorwise.py, mxfp8.py, nvfp4.py hold the kernels
(block128.py wraps the path above); lowp.py runs their linear forward/dgrad/wgrad on the emulated GEMM.
Env: FP8RL_GEMM=<executor> forces a GEMM executor; FP8RL_COMPILE=1 compiles the quantization kernels;
FP8RL_FUSED=0 turns the fused CPU kernels off; FP8RL_WEIGHT_CACHE=0 re-quantizes Fp8Linear weights at
every forward (linear.py).
The names below load on first use (PEP 562), so `fp8rl_core.fp8.formats` imports without torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "convert_linear_layers": "convert",
    "FORMATS": "formats", "Format": "formats", "get_format": "formats", "resolve_scale_format": "formats",
    "Fp8Weight": "functional", "fp8_linear": "functional", "quantize_weight": "functional",
    "EXECUTORS": "gemm", "blockwise_scaled_mm": "gemm", "select_executor": "gemm",
    "compile_enabled": "kernels", "set_compile": "kernels",
    "Fp8Linear": "linear",
    "QuantWeight": "lowp",
    "Quantization": "quantization",
    "dequantize_mxfp8": "mxfp8", "quantize_mxfp8": "mxfp8",
    "dequantize_nvfp4": "nvfp4", "quantize_nvfp4": "nvfp4",
    "E4M3_MAX": "quant", "FP8_DTYPE": "quant", "dequantize_blockwise": "quant", "quantize_blockwise": "quant",
    "dequantize_tensorwise": "tensorwise", "quantize_tensorwise": "tensorwise",
}
__all__ = [
    "E4M3_MAX",
    "EXECUTORS",
    "FORMATS",
    "FP8_DTYPE",
    "Format",
    "Fp8Linear",
    "Fp8Weight",
    "QuantWeight",
    "Quantization",
    "blockwise_scaled_mm",
    "compile_enabled",
    "convert_linear_layers",
    "dequantize_blockwise",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "dequantize_tensorwise",
    "fp8_linear",
    "get_format",
    "quantize_blockwise",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_tensorwise",
    "quantize_weight",
    "resolve_scale_format",
    "select_executor",
    "set_compile",
]

if TYPE_CHECKING:
    from fp8rl_core.fp8.convert import convert_linear_layers
    from fp8rl_core.fp8.formats import FORMATS, Format, get_format, resolve_scale_format
    from fp8rl_core.fp8.functional import Fp8Weight, fp8_linear, quantize_weight
    from fp8rl_core.fp8.gemm import EXECUTORS, blockwise_scaled_mm, select_executor
    from fp8rl_core.fp8.kernels import compile_enabled, set_compile
    from fp8rl_core.fp8.linear import Fp8Linear
    from fp8rl_core.fp8.lowp import QuantWeight
    from fp8rl_core.fp8.mxfp8 import dequantize_mxfp8, quantize_mxfp8
    from fp8rl_core.fp8.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from fp8rl_core.fp8.quant import E4M3_MAX, FP8_DTYPE, dequantize_blockwise, quantize_blockwise
    from fp8rl_core.fp8.quantization import Quantization
    from fp8rl_core.fp8.tensorwise import dequantize_tensorwise, quantize_tensorwise


def __getattr__(name: str) -> Any:
    """Load an exported name (or a submodule) on first access."""
    module = _EXPORTS.get(name)
    if module is None:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
