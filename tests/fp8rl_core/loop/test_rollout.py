"""Batch assembly: response tokens after EOS never enter the batch; log-probs land on their tokens."""
import torch

from fp8rl_core.engines.base import GenerationOutput
from fp8rl_core.loop.rollout import broadcast_advantages, build_train_batch, split_rows


def test_build_train_batch_alignment():
    prompts = [[1, 5, 6], [1, 7]]
    out = GenerationOutput(
        response_ids=torch.tensor([[9, 2, 0], [8, 8, 8]]),
        response_mask=torch.tensor([[True, True, False], [True, True, True]]),
        logprobs=torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]),
        finished=torch.tensor([True, False]))
    b = build_train_batch(prompts, out, pad_id=0)
    assert b.input_ids.tolist() == [[1, 5, 6, 9, 2], [1, 7, 8, 8, 8]]
    assert b.response_mask.tolist() == [[False, False, False, True, True], [False, False, True, True, True]]
    assert b.attention_mask.tolist() == [[True] * 5, [True] * 5]
    assert torch.allclose(b.gen_logprobs[0], torch.tensor([0, 0, 0, -0.1, -0.2]))
    assert torch.allclose(b.gen_logprobs[1], torch.tensor([0, 0, -0.3, -0.4, -0.5]))
    adv = broadcast_advantages(torch.tensor([2.0, -1.0]), b.response_mask)
    assert adv.tolist() == [[0, 0, 0, 2, 2], [0, 0, -1, -1, -1]]


def test_split_rows_partitions():
    g = torch.Generator().manual_seed(0)
    parts = split_rows(10, 3, g)
    assert len(parts) == 3 and sorted(torch.cat(parts).tolist()) == list(range(10))
    assert len(split_rows(2, 5, g)) == 2
