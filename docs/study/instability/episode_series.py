"""The episode's mechanism as a series over checkpoints (docs/study/instability/README.md):

    python docs/study/instability/episode_series.py RUN_DIR WARMSTART_DIR > episode_series.json

RUN_DIR: a run of the evidence's cell that kept every checkpoint (README "Reproduce"); WARMSTART_DIR: its
warm start (`.fp8rl/warmstart/<hash>`). Per checkpoint s (0 = the warm start): the run's logged metrics of
step s and, for layer 0's attention head 2 at the '=' token, the logit gap

    gap = (q_= · k_BOS − q_= · k_=) / sqrt(head_dim)      (FP32 products of the BF16 q, k, as the trainer's
                                                            attention computes them)

for the '=' at positions 4, 5, 6 (prompts with 2, 3, 4 operand digits; in layer 0 q and k depend on the token
and its position only), with the BF16 weights and with layer 0's q/k projection weights quantized to E4M3
[128, 128] (the recipe's Q(W), from their BF16 rounding).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fp8rl_core.diagnostics.tokens import find_checkpoint
from fp8rl_core.explain.attribution import fake_quantize
from fp8rl_core.explain.replay import load_policy_weights
from fp8rl_core.model import load_pretrained
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.layers import apply_rope, rope_cos_sin
from fp8rl_core.model.llama import CausalLM
from fp8rl_core.model.tokenizer import char_tokenizer

PROBES = {4: "7+6=", 5: "7+64=", 6: "17+64="}  # '=' at position 4, 5, 6 (BOS at 0)
HEAD = 2
QK = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj")


def head_gaps(model: CausalLM, fp8_qk: bool) -> dict[int, float]:
    """{position of '=': gap} for one model (FP32 masters, BF16 autocast as the trainer runs)."""
    if fp8_qk:
        others = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in QK)
        fake_quantize(model, others, weights=True, activations=False, quantize_dtype=torch.bfloat16)
    m, tok = model.model, char_tokenizer()
    layer = m.layers[0]
    att = layer.self_attn
    out = {}
    for pos, text in PROBES.items():
        ids = torch.tensor(tok.encode(text))
        assert len(ids) == pos + 1, (text, ids.tolist())
        t = len(ids)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = layer.input_layernorm(m.embed_tokens(ids[None]))
            q = att.q_proj(h).view(1, t, att.n_heads, att.head_dim).transpose(1, 2)
            k = att.k_proj(h).view(1, t, att.n_kv, att.head_dim).transpose(1, 2)
            cos, sin = rope_cos_sin(torch.arange(t)[None], att.head_dim, att.theta, q.dtype, att.rope_scaling)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(att.n_heads // att.n_kv, 1)
        logits = (q.float() @ k.float().transpose(-1, -2))[0, HEAD, pos] / att.head_dim ** 0.5
        out[pos] = round(float(logits[0] - logits[pos]), 4)
    return out


def metrics_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics":
            steps.setdefault(rec["step"], {}).update(rec["values"])
    return steps


def main(run_dir: Path, warm: Path) -> list[dict]:
    config = ModelConfig.from_hf_dict(json.loads((warm / "config.json").read_text()))
    metrics, keep = metrics_by_step(run_dir), ("token_mult_prob_error", "grad_norm", "reward_mean", "is_weight_max",
                                               "val_accuracy", "val_accuracy_bf16_eval")
    series = []
    for step in range(0, max(metrics) + 1):
        if step == 0:
            weights = dict(load_pretrained(warm, dtype=torch.float32).state_dict())
        else:
            weights = load_policy_weights(find_checkpoint(run_dir / "checkpoints", step), config)
        row: dict = {"step": step, **{k: metrics.get(step, {}).get(k) for k in keep}}
        for fp8 in (False, True):
            model = CausalLM(config)
            model.load_state_dict(weights, strict=False)
            model.tie_weights()
            row["gap_fp8_qk" if fp8 else "gap_bf16"] = head_gaps(model.float().eval(), fp8)
        series.append(row)
        print(f"checkpoint {step}: gap at '=' pos 5 {row['gap_bf16'][5]:+.3f} (FP8 q/k {row['gap_fp8_qk'][5]:+.3f})",
              file=sys.stderr)
    return series


if __name__ == "__main__":
    json.dump(main(Path(sys.argv[1]), Path(sys.argv[2])), sys.stdout, indent=1)
