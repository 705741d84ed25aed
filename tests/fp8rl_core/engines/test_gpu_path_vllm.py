"""The 8B cluster path of the vLLM engine, correct by construction (issue 22), checked at its boundary with
fakes: a fake `vllm` module (test_vllm_gen.FakeLLM: records arguments, sleeps, wake-ups, reloads) and
torch.cuda's functions faked (test_vllm_gen.fake_cuda: 8 devices, a current device, empty_cache).

What vLLM 0.32's CUDA build does that these fakes stand for (vllm_placement.py, vllm_gen.py "Colocation";
its CPU build runs for real in test_vllm_real.py):
- the `uni` executor puts every engine on cuda:0 and makes it current; `external_launcher` takes
  RANK / LOCAL_RANK from the environment and makes cuda:LOCAL_RANK current;
- sleep(level=2) discards weights and KV cache (buffers saved and restored by the worker), level 1 copies
  the weights to the host; wake_up maps memory outside PyTorch's caching allocator;
- one sleep-mode engine per process (CuMemAllocator is a singleton).
"""
from __future__ import annotations

import sys

import pytest
import torch
from test_vllm_gen import ODD, FakeLLM, _checkpoint, _record_builds, install_fake_vllm, random_weights, vllm_engine

from fp8rl_core.config import VllmSpec, run_config_from_dict
from fp8rl_core.config.recipe import BF16
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines import base as engines
from fp8rl_core.engines import vllm_convert as conv
from fp8rl_core.engines import vllm_placement as placement
from fp8rl_core.engines.base import SamplingParams
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.loop.builder import build_bf16_generation_engine, build_context, rank_seed, resolve_setup

PROMPTS = [[1, 5], [1, 6, 7], [1, 8, 9, 10]]


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch)


def _rank(monkeypatch, rank: int, world: int) -> Mesh:
    """This process as rank `rank` of `world` (one per GPU of a node): torchrun's variables and the mesh."""
    for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world}.items():
        monkeypatch.setenv(key, str(value))
    return Mesh(world_size=world, rank=rank, local_rank=rank)


def _cfg(tmp_path, recipe: str = "bf16", **vllm):
    return run_config_from_dict({"recipe": recipe, "output_dir": str(tmp_path / "out"), "seed": 4,
                                 "engines": {"generation": "vllm", "vllm": vllm}})


# ---- one engine per rank, on that rank's device ------------------------------------------------------
def test_llm_kwargs_place_one_engine_per_rank():
    """World 8 at TP 1: eight ExternalDP replicas (data_parallel_size 1: vLLM's DP would make every
    generate a collective); world 1 keeps vLLM's own executor; TP 2 at world 8 is refused with the reason."""
    kw = dict(recipe=BF16, dtype="bfloat16", seed=0, max_model_len=40)
    eight = conv.llm_kwargs("m", ODD, vllm=VllmSpec(), world_size=8, **kw)
    assert {k: eight[k] for k in ("distributed_executor_backend", "tensor_parallel_size",
                                  "pipeline_parallel_size", "data_parallel_size")} == {
        "distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "data_parallel_size": 1}
    one = conv.llm_kwargs("m", ODD, vllm=VllmSpec(tensor_parallel_size=2), world_size=1, **kw)
    assert "distributed_executor_backend" not in one and one["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 at world size 8: .*same prompts.*valid: 1"):
        conv.llm_kwargs("m", ODD, vllm=VllmSpec(tensor_parallel_size=2), world_size=8, **kw)


def test_rank_env_must_match_the_process_group():
    env = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8"}
    assert placement.rank_env_error(env, 3, 3, 8, 8) is None
    assert placement.rank_env_error({}, 0, 0, 1, 1) is None  # world size 1: nothing is read
    assert "LOCAL_RANK=None (this rank: 3)" in placement.rank_env_error({"RANK": "3", "WORLD_SIZE": "8"}, 3, 3, 8, 8)
    assert "sees 1 CUDA device" in placement.rank_env_error(env, 3, 3, 8, 1)


def test_each_rank_starts_its_engine_on_its_own_device(fake_vllm, monkeypatch, tmp_path):
    mesh = _rank(monkeypatch, 3, 8)
    engine = vllm_engine(_cfg(tmp_path), ODD, mesh=mesh)
    engine.start(_checkpoint(tmp_path))  # BF16: vLLM reads the folder as it is (no checkpoint, no barrier)
    (llm,) = fake_vllm
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.device_at_start == 3 and torch.cuda.current_device() == 3  # set before vllm.LLM, still after


def test_an_engine_left_on_another_device_is_an_error(fake_vllm, monkeypatch, tmp_path):
    """What the `uni` executor does (Worker.init_device with DeviceConfig "cuda": cuda:0 on every rank)."""

    class UniLLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            torch.cuda.set_device(0)


    monkeypatch.setattr(sys.modules["vllm"], "LLM", UniLLM)
    engine = vllm_engine(_cfg(tmp_path), ODD, mesh=_rank(monkeypatch, 5, 8))
    with pytest.raises(RuntimeError, match=r"current CUDA device is cuda:0, expected cuda:5"):
        engine.start(_checkpoint(tmp_path))


def test_a_rank_without_its_environment_is_refused(fake_vllm, monkeypatch, tmp_path):
    mesh = _rank(monkeypatch, 2, 8)
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=None"):
        vllm_engine(_cfg(tmp_path), ODD, mesh=mesh).start(_checkpoint(tmp_path))
    assert fake_vllm == []
    with pytest.raises(ValueError, match="tensor_parallel_size=2 at world size 8"):
        vllm_engine(_cfg(tmp_path, tensor_parallel_size=2), ODD, mesh=mesh)  # refused at construction


# ---- per-rank sampling seeds ----------------------------------------------------------------------------
def test_ranks_draw_their_own_request_seeds(fake_vllm, monkeypatch, tmp_path):
    """Rank r seeds its requests from rank_seed(seed, r), as the native engine does: GRPO groups on two
    ranks never share sampling noise; rank 0 keeps the run's own stream."""
    seeds = []
    for rank in (0, 1):
        engine = vllm_engine(_cfg(tmp_path), ODD, mesh=_rank(monkeypatch, rank, 2))
        engine.start(_checkpoint(tmp_path))
        engine.refit(random_weights(ODD))
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
        _, params = fake_vllm[-1].requests[-1]
        seeds.append([p["seed"] for p in params])
        assert fake_vllm[-1].kwargs["seed"] == rank_seed(4, rank)
    assert seeds[0] == conv.request_seeds(torch.Generator().manual_seed(4), 3)
    assert seeds[1] == conv.request_seeds(torch.Generator().manual_seed(rank_seed(4, 1)), 3)
    assert not set(seeds[0]) & set(seeds[1])


def test_every_ranks_seed_is_inside_vllms_range():
    """vLLM's worker seeds numpy, which takes [0, 2**32) only: every rank's seed, for any run seed the config
    allows ([0, 2**31)), is a 31-bit number (the 63-bit ones of before raised at engine start on ranks >= 1)."""
    from fp8rl_core.config import load_run_config
    from fp8rl_core.config.schema import ConfigError

    for seed in (0, 4, 2**31 - 1):
        assert all(0 <= rank_seed(seed, r) < 2**31 for r in range(64))
    assert len({rank_seed(4, r) for r in range(64)}) == 64
    with pytest.raises(ConfigError, match="seed"):
        load_run_config(None, [f"seed={2**31}"])


# ---- sleep levels and the caching allocator ------------------------------------------------------------
def test_every_wake_up_follows_an_empty_cache(fake_vllm, tmp_path):
    engine = vllm_engine(_cfg(tmp_path, "fp8_gen"), ODD)
    engine.start(_checkpoint(tmp_path))
    for step in range(3):  # the loop: refit, rollout, (train)
        engine.refit(random_weights(ODD, seed=step))
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    wakes = [e for e in fake_vllm[0].events if e[0] == "wake_up"]
    assert len(wakes) == 6 and FakeLLM.wakes_without_empty_cache == []


def test_level_2_where_a_refit_follows_level_1_where_the_weights_serve_again(fake_vllm, tmp_path):
    engine = vllm_engine(_cfg(tmp_path, "fp8_gen"), ODD)
    engine.start(_checkpoint(tmp_path))
    (llm,) = fake_vllm
    assert llm.events == [("sleep", 2)]  # the builder's refit overwrites the start weights at once
    engine.refit(random_weights(ODD))
    llm.events.clear()
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))  # a rollout: the trainer and a refit follow
    assert llm.events == [("wake_up", ("kv_cache",)), ("generate",), ("sleep", 2)]
    with pytest.raises(RuntimeError, match="level-2 sleep discarded the weights"):  # never sample garbage
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    engine.refit(random_weights(ODD, seed=1))
    llm.events.clear()
    with engine.awake():  # validation: many generate calls on one refit, no sleep between them
        for _ in range(3):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    assert [e[0] for e in llm.events].count("sleep") == 0
    engine.sleep(level=1)  # another engine needs the GPU before the next rollout: keep these weights
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))  # no refit in between: still valid
    assert llm.events[-5:] == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)),
                               ("generate",), ("sleep", 2)]


def test_a_partly_awake_engine_wakes_the_rest_before_sleeping(fake_vllm, tmp_path):
    """vLLM's Executor.sleep returns at once while any tag is asleep: after a refit (weights awake, KV
    asleep) a sleep must wake the KV cache first, or vLLM would keep the weights on the GPU."""
    engine = vllm_engine(_cfg(tmp_path, "fp8_gen"), ODD)
    engine.start(_checkpoint(tmp_path))
    engine.refit(random_weights(ODD))
    (llm,) = fake_vllm
    llm.events.clear()
    engine.sleep(level=2)
    assert llm.events == [("wake_up", ("kv_cache",)), ("sleep", 2)] and engine.asleep == {"weights", "kv_cache"}


def test_refit_streams_one_tensor_at_a_time(fake_vllm, tmp_path):
    """vLLM's reload_weights takes any iterable: the refit hands it a generator, so a tensor is read (and,
    from a sharded trainer, gathered) only when vLLM is ready for it; no second copy of the model."""
    engine = vllm_engine(_cfg(tmp_path, "fp8_gen"), ODD)
    engine.start(_checkpoint(tmp_path))
    reads: list[str] = []

    class Recording(dict):  # a GatheredWeights stand-in: a read is a gather; `shards` serves the checks
        def __getitem__(self, name):
            reads.append(name)
            return super().__getitem__(name)

        @property
        def shards(self):
            return dict(self)

    seen_when = []
    llm = fake_vllm[0]
    original = llm.collective_rpc

    def consume(method, timeout=None, args=(), kwargs=None):
        if method == "reload_weights":
            it = kwargs["weights_iterator"]
            assert not isinstance(it, (list, tuple))
            for _ in it:
                seen_when.append(len(reads))
            kwargs = {**kwargs, "weights_iterator": []}
        return original(method, timeout, args, kwargs)

    llm.collective_rpc = consume
    weights = random_weights(ODD)
    engine.refit(Recording(weights))
    assert reads == [n for n in weights]  # each tensor read once, in the trainer's order
    assert seen_when[0] == 1  # the first pair reached vLLM after one read, not after all of them


def test_a_second_sleep_mode_engine_is_refused_with_the_reason(fake_vllm, tmp_path):
    first = vllm_engine(_cfg(tmp_path, "fp8_gen"), ODD)
    first.start(_checkpoint(tmp_path))
    second = vllm_engine(_cfg(tmp_path), ODD, output_dir=str(tmp_path / "second"))
    with pytest.raises(RuntimeError, match="CuMem allocator can only be used for one instance per process"):
        second.start(_checkpoint(tmp_path))
    first.close()  # the first engine gone: a new one may start
    second.start(_checkpoint(tmp_path))
    assert len(fake_vllm) == 2


# ---- the BF16 evaluation engine under vLLM: the native engine, for every recipe --------------------------
def _sweep_like(tmp_path, recipe: str, path):
    """A cell as the 8B sweep runs it: vLLM in sleep mode, a bounded concurrency, 2 prompts x 4 samples."""
    return run_config_from_dict({
        "recipe": recipe, "output_dir": str(tmp_path / "out"), "device": "cpu", "seed": 4,
        "model": {"path": str(path), "dtype": "bf16"}, "loss": {"kl_coef": 0.1},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4},
        "engines": {"generation": "vllm", "vllm": {"sleep_between_steps": True, "max_num_seqs": 3}}})


def _weight_tensors(engine) -> set[str]:
    """The engine's attributes that hold model weights (its RoPE tables and generator are not weights)."""
    return {k for k, v in vars(engine).items()
            if k not in ("_cos", "_sin") and (isinstance(v, torch.Tensor) or (isinstance(v, list) and v)
                                              or (v is not None and hasattr(v, "weight")))}


@pytest.mark.parametrize("recipe", ["bf16", "fp8_gen", "fp8_e2e"])
def test_one_vllm_engine_and_a_native_bf16_evaluator_for_every_recipe(fake_vllm, monkeypatch, tmp_path, recipe):
    """vLLM runs one sleep-mode engine per process on a GPU (CuMemAllocator), so the engine-neutral evaluation
    (val_accuracy_bf16_eval) runs on the native generation engine in BF16, for every arm alike (bf16
    included: its own vLLM engine would be another evaluator than the FP8 arms'). It holds no weights until
    validation refits it, and gives them back at sleep(level=2)."""
    path = _checkpoint(tmp_path)
    events: list = []
    _record_builds(monkeypatch, events, fake_vllm)
    ctx = build_context(_sweep_like(tmp_path, recipe, path), progress=False, mesh=SINGLE)
    assert len(fake_vllm) == 1 and ctx.gen.llm is fake_vllm[0]  # the arm's: the process's one vLLM engine
    evaluator = ctx.bf16_gen
    assert isinstance(evaluator, NativeGenerationEngine) and evaluator is not ctx.gen
    assert evaluator.recipe.generation is None and evaluator.recipe.training is None and not evaluator.fp8
    assert evaluator.dtype == torch.bfloat16 and evaluator.device == torch.device("cpu")
    assert evaluator.generator.initial_seed() == rank_seed(4, 0)
    assert evaluator.max_batch == 3  # engines.vllm.max_num_seqs: its KV cache no larger than vLLM's pool
    assert _weight_tensors(evaluator) == set()  # nothing allocated before the first validation
    assert ctx.bf16_engine() is evaluator and _weight_tensors(evaluator)  # refit from the trainer
    assert evaluator.embed.dtype == torch.bfloat16
    out = evaluator.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert out.response_ids.shape[0] == len(PROMPTS)
    engines.sleep(evaluator, level=1)  # the same weights serve again: kept
    assert _weight_tensors(evaluator)
    engines.sleep(evaluator, level=2)  # its next use follows a refit: released on every rank
    assert _weight_tensors(evaluator) == set()
    with pytest.raises(RuntimeError, match="no weights"):  # never a silent evaluation without a refit
        evaluator.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    ctx.refit_generation()
    assert ctx.bf16_engine() is evaluator and _weight_tensors(evaluator)


def test_the_evaluator_takes_its_rank_seed_and_device(fake_vllm, monkeypatch, tmp_path):
    mesh = _rank(monkeypatch, 3, 8)
    cfg = run_config_from_dict({"recipe": "fp8_gen", "output_dir": str(tmp_path / "out"), "seed": 4,
                                "model": {"dtype": "bf16"}, "rollout": {"prompts_per_step": 8},
                                "engines": {"generation": "vllm"}})
    evaluator = build_bf16_generation_engine(resolve_setup(cfg, "cpu", mesh), ODD)
    assert evaluator.generator.initial_seed() == rank_seed(4, 3) and fake_vllm == []  # no vLLM engine started
    # max_num_seqs unset: validation's batch, train.val_batch_size, whatever the world size (issue 31, M3: the
    # batches are dealt whole to the ranks; before, every row of the rank, which changed with W)
    assert evaluator.max_batch == cfg.train.val_batch_size == 512
    one = build_bf16_generation_engine(resolve_setup(cfg, "cpu", SINGLE), ODD)
    assert one.max_batch == evaluator.max_batch
    with pytest.raises(ValueError, match="above its max_batch 512"):  # its KV bound holds
        evaluator.generate([[3]] * 513, SamplingParams(max_new_tokens=1))


def test_the_refusal_of_a_second_sleep_mode_engine_stays_as_a_guard(fake_vllm, tmp_path):
    """The builder no longer starts a second vLLM engine; anything that does is still refused at start."""
    first = vllm_engine(_cfg(tmp_path, "bf16"), ODD)
    first.start(_checkpoint(tmp_path))
    second = vllm_engine(_cfg(tmp_path, "fp8_gen"), ODD, output_dir=str(tmp_path / "second"))
    with pytest.raises(RuntimeError, match="one instance per process"):
        second.start(_checkpoint(tmp_path))
    assert len(fake_vllm) == 1


def test_the_longest_prompt_is_measured_at_start_when_max_model_len_is_set(fake_vllm, tmp_path):
    """M4: with engines.vllm.max_model_len set, start measures the task's prompts too, so a limit that cannot
    hold the longest one + max_new_tokens is refused before vLLM starts, not hours later in generate."""
    new = run_config_from_dict({}).rollout.max_new_tokens
    cfg = _cfg(tmp_path, max_model_len=new + 2)  # room for the response, not for a 7-token arithmetic prompt
    with pytest.raises(ValueError, match=rf"engines.vllm.max_model_len: {new + 2} tokens cannot hold the longest"):
        vllm_engine(cfg, ODD).start(_checkpoint(tmp_path))
    assert fake_vllm == []  # vllm.LLM never started


def test_a_validation_batch_sends_the_same_request_seeds_on_every_rank(fake_vllm, monkeypatch, tmp_path):
    """Issue 31, M3: validation's batches are dealt over the ranks, and batch k is seeded VAL_SEED + k, so the
    vLLM engine of whichever rank runs it sends the same per-request seeds as one rank running every batch,
    though the ranks' own streams (rank_seed) differ; each rank's stream is restored afterwards."""
    from types import SimpleNamespace

    from fp8rl_core.loop.evaluate import validation_metrics

    class PeerMesh(Mesh):  # no process group: the all-reduce returns this rank's vector
        def _reduce(self, values, op):
            return torch.as_tensor(values, dtype=torch.float64)

    task = SimpleNamespace(val_examples=[SimpleNamespace(prompt=str(i)) for i in range(3)],
                           reward=lambda ex, text: 0.0)
    tokenizer = SimpleNamespace(encode_prompt=lambda text: [1, 5 + int(text)], decode=lambda ids: "")

    def seeds(rank: int, world: int) -> list[list[int]]:
        engine = vllm_engine(_cfg(tmp_path), ODD, mesh=_rank(monkeypatch, rank, world))
        engine.start(_checkpoint(tmp_path))
        engine.refit(random_weights(ODD))
        before = engine.generator.get_state()
        with engine.awake():  # as loop/run.py _validate holds it over its batches
            validation_metrics(engine, tokenizer, task, SamplingParams(max_new_tokens=2), samples=2, batch_size=2,
                               greedy=False, mesh=PeerMesh(world_size=world, rank=rank))
        assert torch.equal(engine.generator.get_state(), before)  # the rollout stream is untouched
        return [[p["seed"] for p in params] for _, params in fake_vllm[-1].requests]

    one = seeds(0, 1)  # 6 sampled rows in batches of 2: three generate calls
    assert len(one) == 3 and len({s for batch in one for s in batch}) == 6
    assert seeds(0, 2) == [one[0], one[2]] and seeds(1, 2) == [one[1]]
