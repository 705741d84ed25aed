"""Swap a module's nn.Linear layers for Fp8Linear in place (the recipe's "FP8 linear layers")."""
from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch
from typing import Any

from torch import nn

from fp8rl_core.fp8.linear import Fp8Linear


def is_excluded(name: str, patterns: Iterable[str]) -> bool:
    """True if the qualified name matches a pattern, either whole or as a dotted suffix.

    "lm_head" excludes "lm_head" and "model.lm_head"; "layers.0.*" excludes "model.layers.0.mlp.up".
    """
    return any(fnmatch(name, p) or fnmatch(name, "*." + p) for p in patterns)


def convert_linear_layers(module: nn.Module, *, exclude: Iterable[str] = ("lm_head",), quant: Any = None,
                          **fp8_kwargs) -> list[str]:
    """Replace every plain nn.Linear under `module` by an Fp8Linear sharing its Parameters.

    Sharing the Parameter objects keeps optimizers and tied weights working. Layers whose qualified
    name matches an fnmatch pattern in `exclude` (see `is_excluded`) stay BF16. quant (a recipe's
    Quantization, fp8rl_core/config/recipe.py) and fp8_kwargs (power_of_two, check_finite,
    quantize_dtype) go to Fp8Linear. Returns the converted qualified names, in module order.
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
        setattr(parent, attr, Fp8Linear.from_linear(linear, quant=quant, **fp8_kwargs))
    return [name for name, _ in targets]
