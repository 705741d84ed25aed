"""Phase 3: Fp8Linear forward + backward against BF16 nn.Linear, eager and torch.compile'd.

At M = K = N in --sizes (4096 on a GPU, 128 with --cpu), one step = y = layer(x), y.backward(dy): three
GEMMs (2 M N K each; TFLOP/s counts the three), and for Fp8Linear the quantization of X, dY (both ways)
and of W at every step (its Q(W) cache is off here, so the weight's quantization is inside the time, as
once per optimizer step in training). Rows per size:
  eager     nn.Linear bf16 (the baseline), Fp8Linear [executor under test] and Fp8Linear [emulated]:
            `max rel diff` = max over y, dX, dW of the normwise difference, hardware vs emulation;
            `x baseline` = time / BF16's (speed-up = its inverse; Transformer Engine publishes 1.40x for
            FP8 over BF16 training on an H200, the anchor for this number).
  compiled  the same two layers through torch.compile (--compile-backend: inductor on a GPU, aot_eager with
            --cpu, where Inductor's C++ build would take minutes; the C kernels run eagerly inside the
            compiled graph, torch.compiler.disable): time after the compiling first call
            (whose time the note gives), and `max rel diff` against the eager Fp8Linear, which catches a
            wrong lowering of the scaled GEMM (it happened in 2025-2026: issue 22).
"""
from __future__ import annotations

from fp8rl_core.io.environ import environ  # fp8rl_core.fp8 reads FP8RL_GEMM per call
from gpu_phases.common import Run, rel_diff, row
from gpu_phases.gemm import hardware_executor

PHASE = "linear"
TOL = 1e-2  # normwise: FP8 hardware vs emulation, compiled vs eager
TE_ANCHOR = 1.40  # Transformer Engine's published FP8 / BF16 training speed-up on H200


def run(run: Run) -> None:
    for n in run.args.sizes:
        run.case(PHASE, f"eager M=K=N={n}", lambda n=n: rows(run, n, compiled=False))
        run.case(PHASE, f"compiled M=K=N={n}", lambda n=n: rows(run, n, compiled=True))


def rows(run: Run, n: int, compiled: bool) -> list[dict]:
    import torch
    from fp8_numerics import best_times
    from torch import nn

    from fp8rl_core.fp8 import Fp8Linear

    dev, executor = run.device, hardware_executor(run)
    torch.manual_seed(0)
    ref = nn.Linear(n, n, device=dev, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(ref)
    fp8.cache_weight = False  # Q(W) at every step: the weight's quantization is part of the measured step
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    backend = run.args.compile_backend
    fused: dict[str, str] = {}  # extra environment of the FP8 layers (none: the C kernels are compile-safe)

    def once(layer: nn.Module, name: str) -> list[torch.Tensor]:
        x.grad = None
        ref.zero_grad(set_to_none=True)
        with environ(fused) if name == "bf16" else environ({"FP8RL_GEMM": name, **fused}):
            y = layer(x)
            y.backward(dy)
        return [y.detach(), x.grad, ref.weight.grad]

    layers = {"bf16": ref, executor: fp8, "emulated": fp8}
    if compiled:  # checked against the eager Fp8Linear on the same executor: what a correct lowering reproduces
        want = [o.float().clone() for o in once(fp8, executor)]
        torch._dynamo.reset()
        layers = {"bf16": torch.compile(ref, backend=backend), executor: torch.compile(fp8, backend=backend)}
    t = best_times({k: (lambda k=k: once(layers[k], k)) for k in layers}, run.args.repeats, dev)
    outs = {k: [o.float().clone() for o in once(layers[k], k)] for k in layers}
    if not compiled:
        want = outs["emulated"]
    flops, kind = 3 * 2 * n**3, "compiled" if compiled else "eager"
    diffs = [rel_diff(a, b) for a, b in zip(outs[executor], want)]
    per = ", ".join(f"{k} {d:.1e}" for k, d in zip(("y", "dX", "dW"), diffs))
    speedup = t["bf16"] / t[executor]
    first = (f"; first (compiling) calls: bf16 {t['first call bf16']:.1f} s, fp8 {t['first call ' + executor]:.1f} s "
             f"({backend})" if compiled else "")
    out = [row(PHASE, f"nn.Linear bf16 fwd+bwd {kind} M=K=N={n}", time_ms=t["bf16"] * 1e3, ratio=1.0,
               tflops=flops / t["bf16"] / 1e12, note="baseline" + first),
           row(PHASE, f"Fp8Linear [{executor}] fwd+bwd {kind} M=K=N={n}", "ok" if max(diffs) <= TOL else "fail",
               time_ms=t[executor] * 1e3, ratio=t[executor] / t["bf16"], tflops=flops / t[executor] / 1e12,
               max_rel_diff=max(diffs),
               note=f"speed-up vs bf16 {speedup:.2f}x (TE's H200 anchor {TE_ANCHOR:.2f}x); vs "
                    f"{'eager' if compiled else 'emulated'}: {per}",
               data={"speedup": speedup, "diffs": dict(zip(("y", "dX", "dW"), diffs)), "backend": backend})]
    if not compiled:
        vs_bf16 = ", ".join(f"{k} {rel_diff(a, b):.1e}" for k, a, b in zip(("y", "dX", "dW"), outs["emulated"],
                                                                              outs["bf16"]))
        out.append(row(PHASE, f"Fp8Linear [emulated] fwd+bwd eager M=K=N={n}", time_ms=t["emulated"] * 1e3,
                       ratio=t["emulated"] / t["bf16"], tflops=flops / t["emulated"] / 1e12,
                       note=f"the exact emulation; FP8 vs bf16: {vs_bf16}"))
    return out
