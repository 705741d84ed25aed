"""Swap a module's nn.Linear layers for Fp8Linear in place (the recipe's "FP8 linear layers")."""
from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch

import torch
from torch import nn

from fp8rl_core.fp8.linear import Fp8Linear
from fp8rl_core.fp8.quantization import BLOCK128, Quantization


def is_excluded(name: str, patterns: Iterable[str]) -> bool:
    """True if the qualified name matches a pattern, either whole or as a dotted suffix.

    "lm_head" excludes "lm_head" and "model.lm_head"; "layers.0.*" excludes "model.layers.0.mlp.up".
    """
    return any(fnmatch(name, p) or fnmatch(name, "*." + p) for p in patterns)


def convert_linear_layers(module: nn.Module, *, exclude: Iterable[str] = ("lm_head",),
                          quant: Quantization = BLOCK128, quantize_dtype: torch.dtype | None = None) -> list[str]:
    """Replace every plain nn.Linear under `module` by an Fp8Linear sharing its Parameters.

    Sharing the Parameter objects keeps optimizers and tied weights working. Layers whose qualified
    name matches an fnmatch pattern in `exclude` (see `is_excluded`) stay BF16. quant (quantization.py; a
    recipe's `training`) and quantize_dtype go to every Fp8Linear. Returns the converted qualified names, in
    module order.
    """
    patterns = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    targets = [
        (name, sub)
        for name, sub in module.named_modules()
        if type(sub) is nn.Linear and name and not is_excluded(name, patterns)
    ]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear.from_linear(linear, quant=quant, quantize_dtype=quantize_dtype))
    return [name for name, _ in targets]
