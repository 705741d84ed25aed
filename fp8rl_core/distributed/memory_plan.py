"""Peak memory per rank of one GRPO cell, from the model's config alone, and a refusal that names the fix.

    plan = plan_memory("path/to/config.json", Layout(world_size=8, rows_per_step=64 * 32, prompt_tokens=512,
                                                     max_new_tokens=4096, micro_batch_size=1))
    why = check(plan, 80 * 2**30)       # None: it fits; else a message naming the knobs that would make it fit
    print(plan.table())

Pure: no weights are read and nothing is allocated (parameters are counted on the meta device). With
N parameters (N_lin in the blocks' linear layers, N_blk per block, N_root outside the blocks), W ranks,
L layers, hidden h, intermediate I, q_dim = heads x head_dim, kv_dim = kv_heads x head_dim, vocab V:

  resident (every phase):
    params      4 N / W          FP32 master weights (FSDP2 shards; W = 1: the whole model)
    optimizer   8 N / W          AdamW exp_avg + exp_avg_sq, FP32
    reference   2 N / W          frozen BF16 policy for the KL term (kl_coef > 0 only)
    gen_weights 2 N              the generation engine's own copy, unsharded on every rank; FP8
                                 generation: each block linear's codes and scales in the recipe's
                                 format (fp8.format; Format.weight_bytes: block128 1 B per parameter
                                 + an FP32 scale per [128,128]; nvfp4 0.5 B + ...), BF16 for the rest
    bf16_engine 2 N              native generation, FP8-generation recipes: a BF16 generation engine
                                 beside the FP8 one (val_accuracy_bf16_eval, fp8_gen's matched-kernel
                                 replay); under vLLM see `validation` below
  then the largest of three phases:
    generation  b_gen x (prompt + new) x L x 2 x kv_dim x 2 B       KV cache (BF16; fp8.kv_cache e4m3: 1 B an
                                                                    element + FP32 scales, fp8/kv_bytes.py);
                                                                    b_gen: the native engine
                                                                    decodes all rows_r = rows / W at once; vLLM
                                                                    pages it (paged_kv): at least one sequence
    logprobs    b_lp x T x V x 14 B + fsdp                          no-grad forward: BF16 logits, their FP32
                                                                    copy, /temperature, log_softmax
    training    max(grads 4 N / W, saved) + fsdp,  saved = casts + b_mb x T x (L x a + 8 h + 16 V)
                (backward frees a block's saved tensors as it writes that block's gradients)
      a = 18 h + 16 q_dim + 8 I + 4 head_dim   bytes saved for backward per token and block: FP32 norm
          inputs (4 h each), BF16 norm outputs and linear inputs (2 h each), q/k/v/out of attention
          (FP32 on the CPU: 16 q_dim; 8 q_dim in BF16 on CUDA), SwiGLU gate/up/silu/product (8 I), RoPE
      16 V  logits: FP32 log-softmax saved + its gradient + the entropy's temporaries
      casts = 2 N_lin  autocast's BF16 copies of the block linears, kept for backward (FP8 training: the
          quantized weights, Format.weight_bytes x its copies (MXFP8: rowwise + columnwise); the CPU
          emulation of the formats other than block128 keeps FP32 values, 4 N_lin per copy); activation
          checkpointing keeps one block's (2 N_blk) and a = 2 h (block inputs) plus one block recomputed
          (a); FP8 training on the CPU adds b_mb x T x 12 I (FP32 GEMM emulation of one linear:
          dequantized input and FP32 output)
      fsdp (W > 1) = 12 N_blk + 8 N_root  two unsharded blocks in flight + one block's unsharded grads,
          and the root group (embeddings, final norm, head) unsharded with its grads;
          parallel.reshard_after_forward false: every block's gathered weights stay until the step's last backward,
          + 4 N_blk x (L - 2) in the logprobs and training phases
      parallel.mixed_precision bf16 (W > 1: FSDP2 gathers BF16 copies): fsdp = 10 N_blk + 8 N_root (two
          BF16 blocks in flight, one block's BF16 gradients and their FP32 copy for the reduce-scatter),
          kept blocks 2 N_blk each, and no autocast casts (casts = 0 for a BF16 trainer: its weights are BF16)
      parallel.grad_reduce step (W > 1): gradients accumulate unsharded over the micro-batches, so the
          training phase holds all of them beside the saved tensors: grads = 4 N, not max(4 N / W, saved)
  T = prompt + new, b_mb = micro_batch_size (0: all rows_r), b_lp = logprob_batch_size (0: all rows_r).
  Emulated BF16 (Layout.bf16_upcast: the run's BF16 path resolved to `emulated`, a CPU without BF16 dot
  products; model/bf16.py): every BF16 product runs in FP32 on upcast copies of its BF16 operands, which
  costs FP32 bytes where the native path holds BF16 ones:
    upcast_fp32  4 (N_lin + V h) resident per native engine holding BF16 block linears (the generation
                 engine of a BF16-generation recipe, the BF16 engine beside an FP8 one): the FP32 copies of
                 its BF16 block linears and LM head, made once per refit; an FP8-generation engine: the LM
                 head's only
    casts        4 N_lin instead of 2 N_lin (BF16 training): each linear saves the FP32 upcast of its weight
    a            + 16 h + 2 q_dim + 2 I (BF16 training): each linear saves the FP32 upcast of its input,
                 q, k, v one each (12 h), gate and up one each (8 h), o (4 q_dim) and down (4 I), where the
                 native path saves the two norm outputs and the o and down inputs once in BF16
  cpu_offload (W > 1: FSDP2's CPUOffloadPolicy) moves params, grads, optimizer and reference to host
  memory (`host`, not counted on the device); the unsharded FSDP copies stay on the device.

  vLLM generation (Layout.vllm; engines.vllm of the run config): vLLM's own weight copy (gen_weights,
  as above) and its KV pool, kv_cache = engines.vllm.kv_cache_memory_bytes if set, else
  concurrency x max_model_len x L x 2 x kv_dim x 2 B (concurrency: engines.vllm.max_num_seqs, else
  every row of the rank at once; max_model_len: engines.vllm.max_model_len, else prompt + new; at
  tensor_parallel_size > 1 both split over its GPUs). With sleep mode (engines.vllm.sleep_between_steps)
  both exist only in the generation phase (sleep(level=2) after a rollout discards weights and KV pool
  while the trainer runs; the refit reloads the weights); without it they are resident in every phase.
  validation (a phase of its own; loop/evaluate.py splits it over the ranks, issue 31 M3): the held-out work
  is a list of batches of c = val_batch rows (config.val_batch_rows: train.val_batch_size, under vLLM at most
  max_num_seqs), the same at every W: ceil(P / c) greedy + ceil(P S / c) sampled on the arm's engine, the
  sampled ones again on the BF16 evaluator (val_batches); batch i runs on rank i mod W. Under vLLM (every
  recipe) the evaluator is the native generation engine in BF16 (loop/builder.py BF16Evaluator; vLLM runs one
  sleep-mode engine per process, engines/vllm_gen.py refuses a second): every rank refits it after its arm's
  engine has validated and gone to sleep(level=1) (`host: gen_weights`, with sleep mode), evaluates its
  batches and releases it. The phase is the larger of
    evaluating: bf16_engine 2 N (not divided by TP) + bf16_kv_cache b x (prompt + new) x L x 2 x kv_dim x 2 B
             (the native engine's preallocated cache; b = the largest evaluator batch, <= c) + on CUDA
             bf16_activations b x prompt x (4 I + 8 h) + b x V x 8 B (a prefill of every row's prompt at once,
             and the sampled rows' FP32 logits)
    refit:   bf16_engine 2 N + refit_stream (as vLLM's refit below)
  Native generation (not paged): val_kv_cache = the largest batch x (prompt + new) x kv bytes per token
  (the arm's fp8.kv_cache for a BF16 recipe, the BF16 engine's cache in the dtype for an FP8 one).
  Time (validation_s, CUDA only): the busiest rank's sum over its batches; a batch decodes max_new_tokens
  steps (the worst case in length), each reading the weights and the KV caches it attends over at
  GPU_HBM_BYTES_PER_S (the native engine: its whole cache; vLLM: prompt + new / 2 tokens per sequence, at most
  its concurrency at once, in waves), plus a prefill of 2 N FLOPs per prompt token at GPU_BF16_FLOPS: the H100
  roofline, the best case in speed. check_validation_time refuses more than VALIDATION_TIMEOUT_SHARE (25%) of
  parallel.timeout_s (the 8B sweep: 8.4 min at W = 8, 67 min at W = 1).
  Megatron training (Layout.trainer_sharded False): the engine runs one replica per rank, so params,
  optimizer and gradients are not divided by W (see engines/megatron_train.py check_layout).

  On CUDA, beside tensors (device "cuda" only; the CPU measurements below cannot see these):
    cuda_context  CUDA_CONTEXT_BYTES = 1 GiB per process: the CUDA context (lazy module loading, the
                  default since CUDA 12.2: about 0.5 GiB as nvidia-smi shows a torch process on Hopper) plus
                  cuBLAS/cuBLASLt workspaces, rounded up; an assumption until the device check measures it
    nccl          NCCL_BYTES = 1 GiB per rank at W > 1: NCCL's own buffers for the trainer's communicator
                  (NCCL_BUFFSIZE, 4 MiB by default, per channel, peer and protocol, up to 32 channels over
                  NVLink; NVLink SHARP adds its buffers on NVSwitch nodes); an upper bound for one 8-rank
                  node, to be replaced by the device check's measurement
    gen_activations  vLLM's forward at its token budget, in PyTorch's cache while it generates:
                  VLLM_BATCHED_TOKENS x (4 I + 8 h) B (the BF16 gate/up output and a few hidden-size
                  tensors) + concurrency x V x 8 B (FP32 logits and log-probs of the sampled rows);
                  VLLM_BATCHED_TOKENS = 16384, vLLM 0.32's max_num_batched_tokens for the LLM class on
                  GPUs of >= 70 GB (engine/arg_utils.py EngineArgs.get_batch_defaults)
  vLLM refit (a fourth phase): vLLM's weights awake (gen_weights) while the refit streams the trainer's
    tensors (engines/vllm_convert.py iter_refit_tensors): refit_stream = 4 T_max (one gathered FP32
    tensor, T_max the largest: embeddings or LM head) + 2 T_max (its converted copy) + 2 N_blk (vLLM's
    layerwise reload stages one block in checkpoint format; model_loader/reload/layerwise.py). The refit
    never holds a second copy of the model.
  PyTorch's caching allocator and vLLM's wake_up: with sleep mode vLLM maps its weights and KV pool with
    cuMemCreate (vllm device_allocator/cumem.py), outside PyTorch's cache, and the trainer's phases leave
    their peak reserved in that cache. The engine empties the cache before every wake_up
    (engines/vllm_gen.py), so the phases do not add up and the peak is the largest phase.
    `MemoryPlan.without_empty_cache` is what a rank would need otherwise: resident + the largest phase in
    PyTorch's cache (the trainer's, or the native evaluator's validation) + vLLM's generation memory
    (Llama-3.1-8B, the cluster sweep's BF16 cell: 121 GiB against a 69 GiB peak on an 80 GB GPU; before
    the native evaluator 89 against 67, and the issue's review estimated about 100).

Checked against measured peak RSS on the CPU (tests/fp8rl_core/distributed/test_memory_plan.py: tiny and hidden 1024,
within 25%, on the BF16 path a run on that CPU takes).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fp8rl_core.config import RunConfig, recipe_of, resolve_bf16_path, val_batch_rows
from fp8rl_core.fp8 import kv_bytes
from fp8rl_core.fp8.formats import FORMATS
from fp8rl_core.model.config import PRESETS, ModelConfig
from fp8rl_core.model.llama import CausalLM

GiB = 2**30
CUDA_CONTEXT_BYTES = GiB  # per process on CUDA (module docstring: an assumption, rounded up)
NCCL_BYTES = GiB  # per rank at W > 1 on CUDA (module docstring: an upper bound for one 8-rank node)
DEFAULT_PROMPT_TOKENS = 64  # the arithmetic task's prompts fit in it (plans without a prompt bound)
# validation time (validation_seconds): the 8B sweep's GPU, an H100 SXM (HBM3 3.35 TB/s, 989 TFLOP/s dense
# BF16), at full speed; assumptions until the device check measures a decode step
GPU_HBM_BYTES_PER_S = 3.35e12
GPU_BF16_FLOPS = 989e12
VALIDATION_TIMEOUT_SHARE = 0.25  # validation's share of parallel.timeout_s that a plan allows (issue 31, M3)
VLLM_BATCHED_TOKENS = 16384  # vLLM 0.32 max_num_batched_tokens, LLM class, >= 70 GB GPU (arg_utils.get_batch_defaults)


@dataclass(frozen=True)
class Layout:
    """How a cell runs: what the plan needs besides the model's config."""

    world_size: int = 1  # ranks (FSDP2 shards over all of them)
    rows_per_step: int = 128  # sequences per step over all ranks: prompts_per_step x samples_per_prompt
    prompt_tokens: int = 16  # the longest prompt, in tokens
    max_new_tokens: int = 8
    micro_batch_size: int = 0  # sequences per training forward/backward (0: all of a rank's rows)
    logprob_batch_size: int = 0  # sequences per log-prob forward (0: all of a rank's rows)
    cpu_offload: bool = False  # params, grads, optimizer, reference on the host between uses
    activation_checkpointing: bool = False  # recompute each block in backward
    grad_reduce_per_step: bool = False  # parallel.grad_reduce step: full unsharded gradients per rank
    reshard_after_forward: bool = True  # parallel.reshard_after_forward false: all blocks' weights gathered
    bf16_gather: bool = False  # parallel.mixed_precision bf16: FSDP2 gathers BF16 parameters (W > 1)
    reference: bool = False  # a frozen reference policy (loss.kl_coef > 0)
    fp8_training: bool = False
    fp8_generation: bool = False
    fp8_format: str = "block128"  # fp8.format: the quantized weights' bytes (fp8rl_core/fp8/formats.py)
    # a BF16 generation engine beside the arm's (builder.build_bf16_generation_engine): native generation, FP8
    # recipes (resident); vLLM, every recipe (the native evaluator, its own validation phase)
    bf16_engine: bool = False
    device: str = "cpu"  # "cpu" or "cuda": attention runs in FP32 on the CPU (layers.causal_attention)
    bf16_upcast: bool = False  # emulated BF16 (config.resolve_bf16_path: emulated): FP32 upcast copies
    generation_batch_size: int = 0  # sequences decoded at once (0: all of a rank's rows, as the native engine)
    # fp8.kv_cache / fp8.kv_scale of the native generation engine (fp8/kv_bytes.py; vLLM's stays auto)
    kv_cache: str = "auto"
    kv_scale: str = "trainer"
    paged_kv: bool = False  # vLLM: paged KV, as many sequences as memory allows (counted: generation_batch_size or 1)
    vllm: bool = False  # the vLLM engine (engines.generation=vllm): its weights + KV pool, below
    vllm_max_model_len: int = 0  # KV length per sequence (0: prompt_tokens + max_new_tokens)
    vllm_concurrency: int = 0  # sequences whose KV is held at once (engines.vllm.max_num_seqs; 0: all rows_r)
    vllm_kv_cache_bytes: int = 0  # engines.vllm.kv_cache_memory_bytes (0: from the two above)
    vllm_tensor_parallel: int = 1  # GPUs one vLLM engine spans (its weights and KV split over them)
    vllm_sleep: bool = True  # sleep mode: vLLM's memory only in the generation phase
    trainer_sharded: bool = True  # FSDP2 (native engine) divides the trainer's state by W; Megatron (here): no
    val_prompts: int = 128  # held-out prompts (task.val_size; 0: no validation planned)
    val_samples: int = 4  # train.val_samples
    val_batch: int = 512  # rows per validation batch (config.val_batch_rows), dealt whole to the ranks

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.rows_per_step < 1 or self.micro_batch_size < 0 or self.logprob_batch_size < 0:
            raise ValueError(f"layout: need world_size, rows_per_step >= 1 and batch sizes >= 0, got {self}")

    @property
    def rows_per_rank(self) -> int:
        return -(-self.rows_per_step // self.world_size)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class ParamCounts:
    total: int  # tied weights once
    block: int  # one transformer block
    block_linear: int  # all blocks' linear weights (what FP8 quantizes, what autocast casts)
    root: int  # outside the blocks: embeddings, final norm, LM head
    linear_shapes: tuple[tuple[int, int], ...] = ()  # [N, K] of every block linear (formats' scale bytes)
    largest: int = 0  # elements of the largest single tensor (what one gather of a refit holds)


@dataclass(frozen=True)
class MemoryPlan:
    layout: Layout
    model: Any  # fp8rl_core.model.config.ModelConfig
    params: ParamCounts
    device: dict[str, int]  # bytes per rank on the accelerator (the CPU itself on a CPU run), by part
    host: dict[str, int] = field(default_factory=dict)  # bytes per rank offloaded to host memory
    phase: str = ""  # the phase that sets the peak: generation, logprobs, training, refit or validation
    without_empty_cache: int = 0  # the peak if vLLM woke on top of PyTorch's cached trainer peak (docstring)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # every phase's parts beside `resident`
    validation_s: float = 0.0  # the busiest rank's validation, estimated on CUDA (validation_seconds); 0: none

    @property
    def peak(self) -> int:
        return sum(self.device.values())

    def table(self) -> str:
        rows = [f"{k:<12} {v / GiB:9.2f} GiB" for k, v in self.device.items()]
        rows += [f"{'host:' + k:<12} {v / GiB:9.2f} GiB" for k, v in self.host.items()]
        return "\n".join(rows + [f"{'peak':<12} {self.peak / GiB:9.2f} GiB  ({self.phase} phase, per rank)"])


def load_model_config(source: Any) -> Any:
    """A ModelConfig from a ModelConfig, an HF config dict, a config.json path or a checkpoint folder."""

    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, dict):
        return ModelConfig.from_hf_dict(source)
    path = Path(source)
    return ModelConfig.from_hf_dict(json.loads((path / "config.json" if path.is_dir() else path).read_text()))


def count_parameters(cfg: Any) -> ParamCounts:
    """Parameters of our CausalLM for `cfg`, counted on the meta device (nothing is allocated)."""
    return _count(json.dumps(asdict(cfg), sort_keys=True))


@functools.lru_cache(maxsize=64)
def _count(cfg_json: str) -> ParamCounts:
    import torch


    cfg = ModelConfig(**json.loads(cfg_json))

    with torch.device("meta"):
        model = CausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    shapes = tuple(tuple(m.weight.shape) for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    linear = sum(n * k for n, k in shapes)
    return ParamCounts(total=total, block=block, block_linear=linear, root=total - block * cfg.num_hidden_layers,
                       linear_shapes=shapes, largest=max(p.numel() for p in model.parameters()))


def quantized_linear_bytes(p: ParamCounts, fmt: str) -> int:
    """Codes and scales of one quantized copy of every block linear in format `fmt`."""
    f = FORMATS[fmt]
    return sum(f.weight_bytes(s) for s in p.linear_shapes)


def _activations(cfg: Any, lay: Layout, p: ParamCounts, rows: int) -> dict[str, int]:
    """Training-phase bytes of one micro-batch of `rows` sequences (see the module docstring)."""
    h, q_dim, L, V = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_hidden_layers, cfg.vocab_size
    attn = 16 if lay.device == "cpu" else 8
    per_block = 18 * h + attn * q_dim + 8 * cfg.intermediate_size + 4 * cfg.head_dim
    if lay.bf16_upcast and not lay.fp8_training:  # each BF16 linear saves its input's FP32 upcast
        per_block += 16 * h + 2 * q_dim + 2 * cfg.intermediate_size
    if lay.activation_checkpointing:
        saved, casts = L * 2 * h + per_block, _cast_bytes(lay, p) * p.block // max(p.block_linear, 1)
    else:
        saved, casts = L * per_block, _cast_bytes(lay, p)
    tokens = rows * lay.tokens
    out = {"casts": casts, "activations": tokens * (saved + 8 * h), "logits": tokens * 16 * V}
    if lay.fp8_training and lay.device == "cpu":  # FP32 GEMM emulation: dequantized input + FP32 output of one linear
        out["fp8_emulation"] = tokens * 12 * cfg.intermediate_size
    return out


def _cast_bytes(lay: Layout, p: ParamCounts) -> int:
    """The block linears' weights kept for backward: BF16 casts, or the FP8 trainer's quantized copies."""
    if not lay.fp8_training:
        if lay.bf16_upcast:  # each linear saves its weight's FP32 upcast (BF16-gathered or autocast)
            return 4 * p.block_linear
        return 0 if lay.bf16_gather and lay.world_size > 1 else 2 * p.block_linear  # BF16-gathered: no casts
    f = FORMATS[lay.fp8_format]
    if lay.fp8_format != "block128" and lay.device == "cpu":  # the emulation keeps FP32 values per copy
        return 4 * p.block_linear * f.training_weight_copies
    return quantized_linear_bytes(p, lay.fp8_format) * f.training_weight_copies


def _training(cfg: Any, lay: Layout, p: ParamCounts, rows: int, fsdp: dict[str, int]) -> dict[str, int]:
    """Training phase: backward frees each block's saved tensors as it writes that block's gradients,
    so the peak is max(saved, grads), not their sum: grads are counted beyond the saved bytes."""
    saved = _activations(cfg, lay, p, rows)
    if lay.grad_reduce_per_step and lay.world_size > 1 and lay.trainer_sharded:
        return {"grads_unsharded": 4 * p.total, **saved, **fsdp}  # accumulated beside every micro-batch's saved
    grads = max(4 * p.total // (lay.world_size if lay.trainer_sharded else 1) - sum(saved.values()), 0)
    return {**({"grads": grads} if grads else {}), **saved, **fsdp}


def _trainer_state(p: ParamCounts, lay: Layout) -> dict[str, int]:
    """Resident trainer state, split S ways (S = W under FSDP2, 1 for Megatron's replicas):
    params 4 N / S (FP32), optimizer 8 N / S (AdamW's two FP32 moments), reference 2 N / S (BF16, kl_coef > 0)."""
    S = lay.world_size if lay.trainer_sharded else 1
    return {"params": 4 * p.total // S, "optimizer": 8 * p.total // S,
            "reference": 2 * p.total // S if lay.reference else 0}


def _generation_weight_bytes(p: ParamCounts, lay: Layout) -> int:
    """The generation engine's weight copy: 2 N (BF16); FP8 generation: the block linears in fp8.format
    (Format.weight_bytes) + 2 (N - N_lin) for the rest."""
    if not lay.fp8_generation:
        return 2 * p.total
    return quantized_linear_bytes(p, lay.fp8_format) + 2 * (p.total - p.block_linear)


def _fsdp_buffers(cfg: ModelConfig, p: ParamCounts, lay: Layout) -> dict[str, int]:
    """FSDP2's unsharded copies (W > 1, sharded trainer): per_block N_blk + 8 N_root, per_block = 2 g + 4
    (g = 4 B per gathered parameter: two blocks in flight + one block's FP32 gradients) or 2 g + 6 with BF16
    gathers (g = 2: BF16 gradients + their FP32 copy); reshard_after_forward false adds g N_blk (L - 2)."""
    if lay.world_size == 1 or not lay.trainer_sharded:
        return {}
    gathered = 2 if lay.bf16_gather else 4  # bytes per gathered parameter (parallel.mixed_precision)
    per_block = 2 * gathered + (6 if lay.bf16_gather else 4)
    fsdp = {"fsdp_unsharded": per_block * p.block + 8 * p.root}
    if not lay.reshard_after_forward:  # every block gathered from its first forward to the last backward
        fsdp["fsdp_kept_gathered"] = gathered * p.block * max(cfg.num_hidden_layers - 2, 0)
    return fsdp


def _kv_bytes(cfg: ModelConfig, rows: int, tokens: int, kv_cache: str = "auto", kv_scale: str = "trainer") -> int:
    """KV cache bytes of `rows` sequences of `tokens` slots, by the engines' formula (fp8/kv_bytes.py):
    auto L x 2 (K and V) x kv_heads x head_dim x 2 B (BF16) per token; fp8.kv_cache e4m3 1 B per element
    plus the FP32 scales (2 x L per cache; per_token_head 2 x L x kv_heads per token). A real engine's bytes:
    the native engine's CPU emulation holds the dequantized values in FP32 (kv_quant.py), not counted."""
    return kv_bytes.kv_cache_bytes(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, tokens, cfg.head_dim,
                                   kv_cache=kv_cache, kv_scale=kv_scale, dtype_bytes=2)


def _kv_bytes_per_token(cfg: ModelConfig) -> int:
    """KV cache bytes per token in the dtype: L x 2 (K and V) x kv_heads x head_dim x 2 B (BF16)."""
    return _kv_bytes(cfg, 1, 1)


@dataclass(frozen=True)
class _Engine:
    """What the generation engine adds to a plan: its phases ("generation", and "refit" / "validation" where
    they run, in that order), the bytes it keeps resident in every phase, and those it parks on the host."""

    phases: dict[str, dict[str, int]]
    resident: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)


def _vllm_generation(cfg: ModelConfig, lay: Layout, gen_weights: int) -> dict[str, int]:
    """vLLM awake: gen_weights / TP, kv_cache / TP with kv_cache = kv_cache_memory_bytes or
    concurrency x (max_model_len or T) x kv bytes per token; on CUDA gen_activations =
    VLLM_BATCHED_TOKENS x (4 I + 8 h) + concurrency x V x 8 B."""
    rows, tp = lay.rows_per_rank, max(lay.vllm_tensor_parallel, 1)
    conc = min(lay.vllm_concurrency or rows, rows)  # sequences at once (also the native evaluator's batch)
    kv = lay.vllm_kv_cache_bytes or conc * (lay.vllm_max_model_len or lay.tokens) * _kv_bytes_per_token(cfg)
    gen = {"gen_weights": gen_weights // tp, "kv_cache": kv // tp}
    if lay.device == "cuda":
        gen["gen_activations"] = (VLLM_BATCHED_TOKENS * (4 * cfg.intermediate_size + 8 * cfg.hidden_size)
                                  + conc * cfg.vocab_size * 8)
    return gen


def _vllm_engine(cfg: ModelConfig, lay: Layout, p: ParamCounts, gen_weights: int) -> _Engine:
    """vLLM: generation and refit phases (refit_stream = 6 T_max + 2 N_blk beside its awake weights), the
    native BF16 evaluator's validation phase (bf16_engine recipes); without sleep mode its weights and KV
    pool are resident instead. Level-2 sleep discards the weights wherever a refit follows; while the BF16
    evaluator validates, the arm's engine sleeps at level 1 (its weights on the host serve the next rollout)."""
    gen = _vllm_generation(cfg, lay, gen_weights)
    stream = 6 * p.largest + 2 * p.block  # one gathered FP32 tensor + its copy + vLLM's staged block
    refit = {"gen_weights": gen["gen_weights"], "refit_stream": stream}
    phases, resident, host = {"generation": gen, "refit": refit}, {}, {}
    if lay.bf16_engine and lay.val_prompts:  # the native BF16 evaluator, validation only (module docstring)
        phases["validation"] = _evaluator_phase(cfg, lay, p, _kv_bytes_per_token(cfg), stream, gen["gen_weights"])
    if not lay.vllm_sleep:
        resident = {k: v for k, v in gen.items() if k != "gen_activations"}
        phases["generation"] = {k: v for k, v in gen.items() if k == "gen_activations"}
        phases["refit"] = {"refit_stream": stream}
    elif lay.bf16_engine:
        host["gen_weights"] = gen["gen_weights"]
    return _Engine(phases, resident, host)


def _native_engine(cfg: ModelConfig, lay: Layout, p: ParamCounts, gen_weights: int) -> _Engine:
    """The native engine: its weights resident (+ 2 N for the BF16 engine beside an FP8 one), KV cache
    b_gen x T x kv bytes per token (b_gen = generation_batch_size, else every row, else 1 when paged), and a
    validation phase of the largest validation batch's KV cache (not paged: a paged engine pages it too)."""
    resident = {"gen_weights": gen_weights, **({"bf16_engine": 2 * p.total} if lay.bf16_engine else {}),
                "upcast_fp32": _upcast_bytes(cfg, lay, p, lay.fp8_generation) + _upcast_bytes(cfg, lay, p, False)
                * lay.bf16_engine}
    rows, kv = lay.rows_per_rank, (lay.kv_cache, lay.kv_scale)
    gen_rows = min(lay.generation_batch_size or (1 if lay.paged_kv else rows), rows)
    phases = {"generation": {"kv_cache": _kv_bytes(cfg, gen_rows, lay.tokens, *kv)}}
    if lay.val_prompts and not lay.paged_kv:  # the native engines decode one validation batch at once
        val_kv = ("auto", "trainer") if lay.bf16_engine else kv  # the BF16 engine's cache is in the dtype
        largest = max(sum(val_batches(lay), []), default=0)
        phases["validation"] = {"val_kv_cache": _kv_bytes(cfg, largest, lay.tokens, *val_kv)}
    return _Engine(phases, resident)


def _upcast_bytes(cfg: ModelConfig, lay: Layout, p: ParamCounts, fp8_generation: bool) -> int:
    """Emulated BF16: one native engine's FP32 copies of its BF16 products' weights, 4 (N_lin + V h); an
    FP8-generation engine's block linears are FP8 (its LM head only). 0 on the native BF16 path."""
    if not lay.bf16_upcast:
        return 0
    return 4 * ((0 if fp8_generation else p.block_linear) + cfg.vocab_size * cfg.hidden_size)


def _step_phases(cfg: ModelConfig, lay: Layout, p: ParamCounts, engine: _Engine, fsdp: dict[str, int]
                 ) -> dict[str, dict[str, int]]:
    """Every phase's parts beside the resident ones: generation, logprobs (b_lp x T x V x 14 B + fsdp),
    training (_training at b_mb), then the engine's refit and validation where they run."""
    rows = lay.rows_per_rank
    b_lp, b_mb = min(lay.logprob_batch_size or rows, rows), min(lay.micro_batch_size or rows, rows)
    return {"generation": engine.phases["generation"],
            "logprobs": {"logits": b_lp * lay.tokens * cfg.vocab_size * 14, **fsdp},
            "training": _training(cfg, lay, p, b_mb, fsdp),
            **{k: v for k, v in engine.phases.items() if k in ("refit", "validation")}}


def _runtime_bytes(lay: Layout) -> dict[str, int]:
    """CUDA only, in every phase: cuda_context CUDA_CONTEXT_BYTES, and nccl NCCL_BYTES at W > 1."""
    if lay.device != "cuda":
        return {}
    return {"cuda_context": CUDA_CONTEXT_BYTES, **({"nccl": NCCL_BYTES} if lay.world_size > 1 else {})}


def _cached_trainer_bytes(phases: dict[str, dict[str, int]]) -> int:
    """What PyTorch's cache keeps reserved: the largest of the trainer's phases and the native evaluator's
    validation (less the weights it refits; vLLM maps its own memory outside that cache)."""
    cached = [phases[k] for k in ("logprobs", "training")]
    if "validation" in phases:
        cached.append({k: v for k, v in phases["validation"].items() if k != "gen_weights"})
    return max(sum(c.values()) for c in cached)


_OFFLOADED = ("params", "optimizer", "reference", "grads")


def _offload(resident: dict[str, int], phases: dict[str, dict[str, int]], phase: str, host: dict[str, int]
             ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """FSDP2's CPUOffloadPolicy: params, optimizer, reference and grads move to the host (their bytes there,
    zero on the device). Returns (resident, the peak phase's parts, host), each a new dict."""
    moved = {k: v for k, v in {**resident, **phases["training"]}.items() if k in _OFFLOADED and v}
    return _without_offloaded(resident), _without_offloaded(phases[phase]), {**host, **moved}


def _without_offloaded(parts: dict[str, int]) -> dict[str, int]:
    """`parts` with the offloaded ones at 0 bytes (the keys and their order kept)."""
    return {k: (0 if k in _OFFLOADED else v) for k, v in parts.items()}


def plan_memory(model_config: ModelConfig | dict[str, Any] | str | os.PathLike[str], layout: Layout
                ) -> MemoryPlan:
    """Per-rank peak memory of a GRPO step for `model_config` (see load_model_config) run as `layout`:
    resident + the largest phase (module docstring), and without_empty_cache, the peak if vLLM woke on top
    of PyTorch's cached trainer peak: resident + cached trainer + vLLM's generation (sleep mode only)."""
    cfg = load_model_config(model_config)
    p, lay = count_parameters(cfg), layout
    gen_weights = _generation_weight_bytes(p, lay)
    engine = (_vllm_engine if lay.vllm else _native_engine)(cfg, lay, p, gen_weights)
    resident = {**_trainer_state(p, lay), **engine.resident, **_runtime_bytes(lay)}
    phases, host = _step_phases(cfg, lay, p, engine, _fsdp_buffers(cfg, p, lay)), dict(engine.host)
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    trainer = _cached_trainer_bytes(phases)
    if lay.cpu_offload and lay.world_size > 1 and lay.trainer_sharded:  # one process: unsharded, not offloaded
        resident, phases[phase], host = _offload(resident, phases, phase, host)
    device = {k: v for k, v in {**resident, **phases[phase]}.items() if v}
    stacked = sum(device.values())
    if lay.vllm and lay.vllm_sleep:
        stacked = sum(resident.values()) + trainer + sum(engine.phases["generation"].values())
    return MemoryPlan(layout=lay, model=cfg, params=p, device=device, host=host, phase=phase,
                      without_empty_cache=max(stacked, sum(device.values())),
                      phases={k: {n: b for n, b in v.items() if b} for k, v in phases.items()},
                      validation_s=validation_seconds(cfg, lay, p, gen_weights))


def val_batches(lay: Layout) -> list[list[int]]:
    """Rows of each validation batch, as loop/evaluate.val_batches deals them: [the arm's engine's (greedy
    then sampled), the BF16 evaluator's (sampled; greedy when val_samples is 0), if the layout has one]."""
    P, S, c = lay.val_prompts, lay.val_samples, max(lay.val_batch, 1)

    def split(n: int) -> list[int]:
        return [min(c, n - start) for start in range(0, n, c)]

    sampled = split(P * S)
    return [split(P) + sampled, *([sampled or split(P)] if lay.bf16_engine else [])]


def _evaluator_phase(cfg: Any, lay: Layout, p: ParamCounts, kv_token: int, stream: int, gen_weights: int
                     ) -> dict[str, int]:
    """Under vLLM, the native BF16 evaluator on every rank: the larger of its refit (vLLM asleep at level 1:
    its weights on the host with sleep mode, on the device without) and its evaluation of one batch of b rows,
    b the largest evaluator batch (the preallocated KV cache; on CUDA a prefill of b prompts + b rows' logits)."""
    b = max(val_batches(lay)[-1], default=0)
    evaluating = {"bf16_engine": 2 * p.total, "upcast_fp32": _upcast_bytes(cfg, lay, p, False),
                  "bf16_kv_cache": b * lay.tokens * kv_token}
    if lay.device == "cuda":
        width = 4 * cfg.intermediate_size + 8 * cfg.hidden_size  # bytes per token, as gen_activations
        evaluating["bf16_activations"] = b * lay.prompt_tokens * width + b * cfg.vocab_size * 8
    refit = {"bf16_engine": 2 * p.total, "upcast_fp32": evaluating["upcast_fp32"], "refit_stream": stream}
    return max(evaluating, refit, key=lambda d: sum(d.values()))


def _decode_seconds(weights: int, rows: int, context: float, steps: int, prompt: int, kv_token: int, n: int) -> float:
    """One generate call of `rows` answers of `steps` tokens: every decode step reads the weights and `rows`
    KV caches of `context` tokens from HBM (bytes / GPU_HBM_BYTES_PER_S), the prefill computes 2 n FLOPs per
    prompt token (/ GPU_BF16_FLOPS)."""
    step = (weights + rows * context * kv_token) / GPU_HBM_BYTES_PER_S
    return steps * step + 2 * n * rows * prompt / GPU_BF16_FLOPS


def _batch_seconds(cfg: Any, lay: Layout, p: ParamCounts, rows: int, vllm: bool, weights: int) -> float:
    """One validation batch of `rows` (validation_seconds): vLLM decodes at most its concurrency at once over
    paged KV (a full-length answer's mean context: prompt + new / 2); the native engine decodes the batch at
    once over its preallocated cache, which it reads whole (prompt + new slots)."""
    kv_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    new, prompt = lay.max_new_tokens, lay.prompt_tokens
    if not vllm:
        return _decode_seconds(weights, rows, lay.tokens, new, prompt, kv_token, p.total)
    conc = min(lay.vllm_concurrency or rows, rows)
    waves = [min(conc, rows - start) for start in range(0, rows, conc)]
    return sum(_decode_seconds(weights, b, prompt + new / 2, new, prompt, kv_token, p.total) for b in waves)


def validation_seconds(cfg: Any, lay: Layout, p: ParamCounts, gen_weights: int) -> float:
    """The busiest rank's validation time on CUDA (0.0 elsewhere, or without validation): batch i of each
    engine on rank i mod W (val_batches), each batch's time by _batch_seconds, every answer max_new_tokens
    long (the worst case in length) at the HBM and BF16 roofline (the best case in speed; module docstring)."""
    if lay.device != "cuda" or not lay.val_prompts:
        return 0.0
    W = lay.world_size
    engines = zip(val_batches(lay), (lay.vllm, False), (gen_weights, 2 * p.total))
    per_rank = [0.0] * W
    for batches, vllm, weights in engines:
        for i, rows in enumerate(batches):
            per_rank[i % W] += _batch_seconds(cfg, lay, p, rows, vllm, weights)
    return max(per_rank)


def check_validation_time(plan: MemoryPlan, timeout_s: float) -> str | None:
    """None when the busiest rank's estimated validation (plan.validation_s) takes at most
    VALIDATION_TIMEOUT_SHARE of the collective timeout; else a refusal naming the keys that bound it."""
    if plan.validation_s <= VALIDATION_TIMEOUT_SHARE * timeout_s:
        return None
    lay, t = plan.layout, plan.validation_s
    counts = [len(b) for b in val_batches(lay)]
    return (f"validation takes about {t / 60:.1f} min on the busiest of {lay.world_size} rank(s) (estimate: "
            f"{' + '.join(str(-(-n // lay.world_size)) for n in counts)} batch(es) of <= {lay.val_batch} rows, "
            f"answers of {lay.max_new_tokens} tokens), over {VALIDATION_TIMEOUT_SHARE:.0%} of parallel.timeout_s "
            f"({timeout_s:g} s): a rank would wait that long in a collective. Knobs: parallel.timeout_s >= "
            f"{t / VALIDATION_TIMEOUT_SHARE:.0f}; more ranks; task.val_size ({lay.val_prompts}); train.val_samples "
            f"({lay.val_samples}); train.val_batch_size (balance: {sum(counts)} batch(es) over the ranks); "
            "rollout.max_new_tokens")


def check(plan: MemoryPlan, mem_bytes_per_rank: int) -> str | None:
    """None when the plan's peak fits `mem_bytes_per_rank`; else a refusal naming the knobs.

    The refusal gives the peak each knob alone would reach (more ranks: the fewest that fit, at
    most 1024; train.micro_batch_size/logprob_batch_size = 1; parallel.activation_checkpointing;
    parallel.cpu_offload), then the smallest layout that fits with all of them, if any.
    """
    if plan.peak <= mem_bytes_per_rank:
        return None
    lay, fits = plan.layout, lambda lay: plan_memory(plan.model, lay).peak <= mem_bytes_per_rank

    def peak(lay: Layout) -> str:
        return f"{plan_memory(plan.model, lay).peak / GiB:.1f} GiB"

    ranks = [replace(lay, world_size=lay.world_size * 2**k) for k in range(1, 11) if lay.world_size * 2**k <= 1024]
    more = next((r for r in ranks if fits(r)), ranks[-1] if ranks else lay)
    small = replace(lay, micro_batch_size=1, logprob_batch_size=1)
    knobs = [f"more ranks: {more.world_size} -> {peak(more)}",
             f"train.micro_batch_size=1 and train.logprob_batch_size=1 -> {peak(small)}",
             f"parallel.activation_checkpointing=true -> {peak(replace(lay, activation_checkpointing=True))}",
             f"parallel.cpu_offload=true -> {peak(replace(lay, cpu_offload=True))}"]
    allin = [replace(r, micro_batch_size=1, logprob_batch_size=1, activation_checkpointing=True, cpu_offload=off)
             for r in [lay, *ranks] for off in (False, True)]
    best = next((r for r in allin if fits(r)), None)
    tail = (f"fits with all of them at {best.world_size} ranks{' and cpu_offload' if best.cpu_offload else ''}"
            f" ({peak(best)})" if best else "no combination fits: a smaller model or a larger device")
    return (f"needs {plan.peak / GiB:.1f} GiB per rank, has {mem_bytes_per_rank / GiB:.1f} GiB (peak in the "
            f"{plan.phase} phase: " + ", ".join(f"{k} {v / GiB:.1f}" for k, v in
                                                  sorted(plan.device.items(), key=lambda kv: -kv[1]))
            + " GiB). Knobs: " + "; ".join(knobs) + "; " + tail)


def layout_for_run(cfg: RunConfig, world_size: int, prompt_tokens: int | None = None, device: str | None = None
                   ) -> Layout:
    """The Layout of a RunConfig (fp8rl_core/config/run_config.py) at `world_size` ranks. prompt_tokens: the
    longest prompt; None: allowed_prompt_tokens(cfg). The BF16 path (bf16_upcast) is the config's as
    resolved for `device` on the machine that plans (`auto` reads this CPU's flags)."""
    if prompt_tokens is None:
        prompt_tokens = allowed_prompt_tokens(cfg)

    recipe = recipe_of(cfg)
    device = device or ("cpu" if cfg.device == "cpu" else "cuda")
    par = getattr(cfg, "parallel", None)
    vllm = cfg.engines.vllm
    return Layout(vllm=cfg.engines.generation == "vllm", vllm_max_model_len=vllm.max_model_len or 0,
                  vllm_concurrency=vllm.max_num_seqs or 0, vllm_kv_cache_bytes=vllm.kv_cache_memory_bytes or 0,
                  vllm_tensor_parallel=vllm.tensor_parallel_size, vllm_sleep=vllm.sleep_between_steps is not False,
                  trainer_sharded=cfg.engines.training == "native",
                  world_size=world_size, rows_per_step=cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
                  prompt_tokens=prompt_tokens, max_new_tokens=cfg.rollout.max_new_tokens,
                  micro_batch_size=getattr(cfg.train, "micro_batch_size", 0),
                  logprob_batch_size=getattr(cfg.train, "logprob_batch_size", 0),
                  cpu_offload=bool(getattr(par, "cpu_offload", False)),
                  activation_checkpointing=bool(getattr(par, "activation_checkpointing", False)),
                  grad_reduce_per_step=getattr(par, "grad_reduce", "micro_batch") == "step",
                  reshard_after_forward=bool(getattr(par, "reshard_after_forward", True)),
                  bf16_gather=getattr(par, "mixed_precision", "none") == "bf16",
                  reference=cfg.loss.kl_coef > 0, fp8_training=recipe.fp8_training,
                  fp8_generation=recipe.fp8_generation,
                  bf16_engine=recipe.fp8_generation or cfg.engines.generation == "vllm",
                  fp8_format=(recipe.generation or recipe.training).format if recipe.fp8_generation else "block128",
                  device=device, bf16_upcast=resolve_bf16_path(cfg, device) == "emulated",
                  kv_cache=recipe.kv_cache, kv_scale=recipe.kv_scale,
                  paged_kv=cfg.engines.generation == "vllm", val_prompts=cfg.task.val_size,
                  val_samples=cfg.train.val_samples, val_batch=val_batch_rows(cfg))


def allowed_prompt_tokens(cfg: RunConfig) -> int:
    """The longest prompt a run can hold without reading its data: with engines.vllm.max_model_len set, the
    run refuses longer ones at start, so the bound is max_model_len - max_new_tokens (the 8B sweep: 4608 -
    4096 = 512); else DEFAULT_PROMPT_TOKENS, the arithmetic task's bound."""
    limit = cfg.engines.vllm.max_model_len if cfg.engines.generation == "vllm" else None
    return limit - cfg.rollout.max_new_tokens if limit else DEFAULT_PROMPT_TOKENS


def plan_for_run(cfg: RunConfig, world_size: int = 1, prompt_tokens: int | None = None, device: str | None = None
                 ) -> MemoryPlan:
    """The memory plan of a RunConfig: the model from `model.path`'s config.json, else its preset.
    For `sweep plan`: `check(plan_for_run(cell_cfg, nodes * tasks_per_node), gpu_mem_bytes)`."""

    from fp8rl_core.model.sources import resolve_model_path

    source = resolve_model_path(cfg.model.path) if cfg.model.path else PRESETS[cfg.model.preset]
    return plan_memory(source, layout_for_run(cfg, world_size, prompt_tokens, device))
