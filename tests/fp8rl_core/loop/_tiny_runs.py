"""The tiny run the loop tests share: its config (a 10-step warm start cached under tmp_path, 2 prompts × 3
samples of 5 tokens, one thread) and its per-step metrics as metrics.jsonl logged them."""
from __future__ import annotations

import json
from pathlib import Path

from fp8rl_core.config import RunConfig, load_run_config


def tiny_config(tmp_path: Path, name: str, *extra: str, steps: int = 4) -> RunConfig:
    """A tiny run writing to tmp_path/name; `extra` overrides come last (they win)."""
    return load_run_config(None, [
        f"output_dir={tmp_path / name}", f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=10",
        "warmstart.batch_size=16", f"train.steps={steps}", "train.val_every=2", "train.checkpoint_every=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3", "rollout.max_new_tokens=5",
        "task.val_size=6", "threads=1", *extra])


def is_timing(key: str) -> bool:
    """Wall-clock metrics differ run to run; everything else must match bit for bit."""
    return key.endswith("time_s") or key.endswith("per_s")


def step_metrics(path: Path, timings: bool = True) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of a run's metrics.jsonl (timings=False drops the wall-clock ones)."""
    out: dict[int, dict[str, float]] = {}
    for line in (path / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics":
            vals = {k: v for k, v in rec["values"].items() if timings or not is_timing(k)}
            out.setdefault(rec["step"], {}).update(vals)
    return out
