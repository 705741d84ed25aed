"""The registry of low-precision formats: one entry per format, each naming its kernel module.

    FORMATS["mxfp8"].scale_formats      # ("e8m0",): the valid scale formats, the first one the default
    FORMATS["nvfp4"].weight_bytes((N, K))  # bytes of one quantized copy of an [N, K] weight (memory plan)
    FORMATS["tensorwise"].kernels()     # the kernel module (imported on first use; torch lives there)

Every format's kernel module exposes the two functions the linears call (lowp.py drives them):
    quantize_operand(x2, along, *, scale_format, check_finite, name) -> lowp.QTensor
        x2 [R, C] quantized in the blocks of a GEMM operand whose reduction dim is `along` (1: the last
        dim, fprop's X and W and dgrad's dY; 0: the first dim, wgrad's dY and X, contracted over tokens)
    quantize_weight(w2, *, scale_format, check_finite, name, dgrad) -> (fprop QTensor, dgrad QTensor | None)
        the weight [N, K] for fprop (reduction along K) and, with dgrad, for dgrad (reduction along N;
        the same object where one quantization serves both)
block128 is the package's original path (quant.py / functional.py, its fused CPU quantizer and its GEMM
executors): Fp8Linear and fp8_linear keep running it directly; block128.py offers it through the same
interface (the generic emulation, bit-identical to the "emulated" executor; tested).

Adding a format: one entry here plus its kernel module. Torch-free on purpose: the config layer and the
memory plan read this table without importing torch.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

__all__ = ["FORMATS", "Format", "get_format", "resolve_scale_format"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Format:
    """One low-precision format: its scale formats, storage costs, block shapes and kernel module."""

    name: str
    scale_formats: tuple[str, ...]  # valid `fp8.scale_format` values; the first is the default
    element_bits: int  # bits per stored element (8: E4M3, 4: E2M1)
    blocks: str  # one line: the block shape of each GEMM operand
    module: str  # the kernel module, imported lazily by kernels()
    # bytes of the scales of one quantized copy of an [N, K] weight / of an [M, K] activation
    weight_scale_bytes: Callable[[int, int], int]
    act_scale_bytes: Callable[[int, int], int]
    # quantized copies of a weight a trainer keeps for fprop and dgrad (MXFP8: rowwise + columnwise)
    training_weight_copies: int = 1

    @property
    def default_scale_format(self) -> str:
        return self.scale_formats[0]

    def weight_bytes(self, shape: tuple[int, int]) -> int:
        """Codes plus scales of one quantized copy of an [N, K] weight (the generation engine's copy)."""
        n, k = shape
        return _cdiv(n * k * self.element_bits, 8) + self.weight_scale_bytes(n, k)

    def act_bytes(self, shape: tuple[int, int]) -> int:
        """Codes plus scales of an [M, K] activation quantized along K."""
        m, k = shape
        return _cdiv(m * k * self.element_bits, 8) + self.act_scale_bytes(m, k)

    def kernels(self) -> ModuleType:
        """The kernel module (quantize_operand, quantize_weight and the format's public functions)."""
        return importlib.import_module(self.module)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("block128", ("fp32", "pow2"), 8,
               "weights [128,128]; activations and gradients [1,128] along the reduction dim (wgrad: [128,1])",
               "fp8rl_core.fp8.block128",
               weight_scale_bytes=lambda n, k: 4 * _cdiv(n, 128) * _cdiv(k, 128),
               act_scale_bytes=lambda m, k: 4 * m * _cdiv(k, 128)),
        Format("tensorwise", ("fp32", "pow2"), 8,
               "one FP32 scale per tensor (weights per projection), every operand",
               "fp8rl_core.fp8.tensorwise",
               weight_scale_bytes=lambda n, k: 4,
               act_scale_bytes=lambda m, k: 4),
        Format("mxfp8", ("e8m0",), 8,
               "[1,32] along the reduction dim of every GEMM: W rowwise (fprop) and columnwise (dgrad) copies, "
               "X and dY rowwise (fprop, dgrad) and columnwise (wgrad)",
               "fp8rl_core.fp8.mxfp8",
               weight_scale_bytes=lambda n, k: n * _cdiv(k, 32),
               act_scale_bytes=lambda m, k: m * _cdiv(k, 32),
               training_weight_copies=2),
        Format("nvfp4", ("e4m3_fp32",), 4,
               "weights [16,16] (one quantization serves fprop and dgrad); activations and gradients [1,16] "
               "along the reduction dim (wgrad: [16,1]); plus one FP32 scale per tensor",
               "fp8rl_core.fp8.nvfp4",
               weight_scale_bytes=lambda n, k: _cdiv(n, 16) * _cdiv(k, 16) + 4,
               act_scale_bytes=lambda m, k: m * _cdiv(k, 16) + 4),
    )
}


def get_format(name: str) -> Format:
    """FORMATS[name]; an unknown name raises ValueError listing the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"format: unknown format {name!r}; valid: {', '.join(FORMATS)}") from None


def resolve_scale_format(name: str, scale_format: str | None = None) -> str:
    """scale_format checked against the format's valid ones (None: the format's default)."""
    fmt = get_format(name)
    if scale_format is None:
        return fmt.default_scale_format
    if scale_format not in fmt.scale_formats:
        raise ValueError(f"scale_format: {scale_format!r} is not valid for format {name!r}; "
                         f"valid: {', '.join(fmt.scale_formats)}")
    return scale_format
