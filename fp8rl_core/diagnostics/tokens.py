"""The run's diagnostics hook: catalogue metrics per step, worst-token tables, saved rollout batches.

    grpo_step:  metrics.update(observe_step(batch, mesh))      # catalogue metrics of the step's batch
    run loop:   after_step(cfg, tokenizer, model_config, result.batch, sink, step, result.kv_scales)  # files

Files under the run's output_dir (rank 0 only writes them, as everything else a run writes):
- `diagnostics/worst_tokens.jsonl`: every `diagnostics.worst_tokens_every` steps, the k valid tokens with
  the largest |train − gen| log-prob difference, one JSON object per token (WORST_TOKEN_FIELDS). Logged
  as an MLflow artifact (`diagnostics/`) at every checkpoint step and the last step, so a spike in
  Figure 1 can be read in the MLflow UI.
- `rollouts/step_XXXXXXXX.pt`: the rollout batch of step N when checkpoint N − 1 exists (or N = 1: the
  warm start), i.e. a batch together with the exact weights that generated it, for
  `fp8rl-train explain` (loadable with torch.load(weights_only=True)); under fp8.kv_cache e4m3 with kv_scale
  trainer or first_forward, with the per-layer KV scales that generated it (`explain` refits its replay with them).
Under data parallelism the catalogue is global (all-reduced over the mesh); the table and the saved
rollout hold rank 0's share of the batch (its whole GRPO groups).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import RunConfig
from fp8rl_core.config.schema import to_dict
from fp8rl_core.diagnostics.catalogue import all_reduce_sums, reduce_with, step_diagnostics
from fp8rl_core.distributed.mesh import Mesh
from fp8rl_core.engines.base import TrainBatch
from fp8rl_core.engines.kv_quant import KVScales
from fp8rl_core.io.checkpoint import list_checkpoints
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.tokenizer import Tokenizer
from fp8rl_core.tracking.sink import MetricSink

WORST_TOKENS_FILE = "diagnostics/worst_tokens.jsonl"
ROLLOUTS_DIR = "rollouts"
ARTIFACT_DIR = "diagnostics"
WORST_TOKEN_FIELDS = ("step", "rank", "row", "position", "prompt", "context", "token", "token_id",
                      "train_logprob", "gen_logprob", "abs_diff", "is_weight")


def observe_step(batch: TrainBatch, mesh: Mesh | None = None) -> dict[str, float]:
    """The grpo_step hook: the catalogue's metrics of the step's batch (old vs gen log-probs, IS weights)."""
    # under data parallelism the sums are all-reduced over the run's mesh, so every metric is global and
    # token-weighted (world size 1: no collective)
    reduce = reduce_with(mesh) if mesh is not None and mesh.distributed else all_reduce_sums
    return step_diagnostics(batch.old_logprobs, batch.gen_logprobs, batch.response_mask, batch.is_weights,
                            reduce=reduce, advantages=batch.advantages)


def worst_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                 train_lp: torch.Tensor, gen_lp: torch.Tensor, is_weights: torch.Tensor | None,
                 tokenizer: Any, k: int, context_tokens: int, step: int) -> list[dict[str, Any]]:
    """The k valid tokens with the largest |train − gen| (ties: lowest flat index first), as table rows.

    All tensors [B, T] (input_ids Long, masks Bool, log-probs Float). `prompt` is the text of the row's
    tokens before its first response token, `context` the text of the `context_tokens` tokens before
    the token itself (prompt included), `token` the token's text ("<eos>" / "<id N>" for special ones).
    """
    m = response_mask.bool()
    diff = (train_lp.double() - gen_lp.double()).abs()
    # non-finite differences are the worst of all (a broken engine): rank them first
    score = torch.where(m, torch.nan_to_num(diff, nan=float("inf")), torch.full_like(diff, -1.0))
    k = min(k, int(m.sum()))
    if k <= 0:
        return []
    # a stable descending sort: ties keep flat order, so the table is reproducible bit for bit
    order = torch.sort(score.flatten(), descending=True, stable=True).indices[:k]
    T = input_ids.shape[1]
    eos = _eos_ids(tokenizer)
    rows = []
    for rank, flat in enumerate(order.tolist(), start=1):
        b, t = divmod(flat, T)
        ids = input_ids[b].tolist()
        first = int(m[b].nonzero()[0])
        tok = ids[t]
        text = tokenizer.decode([tok], stop_at_eos=False)
        if tok in eos:
            text = "<eos>"
        elif not text:
            text = f"<id {tok}>"
        rows.append({
            "step": step, "rank": rank, "row": b, "position": t,
            "prompt": tokenizer.decode(ids[:first], stop_at_eos=False),
            "context": tokenizer.decode(ids[max(0, t - context_tokens):t], stop_at_eos=False),
            "token": text, "token_id": tok,
            "train_logprob": float(train_lp[b, t]), "gen_logprob": float(gen_lp[b, t]),
            "abs_diff": float(diff[b, t]),
            "is_weight": float(is_weights[b, t]) if is_weights is not None else 1.0,
        })
    return rows


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    """Every id that ends a turn, all shown as "<eos>": a model may have several (Llama-3.1-Instruct ends
    a turn with <|eot_id|>, not <|end_of_text|>), and they decode to "" like any special token."""
    ids = getattr(tokenizer, "eos_ids", None) or (getattr(tokenizer, "eos_id", None),)
    return frozenset(i for i in ids if i is not None)


def append_rows(path: Path, step: int, rows: list[dict[str, Any]]) -> None:
    """Append `rows` (of `step`) to a JSONL table, first dropping rows of steps >= `step` (a resumed run
    recomputes the steps after its checkpoint; the table keeps one copy of each)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and _last_step(path) >= step:  # rows go in step order: only a resume rewrites
        lines = path.read_text().splitlines()
        keep = [x for x in lines if x.strip() and _row_step(x) < step]
        if len(keep) != len(lines):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(x + "\n" for x in keep))
            os.replace(tmp, path)
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _row_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except ValueError:
        return 1 << 62  # a torn line: dropped


def _last_step(path: Path) -> int:
    """The step of the table's last row (-1 when empty), read from the file's tail only."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        tail = [x for x in f.read().splitlines() if x.strip()]
    try:
        return int(json.loads(tail[-1])["step"]) if tail else -1
    except ValueError:  # a torn last line (a kill mid-write): take the slow path, which rewrites the file
        return 1 << 62


def save_rollout(path: Path, batch: Any, step: int, weights_step: int, run_config: dict,
                 model_config: dict, kv_scales: KVScales | None = None) -> Path:
    """Write one rollout batch atomically (tensors + JSON strings: torch.load(weights_only=True) reads it).
    kv_scales: the per-layer KV scales it was generated with (engines.kv_quant.KVScales; fp8.kv_cache e4m3
    with kv_scale trainer or first_forward), kept as kv_scales_k / _v / _step (/ _amax_k / _amax_v)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"step": step, "weights_step": weights_step, "run_config": json.dumps(run_config),
            "model_config": json.dumps(model_config)}
    if kv_scales is not None:
        data.update(kv_scales_k=kv_scales.k.detach().cpu(), kv_scales_v=kv_scales.v.detach().cpu(),
                    kv_scales_step=int(kv_scales.step))
        if kv_scales.amax_k is not None:
            data.update(kv_scales_amax_k=kv_scales.amax_k.detach().cpu(),
                        kv_scales_amax_v=kv_scales.amax_v.detach().cpu())
    for name in ("input_ids", "attention_mask", "response_mask", "gen_logprobs", "old_logprobs", "is_weights",
                 "advantages"):
        value = getattr(batch, name)
        if value is not None:
            data[name] = value.detach().cpu()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(data, tmp)
    os.replace(tmp, path)
    return path


def prune_rollouts(out: Path) -> list[Path]:
    """Delete saved rollouts whose weights are gone (checkpoint N - 1 pruned; step 1's weights are the
    warm start, always there): they can no longer be replayed, and at scale each is a step's batch."""
    removed = []
    for path in sorted((out / ROLLOUTS_DIR).glob("step_*.pt")):
        step = int(path.stem.split("_")[1])
        if step > 1 and find_checkpoint(out / "checkpoints", step - 1) is None:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def find_checkpoint(ckpt_dir: str | Path, step: int) -> Path | None:
    """The run's checkpoint of `step`, or None. The one adapter to fp8rl_core.io.checkpoint (whose storage
    format may change): its public `list_checkpoints`, folders named `step_XXXXXXXX`."""

    for path in list_checkpoints(ckpt_dir):
        if path.name == f"step_{step:08d}":
            return path
    return None


def rollout_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / ROLLOUTS_DIR / f"step_{step:08d}.pt"


def after_step(cfg: RunConfig, tokenizer: Tokenizer, model_config: ModelConfig | None, batch: TrainBatch | None,
               sink: MetricSink, step: int, kv_scales: KVScales | None = None) -> None:
    """The run loop's hook after logging step `step` (its batch: grpo_step's StepResult.batch): worst-token
    table, saved rollout, artifact upload. model_config: the generating engine's (saved with the rollout);
    kv_scales: the KV scales the batch was generated with (StepResult.kv_scales, saved with the rollout)."""
    spec = cfg.diagnostics
    if batch is None or _rank() != 0:
        return  # rank 0 alone writes the run's files (its own share of the batch, under data parallelism)
    out = Path(cfg.output_dir)
    table = out / WORST_TOKENS_FILE
    if spec.worst_tokens_every > 0 and step % spec.worst_tokens_every == 0:
        rows = worst_tokens(batch.input_ids, batch.attention_mask, batch.response_mask, batch.old_logprobs,
                            batch.gen_logprobs, batch.is_weights, tokenizer, spec.worst_tokens_k,
                            spec.context_tokens, step)
        append_rows(table, step, rows)
    if spec.save_rollouts and (step == 1 or find_checkpoint(out / "checkpoints", step - 1) is not None):
        save_rollout(rollout_path(out, step), batch, step, step - 1, to_dict(cfg),
                     model_config.to_hf_dict() if model_config is not None else {}, kv_scales)
        prune_rollouts(out)
    if table.exists() and (step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps):
        sink.log_artifact(table, ARTIFACT_DIR)  # shipped as a copy: the MLflow table is as fresh as the checkpoint
