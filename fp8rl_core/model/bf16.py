"""BF16 matrix products on any CPU: native BF16 kernels, or the same results emulated exactly in FP32.

The recipe's attention, norms, embeddings and LM head are BF16 on every machine (docs/design.md
"Numerics"). A BF16 GEMM with FP32 accumulation (what oneDNN/AMX, AVX512_BF16 and GPU tensor cores
return) computes  C = bf16( sum_k a_k * b_k )  with every product a_k * b_k exact in FP32 (8-bit
mantissas multiply into 16 bits) and the sum in FP32. So

    emulated(A, B) = bf16( fp32(A) @ fp32(B) )

is the same function; only the order of the FP32 summation can differ (a few BF16 ulps at most, and
only where a sum rounds differently). Attention is the one place where native kernels round inside:
torch's BF16 CPU flash kernel (like FlashAttention-2 on GPUs) rounds the softmax probabilities P to
BF16 before P@V, which the emulation does not (it rounds once, at the output, so it is the closer of
the two to exact attention; tests/fp8rl_core/model/test_bf16.py bounds both). `model.bf16_compute` chooses:
- `native`: torch's BF16 kernels (fast with AVX512_BF16 / AMX or on a GPU; 10-20x slower than FP32 on an
  AVX2-only CPU, which converts every element);
- `emulated`: every linear / matmul / SDPA that would run in BF16 upcasts its BF16 operands, runs in
  FP32 and rounds its result to BF16; every other op keeps its BF16 inputs and outputs;
- `auto`: native on CUDA and on CPUs with BF16 dot products (`BF16_DOT_FLAGS`), emulated elsewhere.
With `model.dtype: fp32` nothing runs in BF16 and the choice has no effect.

Autograd needs nothing special: the backward of `bf16(fp32(x) @ fp32(w)^T)` is an FP32 GEMM of the
upcast gradient, rounded to BF16 by the backward of the upcast: exactly a BF16 dgrad/wgrad with FP32
accumulation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl_core.fp8 import cpu_features

BF16_PATHS = ("native", "emulated")  # what runs; model.bf16_compute `auto` picks one here (resolve_bf16_compute)
# CPU flags (Linux /proc/cpuinfo names) of BF16 dot-product instructions: AVX512_BF16 `vdpbf16ps`
# (Intel Cooper Lake+, AMD Zen 4+), AMX `tdpbf16ps` (Intel Sapphire Rapids+), Arm's BF16 extension.
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# the flags worth recording with a run: they decide the BF16 path and the speed of the FP8 emulation
RECORDED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "bf16")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (fp8rl_core.fp8.cpu_features.proc_flags: /proc/cpuinfo, read once)."""
    return cpu_features.proc_flags()


def has_bf16_dot(flags: frozenset[str] | None = None) -> bool:
    return bool(set(BF16_DOT_FLAGS) & (cpu_flags() if flags is None else flags))


def missing_bf16_dot() -> str:
    """Why native BF16 is slow here ("" where the CPU has BF16 dot products): a skip reason naming the flags."""
    if has_bf16_dot():
        return ""
    return (f"native BF16 needs one of the CPU flags {', '.join(BF16_DOT_FLAGS)}; this CPU has none "
            "(torch's BF16 kernels would convert every element)")


def recorded_flags() -> str:
    """The decision-relevant CPU flags present here, comma-separated ("" when none is)."""
    return ",".join(f for f in RECORDED_FLAGS if f in cpu_flags())


def resolve_bf16_compute(mode: str, device: str | torch.device, flags: frozenset[str] | None = None) -> str:
    """`auto` | a path (BF16_PATHS) -> the path that runs here: "native" or "emulated"."""
    if mode in BF16_PATHS:
        return mode
    if mode != "auto":
        raise ValueError(f"model.bf16_compute: {mode!r} not allowed; valid: auto, {', '.join(BF16_PATHS)}")
    return "native" if torch.device(device).type == "cuda" or has_bf16_dot(flags) else "emulated"


def bf16_path(dtype: str, mode: str, device: str | torch.device) -> str:
    """The path a run takes: "native" / "emulated" (`mode` resolved here), or "none" when the model's
    compute dtype (`model.dtype`) is not bf16 (nothing runs in BF16, the key has no effect)."""
    return resolve_bf16_compute(mode, device) if dtype == "bf16" else "none"


def _is_bf16(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == torch.bfloat16 for t in tensors)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, emulate: bool = False) -> torch.Tensor:
    """y = x w^T + b; with `emulate` and BF16 operands: bf16(fp32(x) fp32(w)^T + fp32(b)).

    x [..., K], w [N, K], b [N] -> [..., N]. The bias joins the FP32 sum before the single rounding,
    as a BF16 addmm adds it to its FP32 accumulator."""
    if not (emulate and _is_bf16(x, w, b)):
        return F.linear(x, w, b)
    return linear_upcast(x, w.float(), None if b is None else b.float())


def linear_upcast(x: torch.Tensor, w32: torch.Tensor, b32: torch.Tensor | None = None) -> torch.Tensor:
    """The emulated BF16 linear on FP32 copies of BF16 weights (an engine upcasts them once per refit,
    exactly): bf16(fp32(x) w32^T + b32)."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), w32, b32).to(torch.bfloat16)


def bmm(a: torch.Tensor, b: torch.Tensor, emulate: bool = False) -> torch.Tensor:
    """a [N, M, K] @ b [N, K, P] -> [N, M, P]; emulated like `linear`."""
    if not (emulate and _is_bf16(a, b)):
        return torch.bmm(a, b)
    return torch.bmm(a.float(), b.float()).to(torch.bfloat16)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, emulate: bool = False, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, **kw); emulated: on FP32 upcasts (exact), output rounded.

    A BF16 flash kernel keeps its scores, softmax and P@V accumulation in FP32 and rounds the output
    once; the FP32 kernel on the upcast operands computes the same function (it does not round P to
    BF16 before P@V, as some GPU kernels do: a difference of summation detail, not of definition)."""
    if not (emulate and _is_bf16(q, k, v)):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(torch.bfloat16)


class EmulatedBf16Linear(nn.Linear):
    """nn.Linear whose BF16 product (under autocast, or with BF16 parameters) is emulated in FP32.

    Same parameters and state_dict keys as nn.Linear; FP32 without autocast runs plain F.linear."""

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> EmulatedBf16Linear:
        """Wrap an existing nn.Linear, sharing (not copying) its Parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight, new.bias = layer.weight, layer.bias
        new.train(layer.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):  # what autocast would hand the BF16 kernel
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        return linear(x, w, b, emulate=True)


def upcast_bf16_matmuls(model: nn.Module) -> list[str]:
    """In place: every plain nn.Linear becomes EmulatedBf16Linear (Fp8Linear and other subclasses keep
    their own GEMMs), and every module with an `upcast_bf16` attribute (attention) sets it.
    Idempotent. Returns the names of the swapped linears."""
    swapped = []
    for name, module in list(model.named_modules()):
        if hasattr(module, "upcast_bf16"):
            module.upcast_bf16 = True
        if type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    EmulatedBf16Linear.from_linear(module))
            swapped.append(name)
    return swapped


emulate_bf16_matmuls = upcast_bf16_matmuls  # its name before issue 33 (kept for callers)
