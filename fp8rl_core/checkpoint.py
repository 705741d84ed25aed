"""Export a run checkpoint (fp8rl_core/io/checkpoint.py, DCP) as an HF checkpoint folder (config.json +
safetensors), in one process at any saved world size:

    python -m fp8rl_core.checkpoint export runs/x/checkpoints/step_00000010 out/hf_step10 [--quantization fp8_block]

An entry point: it joins the checkpoint layer (io) and the model, which io does not import.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fp8rl_core.io import checkpoint as ckpt_io
from fp8rl_core.model import save_pretrained
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.llama import CausalLM


def export_hf(ckpt: str | Path, out_dir: str | Path, quantization: str | None = None) -> Path:
    """An HF checkpoint folder (config.json + safetensors) of the policy in DCP checkpoint `ckpt`.

    Runs in one process at any saved world size (DCP gathers the shards). quantization: None or
    "fp8_block" (fp8rl_core.model.save_pretrained).
    """
    ckpt = Path(ckpt)
    if not (ckpt / "config.json").exists():
        raise FileNotFoundError(f"{ckpt}: no config.json; not a checkpoint written by fp8rl_core.loop.run")
    cfg = ModelConfig.from_hf_dict(json.loads((ckpt / "config.json").read_text()))
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    weights = {k: v for k, v in model.state_dict().items()}
    ckpt_io.load_checkpoint(ckpt, {ckpt_io.TRAIN_KEY: {"model": weights}}, partial=True)
    model.load_state_dict(weights, strict=True)
    return save_pretrained(model, out_dir, quantization=quantization)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8rl_core.checkpoint", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write an HF checkpoint folder from a DCP checkpoint")
    e.add_argument("ckpt")
    e.add_argument("out_dir")
    e.add_argument("--quantization", choices=["fp8_block"], default=None)
    args = p.parse_args(argv)
    out = export_hf(args.ckpt, args.out_dir, args.quantization)
    print(f"exported {args.ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
