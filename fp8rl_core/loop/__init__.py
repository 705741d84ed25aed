"""One GRPO run, assembled and driven: the builder turns a RunConfig into a RunContext (context.py) of
engines, task and sampling; step.py is one GRPO step over it (rollout.py assembles its batches);
evaluate.py validates; warmstart.py makes the shared SFT checkpoint; run.py loops, checkpoints and logs.
This is the only layer that reads the whole run config."""
