"""FP8 GEMM preflight: every distinct GEMM shape a cell's FP8 layers run, checked before its first step.

    shapes = model_shapes(model_config, ms=(256, 4160))          # from the model's config alone
    result = run_preflight(shapes, "cuda:0")                      # raises PreflightError on any shape
    sink.set_tags(result.as_params()); sink.log(0, result.as_metrics())

The bound (docs/design.md, "3. Numerics"; in code: gemm_bound.py, which the scaled_mm startup probe uses
too): |C - C_ref| <= 2**-9 * C_abs, C_abs = sum_kb |sa_kb| |sb_kb| (|QA_kb| @ |QB_kb|^T), C_ref in float64
from the same E4M3 codes and scales.

Shapes are in the layer's terms: M tokens (rows), K in_features, N out_features. The pass says which
GEMM runs (linear.py): fprop C[M, N] = X[M, K] . W[N, K]^T, A (1,128) x B (128,128); dgrad
C[M, K] = dY[M, N] . W, B = W^T (the [128,128] grid transposed); wgrad C[N, K] = dY^T . X over the M
tokens, both quantized (128, 1) and transposed to (1, 128). The operands are built exactly so (the same
quantizer, the same transposed views), with magnitudes varied across rows, tokens and K-blocks so that
a scale read from the wrong block shows.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp8rl_core.fp8.gemm import blockwise_scaled_mm, select_executor
from fp8rl_core.fp8.gemm_bound import BOUND, BOUND_TEXT, bound_ratio  # noqa: F401  (BOUND: re-exported)
from fp8rl_core.fp8.operand import Operand
from fp8rl_core.fp8.quant import quantize_2d

PASSES = ("fprop", "dgrad", "wgrad")
ACT, WEIGHT = (1, 128), (128, 128)
BLOCKS = {"fprop": (ACT, WEIGHT), "dgrad": (ACT, WEIGHT), "wgrad": (ACT, ACT)}
CPU_MS = (5, 130)  # a CPU cell's M values: a partial row tile, and a token count over one 128-block
PLAN_CPU_MS = (5,)  # `sweep plan --preflight` on a CPU: one small M, so that 8B stays fast
TAG = "fp8rl.preflight"  # passed | skipped; the result's own tags are TAG + ".<field>"
METRICS = ("fp8_preflight_shapes", "fp8_preflight_worst_ratio", "fp8_preflight_time_s")  # logged at step 0
COMPILE_BACKEND = "inductor"  # torch.compile backend of compiled=True (tests use a cheaper one)


@dataclass(frozen=True)
class GemmShape:
    """One GEMM of a linear layer: m tokens, k in_features, n out_features (see the module docstring);
    block_a, block_b: the GEMM operands' blocks (after the wgrad operands' transposition)."""

    layer: str
    pass_name: str  # "fprop" | "dgrad" | "wgrad"
    m: int
    k: int
    n: int
    block_a: tuple[int, int]
    block_b: tuple[int, int]

    def gemm_dims(self) -> tuple[int, int, int]:
        """(rows of C, contraction, columns of C) of the GEMM this pass runs."""
        return {"fprop": (self.m, self.k, self.n), "dgrad": (self.m, self.n, self.k),
                "wgrad": (self.n, self.m, self.k)}[self.pass_name]

    def describe(self) -> str:
        return (f"{self.layer} {self.pass_name} M={self.m} K={self.k} N={self.n} "
                f"blocks A{self.block_a} x B{self.block_b}")


def _field(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)


def layer_dims(model_config: Any, lm_head: bool = False, fused: bool = False) -> list[tuple[str, int, int]]:
    """(name, K, N) of a transformer block's linears (fused: the generation engine's [q|k|v] and
    [gate|up], each shard padded to 128 rows, native_gen.fuse_linear), and of the LM head if asked.
    model_config: a ModelConfig or an HF config dict (duck-typed: fp8/ sits below model/)."""
    h, inter = int(_field(model_config, "hidden_size")), int(_field(model_config, "intermediate_size"))
    heads, kv = int(_field(model_config, "num_attention_heads")), int(_field(model_config, "num_key_value_heads"))
    hd = int(_field(model_config, "head_dim") or h // heads)
    pad = lambda n: -(-n // 128) * 128  # noqa: E731
    if fused:
        dims = [("qkv_proj(fused)", h, pad(heads * hd) + 2 * pad(kv * hd)), ("o_proj", heads * hd, h),
                ("gate_up_proj(fused)", h, 2 * pad(inter)), ("down_proj", inter, h)]
    else:
        dims = [("q_proj", h, heads * hd), ("k_proj", h, kv * hd), ("v_proj", h, kv * hd), ("o_proj", heads * hd, h),
                ("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h)]
    return dims + ([("lm_head", h, int(_field(model_config, "vocab_size")))] if lm_head else [])


def model_shapes(model_config: Any, ms: Iterable[int], *, lm_head: bool = False, training: bool = True,
                 generation: bool = True, blocks: bool = True) -> list[GemmShape]:
    """Every distinct GEMM of a model's Fp8Linear layers at each M in ms: training (the trainer's
    separate projections: fprop, dgrad, wgrad) and generation (the native engine's fused projections:
    fprop). lm_head: the head is FP8 too (fp8.lm_head); blocks False: every block is kept BF16.
    Layers sharing a shape are one entry, their names joined by '/'."""
    linears: list[tuple[str, str, int, int]] = []
    for side, passes in (("training", PASSES), ("generation", ("fprop",))):
        if not (training if side == "training" else generation):
            continue
        dims = layer_dims(model_config, lm_head, fused=side == "generation")
        linears += [(p, name, k, n) for p in passes for name, k, n in dims if blocks or name == "lm_head"]
    out: dict[tuple, GemmShape] = {}
    for m in ms:
        for p, name, k, n in linears:
            key = (p, int(m), k, n)
            old = out.get(key)
            if old is None:
                out[key] = GemmShape(name, p, int(m), k, n, *BLOCKS[p])
            elif name not in old.layer.split("/"):
                out[key] = GemmShape(f"{old.layer}/{name}", p, int(m), k, n, *BLOCKS[p])
    return list(out.values())


# --- the operands of each pass, built as linear.py builds them -------------------------------------

def _random(rows: int, cols: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """randn [rows, cols] times 2^a per row and 2^b per 128-column block (a in [-3, 3], b in [-4, 4])."""
    x = torch.randn(rows, cols, generator=g, device=device)
    row = torch.randint(-3, 4, (rows, 1), generator=g, device=device).float().exp2_()
    col = torch.randint(-4, 5, (1, -(-cols // 128)), generator=g, device=device).float().exp2_()
    return x.mul_(row).mul_(col.repeat_interleave(128, 1)[:, :cols])


def _quantize(x: torch.Tensor, block: tuple[int, int], name: str) -> Operand:
    q, scale, _ = quantize_2d(x, block, power_of_two=False, check_finite=False, name=name, want_dequant=False)
    return Operand(q, scale, block)


def make_operands(shape: GemmShape, device: torch.device, g: torch.Generator) -> tuple[Operand, Operand]:
    """(A, B) of the shape's pass, quantized and laid out as fp8/linear.py passes them."""
    m, k, n = shape.m, shape.k, shape.n
    if shape.pass_name == "fprop":  # X [M, K] (1,128), W [N, K] (128,128)
        return _quantize(_random(m, k, g, device), ACT, "x"), _quantize(_random(n, k, g, device), WEIGHT, "weight")
    if shape.pass_name == "dgrad":  # dY [M, N] (1,128), W^T: W [N, K] (128,128) transposed
        return (_quantize(_random(m, n, g, device), ACT, "grad_output"),
                _quantize(_random(n, k, g, device), WEIGHT, "weight").t())
    if shape.pass_name == "wgrad":  # dY [M, N] and X [M, K] quantized (128,1) along tokens, transposed
        return (_quantize(_random(m, n, g, device), (128, 1), "grad_output").t(),
                _quantize(_random(m, k, g, device), (128, 1), "x").t())
    raise ValueError(f"pass {shape.pass_name!r}: valid: {', '.join(PASSES)}")


# --- the run -----------------------------------------------------------------------------------------

class PreflightError(RuntimeError):
    """A GEMM shape failed the preflight; the message names it, the executor, the error and the bound."""

    def __init__(self, message: str, failures: Sequence[tuple[GemmShape, str]] = ()):
        super().__init__(message)
        self.failures = list(failures)


@dataclass
class PreflightResult:
    shapes_checked: int
    worst_ratio: float  # max over shapes of max |C - C_ref| / (2^-9 C_abs); <= 1
    worst_shape: GemmShape | None
    executor: str
    compiled: bool
    seconds: float

    def as_metrics(self) -> dict[str, float]:
        return dict(zip(METRICS, (float(self.shapes_checked), self.worst_ratio, self.seconds)))

    def as_params(self) -> dict[str, str]:
        """What ran, as strings: the run loop logs these as MLflow tags (per attempt, like fp8rl.fp8_gemm)."""
        worst = "-" if self.worst_shape is None else self.worst_shape.describe()
        return {TAG: "passed", f"{TAG}.executor": self.executor, f"{TAG}.compiled": str(self.compiled).lower(),
                f"{TAG}.shapes": str(self.shapes_checked), f"{TAG}.worst_ratio": repr(self.worst_ratio),
                f"{TAG}.worst_shape": worst, f"{TAG}.seconds": repr(self.seconds), f"{TAG}.bound": BOUND_TEXT}


def metrics_from_params(params: Mapping[str, str]) -> dict[str, float]:
    """as_metrics() back from as_params() (the run loop carries the result in its numerics tags); {}
    when no preflight passed (none ran, or it was skipped)."""
    if params.get(TAG) != "passed":
        return {}
    return dict(zip(METRICS, (float(params[f"{TAG}.shapes"]), float(params[f"{TAG}.worst_ratio"]),
                              float(params[f"{TAG}.seconds"]))))


def _gemm(compiled: bool):
    if not compiled:
        return blockwise_scaled_mm
    torch._dynamo.reset()  # a fresh graph per shape: never the recompile limit's silent fall back to eager
    return torch.compile(blockwise_scaled_mm, backend=COMPILE_BACKEND)


def check_shape(shape: GemmShape, device: torch.device, executor: str, compiled: bool, seed: int
                ) -> tuple[float, str]:
    """(ratio to the bound, where) of one shape on `executor`; an executor error propagates."""
    g = torch.Generator(device=device).manual_seed(seed)
    a, b = make_operands(shape, device, g)
    c = _gemm(compiled)(a.q, a.scale, b.q, b.scale, block_a=a.block, block_b=b.block, out_dtype=torch.float32,
                        executor=executor)
    ratio, (i, j) = bound_ratio(c, a, b)
    return ratio, f"C[{i}, {j}]"


def run_preflight(shapes: Sequence[GemmShape], device: torch.device | str, *, executor: str | None = None,
                  compiled: bool = False, seed: int = 0) -> PreflightResult:
    """Check every shape on `executor` (None: the one select_executor picks for `device`) against the
    float64 reference under the bound. Raises PreflightError naming the worst failing shape (and
    counting the others) if any fails or errors; nothing falls back."""
    device = torch.device(device)
    try:
        name = select_executor(device, executor)
    except RuntimeError as e:  # cuda_exec.ScaledMmProbeError: the hardware executor failed its startup probe
        raise PreflightError(f"FP8 GEMM preflight on {device}: no executor to check ({e}). No FP8 step ran.",
                             [(s, str(e)) for s in shapes]) from e
    mode = "compiled" if compiled else "eager"
    t0 = time.perf_counter()
    worst, worst_shape, failures = 0.0, None, []
    for i, shape in enumerate(shapes):
        try:
            ratio, where = check_shape(shape, device, name, compiled, seed * 1_000_003 + i)
        except Exception as e:  # noqa: BLE001  (an executor that raises on a shape fails that shape)
            failures.append((math.inf, shape, f"{type(e).__name__}: {str(e).strip()[:400]}"))
            continue
        if ratio > 1.0:
            failures.append((ratio, shape, f"max |C - C_ref| is {ratio:.4g}x the bound, at {where}"))
        if ratio >= worst:
            worst, worst_shape = ratio, shape
    seconds = time.perf_counter() - t0
    if failures:
        failures.sort(key=lambda f: -f[0])
        _, shape, error = failures[0]
        more = "; ".join(s.describe() for _, s, _ in failures[1:6])
        raise PreflightError(
            f"FP8 GEMM preflight failed on {device} (executor {name!r}, {mode}): {shape.describe()}: {error}. "
            f"Bound: {BOUND_TEXT}. {len(failures)} of {len(shapes)} shapes failed"
            + (f" (also: {more}{', ...' if len(failures) > 6 else ''})" if more else "")
            + ". No FP8 step ran; no other executor is substituted (FP8RL_GEMM=<executor> picks one knowingly).",
            [(s, e) for _, s, e in failures])
    return PreflightResult(len(shapes), worst, worst_shape, name, compiled, seconds)
