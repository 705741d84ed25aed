"""Warm start: cached by config hash, shared across processes, and it actually teaches the task."""
import torch

from fp8rl_core.config import load_run_config
from fp8rl_core.loop.builder import load_tokenizer, resolve_setup
from fp8rl_core.loop.warmstart import dev_accuracy, dev_examples, sft_batch, warm_start, warmstart_key
from fp8rl_core.tasks import make_task


def _cfg(tmp_path, *extra):
    return load_run_config(None, [f"warmstart.cache_dir={tmp_path}", "task.val_size=8", *extra])


def test_cached_by_key_and_zero_steps_allowed(tmp_path):
    cfg = _cfg(tmp_path, "warmstart.steps=0")
    setup = resolve_setup(cfg, "cpu")
    path = warm_start(setup, progress=False)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert warm_start(setup, progress=False) == path  # second call: found, not retrained
    assert (path / "config.json").stat().st_mtime_ns == stamp
    assert warmstart_key(_cfg(tmp_path / "elsewhere", "warmstart.steps=0")) == path.name  # cache dir not in key
    assert warmstart_key(_cfg(tmp_path, "warmstart.steps=1")) != path.name
    assert not list(tmp_path.glob(".tmp-*"))  # no temporary folder left behind


def test_sft_batch_masks_target_and_eos_only():
    cfg = load_run_config(None, ["task.val_size=8"])
    tok, task = load_tokenizer(cfg), make_task(cfg.task)
    ex = task.sample_train(0, 2)
    ids, mask = sft_batch(ex, tok, task)
    for i, e in enumerate(ex):
        n_prompt = len(tok.encode(e.prompt))
        target = ids[i][mask[i]].tolist()
        assert target == tok.encode(e.answer, add_bos=False) + [tok.eos_id]
        assert not mask[i, :n_prompt].any()
    assert ids.dtype == torch.long


def _stamp(path):
    return dict(kv.split("=") for kv in (path / "warmstart.txt").read_text().split())


def test_target_accuracy_stops_at_the_first_check_that_reaches_it(tmp_path):
    # target 0.0 is reached at the first check (step eval_every); the run must stop there
    cfg = _cfg(tmp_path, "warmstart.steps=50", "warmstart.eval_every=3", "warmstart.target_accuracy=0.0",
               "warmstart.dev_size=8", "warmstart.batch_size=4")
    path = warm_start(resolve_setup(cfg, "cpu"), progress=False)
    stamp = _stamp(path)
    assert int(stamp["steps"]) == 3 and 0.0 <= float(stamp["dev_accuracy"]) <= 1.0


def test_without_target_every_step_runs_and_dev_is_not_measured(tmp_path):
    cfg = _cfg(tmp_path, "warmstart.steps=5", "warmstart.eval_every=2", "warmstart.target_accuracy=null",
               "warmstart.batch_size=4")
    stamp = _stamp(warm_start(resolve_setup(cfg, "cpu"), progress=False))
    assert int(stamp["steps"]) == 5 and stamp["dev_accuracy"] == "nan"


def test_dev_prompts_are_fixed_and_never_validation_prompts():
    cfg = load_run_config(None, ["task.val_size=64", "warmstart.dev_size=200"])
    task = make_task(cfg.task)
    dev = dev_examples(cfg, task)
    assert len(dev) == 200 and dev == dev_examples(cfg, make_task(cfg.task))
    assert not {e.prompt for e in dev} & {e.prompt for e in task.val_examples}


def test_dev_accuracy_counts_exact_greedy_answers(tmp_path):
    # an untrained model answers (almost) nothing right; the same examples with answers replaced by
    # the model's own greedy outputs score 1.0 -- so the function scores what the model decodes
    from fp8rl_core.engines.base import SamplingParams
    from fp8rl_core.engines.native_gen import NativeGenerationEngine
    from fp8rl_core.model import build_model
    from fp8rl_core.model.config import preset
    from fp8rl_core.tasks import Example

    cfg = load_run_config(None, ["task.val_size=8", "rollout.max_new_tokens=4"])
    tok, task = load_tokenizer(cfg), make_task(cfg.task)
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=max(32, tok.vocab_size)), dtype=torch.float32)
    dev = task.sample_train(1, 16)
    gen = NativeGenerationEngine(model.config, dtype=torch.bfloat16)
    gen.refit(model.state_dict())
    out = gen.generate([tok.encode(e.prompt) for e in dev], SamplingParams(max_new_tokens=4, greedy=True))
    said = [tok.decode(out.response_ids[i, :n].tolist()) for i, n in enumerate(out.response_mask.sum(1).tolist())]
    echoed = [Example(e.prompt, s) for e, s in zip(dev, said)]
    assert dev_accuracy(model, resolve_setup(cfg, "cpu"), echoed) == 1.0
    right = sum(task.reward(e, s) for e, s in zip(dev, said)) / len(dev)
    assert dev_accuracy(model, resolve_setup(cfg, "cpu"), dev) == right


WS_TINY = ("warmstart.steps=2", "warmstart.eval_every=1", "warmstart.target_accuracy=1.0", "warmstart.dev_size=4",
           "warmstart.batch_size=4")


def test_emulated_bf16_warm_start_emulates_every_bf16_product_and_shares_the_cache(tmp_path, monkeypatch):
    """model.bf16_compute=emulated: no matrix product of the warm start runs a BF16 kernel: its training
    forwards (every linear, the LM head included) and its dev-accuracy engine (an emulating one) run
    their linears as FP32 products on BF16-rounded operands. The checkpoint keeps plain HF names, and
    its cache key is the native / auto one (summation order only), so a native config finds it instead
    of training again."""
    import torch.nn.functional as F

    from fp8rl_core.engines.native_gen import NativeGenerationEngine
    from fp8rl_core.model.hf_io import load_pretrained

    calls, engines = [], []
    real_linear, real_generate = F.linear, NativeGenerationEngine.generate

    def linear(x, w, b=None):  # True: a BF16 kernel (autocast on, or a BF16 operand)
        calls.append(torch.is_autocast_enabled("cpu") or torch.bfloat16 in (x.dtype, w.dtype))
        return real_linear(x, w, b)

    def generate(self, *a, **kw):
        engines.append(self.upcast_bf16)
        return real_generate(self, *a, **kw)

    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(NativeGenerationEngine, "generate", generate)
    cfg = _cfg(tmp_path, "model.bf16_compute=emulated", *WS_TINY)
    path = warm_start(resolve_setup(cfg, "cpu"), progress=False)
    assert int(_stamp(path)["steps"]) == 2  # trained (dev accuracy 1.0 is not reached in 2 steps)
    assert engines == [True, True]  # one dev check per step, on an emulating engine
    loaded = load_pretrained(path)
    per_forward = 7 * loaded.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down; LM head
    assert len(calls) > 2 * per_forward and not any(calls)  # two training forwards, the dev engine's products
    assert all(type(m) is torch.nn.Linear for m in loaded.modules() if isinstance(m, torch.nn.Linear))
    for mode in ("native", "auto"):
        other = _cfg(tmp_path, f"model.bf16_compute={mode}", *WS_TINY)
        assert warmstart_key(other) == path.name
        stamp = (path / "config.json").stat().st_mtime_ns
        calls.clear()
        assert warm_start(resolve_setup(other, "cpu"), progress=False) == path
        assert not calls and (path / "config.json").stat().st_mtime_ns == stamp  # found, not retrained
    assert warmstart_key(_cfg(tmp_path, "model.dtype=fp32", *WS_TINY)) != path.name  # the dtype is in the key


def test_the_warm_start_is_the_plain_loop_bit_for_bit(tmp_path):
    """The cached checkpoint equals, bit for bit, a loop written out with torch alone (same seed, batches,
    AdamW, warmup + cosine schedule, clip 1.0, BF16 autocast on this CPU's BF16 path): the parts that
    benchmarks/warmstart.py times (initial_model, sft_optimizer, sft_step) are the warm start, and splitting
    them out changed no bit. Same machine on both sides, so no CPU kind is assumed."""
    import math
    import random

    from safetensors.torch import load_file

    from fp8rl_core.model import bf16, build_model
    from fp8rl_core.model.config import preset

    cfg = _cfg(tmp_path, "warmstart.steps=6", "warmstart.target_accuracy=null", "warmstart.batch_size=8")
    setup = resolve_setup(cfg, "cpu")
    saved = load_file(str(warm_start(setup, progress=False) / "model.safetensors"))

    ws = cfg.warmstart
    torch.manual_seed(cfg.task.data_seed)
    model = build_model(preset("tiny", vocab_size=max(32, setup.tokenizer.vocab_size)), dtype=torch.float32)
    if setup.warmstart_upcast_bf16:
        bf16.upcast_bf16_matmuls(model)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    warmup = max(1, ws.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.55 + 0.45 * math.cos(math.pi * min(s / ws.steps, 1.0))))
    rng = random.Random(cfg.task.data_seed + 1)
    for _ in range(ws.steps):
        ids, mask = sft_batch(setup.task.warmstart_sample(rng, ws.batch_size), setup.tokenizer, setup.task)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    mine = model.state_dict()
    assert saved.keys() <= mine.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, mine[name].to(tensor.dtype)), name
