"""The numerics study's arms: a run's knob setting, normalized, and its label (`analysis/numerics.py`'s
module docstring says how the knobs are normalized), and the names of a paired effect's verdicts. Its own
module so that `analysis.numerics` and `analysis.numerics_episodes` share it without importing each other.

**The reference arm.** Every arm is paired against one reference setting of the knobs: by default every knob at
its default (the arm labelled `default`); a sweep file's `analysis.reference` (knob -> value, the knobs not named
at their defaults) names another, e.g. `{fp8.format: nvfp4, loss.importance_sampling: token}` for corrections
compared with per-token IS under NVFP4 generation. Labels then name what differs from the reference, and the
reference arm itself is labelled `reference`."""
from __future__ import annotations

from collections.abc import Mapping

from fp8rl_core.config import Fp8Spec, LossSpec
from fp8rl_core.fp8.formats import FORMATS  # torch-free registry

DEFAULT_ARM = "default"  # the reference arm's label when the reference is every knob's default
REFERENCE_ARM = "reference"  # its label under a sweep file's `analysis.reference`
# the knobs and their defaults as the params read them (strings), from the run config itself; the order
# of labels and of the table
KNOBS = ("format", "scale_format", "quantize_from", "lm_head", "bf16_first_layers", "bf16_last_layers",
         "kv_cache", "kv_scale", "kv_quantize_from")  # the fp8.* knobs; the FP8 KV cache's last (issue 34)
OTHER_KNOBS = ("importance_sampling",)  # the loss.* knobs: a mismatch correction (sweeps/fp8_corrections.yaml)
KNOB_DEFAULTS = {**{f"fp8.{k}": str(getattr(Fp8Spec(), k)) for k in KNOBS},
                 **{f"loss.{k}": str(getattr(LossSpec(), k)) for k in OTHER_KNOBS}}
FORMAT, SCALE_FORMAT = "fp8.format", "fp8.scale_format"
LEGACY_POW2 = "fp8.power_of_two_scales"  # true = scale_format pow2
INT_KNOBS = ("fp8.bf16_first_layers", "fp8.bf16_last_layers")
HIGHER, LOWER, NONE, TOO_FEW = "higher", "lower", "no detectable difference", "n/a (n < 2)"


def _default_scale_format(fmt: str) -> str | None:
    """The format's own default scale format (what `auto` resolves to), None for an unknown format."""
    f = FORMATS.get(fmt)
    return f.default_scale_format if f is not None else None


def knob_values(params: Mapping[str, str]) -> dict[str, str]:
    """The run's knobs, normalized (module docstring): equal strings mean the same numerics."""
    values = {k: str(params.get(k, d)).strip() for k, d in KNOB_DEFAULTS.items()}
    for k in INT_KNOBS:
        try:
            values[k] = str(int(float(values[k])))
        except ValueError:
            pass
    scale = values[SCALE_FORMAT]
    if scale == "auto" and str(params.get(LEGACY_POW2, "")).strip().lower() == "true":
        scale = "pow2"
    if scale == _default_scale_format(values[FORMAT]):
        scale = "auto"
    values[SCALE_FORMAT] = scale
    return values


def reference_values(reference: Mapping[str, str] | None = None) -> dict[str, str]:
    """The reference arm's knobs, normalized: the defaults, with `reference`'s values over them."""
    return knob_values({**KNOB_DEFAULTS, **(reference or {})})


def reference_label(reference: Mapping[str, str] | None = None) -> str:
    """The reference arm's label: `default`, or `reference` under an `analysis.reference`."""
    return REFERENCE_ARM if reference else DEFAULT_ARM


def reference_settings(reference: Mapping[str, str]) -> str:
    """'fp8.format=nvfp4 + loss.importance_sampling=token': the knobs `reference` names, normalized."""
    values = reference_values(reference)
    return " + ".join(f"{k}={values[k]}" for k in KNOB_DEFAULTS if k in reference)


def reference_text(reference: Mapping[str, str] | None = None) -> str:
    """'the default recipe', or 'the reference (fp8.format=nvfp4 + loss.importance_sampling=token)'."""
    return f"the reference ({reference_settings(reference)})" if reference else "the default recipe"


def changed_knobs(params: Mapping[str, str], reference: Mapping[str, str] | None = None) -> dict[str, str]:
    """The knobs whose value differs from the reference's (the defaults'), in `KNOB_DEFAULTS` order."""
    ref = reference_values(reference)
    return {k: v for k, v in knob_values(params).items() if v != ref[k]}


def arm_label(params: Mapping[str, str], reference: Mapping[str, str] | None = None) -> str:
    """`default` (or `reference`), `fp8.format=mxfp8`, or `fp8.format=mxfp8 + fp8.lm_head=fp8` (two knobs)."""
    changed = changed_knobs(params, reference)
    return " + ".join(f"{k}={v}" for k, v in changed.items()) or reference_label(reference)
