"""Worst-token tables and saved rollouts (unit). End to end, a tiny real run leaving the table and the explain
report in MLflow: tests/analysis/test_explain.py."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fp8rl_core.diagnostics.tokens import append_rows, worst_tokens
from fp8rl_core.model.tokenizer import char_tokenizer


def _batch(tok):
    rows = [tok.encode("12+3=") + tok.encode("15", add_bos=False) + [tok.eos_id],
            tok.encode("7-4=") + tok.encode("3", add_bos=False) + [tok.eos_id]]
    prompt_lens = [len(tok.encode("12+3=")), len(tok.encode("7-4="))]
    T = max(map(len, rows))
    ids = torch.full((2, T), tok.pad_id, dtype=torch.long)
    am = torch.zeros(2, T, dtype=torch.bool)
    rm = torch.zeros(2, T, dtype=torch.bool)
    for b, (r, L) in enumerate(zip(rows, prompt_lens)):
        ids[b, :len(r)] = torch.tensor(r)
        am[b, :len(r)] = True
        rm[b, L:len(r)] = True
    gen = torch.where(rm, torch.full((2, T), -1.0), torch.zeros(2, T))
    return ids, am, rm, gen, prompt_lens


def test_worst_tokens_rank_by_abs_diff_with_text_and_both_logprobs():
    tok = char_tokenizer()
    ids, am, rm, gen, L = _batch(tok)
    train = gen.clone()
    train[0, L[0] + 1] = -4.0  # "5" of "15": 3 nats off
    train[1, L[1]] = 0.5  # "3": 1.5 nats off
    train[0, 0] = -99.0  # off-mask (a prompt token): never listed
    w = torch.exp(train - gen) * rm
    rows = worst_tokens(ids, am, rm, train, gen, w, tok, k=3, context_tokens=3, step=7)
    assert [r["rank"] for r in rows] == [1, 2, 3]
    top, second = rows[0], rows[1]
    assert (top["row"], top["token"], top["prompt"], top["context"]) == (0, "5", "12+3=", "3=1")
    assert top["train_logprob"] == -4.0 and top["gen_logprob"] == -1.0 and top["abs_diff"] == 3.0
    assert top["is_weight"] == pytest.approx(math.exp(-3.0))
    assert (second["row"], second["token"], second["abs_diff"]) == (1, "3", 1.5)
    assert rows[2]["abs_diff"] == 0.0 and rows[2]["step"] == 7  # ties: first in flat order
    assert worst_tokens(ids, am, torch.zeros_like(rm), train, gen, w, tok, 3, 3, 7) == []


def test_non_finite_differences_rank_first_and_eos_is_named():
    tok = char_tokenizer()
    ids, am, rm, gen, L = _batch(tok)
    train = gen.clone()
    eos_pos = L[1] + 1
    train[1, eos_pos] = float("nan")
    rows = worst_tokens(ids, am, rm, train, gen, None, tok, k=1, context_tokens=2, step=1)
    assert rows[0]["row"] == 1 and rows[0]["token"] == "<eos>" and rows[0]["is_weight"] == 1.0


def test_every_eos_id_is_named():
    """A model with several EOS ids (config.json + generation_config.json): each one reads "<eos>"."""
    from fp8rl_core.model.tokenizer import Tokenizer

    base = char_tokenizer()
    other = base.vocab_size - 2  # a second stop id, as Llama-3.1-Instruct's <|eot_id|>
    tok = Tokenizer(base.tok, bos_id=1, eos_id=2, pad_id=0, extra_eos_ids=[other])
    ids, am, rm, gen, L = _batch(tok)
    ids[0, L[0] + 2] = other  # row 0 ends on the second EOS id, row 1 on the first
    train = gen.clone()
    train[0, L[0] + 2], train[1, L[1] + 1] = -5.0, -4.0
    rows = worst_tokens(ids, am, rm, train, gen, None, tok, k=2, context_tokens=2, step=1)
    assert [(r["row"], r["token_id"], r["token"]) for r in rows] == [(0, other, "<eos>"), (1, 2, "<eos>")]


def test_append_rows_keeps_one_copy_of_recomputed_steps(tmp_path):
    path = tmp_path / "t.jsonl"
    for step in (1, 2, 3):
        append_rows(path, step, [{"step": step, "rank": 1}])
    append_rows(path, 2, [{"step": 2, "rank": 1, "again": True}])  # a resumed run redoes step 2 (and 3 next)
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [1, 2]
    with open(path, "a") as f:
        f.write('{"step": 3, "ra')  # a kill mid-write
    append_rows(path, 3, [{"step": 3, "rank": 1}])
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_rollouts_whose_weights_were_pruned_are_deleted(tmp_path):
    from fp8rl_core.diagnostics.tokens import prune_rollouts, rollout_path

    kept = tmp_path / "checkpoints" / "step_00000003"
    kept.mkdir(parents=True)
    (kept / "meta.json").write_text("{}")
    (tmp_path / "checkpoints" / ".tmp-step_00000005").mkdir()  # half written: not a checkpoint
    for step in (1, 4, 6):
        rollout_path(tmp_path, step).parent.mkdir(exist_ok=True)
        rollout_path(tmp_path, step).write_bytes(b"x")
    removed = prune_rollouts(tmp_path)
    assert [p.name for p in removed] == ["step_00000006.pt"]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_00000001.pt", "step_00000004.pt"]
