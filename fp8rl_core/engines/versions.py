"""The GPU stack the optional backends support, and the start-up check that says so.

One coherent set is pinned as the `gpu` extra of pyproject.toml (`pip install 'fp8rl[gpu]'`), for
CUDA 13: torch 2.11.0 (cu130), vLLM 0.25.1 (whose wheel pins torch==2.11.0 exactly),
Transformer Engine 2.11.0 (core_cu13; the newest inside megatron-core 0.16.1's own tested range,
>=2.9.0a0,<2.12.0, from its wheel's `dev` extra), megatron-core 0.16.1 (the version our conversion is
tested against on the CPU). `SUPPORTED` gives, per package, the oldest version with every API the backend
calls (below it: an error) and the tested pin (another version at or above the floor: a warning).

Floors, and why:
- vllm 0.10.2: `logprobs_mode="processed_logprobs"` (log-probs after temperature); FP8 refit also needs the
  workers' `reload_weights(..., is_checkpoint_format=True)`, checked by signature at start
  (vllm_convert.choose_refit_method); `kv_cache_memory_bytes` is checked by EngineArgs field.
- transformer-engine 2.6: `Float8BlockScaling` (fp8_recipe="blockwise") with FP32 block scales.
- megatron-core 0.16: the TransformerConfig keys and GPTModel arguments of megatron_convert.py.
vLLM wheels pin torch exactly: `torch_pin_error` compares the installed torch with the one the
installed vLLM requires (its own metadata), since a mismatch fails later with undefined symbols.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from importlib import metadata

INSTALL = "pip install 'fp8rl[gpu]'"
# distribution -> (floor, tested pin)
SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.6", "2.11.0"),
    "vllm": ("0.10.2", "0.25.1"),
    "transformer-engine": ("2.6", "2.11.0"),
    "megatron-core": ("0.16", "0.16.1"),
}


def parse_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: '2.11.0+cu130' -> (2, 11, 0), '0.25.1rc1' -> (0, 25, 1)."""
    nums = []
    for part in text.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        nums.append(int(m.group()))
        if m.group() != part:
            break
    return tuple(nums)


def installed(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_problems(versions: Mapping[str, str | None]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for installed versions {dist: version or None (absent, not checked)}."""
    errors, notes = [], []
    for dist, version in versions.items():
        if version is None or dist not in SUPPORTED:
            continue
        floor, pin = SUPPORTED[dist]
        if parse_version(version) < parse_version(floor):
            errors.append(f"{dist} {version} is older than the oldest supported {floor} (tested: {pin}); {INSTALL}")
        elif parse_version(version) != parse_version(pin):
            notes.append(f"{dist} {version} is not the tested {pin} (supported: >= {floor}); {INSTALL} "
                         "installs the tested set")
    return errors, notes


def torch_pin_error(torch_version: str | None, vllm_requires: list[str] | None) -> str | None:
    """Why the installed torch cannot run the installed vLLM (whose wheel pins torch==X), or None."""
    if torch_version is None or not vllm_requires:
        return None
    for req in vllm_requires:
        m = re.match(r"^torch\s*==\s*([\w.+]+)\s*(;.*)?$", req.strip())
        if m and not (m.group(2) and "extra" in m.group(2)):
            want = m.group(1)
            if parse_version(torch_version) != parse_version(want):
                return (f"vLLM was built for torch=={want}, but torch {torch_version} is installed (vLLM wheels "
                        f"pin torch exactly: its kernels fail to load on another one); {INSTALL}")
    return None


def check_stack(dists: tuple[str, ...], *, get: Callable[[str], str | None] = installed,
                requires: Callable[[str], list[str] | None] | None = None) -> list[str]:
    """Check the installed versions of `dists` (and torch) at a backend's start: raise RuntimeError naming
    every unsupported one (and a torch that the installed vLLM was not built for); warn once per
    untested version. Returns the warning texts."""
    if requires is None:
        def requires(dist: str) -> list[str] | None:
            try:
                return metadata.requires(dist)
            except metadata.PackageNotFoundError:
                return None
    versions = {d: get(d) for d in dists}
    if not any(versions.values()):
        return []  # none of them installed as a distribution (a test's stand-in module): nothing to check
    versions["torch"] = get("torch")
    errors, notes = version_problems(versions)
    if "vllm" in dists and versions.get("vllm") is not None:
        pin = torch_pin_error(versions["torch"], requires("vllm"))
        if pin:
            errors.append(pin)
    if errors:
        supported = ", ".join(f"{d} >= {f} (tested {p})" for d, (f, p) in SUPPORTED.items())
        raise RuntimeError("unsupported GPU stack: " + "; ".join(errors) + f". Supported: {supported}")
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return notes
