"""What a run writes and reaches outside itself: DCP checkpoints (checkpoint.py), durable file writes
(atomic.py) and free TCP ports (ports.py). MLflow logging has its own package, fp8rl_core.tracking."""
