"""A thin wrapper around a Hugging Face `tokenizers.Tokenizer` with the ids the RL core needs.

Two sources: `char_tokenizer()` builds the character-level tokenizer of the synthetic tasks (a real
`tokenizers.Tokenizer`, so it saves as a standard tokenizer.json), and `Tokenizer.from_file(path)` loads
any tokenizer.json (e.g. a real Llama or Qwen2 one) and finds BOS/EOS/PAD from its special tokens,
tokenizer_config.json, or explicit arguments.

The wrapper never lets the backend add special tokens: `encode` prepends BOS itself, so a tokenizer.json
whose post-processor also adds one (Llama's) cannot produce a double BOS. A chat model's template
(tokenizer_config.json `chat_template`, Jinja as in transformers) is applied by `encode_prompt`.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from fp8rl_core.model.config import eos_id_list
from fp8rl_core.model.hf_io import CONFIG, read_generation_config

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# The synthetic tasks' alphabet: arithmetic plus a little punctuation for JSONL math-like data.
# ids: <pad>=0, <s>=1, </s>=2, then these 28 characters (3..30), then <unk>=31: 32 = ModelConfig.vocab_size.
CHARS = "0123456789 +-*/%^=()<>.,:;?!"

# Special-token spellings of common model families, tried in order when nothing names the ids.
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|im_end|>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class Tokenizer:
    """Text <-> token ids for the policy model.

    tok:   the backend `tokenizers.Tokenizer`
    bos_id / eos_id / pad_id: special ids (bos_id may be None: Qwen2 has no BOS; pad defaults to EOS)
    strict: raise on text the vocabulary does not cover instead of encoding <unk>, which would silently
            corrupt prompts and exact-match rewards (byte-level BPEs never produce <unk>)
    chat_template: the Jinja chat template of an instruct model (None: prompts are plain text)
    """

    def __init__(self, tok: HFTokenizer, *, bos_id: int | None, eos_id: int, pad_id: int | None = None,
                 strict: bool = True, extra_eos_ids: tuple[int, ...] | list[int] = (),
                 chat_template: str | None = None):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_id, self.eos_id = bos_id, eos_id
        # every id that ends a turn: eos_id first, then the model's other EOS ids (config.json and
        # generation_config.json; Llama-3.1-Instruct ends a turn with <|eot_id|>, not <|end_of_text|>)
        self.eos_ids = tuple(dict.fromkeys([eos_id, *(int(i) for i in extra_eos_ids)]))
        self.pad_id = eos_id if pad_id is None else pad_id
        self.strict = strict
        self.unk_id = _unk_id(tok)
        for name, i in (("bos_id", bos_id), ("pad_id", self.pad_id), *(("eos_id", e) for e in self.eos_ids)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise ValueError(f"{name}={i} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, with BOS first when add_bos (and the tokenizer has a BOS); never EOS."""
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        if self.strict and self.unk_id is not None and self.unk_id in ids:
            bad = sorted({text[a:b] for i, (a, b) in zip(ids, enc.offsets) if i == self.unk_id})
            raise ValueError(f"text {text!r} has characters outside the tokenizer's vocabulary: {bad}")
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def encode_prompt(self, text: str, system: str | None = None) -> list[int]:
        """Token ids of a task prompt as the model expects it: with a chat template, the conversation
        [system?, user: text] rendered with the assistant's turn opened (add_generation_prompt), encoded
        without adding BOS (the template writes whatever BOS the model wants: SmolLM2's BOS <|im_start|>
        opens the first turn, exactly once at position 0); without one, `encode(text)` (BOS + text; a system
        text goes first, on its own line)."""
        if self.chat_template is None:
            return self.encode(text if system is None else f"{system}\n{text}")
        messages = ([] if system is None else [{"role": "system", "content": system}])
        rendered = render_chat(self.chat_template, [*messages, {"role": "user", "content": text}],
                               bos_token=self._token(self.bos_id), eos_token=self._token(self.eos_id))
        return self.encode(rendered, add_bos=False)

    def _token(self, i: int | None) -> str:
        return "" if i is None else self.tok.id_to_token(i)

    def decode(self, ids: list[int], stop_at_eos: bool = True) -> str:
        """Text of `ids` without special tokens; with stop_at_eos, everything from the first EOS (any id
        of eos_ids) is dropped."""
        ids = [int(i) for i in ids]
        if stop_at_eos:
            cut = next((t for t, i in enumerate(ids) if i in self.eos_ids), None)
            ids = ids if cut is None else ids[:cut]
        return self.tok.decode(ids, skip_special_tokens=True)

    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json (into `path` if it is a folder or has no .json suffix) and, in a folder, a
        tokenizer_config.json naming the special tokens (so transformers' AutoTokenizer can load it)."""
        path = Path(path)
        if path.suffix != ".json":
            path.mkdir(parents=True, exist_ok=True)
            names = {k: self.tok.id_to_token(i) for k, i in
                     (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id))
                     if i is not None}
            cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **names}
            if self.chat_template is not None:
                cfg["chat_template"] = self.chat_template
            (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            path = path / "tokenizer.json"
        self.tok.save(str(path))
        return path

    @classmethod
    def from_file(cls, path: str | Path, *, bos: int | str | None = None, eos: int | str | None = None,
                  pad: int | str | None = None, strict: bool = True) -> Tokenizer:
        """Load a tokenizer.json (or a folder holding one). Special tokens, each an id or a token string:
        the arguments first, then the folder's tokenizer_config.json, then well-known spellings; PAD falls
        back to EOS; a missing EOS is an error (generation could not stop). The `eos_token_id` ids of the
        folder's config.json and generation_config.json become further stop ids (`eos_ids`)."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        tok = HFTokenizer.from_file(str(file))
        cfg_file = file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        bos_id = _find(tok, bos, cfg.get("bos_token"), _BOS_NAMES, "bos")
        eos_id = _find(tok, eos, cfg.get("eos_token"), _EOS_NAMES, "eos")
        pad_id = _find(tok, pad, cfg.get("pad_token"), _PAD_NAMES, "pad")
        if eos_id is None:
            raise ValueError(f"{file}: cannot tell which token is EOS; pass eos=<id or token string>")

        model_cfg = file.parent / CONFIG  # a tokenizer folder need not hold a model's config.json
        extra = eos_id_list(json.loads(model_cfg.read_text()) if model_cfg.is_file() else {},
                            read_generation_config(file.parent))
        template = cfg.get("chat_template")
        return cls(tok, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, strict=strict, extra_eos_ids=extra,
                   chat_template=template if isinstance(template, str) else None)


def render_chat(template: str, messages: list[dict[str, str]], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    """A chat template rendered as transformers renders it (ImmutableSandboxedEnvironment, trim_blocks,
    lstrip_blocks, loopcontrols; `raise_exception` and `strftime_now` available)."""
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                      bos_token=bos_token, eos_token=eos_token)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """The template compiled once (every prompt of every step is rendered with it: a hot path)."""
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("a chat template needs jinja2: pip install 'jinja2>=3.1'") from e

    def raise_exception(message: str):
        raise ValueError(f"chat template: {message}")

    def strftime_now(fmt: str) -> str:
        from datetime import datetime
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


def _unk_id(tok: HFTokenizer) -> int | None:
    unk = getattr(tok.model, "unk_token", None)
    return tok.token_to_id(unk) if isinstance(unk, str) else None


def _find(tok: HFTokenizer, given: int | str | None, from_cfg: object, names: tuple[str, ...],
          what: str) -> int | None:
    """The id of a special token: explicit argument, then tokenizer_config.json, then known names."""
    if isinstance(given, int):
        return given
    if isinstance(given, str):
        i = tok.token_to_id(given)
        if i is None:
            raise ValueError(f"{what}={given!r} is not a token of this tokenizer")
        return i
    if isinstance(from_cfg, dict):  # older configs: {"content": "<s>", ...}
        from_cfg = from_cfg.get("content")
    if isinstance(from_cfg, str) and tok.token_to_id(from_cfg) is not None:
        return tok.token_to_id(from_cfg)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for name in names:
        if name in specials or (not specials and tok.token_to_id(name) is not None):
            return tok.token_to_id(name)
    return None


def char_tokenizer(chars: str = CHARS, extra: str = "") -> Tokenizer:
    """The synthetic tasks' character-level tokenizer: <pad>=0, <s>=1, </s>=2, one id per character of
    `chars` (3...), then those of `extra` not already there (e.g. `task.alphabet()` of a JSONL task; the
    vocabulary then exceeds ModelConfig's default 32), then <unk>. Built as a WordLevel model whose
    pre-tokenizer isolates every character, with a Fuse decoder (concatenation). Strict: text with other
    characters raises ValueError."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars has duplicates: {chars!r}")
    chars += "".join(sorted(set(extra) - set(chars)))
    vocab = {PAD: 0, BOS: 1, EOS: 2, **{c: 3 + i for i, c in enumerate(chars)}}
    vocab[UNK] = len(vocab)
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
    # "." does not match a newline; "isolated" still emits it as its own piece (-> <unk>).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    return Tokenizer(tok, bos_id=1, eos_id=2, pad_id=0, strict=True)
