"""The RL algorithm as pure tensor functions: GRPO advantages and loss (grpo.py), the importance-sampling
corrections of the generation/training mismatch (importance.py), and the mismatch metric (metrics.py).
No engines, no config: shapes in, shapes out."""
