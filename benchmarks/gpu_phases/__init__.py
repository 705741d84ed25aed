"""The device check's phases (benchmarks/gpu_check.py runs them in this order; each file's docstring says
what it measures and against what): env, gemm (the `preflight` phase), linear, grpo, fsdp, megatron.
common.py: rows, the clock, the output files; models.py: the random-init Llamas they run.
Every module of ours is imported inside a phase, never at the top, so that `gpu_check.py --help` and
the first phase run before anything heavy is imported."""
