"""The tokenizer wrapper: the character tokenizer's ids, round trips through tokenizer.json, and
loading a Llama-3-style byte-level BPE tokenizer (built here; no hub)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.tokenizer import CHARS, Tokenizer, char_tokenizer, render_chat


def test_char_tokenizer_ids():
    tok = char_tokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == len(CHARS) + 4 <= ModelConfig().vocab_size
    for i, c in enumerate(CHARS):
        assert tok.encode(c, add_bos=False) == [3 + i]  # one id per character, in CHARS order
    assert tok.encode("12+3=") == [1, 4, 5, 14, 6, 20]  # BOS, '1', '2', '+', '3', '='
    assert set("0123456789+-*= ") <= set(CHARS)


def test_decode_stops_at_eos_and_drops_specials():
    tok = char_tokenizer()
    ids = tok.encode("7-12=") + tok.encode("-5", add_bos=False) + [tok.eos_id] + tok.encode("99", add_bos=False)
    assert tok.decode(ids) == "7-12=-5"
    assert tok.decode(ids, stop_at_eos=False) == "7-12=-599"
    assert tok.decode([tok.pad_id, tok.bos_id] + tok.encode(" 1 ", add_bos=False)) == " 1 "


def test_unknown_characters_are_an_error_naming_them():
    with pytest.raises(ValueError, match=r"outside the tokenizer's vocabulary: \['\\n', 'x'\]"):
        char_tokenizer().encode("3x=\n")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=CHARS, max_size=20))
def test_char_round_trip(text):
    tok = char_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text) + 1
    assert tok.decode(ids) == text


def test_save_load_round_trip(tmp_path):
    tok = char_tokenizer()
    path = tok.save(tmp_path / "tok")
    assert path.name == "tokenizer.json"
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<s>", "</s>", "<pad>")
    raw = HFTokenizer.from_file(str(path))  # the tokenizers library itself reads the file
    assert raw.encode("12+3=", add_special_tokens=False).ids == tok.encode("12+3=", add_bos=False)
    for source in (tmp_path / "tok", path):  # a folder or the file
        back = Tokenizer.from_file(source)
        assert (back.pad_id, back.bos_id, back.eos_id, back.vocab_size) == (0, 1, 2, tok.vocab_size)
        assert back.encode("(4*5)/2=10") == tok.encode("(4*5)/2=10")
        with pytest.raises(ValueError, match="outside"):
            back.encode("a")
    single = tok.save(tmp_path / "single.json")  # a .json path: just that file
    assert single == tmp_path / "single.json" and Tokenizer.from_file(single).eos_id == 2


@pytest.mark.slow  # importing transformers takes seconds
def test_transformers_reads_the_saved_folder(tmp_path):
    import transformers  # a dev dependency: a missing one is an error, not a skip
    tok = char_tokenizer()
    tok.save(tmp_path)
    peer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert peer("12+3=").input_ids == tok.encode("12+3=", add_bos=False)
    assert (peer.bos_token_id, peer.eos_token_id, peer.pad_token_id) == (1, 2, 0)


def _llama3_like(tmp_path, config: dict | None = None):
    """A byte-level BPE with Llama-3 special tokens and a post-processor that prepends BOS."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is 12 plus 30? it is 42.", "hello world, hello tokens"], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    folder = tmp_path / "llama"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, tok


def test_llama_style_tokenizer_from_known_names(tmp_path):
    folder, raw = _llama3_like(tmp_path)
    tok = Tokenizer.from_file(folder)
    bos, eos = raw.token_to_id("<|begin_of_text|>"), raw.token_to_id("<|end_of_text|>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (bos, eos, eos)  # no pad token: pad = EOS
    ids = tok.encode("hello 42")
    assert ids[0] == bos and ids.count(bos) == 1  # the post-processor's BOS is not added twice
    assert ids[1:] == raw.encode("hello 42", add_special_tokens=False).ids
    assert tok.decode(ids + [eos] + ids) == "hello 42"
    assert tok.decode([tok.bos_id] + tok.encode("héllo ✓", add_bos=False)) == "héllo ✓"  # bytes, no <unk>


def test_special_tokens_from_config_and_arguments(tmp_path):
    folder, raw = _llama3_like(tmp_path, {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>"})
    tok = Tokenizer.from_file(folder)
    assert tok.eos_id == raw.token_to_id("<|eot_id|>")  # tokenizer_config.json wins over known names
    tok = Tokenizer.from_file(folder, eos="<|end_of_text|>", pad=5, bos=None)
    assert (tok.eos_id, tok.pad_id) == (raw.token_to_id("<|end_of_text|>"), 5)
    with pytest.raises(ValueError, match="'<eos>' is not a token"):
        Tokenizer.from_file(folder, eos="<eos>")


def test_missing_eos_and_file_are_clear_errors(tmp_path):
    tok = HFTokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="cannot tell which token is EOS; pass eos="):
        Tokenizer.from_file(tmp_path)
    assert Tokenizer.from_file(tmp_path, eos="b").eos_id == 1
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer(tok, bos_id=None, eos_id=7)


def test_extra_characters_extend_the_vocabulary():
    tok = char_tokenizer(extra="ba+")  # '+' is already there; 'a', 'b' are appended in sorted order
    assert tok.vocab_size == len(CHARS) + 6
    assert tok.encode("ab", add_bos=False) == [3 + len(CHARS), 4 + len(CHARS)]
    assert tok.decode(tok.encode("a+b=1")) == "a+b=1"
    with pytest.raises(ValueError, match="duplicates"):
        char_tokenizer(chars="00")


CHAT = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{{ bos_token + m['role'] + ':' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ bos_token }}{% endif %}")


def test_encode_prompt_without_a_template_is_encode():
    tok = char_tokenizer()
    assert tok.chat_template is None
    assert tok.encode_prompt("1+2=") == tok.encode("1+2=")


def test_encode_prompt_renders_the_chat_template_with_one_bos(tmp_path):
    """The template writes BOS itself; encode_prompt adds none (exactly one at position 0), and the
    template round-trips through save/from_file (tokenizer_config.json chat_template)."""
    tok = char_tokenizer(extra="emrstuy")
    tok.chat_template = CHAT
    ids = tok.encode_prompt("1+2=", system="2")
    assert tok.decode(ids, stop_at_eos=False) == "system:2user:1+2="  # specials dropped
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id and ids[-1] == tok.bos_id
    assert ids.count(tok.eos_id) == 2
    tok.save(tmp_path)
    again = Tokenizer.from_file(tmp_path)
    assert again.chat_template == CHAT and again.encode_prompt("1+2=", system="2") == ids
    with pytest.raises(ValueError, match="chat template: no bad roles"):
        render_chat(CHAT, [{"role": "bad", "content": ""}])
