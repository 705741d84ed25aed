"""What a run writes and reaches outside itself: DCP checkpoints (checkpoint.py), durable file writes
(atomic.py), free TCP ports (ports.py) and environment variables set for a block (environ.py). MLflow
logging has its own package, fp8rl_core.tracking."""
