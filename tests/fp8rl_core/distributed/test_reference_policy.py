"""The reference policy of the KL term: frozen, in the compute dtype (BF16), FP8 linears for FP8 recipes,
and on the same (BF16-representable) weights its log-probs are the policy's."""
from __future__ import annotations

import pytest
import torch
from _workers import CFG, global_batch

from fp8rl_core.config.recipe import BF16, RECIPES
from fp8rl_core.engines.native_train import NativeTrainingEngine, ReferencePolicy
from fp8rl_core.fp8 import Fp8Linear


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_the_policy_it_was_copied_from(fp8):
    from fp8rl_core.model import build_model

    torch.manual_seed(0)
    policy_model = build_model(CFG)
    ref_model = build_model(CFG, dtype=torch.bfloat16)
    ref_model.load_state_dict({k: v.to(torch.bfloat16) for k, v in policy_model.state_dict().items()})
    # masters that are BF16-representable: then the reference is the policy exactly, not approximately
    with torch.no_grad():
        for p in policy_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    recipe = RECIPES["fp8_e2e"] if fp8 else BF16
    policy = NativeTrainingEngine(policy_model, recipe=recipe)
    ref = ReferencePolicy(ref_model, device="cpu", recipe=recipe, logprob_batch_size=3)
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    assert any(isinstance(m, Fp8Linear) for m in ref.model.modules()) == fp8
    batch = global_batch()
    lp_ref, lp_pol = ref.logprobs(batch), policy.logprobs(batch)
    assert lp_ref.dtype == torch.float32 and torch.isfinite(lp_ref).all()
    # BF16-representable masters: autocast casts them to the very BF16 weights the reference holds, and
    # both run the same kernels, so the log-probs are the same bits (seen on this CPU)
    assert torch.equal(lp_ref, lp_pol)
