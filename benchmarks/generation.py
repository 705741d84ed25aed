"""Generation throughput: the native engine vs `transformers` `generate`, same tiny model, batch and lengths.

Usage: python benchmarks/generation.py [--batch 128] [--new-tokens 8 32] [--repeats 3] [--threads 0]

Random weights (the `tiny` preset: 4 layers, hidden 256); prompts of 10-14 tokens, left-padded; sampling
at T=1 with no top-k/top-p; EOS disabled (eos_token_id=None on both sides) so every row produces exactly
max_new_tokens tokens. Tokens/s = batch * new_tokens / wall time of one generate call (prefill included),
best of --repeats after one warm-up. The FP8 row runs our engine's blockwise-FP8 linears (CPU emulation);
its baseline is the same BF16 transformers run (transformers has no blockwise-FP8 CPU kernel: its
FineGrainedFP8 CPU path dequantizes to BF16 at load).
"""
from __future__ import annotations

import argparse
import time

import torch

from fp8rl_core.config import Fp8Spec
from fp8rl_core.engines.base import SamplingParams
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.model.config import preset


def hf_model(cfg, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict())).to(dtype).eval()
    for p in model.parameters():  # O(1) logits, so the distributions are not flat
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
    return model


def prompts_for(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(10, 15, (batch,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, oneDNN primitive caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=None,
                             top_p=None, eos_token_id=None, pad_token_id=pad)
    assert out.shape[1] == width + new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = preset("tiny", eos_token_id=None)
    model = hf_model(cfg, torch.bfloat16)
    weights = model.state_dict()
    prompts = prompts_for(args.batch, cfg.vocab_size)
    engines = {"bf16": NativeGenerationEngine(cfg), "fp8": NativeGenerationEngine(cfg, fp8=True, fp8_spec=Fp8Spec())}
    for e in engines.values():
        e.refit(weights)
    print(f"batch {args.batch}, prompts 10-14 tokens, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'mode':<5} {'new':>4} {'transformers tok/s':>19} {'native tok/s':>13} {'ratio':>6}")
    for n in args.new_tokens:
        t_hf = best_time(lambda: hf_generate(model, prompts, n, cfg.pad_token_id), args.repeats)
        for mode, engine in engines.items():
            sampling = SamplingParams(max_new_tokens=n)
            t_ours = best_time(lambda: engine.generate(prompts, sampling), args.repeats)
            tok = args.batch * n
            print(f"{mode:<5} {n:>4} {tok / t_hf:>19.0f} {tok / t_ours:>13.0f} {t_hf / t_ours:>5.1f}x")


if __name__ == "__main__":
    main()
