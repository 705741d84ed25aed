"""What the real-vLLM tests run, each in its own spawned process (vLLM changes torch process-wide: it seeds
the global RNGs, replaces torch.set_num_threads on a CPU, patches pin_memory). test_vllm_real.py asserts on
what these return; nothing here asserts, so that a failure is reported with every number measured.

The named tiny model, TINY ("tiny-llama-v64"): a Llama of 4 layers, hidden 256, 4 heads over 2 KV heads,
vocabulary 64, three EOS ids (2, 3, 5: every one must stop vLLM), weights N(0, 0.08) from seed 0, saved in
BF16 by our hf_io.save_pretrained. Small enough for a 2-core CPU, peaky enough (O(1) logits) that
log-prob differences between kernels show.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.model.config import ModelConfig

TINY = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   bos_token_id=1, eos_token_id=[2, 3, 5], pad_token_id=0)
MAX_NEW = 24
SEED = 7  # the run's seed: rank 0 samples with it, rank r with rank_seed(SEED, r)


def prompts(n: int = 32) -> list[list[int]]:
    """n prompts of 3..10 tokens (BOS + ids in [6, 64): no EOS inside a prompt)."""
    g = torch.Generator().manual_seed(1)
    return [[1] + torch.randint(6, 64, (3 + i % 8,), generator=g).tolist() for i in range(n)]


def write_tiny(folder: Path) -> Path:
    from fp8rl_core.model.hf_io import save_pretrained
    from fp8rl_core.model.llama import CausalLM

    torch.manual_seed(0)
    model = CausalLM(TINY)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return save_pretrained(model, folder, dtype=torch.bfloat16)


def run_config(out: Path, recipe: str = "bf16", **vllm: Any):
    """The run's config: these prompts (up to 11 tokens) are longer than the task's, hence max_model_len 64."""
    from fp8rl_core.config import run_config_from_dict

    vllm = {"max_model_len": 64, **vllm}

    return run_config_from_dict({"recipe": recipe, "seed": SEED, "output_dir": str(out), "threads": 2,
                                 "rollout": {"max_new_tokens": MAX_NEW, "prompts_per_step": 8, "temperature": 1.0,
                                             "samples_per_prompt": 4},
                                 "engines": {"generation": "vllm", "vllm": vllm}})


def engine(cfg, mesh=None):
    from fp8rl_core.distributed.mesh import SINGLE
    from fp8rl_core.loop.builder import resolve_setup, vllm_engine

    return vllm_engine(resolve_setup(cfg, "cpu", mesh or SINGLE), TINY)


def refusal(fn) -> str:
    """The message of the exception fn() raises ('' when it raises none)."""
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def sample(gen, sampling) -> dict:
    out = gen.generate(prompts(), sampling)
    return {"ids": out.response_ids.tolist(), "mask": out.response_mask.tolist(),
            "logprobs": out.logprobs.tolist(), "finished": out.finished.tolist()}


# ---- one process: start, generate, log-probs, refit, stop tokens, refusals ---------------------------
def refusals(tmp: Path) -> dict:
    """What is refused before vLLM starts, with the messages: a prompt over max_model_len, sleep mode on a
    CPU, FP8 generation without AMX (and without fp8_weight_only on AMX)."""
    model = write_tiny(tmp / "model")
    short = engine(run_config(tmp / "short", max_model_len=MAX_NEW + 4))  # the task's prompts need more
    return {"prompt_too_long": refusal(lambda: short.start(model)), "started": short.llm is not None,
            "sleep_on_cpu": refusal(lambda: engine(run_config(tmp / "s", sleep_between_steps=True))),
            "fp8_gen": refusal(lambda: engine(run_config(tmp / "f", "fp8_gen"))),
            "fp8_gen_weight_only": refusal(lambda: engine(run_config(tmp / "w", "fp8_gen", fp8_weight_only=True)))}


def main_engine(mesh, tmp: str) -> dict:
    """Start vLLM (BF16) on TINY through our engine, generate twice under request seeds, rescore with our
    trainer and with transformers, refit to weights after 3 AdamW steps, generate again; stop tokens from
    vLLM's raw outputs. Saves the refit weights (BF16) for fresh_engine."""
    import vllm

    from fp8rl_core.engines.base import SamplingParams
    from fp8rl_core.engines.vllm_convert import llm_kwargs
    from fp8rl_core.loop.builder import build_training_engine, resolve_setup

    tmp_path = Path(tmp)
    result = refusals(tmp_path)
    model_dir = tmp_path / "model"
    torch.set_num_threads(2)
    cfg = run_config(tmp_path / "out")
    gen = engine(cfg)
    gen.start(model_dir)
    result["threads_after_start"] = torch.get_num_threads()
    raw: list = []
    generate = gen.llm.generate
    gen.llm.generate = lambda *a, **k: raw.append(generate(*a, **k)) or raw[-1]
    trainer = build_training_engine(resolve_setup(cfg, "cpu"), model_dir)
    gen.refit(trainer.weights())
    sampling = SamplingParams(max_new_tokens=MAX_NEW, seed=11)
    first, again = sample(gen, sampling), sample(gen, sampling)
    result.update(first=first, again=again, tags=gen.tags(), max_model_len=gen.max_model_len,
                  kv_cache_bytes=gen._kv_cache_bytes(), batch_rows=gen.batch_rows,
                  raw_ids=[list(o.outputs[0].token_ids) for o in raw[0]])
    result["scores"] = rescore(trainer, model_dir, first)
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    kw = llm_kwargs(model_dir, TINY, recipe=gen.recipe, dtype="bfloat16", seed=0, vllm=cfg.engines.vllm,
                    max_model_len=64, kv_cache_bytes=2**24, sleep=True, world_size=2)  # a GPU's, the most keys
    result["unknown_engine_args"] = sorted(set(kw) - fields)
    train_a_little(trainer, first)
    gen.refit(trainer.weights())
    result["refit"] = sample(gen, sampling)
    save_bf16(trainer, tmp_path / "refit_model")
    gen.close()
    return result


def rescore(trainer, model_dir: Path, out: dict) -> dict:
    """vLLM's log-probs against our trainer's (BF16 compute, the run's) and transformers' (BF16, eager) on
    the same BF16 weights: token_mult_prob_error and the largest |delta log p| of each."""
    from transformers import AutoModelForCausalLM

    from fp8rl_core.algorithms.metrics import token_mult_prob_error
    from fp8rl_core.engines.base import GenerationOutput
    from fp8rl_core.loop.rollout import build_train_batch

    gen_out = GenerationOutput(torch.tensor(out["ids"]), torch.tensor(out["mask"]), torch.tensor(out["logprobs"]),
                               torch.tensor(out["finished"]))
    batch = build_train_batch(prompts(), gen_out, TINY.pad_id)
    ours = trainer.logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.float()
    theirs = torch.zeros_like(ours)
    theirs[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    m = batch.response_mask
    return {name: {"token_mult_prob_error": token_mult_prob_error(lp, batch.gen_logprobs, m),
                   "max_abs_diff": float((lp - batch.gen_logprobs)[m].abs().max()), "tokens": int(m.sum())}
            for name, lp in (("native", ours), ("transformers", theirs))}


def train_a_little(trainer, out: dict, steps: int = 3) -> None:
    """3 AdamW steps (lr 3e-3) raising the log-likelihood of the sampled responses: materially new weights."""
    from fp8rl_core.engines.base import GenerationOutput
    from fp8rl_core.loop.rollout import build_train_batch

    gen_out = GenerationOutput(torch.tensor(out["ids"]), torch.tensor(out["mask"]), torch.tensor(out["logprobs"]),
                               torch.tensor(out["finished"]))
    batch = build_train_batch(prompts(), gen_out, TINY.pad_id)
    model = trainer.model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = batch.input_ids[:, 1:].masked_fill(~batch.response_mask[:, 1:], -100)
    for _ in range(steps):
        logits = model(batch.input_ids, batch.attention_mask).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, TINY.vocab_size), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def save_bf16(trainer, folder: Path) -> None:
    from fp8rl_core.model.hf_io import save_pretrained

    save_pretrained(trainer.model, folder, dtype=torch.bfloat16)


def fresh_engine(mesh, tmp: str) -> dict:
    """A new vLLM engine started on the refit weights (as saved by main_engine): what the refit must equal."""
    from fp8rl_core.engines.base import SamplingParams

    gen = engine(run_config(Path(tmp) / "fresh"))
    gen.start(Path(tmp) / "refit_model")
    result = sample(gen, SamplingParams(max_new_tokens=MAX_NEW, seed=11))
    gen.close()
    return result


# ---- two ranks, external_launcher over gloo ------------------------------------------------------------
def two_ranks(mesh, tmp: str) -> dict:
    """One engine per rank (external_launcher, joining our gloo group), KV cache sized per rank, each rank
    sampling with its own seed; rank 0 writes the model first."""
    from fp8rl_core.engines.base import SamplingParams
    from fp8rl_core.model import load_pretrained

    model_dir = Path(tmp) / "model"
    if mesh.is_rank0:
        write_tiny(model_dir)
    mesh.barrier()
    gen = engine(run_config(Path(tmp) / "out"), mesh=mesh)
    gen.start(model_dir)
    gen.refit(load_pretrained(model_dir, dtype=torch.float32).state_dict())
    out = sample(gen, SamplingParams(max_new_tokens=MAX_NEW))
    result = {"rank": mesh.rank, "seed": gen.seed, "kv_cache_bytes": gen._kv_cache_bytes(),
              "batch_rows": gen.batch_rows, "max_model_len": gen.max_model_len, "ids": out["ids"],
              "executor": type(gen.llm.llm_engine.model_executor).__name__}
    gen.close()
    return result


# ---- FP8 on an AMX CPU (weight-only) ----------------------------------------------------------------------
def fp8_weight_only(mesh, tmp: str) -> dict:
    """fp8_gen with engines.vllm.fp8_weight_only on a CPU with AMX: vLLM's W8A16 kernel, tagged as such."""
    from fp8rl_core.engines.base import SamplingParams
    from fp8rl_core.model import load_pretrained

    model_dir = write_tiny(Path(tmp) / "model")
    gen = engine(run_config(Path(tmp) / "out", "fp8_gen", fp8_weight_only=True))
    gen.start(model_dir)
    gen.refit(load_pretrained(model_dir, dtype=torch.float32).state_dict())
    out = sample(gen, SamplingParams(max_new_tokens=MAX_NEW, seed=11))
    gen.close()
    return {"tags": gen.tags(), "finite": bool(torch.isfinite(torch.tensor(out["logprobs"])).all())}


def dump(result: Any) -> str:
    return json.dumps(result, indent=1, default=str)
