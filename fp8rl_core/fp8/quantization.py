"""`Quantization`: how one engine's low-precision linear layers quantize, the one configuration of the kernels.

    quant = Quantization(format="mxfp8", scale_format="e8m0")
    Fp8Linear(1024, 1024, quant=quant)          # the trainer's linear (linear.py)
    quantize_weight(w, bias, quant=quant)       # a generation engine's weight (functional.py)

A knob of the run config's `fp8` section that changes how a linear quantizes is a field here, named as its
`fp8.*` key (config/recipe.py's `resolve_recipe` copies the fields by name), and the kernel reads it from
this object. Plain values, torch-free: the config layer builds it without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quantization:
    """How one engine's low-precision linear layers quantize. Default: block128, E4M3 blocks with FP32
    scales (DeepSeek-V3: weights [128, 128], activations and gradients [1, 128]).

    format: a name in fp8rl_core.fp8.formats.FORMATS (block128 | tensorwise | mxfp8 | nvfp4);
    scale_format: resolved, one of that format's scale formats (block128/tensorwise: fp32 | pow2;
    mxfp8: e8m0; nvfp4: e4m3 block scales with an FP32 tensor scale, "e4m3_fp32").
    """

    format: str = "block128"
    scale_format: str = "fp32"
    check_finite: bool = True  # raise on NaN/inf before quantizing
    # trainer only: Q(W) of the BF16 rounding of the FP32 master ("bf16", what the generation engine is
    # refit with) or of the master itself ("master"); the generation engine quantizes what a refit sends
    quantize_from: str = "bf16"

    @property
    def power_of_two_scales(self) -> bool:
        """block128/tensorwise scales rounded up to 2^k (Transformer Engine's default)."""
        return self.scale_format == "pow2"


BLOCK128 = Quantization()  # the default: block128 with FP32 scales, finiteness checked
