"""Every EOS id stops a sequence: config.json's list and generation_config.json's, in the native engine,
the vLLM request parameters and output conversion, and the tokenizer's decode.

The model case: Llama-3.1-Instruct lists eos_token_id [128001, 128008, 128009] and ends a turn with
128009 (<|eot_id|>), the third; Qwen2.5-Instruct's turn end is only in generation_config.json.
Here a tiny config whose turns end with a second EOS id (5) besides the tokenizer's EOS (2).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from fp8rl_core.engines import vllm_convert as conv
from fp8rl_core.engines.base import SamplingParams
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.model import ModelConfig, build_model, save_pretrained
from fp8rl_core.model.config import merge_eos_ids
from fp8rl_core.model.hf_io import read_model_config
from fp8rl_core.model.tokenizer import Tokenizer, char_tokenizer

TURN_END = 5  # the second EOS id


def uniform_engine(eos) -> NativeGenerationEngine:
    """A native engine whose LM head is zero: every token equally likely, so both EOS ids get sampled."""
    cfg = ModelConfig(eos_token_id=eos)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    engine = NativeGenerationEngine(cfg, dtype=torch.float32, seed=0)
    engine.refit(model.state_dict())
    return engine


def test_config_keeps_the_list_and_merges_generation_config(tmp_path):
    cfg = ModelConfig.from_hf_dict({"eos_token_id": [128001, 128008, 128009], "vocab_size": 128256})
    assert cfg.eos_ids == (128001, 128008, 128009) and cfg.to_hf_dict()["eos_token_id"] == [128001, 128008, 128009]
    assert ModelConfig(eos_token_id=[2]).eos_token_id == 2 and ModelConfig(eos_token_id=None).eos_ids == ()
    assert ModelConfig(eos_token_id=[7, 2], pad_token_id=None).pad_id == 7
    assert merge_eos_ids({"eos_token_id": 151643}, {"eos_token_id": [151645, 151643]}) == [151643, 151645]
    assert merge_eos_ids({}, {"eos_token_id": None}) is None
    save_pretrained(build_model(ModelConfig()), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, TURN_END]}))
    assert read_model_config(tmp_path).eos_ids == (2, TURN_END)


def test_native_engine_stops_at_either_eos_id():
    prompts = [[1, 3, 4]] * 16
    sampling = SamplingParams(max_new_tokens=40, seed=3)
    out = uniform_engine([2, TURN_END]).generate(prompts, sampling)
    ends = set()
    for ids, mask, done in zip(out.response_ids.tolist(), out.response_mask.tolist(), out.finished.tolist()):
        n = sum(mask)
        first = next((t for t, tok in enumerate(ids) if tok in (2, TURN_END)), None)
        assert done == (first is not None) and n == (first + 1 if done else len(ids))
        if done:
            ends.add(ids[first])
            assert all(tok == 0 for tok in ids[n:])  # pad after the stop
    assert ends == {2, TURN_END}  # some rows ended on the turn-end id, some on the first EOS
    # the same stream with only the first EOS configured runs through the turn-end id
    plain = uniform_engine(2).generate(prompts, sampling)
    assert any(TURN_END in ids[: int(m.sum())] for ids, m in zip(plain.response_ids.tolist(), plain.response_mask))


def test_vllm_requests_stop_on_every_id_and_outputs_cut_at_the_first():
    cfg = ModelConfig(vocab_size=128256, eos_token_id=[128001, 128008, 128009])
    kw = conv.sampling_kwargs(SamplingParams(max_new_tokens=9), cfg.eos_ids)
    assert kw["stop_token_ids"] == [128001, 128008, 128009]
    assert "stop_token_ids" not in conv.sampling_kwargs(SamplingParams(max_new_tokens=9), ())

    def request(ids):
        lps = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps)])

    out = conv.to_generation_output([request([10, 11, 128009, 12]), request([13, 128001]), request([14, 15])],
                                    cfg.eos_ids, pad_id=0)
    assert out.response_mask.sum(1).tolist() == [3, 2, 0 + 2] and out.finished.tolist() == [True, True, False]
    assert out.response_ids[0].tolist() == [10, 11, 128009]


def test_tokenizer_reads_the_folder_eos_ids_and_decode_cuts_at_any(tmp_path):
    tok = char_tokenizer()
    tok.save(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, TURN_END]}))
    loaded = Tokenizer.from_file(tmp_path)
    assert loaded.eos_id == 2 and loaded.eos_ids == (2, TURN_END)
    ids = loaded.encode("13+4", add_bos=False)
    assert loaded.decode(ids + [TURN_END] + loaded.encode("99", add_bos=False)) == "13+4"
    assert tok.decode(ids + [TURN_END]) != "13+4"  # without the folder's list, 5 is an ordinary token
