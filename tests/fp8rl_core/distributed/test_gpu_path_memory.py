"""The memory plan of the 8B cluster sweep counts what a GPU rank holds beside the model's tensors (issue 22):
the CUDA and NCCL contexts, vLLM's activations, the refit's streamed tensors, and says what a rank would
need if PyTorch's cache were not emptied before vLLM's wake_up (fp8rl_core/distributed/memory_plan.py)."""
from __future__ import annotations

from pathlib import Path

from test_memory_plan import LLAMA_8B

from fp8rl_core.distributed.memory_plan import (
    CUDA_CONTEXT_BYTES,
    NCCL_BYTES,
    VLLM_BATCHED_TOKENS,
    GiB,
    Layout,
    check,
    layout_for_run,
    plan_memory,
)


def _sweep_plans():
    from launchers.plan.grid import expand
    from launchers.sweepfile.loading import load_sweep

    root = Path(__file__).resolve().parents[3]
    sweep = load_sweep(root / "sweeps" / "fp8_ablation_llama8b.yaml", cwd=root)
    ranks = sweep.launcher.slurm.nodes * sweep.launcher.slurm.tasks_per_node
    return {c.config.recipe: plan_memory(LLAMA_8B, layout_for_run(c.config, ranks, prompt_tokens=512))
            for c in expand(sweep)}


def test_the_8b_sweep_counts_contexts_activations_and_the_refit():
    plans = _sweep_plans()
    plan = plans["bf16"]
    assert plan.device["cuda_context"] == CUDA_CONTEXT_BYTES == GiB and plan.device["nccl"] == NCCL_BYTES == GiB
    h, i, v = LLAMA_8B["hidden_size"], LLAMA_8B["intermediate_size"], LLAMA_8B["vocab_size"]
    assert plan.phases["generation"]["gen_activations"] == VLLM_BATCHED_TOKENS * (4 * i + 8 * h) + 64 * v * 8
    assert check(plan, 80 * GiB) is None
    # (without the evaluator, whose refit on a non-validating rank holds more: the validation phase)
    # the refit streams: vLLM's weights awake + one gathered FP32 tensor (the 128256 x 4096 head), its copy
    # and one staged block; never a second copy of the model
    refit = plan_memory(LLAMA_8B, Layout(**{**plan.layout.__dict__, "rows_per_step": 8, "max_new_tokens": 8,
                                            "vllm_kv_cache_bytes": 1, "bf16_engine": False}))
    assert refit.phase == "refit", refit.table()
    assert refit.device["refit_stream"] == 6 * v * h + 2 * refit.params.block < refit.device["gen_weights"] / 3
    # level-2 sleep after a rollout: discarded, not copied to the host; the host holds the arm's weights only
    # while the native BF16 evaluator validates (level 1: the next rollout uses them)
    assert plan.host == {"gen_weights": plan.phases["generation"]["gen_weights"]}
    for recipe in ("fp8_gen", "fp8_e2e"):  # block-FP8 codes + scales
        assert plans[recipe].phases["generation"]["gen_weights"] < plan.phases["generation"]["gen_weights"]


def test_without_empty_cache_the_8b_cell_would_not_fit():
    """vLLM's wake_up maps its weights and KV pool outside PyTorch's cache: if PyTorch's cached peak (the
    trainer's, or the native BF16 evaluator's at validation) were kept, a rank would need resident + that
    phase + vLLM's memory. The issue's review found ~100 GiB for the plan's 64; with the terms above the plan
    says 69 GiB (the evaluator's validation), and 121 without empty_cache."""
    plan = _sweep_plans()["bf16"]
    assert 85 * GiB < plan.without_empty_cache and plan.peak < 70 * GiB
    assert plan.without_empty_cache > 80 * GiB > plan.peak


def test_cpu_plans_are_unchanged_by_the_gpu_terms():
    cpu = plan_memory(LLAMA_8B, Layout(world_size=8, device="cpu"))
    assert not {"cuda_context", "nccl", "gen_activations"} & set(cpu.device)
    one = plan_memory(LLAMA_8B, Layout(world_size=1, device="cuda"))
    assert "cuda_context" in one.device and "nccl" not in one.device  # no communicator at world size 1


# ---- the BF16 evaluation engine under vLLM: the native one, for every recipe ------------------------------
def test_every_8b_cell_counts_the_native_bf16_evaluator_in_its_validation_phase():
    """Under vLLM the evaluator of val_accuracy_bf16_eval is the native engine in BF16 for every recipe
    (engines/bf16_eval.py): 2 N of weights (not divided by TP) and its preallocated KV cache for vLLM's
    concurrency, only while it validates (the arm's engine on the host, level 1); never in the rollout."""
    from fp8rl_core.distributed.memory_plan import count_parameters

    plans = _sweep_plans()
    n = count_parameters(plans["bf16"].model).total
    kv = 64 * 4608 * 32 * 2 * 8 * 128 * 2  # vLLM's concurrency x (512 + 4096) x 128 KiB per token: 36 GiB
    for recipe, plan in plans.items():
        lay = plan.layout
        assert lay.bf16_engine, recipe  # every recipe, bf16 included
        val = plan.phases["validation"]
        assert val["bf16_engine"] == 2 * n and val["bf16_kv_cache"] == kv == 36 * GiB, recipe
        assert "bf16_engine" not in plan.phases["generation"]  # released before the next rollout
        assert plan.phase == "validation" and plan.device["bf16_engine"] == 2 * n
        assert check(plan, 80 * GiB) is None, (recipe, plan.table())
        assert 68 * GiB < plan.peak < 70 * GiB  # 68.9 GiB per rank, every cell
        assert plan.host["gen_weights"] == plan.phases["generation"]["gen_weights"]
    # an FP8 arm's rollout no longer carries a second engine's weights (75.9 GiB before)
    resident = sum(v for k, v in plans["fp8_gen"].device.items() if not k.startswith("bf16_"))
    assert resident + sum(plans["fp8_gen"].phases["generation"].values()) < 62 * GiB


def test_the_native_layout_keeps_its_resident_bf16_engine():
    from fp8rl_core.config import load_run_config
    from fp8rl_core.distributed.memory_plan import count_parameters

    for recipe, resident in (("bf16", False), ("fp8_gen", True), ("fp8_e2e", True)):
        cfg = load_run_config(None, [f"recipe={recipe}", "engines.generation=native"])
        plan = plan_memory(LLAMA_8B, layout_for_run(cfg, 8, prompt_tokens=512))
        # no evaluator phase: the native engines validate one batch at once (512 rows: train.val_batch_size)
        assert set(plan.phases["validation"]) == {"val_kv_cache"} and plan.layout.bf16_engine == resident
        assert plan.device.get("bf16_engine", 0) == (2 * count_parameters(plan.model).total if resident else 0)
    bare = plan_memory(LLAMA_8B, Layout(world_size=8, vllm=True, device="cuda"))  # a layout without evaluator
    assert "validation" not in bare.phases and "gen_weights" not in bare.host


# ---- validation split over the ranks (issue 31, M3) -------------------------------------------------------
def test_validation_time_and_memory_per_rank_are_its_share_and_checked_against_the_timeout():
    """The 8B sweep validates 512 prompts greedy + 512 x 4 sampled in batches of 64 (max_num_seqs) on vLLM and
    the sampled ones on the native evaluator: 40 + 32 batches. One rank (before M3: rank 0 ran them all while
    the others waited) needs about an hour, worst case; 8 ranks each run 5 + 4 batches, an eighth of it. The
    evaluator's KV cache is one batch's whatever W. The plan refuses a validation over 25% of the timeout."""
    from fp8rl_core.config import load_run_config
    from fp8rl_core.distributed.memory_plan import check_validation_time, val_batches

    plans = _sweep_plans()
    eight = plans["bf16"]
    one = plan_memory(LLAMA_8B, Layout(**{**eight.layout.__dict__, "world_size": 1}))
    assert [len(b) for b in val_batches(eight.layout)] == [40, 32]
    assert one.validation_s > 45 * 60 and abs(eight.validation_s - one.validation_s / 8) < 1e-6 * one.validation_s
    assert one.phases["validation"]["bf16_kv_cache"] == eight.phases["validation"]["bf16_kv_cache"] == 36 * GiB
    assert check_validation_time(eight, 2400) is None  # the sweep's parallel.timeout_s: 8.4 min <= 10 min
    why = check_validation_time(eight, 1800)  # torch's default: 8.4 min > 7.5 min
    for key in ("parallel.timeout_s", "more ranks", "task.val_size", "train.val_samples", "train.val_batch_size",
                "rollout.max_new_tokens"):
        assert key in why, why
    assert check_validation_time(one, 2400).startswith("validation takes about 66.9 min")
    cfg = load_run_config(None, [])  # a CPU cell: no time estimated, nothing refused
    assert plan_memory(LLAMA_8B, layout_for_run(cfg, 1, device="cpu")).validation_s == 0.0


def test_sweep_plan_refuses_a_validation_over_a_quarter_of_the_timeout(tmp_path):
    import json

    from launchers.plan.memory import TIME_KEY, VALIDATION_REFUSAL, _plan

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    lay = _sweep_plans()["bf16"].layout
    assert _plan(str(tmp_path), "tiny", lay, 80 * GiB, 2400.0)[1] is None
    assert _plan(str(tmp_path), "tiny", lay, 80 * GiB, 1800.0)[1].startswith(VALIDATION_REFUSAL)
    assert TIME_KEY == "base.parallel.timeout_s"
