"""Memory plan: refuses what cannot fit (naming the knobs), accepts a sharded 8B layout, counts parameters
exactly, and its estimate is within 25% of the peak memory a real step reaches on this CPU, on the BF16 path
a run takes here (model.bf16_compute auto: native BF16 kernels with BF16 dot products, else the emulation).

The measurement runs in a fresh subprocess (this file run as a script), so that nothing this test
process allocated or cached pollutes it: the peak of resident anonymous memory (sampled every 1 ms)
minus its value after imports and warm-up.
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from fp8rl_core.config import load_run_config
from fp8rl_core.distributed.memory_plan import (
    GiB,
    Layout,
    check,
    count_parameters,
    layout_for_run,
    plan_for_run,
    plan_memory,
    val_batches,
)
from fp8rl_core.model.config import ModelConfig

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# The cluster study's step: 64 prompts x 32 samples, 4096 new tokens, a KL reference, vLLM generation.
STUDY = dict(rows_per_step=64 * 32, prompt_tokens=512, max_new_tokens=4096, reference=True, device="cuda",
             paged_kv=True)
WIDE = ModelConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=8)


@pytest.fixture
def llama_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))  # no weights: the config is enough
    return tmp_path


def test_llama8b_on_one_80gb_gpu_is_refused_naming_the_knobs(llama_dir):
    plan = plan_memory(llama_dir / "config.json", Layout(world_size=1, **STUDY))
    assert 8.0e9 < plan.params.total < 8.1e9  # Llama-3.1-8B: 8.03 B parameters
    why = check(plan, 80 * GiB)
    assert why is not None and "needs" in why
    for knob in ("more ranks", "train.micro_batch_size", "parallel.cpu_offload", "parallel.activation_checkpointing"):
        assert knob in why, why


def test_llama8b_on_8_gpus_sharded_is_accepted(llama_dir):
    layout = Layout(world_size=8, micro_batch_size=1, logprob_batch_size=1, activation_checkpointing=True, **STUDY)
    plan = plan_memory(llama_dir, layout)
    assert check(plan, 80 * GiB) is None, plan.table()
    unsharded = plan_memory(llama_dir, Layout(world_size=1, micro_batch_size=1, logprob_batch_size=1,
                                              activation_checkpointing=True, **STUDY))
    # FP32 params + AdamW: 12 B/param, split 8 ways
    assert plan.device["params"] + plan.device["optimizer"] == pytest.approx(
        (unsharded.device["params"] + unsharded.device["optimizer"]) / 8, rel=1e-6)
    assert check(unsharded, 80 * GiB) is not None


def test_offload_moves_sharded_state_to_the_host(llama_dir):
    base = Layout(world_size=8, micro_batch_size=1, logprob_batch_size=1, activation_checkpointing=True, **STUDY)
    on, off = plan_memory(llama_dir, base), plan_memory(llama_dir, Layout(**{**asdict(base), "cpu_offload": True}))
    assert "params" not in off.device and off.host["params"] == on.device["params"]
    assert off.peak < on.peak


def test_parameter_count_is_the_models():
    from fp8rl_core.model import build_model

    for cfg in (ModelConfig(), WIDE, ModelConfig(tie_word_embeddings=True)):
        model = build_model(cfg)
        p = count_parameters(cfg)
        assert p.total == sum(x.numel() for x in model.parameters())
        assert p.block == sum(x.numel() for x in model.model.layers[0].parameters())


def test_fewer_collectives_cost_the_memory_the_plan_names(llama_dir):
    """parallel.grad_reduce=step holds the full FP32 gradient per rank in the training phase;
    reshard_after_forward=false keeps every block gathered; at one rank neither changes anything."""
    base = Layout(world_size=8, micro_batch_size=1, logprob_batch_size=1, activation_checkpointing=True, **STUDY)
    plan = plan_memory(llama_dir, base)
    step = plan_memory(llama_dir, replace(base, grad_reduce_per_step=True))
    kept = plan_memory(llama_dir, replace(base, reshard_after_forward=False))
    n, blk, layers = plan.params.total, plan.params.block, plan.model.num_hidden_layers
    assert step.phase == "training" and step.device["grads_unsharded"] == 4 * n and step.peak > 4 * n
    assert kept.device["fsdp_kept_gathered"] == 4 * blk * (layers - 2) and kept.peak > plan.peak
    assert "grads_unsharded" not in plan.device and "fsdp_kept_gathered" not in plan.device
    one = replace(base, world_size=1)
    assert plan_memory(llama_dir, replace(one, grad_reduce_per_step=True, reshard_after_forward=False)).device \
        == plan_memory(llama_dir, one).device


def test_layout_of_a_run_config_reads_its_keys():
    from fp8rl_core.config import load_run_config

    cfg = load_run_config(None, ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "recipe=fp8_e2e",
                                 "rollout.max_new_tokens=7", "loss.kl_coef=0.1", "device=cpu",
                                 "parallel.grad_reduce=step", "parallel.reshard_after_forward=false"])
    lay = layout_for_run(cfg, world_size=2, prompt_tokens=9)
    assert lay.grad_reduce_per_step and not lay.reshard_after_forward
    assert (lay.rows_per_step, lay.max_new_tokens, lay.prompt_tokens, lay.world_size) == (8, 7, 9, 2)
    assert lay.reference and lay.fp8_training and lay.fp8_generation and lay.device == "cpu"
    assert plan_for_run(cfg, 2, 9).params.total == count_parameters(ModelConfig()).total


# --- estimate vs measured -------------------------------------------------------------------------------

CASES = {  # name: (model config, rows, prompt tokens, new tokens, recipe)
    "tiny": (ModelConfig(), 64, 8, 24, "bf16"),
    "tiny_fp8": (ModelConfig(), 64, 8, 24, "fp8_e2e"),
    "hidden1024": (WIDE, 16, 8, 24, "bf16"),
}


def _upcast() -> bool:
    """The BF16 path a run on this CPU takes (model.bf16_compute auto): emulated where it has no BF16 dot products."""
    from fp8rl_core.model.bf16 import resolve_bf16_compute

    return resolve_bf16_compute("auto", "cpu") == "emulated"


def _probe(name: str) -> int:
    """In this (fresh) process: one rank's GRPO step at world size 1 and its peak RSS growth in bytes.

    A first pass on a one-layer model loads every code path (AdamW's imports, oneDNN, the engines),
    so that one-time costs land in the baseline, not in the step.
    """
    import threading

    import torch

    cfg, rows, prompt, new, recipe = CASES[name]
    torch.set_num_threads(1)
    _step(ModelConfig(num_hidden_layers=1), 2, 4, 4, recipe, _upcast())
    base = peak = _rss_anon()
    done = threading.Event()

    def sample() -> None:  # torch kernels release the GIL, so this thread sees the step's peak
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_anon())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        _step(cfg, rows, prompt, new, recipe, _upcast())
    finally:
        done.set()
        watcher.join()
    return max(peak, _rss_anon()) - base


def _step(cfg: ModelConfig, rows: int, prompt: int, new: int, recipe: str, upcast: bool) -> None:
    """Refit, generate, old log-probs, two train steps (AdamW state exists in the second); `upcast`: the
    emulated BF16 path in both engines."""
    import torch

    from fp8rl_core.config.recipe import RECIPES
    from fp8rl_core.engines.base import SamplingParams, TrainBatch
    from fp8rl_core.engines.native_gen import NativeGenerationEngine
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.model import build_model

    torch.manual_seed(0)
    train = NativeTrainingEngine(build_model(cfg), recipe=RECIPES[recipe], upcast_bf16=upcast)
    gen = NativeGenerationEngine(cfg, recipe=RECIPES[recipe], dtype=torch.bfloat16, device="cpu", seed=0,
                                 upcast_bf16=upcast)
    gen.refit(train.weights())
    gen.generate(torch.randint(3, cfg.vocab_size, (rows, prompt)).tolist(),
                 SamplingParams(max_new_tokens=new, temperature=1.0))
    T = prompt + new
    resp = torch.zeros(rows, T, dtype=torch.bool)
    resp[:, prompt:] = True
    batch = TrainBatch(input_ids=torch.randint(3, cfg.vocab_size, (rows, T)),
                       attention_mask=torch.ones(rows, T, dtype=torch.bool), response_mask=resp,
                       advantages=torch.randn(rows, 1).expand(rows, T).contiguous())
    batch.old_logprobs = train.logprobs(batch)
    for _ in range(2):
        train.train_step(batch)


def _rss_anon() -> int:
    """Resident anonymous memory (tensors, heap) in bytes. Not ru_maxrss: that counts file-backed pages
    too (libtorch's code), and how many of those a fault maps depends on what the page cache holds, so
    it read 290-770 MiB instead of 180 after other tests had run (a measurement must not depend on test
    order)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def _measure(name: str) -> int:
    # glibc's mmap threshold pinned: freed tensors go back to the OS at once, so that RSS follows the
    # bytes alive (its default adapts upwards and keeps freed blocks mapped, inflating RSS by up to 2x)
    # The child gets a clean environment: variables that earlier tests of this session left behind
    # (torch.distributed's RANK/WORLD_SIZE/MASTER_*, FP8RL_* switches) changed what it allocated (seen:
    # +120 MiB after the distributed tests), and a measurement must not depend on test order.
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, check=True, timeout=900,
                         env=env)
    return int(out.stdout.strip().splitlines()[-1])


def _estimate(name: str) -> int:
    cfg, rows, prompt, new, recipe = CASES[name]
    return plan_memory(cfg, Layout(world_size=1, rows_per_step=rows, prompt_tokens=prompt, max_new_tokens=new,
                                   fp8_training=recipe == "fp8_e2e", fp8_generation=recipe != "bf16",
                                   bf16_upcast=_upcast())).peak


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_estimate_within_25_percent_of_measured_peak(name):
    measured, estimate = _measure(name), _estimate(name)
    path = "emulated" if _upcast() else "native"
    print(f"{name} ({path} BF16): estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert 0.75 * measured <= estimate <= 1.25 * measured, (estimate, measured)


if __name__ == "__main__":
    print(_probe(sys.argv[1]))


# --- vLLM and Megatron layouts; the 8B cluster sweep -----------------------------------------------------

def test_vllm_kv_pool_and_sleep_mode(llama_dir):
    base = dict(world_size=8, micro_batch_size=1, logprob_batch_size=1, activation_checkpointing=True,
                rows_per_step=64 * 32, prompt_tokens=512, max_new_tokens=4096, reference=True, device="cuda")
    asleep = plan_memory(llama_dir, Layout(**base, vllm=True, vllm_max_model_len=4608, vllm_concurrency=64))
    per_token = 32 * 2 * 8 * 128 * 2  # layers x (k, v) x kv heads x head_dim x BF16: 128 KiB
    assert asleep.phase == "generation" and asleep.device["kv_cache"] == 64 * 4608 * per_token
    assert asleep.device["gen_weights"] == 2 * asleep.params.total
    assert "gen_weights" not in asleep.host  # sleep(level=2) discards them: the refit reloads them
    awake = plan_memory(llama_dir, Layout(**base, vllm=True, vllm_max_model_len=4608, vllm_concurrency=64,
                                          vllm_sleep=False))
    assert awake.peak > asleep.peak and "gen_weights" not in awake.host  # resident while training too
    pool = plan_memory(llama_dir, Layout(**base, vllm=True, vllm_kv_cache_bytes=100 * GiB, vllm_tensor_parallel=2))
    assert pool.device["kv_cache"] == 50 * GiB  # explicit bytes, split over vLLM's 2 GPUs
    unbounded = plan_memory(llama_dir, Layout(**base, vllm=True, vllm_max_model_len=131072, vllm_concurrency=64))
    assert check(unbounded, 80 * GiB) is not None  # the model's own 131072 positions: ~1 TiB of KV


def test_megatron_replicas_are_not_sharded(llama_dir):
    lay = Layout(world_size=8, trainer_sharded=False, micro_batch_size=1, logprob_batch_size=1, **STUDY)
    plan = plan_memory(llama_dir, lay)
    assert plan.device["params"] + plan.device["optimizer"] == 12 * plan.params.total
    assert check(plan, 80 * GiB) is not None


def test_the_8b_cluster_sweep_fits_8x80gb():
    """On an 80 GB H100's 79.6 GiB, at the prompt length the sweep allows (max_model_len - max_new_tokens = 512,
    not the arithmetic task's 64: issue 31, M8 and M10)."""
    from pathlib import Path

    from launchers.plan.grid import expand
    from launchers.sweepfile.loading import load_sweep

    root = Path(__file__).resolve().parents[3]
    sweep = load_sweep(root / "sweeps" / "fp8_ablation_llama8b.yaml", cwd=root)
    cells = expand(sweep)
    assert len(cells) == 12 and sweep.launcher.slurm.gpu_mem_gb == 79.6
    ranks = sweep.launcher.slurm.nodes * sweep.launcher.slurm.tasks_per_node
    for cell in cells:
        cfg = cell.config
        assert cfg.engines.generation == "vllm" and cfg.engines.vllm.sleep_between_steps
        lay = layout_for_run(cfg, ranks)
        assert lay.vllm and lay.vllm_max_model_len == 4608 and lay.vllm_concurrency == 64
        assert lay.prompt_tokens == 512 and lay.bf16_gather  # parallel.mixed_precision bf16 (M5)
        plan = plan_memory(LLAMA_8B, lay)  # the checkpoint's config.json lives on the cluster: its fields here
        assert check(plan, int(sweep.launcher.slurm.gpu_mem_gb * GiB)) is None, (cell.label(), plan.table())
        assert plan.phases["generation"]["kv_cache"] == cfg.engines.vllm.kv_cache_memory_bytes


@pytest.mark.parametrize("fmt,bits,scale_bytes", [
    ("block128", 8, lambda n, k: 4 * -(-n // 128) * -(-k // 128)),
    ("tensorwise", 8, lambda n, k: 4),
    ("mxfp8", 8, lambda n, k: n * -(-k // 32)),
    ("nvfp4", 4, lambda n, k: -(-n // 16) * -(-k // 16) + 4),
])
def test_the_generation_copy_counts_each_formats_bytes(fmt, bits, scale_bytes):
    """gen_weights = every block linear's codes + scales in fp8.format (counted here from the format's
    definition, per [N, K] weight) + 2 B for every other parameter."""
    from fp8rl_core.config import load_run_config
    from fp8rl_core.distributed.memory_plan import count_parameters, plan_for_run

    cfg = load_run_config(None, ["recipe=fp8_gen", "model.preset=tiny", f"fp8.format={fmt}"])
    plan = plan_for_run(cfg)
    p = count_parameters(plan.model)
    m = plan.model
    h, i = m.hidden_size, m.intermediate_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * plan.model.num_hidden_layers
    lin = sum(n * k for n, k in shapes)
    assert lin == p.block_linear
    expected = sum(n * k * bits // 8 + scale_bytes(n, k) for n, k in shapes) + 2 * (p.total - lin)
    assert plan.device["gen_weights"] == expected


@pytest.mark.parametrize("kv_scale", ["trainer", "first_forward", "per_token_head"])
def test_an_e4m3_kv_cache_counts_one_byte_an_element_plus_its_scales(kv_scale):
    """fp8.kv_cache e4m3: K and V of every layer at 1 B an element + FP32 scales (per layer: 2 L; per_token_head:
    2 L x kv_heads per token), the engines' formula (fp8/kv_bytes.py); the BF16 engine's validation cache stays
    in the dtype. b_gen 3, T 16."""
    cfg = ModelConfig()
    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    lay = Layout(world_size=2, rows_per_step=16, prompt_tokens=10, max_new_tokens=6, generation_batch_size=3,
                 val_prompts=4, val_samples=1, val_batch=4, kv_cache="e4m3", kv_scale=kv_scale)
    scales = 2 * L * (3 * H * 16 if kv_scale == "per_token_head" else 1) * 4
    assert plan_memory(cfg, lay).phases["generation"] == {"kv_cache": 3 * 16 * 2 * L * H * D + scales}
    auto = plan_memory(cfg, replace(lay, kv_cache="auto", kv_scale="trainer"))
    assert auto.phases["generation"] == {"kv_cache": 3 * 16 * 2 * L * H * D * 2}
    b = max(sum(val_batches(lay), []))  # the largest validation batch
    val = b * 16 * 2 * L * H * D
    assert plan_memory(cfg, lay).phases["validation"]["val_kv_cache"] == \
        val + 2 * L * (b * H * 16 if kv_scale == "per_token_head" else 1) * 4
    assert plan_memory(cfg, replace(lay, bf16_engine=True)).phases["validation"]["val_kv_cache"] == val * 2
    run = load_run_config(None, ["fp8.kv_cache=e4m3", f"fp8.kv_scale={kv_scale}"])
    assert (layout_for_run(run, 1).kv_cache, layout_for_run(run, 1).kv_scale) == ("e4m3", kv_scale)


def test_each_steps_formula_in_bytes():
    """The named steps of plan_memory, each against its docstring's formula (ModelConfig(), W = 2, native):
    trainer state 4/8/2 N / W, fsdp (2 g + 4) N_blk + 8 N_root (BF16 gathers: 2 g + 6, g = 2), KV cache
    b_gen x T x L x 2 x kv_heads x head_dim x 2 B, logits b_lp x T x V x 14 B."""
    cfg, n = ModelConfig(), count_parameters(ModelConfig())
    lay = Layout(world_size=2, rows_per_step=16, prompt_tokens=10, max_new_tokens=6, reference=True,
                 generation_batch_size=3, logprob_batch_size=5, val_prompts=0)
    plan = plan_memory(cfg, lay)
    kv_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert [plan.device[k] for k in ("params", "optimizer", "reference")] == [4 * n.total // 2, 8 * n.total // 2,
                                                                              2 * n.total // 2]
    assert plan.phases["generation"] == {"kv_cache": 3 * 16 * kv_token}  # b_gen 3 of a rank's 8 rows, T = 16
    fsdp = 12 * n.block + 8 * n.root
    assert plan.phases["logprobs"] == {"logits": 5 * 16 * cfg.vocab_size * 14, "fsdp_unsharded": fsdp}
    bf16 = plan_memory(cfg, replace(lay, bf16_gather=True))
    assert bf16.phases["logprobs"]["fsdp_unsharded"] == 10 * n.block + 8 * n.root
    assert "validation" not in plan.phases and set(plan.phases) == {"generation", "logprobs", "training"}


def test_emulated_bf16_counts_its_fp32_upcasts():
    """model.bf16_compute emulated: FP32 copies of the BF16 engine's linears and head (4 (N_lin + V h)), the
    trainer's FP32 weight upcasts (4 N_lin, not 2) and each linear's FP32 input (+16 h + 2 q_dim + 2 I per token
    and block); native: none of them. The layout of a run config resolves the key for the planned device."""
    cfg = ModelConfig()
    native = Layout(world_size=1, rows_per_step=64, prompt_tokens=8, max_new_tokens=24)
    plan, up = plan_memory(cfg, native), plan_memory(cfg, replace(native, bf16_upcast=True))
    p, h, q_dim, inter = up.params, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size
    assert "upcast_fp32" not in plan.device
    assert up.device["upcast_fp32"] == 4 * (p.block_linear + cfg.vocab_size * h)
    assert up.phases["training"]["casts"] - plan.phases["training"]["casts"] == 2 * p.block_linear
    extra = up.phases["training"]["activations"] - plan.phases["training"]["activations"]
    assert extra == 64 * 32 * cfg.num_hidden_layers * (16 * h + 2 * q_dim + 2 * inter)
    fp8 = plan_memory(cfg, replace(native, bf16_upcast=True, fp8_generation=True, fp8_training=True,
                                   bf16_engine=True))  # FP8 engine: its head; the BF16 one beside it: all
    assert fp8.device["upcast_fp32"] == 4 * cfg.vocab_size * h + 4 * (p.block_linear + cfg.vocab_size * h)
    for mode, device, upcast in (("emulated", "cpu", True), ("native", "cpu", False), ("native", "cuda", False)):
        run = load_run_config(None, [f"model.bf16_compute={mode}"])
        assert layout_for_run(run, 1, 8, device).bf16_upcast is upcast, (mode, device)
    fp32 = load_run_config(None, ["model.dtype=fp32", "device=cpu"])
    assert not layout_for_run(fp32, 1, 8).bf16_upcast  # nothing runs in BF16
