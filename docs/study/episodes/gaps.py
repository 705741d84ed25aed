"""Layer 0, head 2, '=' at position 5: the attention-logit gap BOS − '=' (docs/study/instability/) at each
kept checkpoint of every distinct-kernel run of a sweep, beside the run's episode flag:

    python docs/study/episodes/gaps.py URI SWEEP OUTPUTS_DIR WARMSTART_DIR   # e.g.
    python docs/study/episodes/gaps.py sqlite:///mlflow.db fp8_episodes outputs/fp8_episodes .fp8rl/warmstart/<hash>

OUTPUTS_DIR/cells/<cell id>/checkpoints holds each run's checkpoints (the sweep keeps its last two: steps 40
and 80 for the study's 80 steps). A negative gap: the head has switched from BOS to '=' itself.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from analysis.config import AnalysisConfig
from analysis.episodes import detect_all
from analysis.fetch import fetch_sweep
from analysis.kernel_match import only_kernels
from fp8rl_core.config.yaml_io import load_mapping_file
from fp8rl_core.explain.replay import load_policy_weights
from fp8rl_core.io.checkpoint import list_checkpoints
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.llama import CausalLM
from fp8rl_core.tracking import TAG_CELL_ID, TAG_IS, TAG_RECIPE, TAG_SEED

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instability"))
from episode_series import head_gaps  # noqa: E402

SWEEP = Path(__file__).resolve().parents[3] / "sweeps" / "fp8_episodes.yaml"


def main(uri: str, sweep: str, outputs: Path, warm: Path) -> None:
    config = ModelConfig.from_hf_dict(json.loads((warm / "config.json").read_text()))
    cfg = AnalysisConfig.from_dict(load_mapping_file(SWEEP).get("analysis"))
    runs = only_kernels(fetch_sweep(uri, sweep, sweep).runs)
    print("| recipe | IS | seed | episode | gap by checkpoint |\n|---|---|--:|---|---|")
    rows = []
    for run, eps in zip(runs, detect_all(runs, cfg)):
        gaps = []
        for ckpt in list_checkpoints(outputs / "cells" / run.tags[TAG_CELL_ID] / "checkpoints"):
            model = CausalLM(config)
            model.load_state_dict(load_policy_weights(ckpt, config), strict=False)
            model.tie_weights()
            gaps.append(f"{int(ckpt.name.split('_')[1])}: {head_gaps(model.float().eval(), False)[5]:+.1f}")
        rows.append((run.tags[TAG_RECIPE], run.tags[TAG_IS], int(run.tags[TAG_SEED]),
                     "yes" if eps.has_episode else "–", ", ".join(gaps)))
    for row in sorted(rows):
        print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    with torch.no_grad():
        main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
