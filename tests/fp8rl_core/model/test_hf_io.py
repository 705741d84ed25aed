"""Our model vs transformers (the peer): load HF checkpoints, save ones HF loads, block-FP8 round trips.

Error norm throughout: relative max-norm, max|ours - ref| / max|ref|, over all logits, in FP32.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from fp8rl_core.fp8 import dequantize_blockwise, quantize_blockwise
from fp8rl_core.model import ModelConfig, build_model, load_pretrained, save_pretrained
from fp8rl_core.model.hf_io import INDEX

TOL = 1e-5
TINY = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).abs().max() / ref.double().abs().max())


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial weights everywhere (HF inits norms to 1 and biases to 0, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def hf_model(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=5000.0, **overrides)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**TINY, rope_theta=20000.0, **overrides)
        model = transformers.Qwen2ForCausalLM(cfg)
    randomize_(model)
    return model.eval()


def ids(batch: int = 2, length: int = 12, vocab: int = TINY["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {}), ("llama", {"tie_word_embeddings": True}),
                                            ("qwen2", {"tie_word_embeddings": True})])
def test_load_hf_checkpoint_matches_transformers(tmp_path, kind, overrides):
    ref = hf_model(kind, **overrides)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    x = ids()
    with torch.no_grad():
        err = rel_err(ours(x), ref(x).logits)
    assert err <= TOL, f"{kind} {overrides}: relative max error {err:.2e} > {TOL}"
    assert ours.config.rope_theta == ref.config.rope_parameters["rope_theta"]
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert all(p.requires_grad and p.dtype == torch.float32 for p in ours.parameters())


def test_load_sharded_checkpoint(tmp_path):
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path, max_shard_size="400KB")
    assert (tmp_path / INDEX).is_file() and len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = load_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        assert rel_err(ours(x), ref(x).logits) <= TOL


def test_load_bf16_checkpoint(tmp_path):
    ref = hf_model("qwen2").to(torch.bfloat16)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    hf_state = ref.state_dict()
    for key, value in ours.state_dict().items():  # BF16 -> FP32 is exact
        assert torch.equal(value, hf_state[key].float()), key


@pytest.mark.parametrize("kind,tie", [("llama", False), ("qwen2", True)])
def test_our_checkpoint_loads_in_transformers(tmp_path, kind, tie):
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, model_type=kind, tie_word_embeddings=tie, rope_theta=3000.0,
                      attention_bias=kind == "qwen2")
    ours = build_model(cfg)
    randomize_(ours)
    save_pretrained(ours, tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in saved) == (not tie)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(ref).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    hf_state = ref.state_dict()
    for key, value in ours.state_dict().items():
        assert torch.equal(value, hf_state[key]), f"{key} changed through save -> transformers load"
    x = ids()
    with torch.no_grad():
        assert rel_err(ours(x), ref(x).logits) <= TOL
    assert load_pretrained(tmp_path).config == cfg


def test_fp8_block_round_trip_is_bit_exact(tmp_path):
    """Partial blocks on purpose: intermediate 320 = 2.5 blocks, 3 kv heads * 64 = 1.5 blocks."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, head_dim=64)
    ours = build_model(cfg)
    randomize_(ours)
    save_pretrained(ours, tmp_path, quantization="fp8_block", ignore=("lm_head", "model.layers.1.mlp.*"))
    hf = json.loads((tmp_path / "config.json").read_text())
    qc = hf["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert sorted(qc["modules_to_not_convert"]) == sorted(
        ["lm_head", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"])
    saved = load_file(str(tmp_path / "model.safetensors"))
    loaded = load_pretrained(tmp_path).state_dict()
    n_quantized = 0
    for key, w in ours.state_dict().items():
        if key + "_scale_inv" in saved:
            n_quantized += 1
            q, s = quantize_blockwise(w, (128, 128))
            assert saved[key].dtype == torch.float8_e4m3fn
            assert torch.equal(saved[key].view(torch.uint8), q.view(torch.uint8)), key
            assert torch.equal(saved[key + "_scale_inv"], s), key
            assert torch.equal(loaded[key], dequantize_blockwise(q, s, (128, 128))), key
        else:
            assert torch.equal(loaded[key], w), f"{key} should be stored unquantized"
    assert n_quantized == 2 * 7 - 3  # 7 linears per block, layer 1's MLP kept


def test_fp8_block_checkpoint_loads_in_transformers(tmp_path):
    """transformers 5 on a CPU dequantizes block-FP8 checkpoints (FineGrainedFP8Config(dequantize=True))."""
    import accelerate  # noqa: F401  (transformers' FP8 quantizer needs it; a dev dependency)
    torch.manual_seed(0)
    # All dims multiples of 128: transformers derives the block from weight/scale shapes (no partial blocks).
    cfg = ModelConfig(**TINY, model_type="llama")
    ours = build_model(cfg)
    randomize_(ours)
    save_pretrained(ours, tmp_path, quantization="fp8_block")
    fp8cfg = transformers.FineGrainedFP8Config(dequantize=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            quantization_config=fp8cfg).eval()
    mine = load_pretrained(tmp_path)
    hf_state = ref.state_dict()
    for key, value in mine.state_dict().items():
        assert torch.equal(value, hf_state[key].float()), f"{key}: transformers dequantized differently"
    x = ids()
    with torch.no_grad():
        assert rel_err(mine(x), ref(x).logits) <= TOL


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing .*model.layers.2"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 384}))
    with pytest.raises(ValueError, match="mlp.*shape"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quant_method"):
        load_pretrained(tmp_path)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "rope_parameters": yarn}))
    with pytest.raises(ValueError, match="rope_type"):
        load_pretrained(tmp_path)


def test_save_writes_bf16_and_tokenizer_and_leaves_no_temp_files(tmp_path):
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    ours = build_model(ModelConfig(**TINY))
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    save_pretrained(ours, tmp_path / "a", dtype=torch.bfloat16, tokenizer=tok)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json"]  # no .tmp leftovers
    assert Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")).get_vocab() == vocab
    assert json.loads((tmp_path / "a" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_pretrained(tmp_path / "a")
    for key, w in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], w.bfloat16().float()), key
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / INDEX).write_text("{}")
    with pytest.raises(FileExistsError, match="sharded"):
        save_pretrained(ours, tmp_path / "b")
