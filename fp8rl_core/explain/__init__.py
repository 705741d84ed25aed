"""`fp8rl-train explain`'s computation: replay one saved rollout of a run under kernel variants
(replay.py) and attribute its mismatch to what differs between the two engines (attribution.py). It
returns data; the report, figure and CLI are analysis/explain.py. Above the loop: it rebuilds what a
run started from (loop.builder) and is never imported by the run itself."""
