"""fp8rl-train: run (or resume) one GRPO run from a config file plus dotted overrides.

    fp8rl-train --config run.yaml recipe=fp8_e2e loss.importance_sampling=token seed=1
    fp8rl-train --print-config train.steps=5        # show the resolved config and its id, run nothing
    fp8rl-train explain RUN_DIR [--step N]          # where a run's mismatch comes from (analysis/explain.py)
    torchrun --standalone --nproc-per-node 2 -m fp8rl_core.cli train.steps=5   # one run on 2 ranks
"""
from __future__ import annotations

import argparse
import json
import sys

import yaml

from fp8rl_core.config import load_run_config, run_config_hash
from fp8rl_core.config.schema import ConfigError, to_dict
from fp8rl_core.distributed.env import detect_rank_env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["explain"]:  # a verb, not an override (an override always has "=")
        # the one import of analysis from the core: the report lives there, the replay in fp8rl_core/diagnostics
        from analysis.explain import main as explain_main

        return explain_main(argv[1:])
    ap = argparse.ArgumentParser(prog="fp8rl-train", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML run config (default: the built-in defaults)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=1e-4")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    args = ap.parse_args(argv)
    try:
        cfg = load_run_config(args.config, args.overrides)
        _check_world_size(cfg)
        _check_gemm_pin(cfg)
    except (ConfigError, OSError) as e:
        print(f"fp8rl-train: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from fp8rl_core.loop.builder import bf16_path_note

        print(f"# run id {run_config_hash(cfg)}")
        print(f"# {bf16_path_note(cfg)}")
        print(f"# {fp8_gemm_note(cfg)}")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    from fp8rl_core.loop.run import RunFailed, run

    try:
        summary = run(cfg, progress=not args.no_progress)
    except RunFailed as e:
        print(f"fp8rl-train: run failed: {e}", file=sys.stderr)
        return 1
    if detect_rank_env().rank == 0:  # one summary per run, not one per rank
        print(json.dumps({k: round(v, 6) for k, v in summary.items()}, indent=1))
    return 0


def fp8_gemm_note(cfg) -> str:
    """Which FP8 GEMM executor the run takes here and how it is chosen (fp8/choice.py; nothing measured)."""
    from fp8rl_core.fp8 import cpu_features
    from fp8rl_core.fp8.choice import note
    from fp8rl_core.loop.builder import resolve_device

    device = resolve_device(cfg)
    why = "CUDA" if device.startswith("cuda") else f"CPU flags: {cpu_features.kernel_flags()}"
    return f"FP8 GEMM: {note(cfg.fp8.gemm, device)} (on {device}; {why})"


def _check_gemm_pin(cfg) -> None:
    """Pin fp8.gemm here, before any work: an executor this device cannot run, or a $FP8RL_GEMM that
    disagrees with the config (whose value is in the cell id), is refused with the fix."""
    if cfg.fp8.gemm == "auto":
        return
    from fp8rl_core.fp8.gemm import pin_executor
    from fp8rl_core.loop.builder import resolve_device

    try:
        pin_executor(cfg.fp8.gemm, resolve_device(cfg))
    except ValueError as e:
        key, _, why = str(e).partition(": ")
        raise ConfigError(key, why) from None


def _check_world_size(cfg) -> None:
    """Refuse, before any process group or work exists, a batch the launcher's ranks cannot split."""
    from fp8rl_core.distributed.mesh import Mesh
    from fp8rl_core.loop.builder import check_data_parallel

    check_data_parallel(cfg, Mesh(world_size=detect_rank_env().world_size))


if __name__ == "__main__":
    sys.exit(main())
