"""Algorithms: aggregation, KL estimators, policy losses (PPO, GRPO, M2PO), registry, advantages.

Expected numbers are worked out by hand in the comments next to them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlhf_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    POLICY_LOSSES,
    AlgorithmOptions,
    advantages_from_config,
    agg_loss,
    compute_advantages,
    compute_grpo_advantages,
    compute_grpo_loss,
    compute_m2po_loss,
    compute_policy_loss,
    compute_ppo_loss,
    compute_rloo_advantages,
    global_normalisers,
    kl_penalty,
    m2po_keep_mask,
    m2po_trust_region_mask,
    step_keep_mask,
)
from rlhf_core.config import AlgorithmConfig, ConfigError, load_config, validate_config

LOG = math.log
F64 = torch.float64


def t(x, dtype=F64, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def close(a, b, tol=1e-6):
    a, b = (x.detach() if isinstance(x, torch.Tensor) else x for x in (a, b))
    return abs(float(a) - float(b)) < tol


def all_losses():
    """(name, fn(logprobs, old, adv, mask, **kw)) for every loss variant."""
    return [
        ("ppo", lambda *a, **k: compute_ppo_loss(*a, **k)),
        ("grpo", lambda *a, **k: compute_grpo_loss(*a, **k)),
        ("m2po-trust_region", lambda *a, **k: compute_m2po_loss(*a, masking="trust_region", **k)),
        ("m2po-ratio_sq", lambda *a, **k: compute_m2po_loss(*a, masking="ratio_sq", **k)),
    ]


LOSS_IDS = [name for name, _ in all_losses()]


# ------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------

# rows: [1,2,3] mask [1,1,0]; [4,5,6] mask [1,0,0]; [7,8,9] mask [0,0,0]  -> valid values 1, 2 | 4 | -
AGG_LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
AGG_MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
AGG_EXPECTED = {
    "token-mean": 7 / 3,  # (1 + 2 + 4) / 3
    "seq-mean-token-mean": 2.75,  # mean(3/2, 4/1); the empty row is excluded
    "seq-mean-token-sum": 3.5,  # mean(3, 4)
    "seq-mean-token-sum-norm": 7 / 9,  # (1 + 2 + 4) / (3 rows * 3): norm_len not given falls back to L
}


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_hand_values(agg):
    mask = torch.tensor(AGG_MASK, dtype=torch.bool)
    assert close(agg_loss(t(AGG_LOSS), mask, agg), AGG_EXPECTED[agg])
    assert close(agg_loss(t(AGG_LOSS), mask.double(), agg), AGG_EXPECTED[agg])  # float mask, same values


def test_agg_loss_no_mask_and_float_weights():
    loss = t([[2.0, 4.0], [6.0, 8.0]])
    assert close(agg_loss(loss, None, "token-mean"), 5.0)
    assert close(agg_loss(loss, None, "seq-mean-token-sum"), 10.0)  # mean(6, 14)
    # float weights: (0.5·2 + 1·4) / 1.5 = 10/3
    assert close(agg_loss(t([[2.0, 4.0]]), t([[0.5, 1.0]]), "token-mean"), 10 / 3)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_empty_mask_is_zero_with_zero_grad(agg):
    loss = t(AGG_LOSS, grad=True)
    out = agg_loss(loss, torch.zeros(3, 3, dtype=torch.bool), agg)
    out.backward()
    assert float(out.detach()) == 0.0 and torch.equal(loss.grad, torch.zeros(3, 3, dtype=F64))


def test_seq_mean_token_sum_norm_uses_a_fixed_length_not_the_padded_width():
    # Dr.GRPO divides by rows x the generation budget (TRL dr_grpo: max_completion_length), a constant.
    # With norm_len = 8: (1 + 2 + 4) / (3 rows * 8) = 7/24, whatever the padded width L.
    mask = torch.tensor(AGG_MASK, dtype=torch.bool)
    assert close(agg_loss(t(AGG_LOSS), mask, "seq-mean-token-sum-norm", norm_len=8), 7 / 24)
    wide_loss = torch.cat([t(AGG_LOSS), torch.full((3, 5), 123.0, dtype=F64)], dim=1)  # 5 padded columns
    wide_mask = torch.cat([mask, torch.zeros(3, 5, dtype=torch.bool)], dim=1)
    assert close(agg_loss(wide_loss, wide_mask, "seq-mean-token-sum-norm", norm_len=8), 7 / 24)
    # without a fixed normaliser the padded width leaks in: 7/9 vs 7/24
    assert not close(agg_loss(wide_loss, wide_mask, "seq-mean-token-sum-norm"), AGG_EXPECTED["seq-mean-token-sum-norm"])
    # norm_len changes nothing in the other modes
    for agg in AGG_MODES[:3]:
        assert close(agg_loss(wide_loss, wide_mask, agg, norm_len=8), AGG_EXPECTED[agg])


@pytest.mark.parametrize("name,fn", [*all_losses(), ("registry", None)], ids=[*LOSS_IDS, "registry"])
def test_wider_padding_does_not_change_the_loss(name, fn):
    """The same rows in a batch padded wider (extra masked columns) give the same loss and gradient."""
    logp, old, adv, mask, ref = _inputs(20)
    L, extra = logp.shape[1], 7

    def pad(x, value):
        return torch.cat([x, torch.full((x.shape[0], extra), value, dtype=x.dtype)], dim=1)

    def run(lp, o, m, r):
        lp = lp.clone().requires_grad_()
        if fn is None:
            cfg = AlgorithmConfig(loss="grpo", agg="seq-mean-token-sum-norm", kl_coef=0.1)
            loss, _ = compute_policy_loss(cfg, lp, o, adv, m, ref_logprobs=r, norm_len=16)
        else:
            loss, _ = fn(lp, o, adv, m, agg="seq-mean-token-sum-norm", ref_logprobs=r, kl_coef=0.1, norm_len=16)
        loss.backward()
        return loss.detach(), lp.grad

    narrow = run(logp, old, mask, ref)
    wide = run(pad(logp, 0.0), pad(old, -1.0), pad(mask, False), pad(ref, 0.5))
    assert close(narrow[0], wide[0], 1e-12)
    assert torch.allclose(wide[1][:, :L], narrow[1], atol=1e-15) and (wide[1][:, L:] == 0).all()


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_global_normalisers_make_micro_batches_sum_exactly(agg):
    # Rows of unequal lengths, one empty row, float weights: the per-micro-batch losses with the step's
    # normalisers add up to the full-batch loss, and so do their gradients.
    g = torch.Generator().manual_seed(13)
    loss = torch.randn(10, 6, dtype=F64, generator=g).requires_grad_()
    mask = (torch.rand(10, 6, generator=g) > 0.4).double() * torch.rand(10, 6, dtype=F64, generator=g)
    mask[4] = 0.0
    full = agg_loss(loss, mask, agg, norm_len=9)
    (full_grad,) = torch.autograd.grad(full, loss)
    norm = global_normalisers(mask)
    assert close(norm["global_tokens"], mask.sum(), 1e-12) and float(norm["global_seqs"]) == 9.0
    assert float(norm["global_rows"]) == 10.0
    parts = [agg_loss(loss[s : s + 3], mask[s : s + 3], agg, norm_len=9, **norm) for s in range(0, 10, 3)]
    (part_grad,) = torch.autograd.grad(sum(parts), loss)
    assert close(sum(parts), full, 1e-12)
    assert torch.allclose(part_grad, full_grad, atol=1e-14, rtol=0)
    # all-zero step mask: still 0, never NaN
    zero = torch.zeros(3, 6, dtype=F64)
    assert float(agg_loss(loss[:3].detach(), zero, agg, **global_normalisers(zero))) == 0.0


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="aggregation"):
        agg_loss(t([[1.0]]), None, "mean")


# ------------------------------------------------------------------------------------------------
# KL estimators
# ------------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values():
    logp, ref = t([0.0, 0.0]), t([LOG(2.0), -1.0])
    # k1 = logp - ref
    assert torch.allclose(kl_penalty(logp, ref, "k1"), t([-LOG(2.0), 1.0]))
    # k2 = ½ (logp - ref)²: ½·0.693147² = 0.2402265, ½·1 = 0.5
    assert torch.allclose(kl_penalty(logp, ref, "k2"), t([0.5 * LOG(2.0) ** 2, 0.5]))
    # k3 = e^(ref-logp) - (ref-logp) - 1: 2 - 0.693147 - 1 = 0.306853; e^-1 + 1 - 1 = 0.367879
    assert torch.allclose(kl_penalty(logp, ref, "k3"), t([1.0 - LOG(2.0), math.exp(-1.0)]))
    assert torch.equal(kl_penalty(ref, ref, "k3"), torch.zeros(2, dtype=F64))


def test_kl_k3_is_clamped_finite_nonnegative():
    logp = t([0.0, 0.0], dtype=torch.float32, grad=True)
    kl = kl_penalty(logp, torch.tensor([100.0, -100.0]), "k3")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and (kl >= 0).all() and torch.isfinite(logp.grad).all()
    # exponent clamped to 20: e^20 - 20 - 1
    assert close(kl[0] / (math.exp(20) - 21), 1.0, 1e-5)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, logp, "k4")


# ------------------------------------------------------------------------------------------------
# PPO
# ------------------------------------------------------------------------------------------------


def test_ppo_identical_policies_ratio_one():
    torch.manual_seed(0)
    logp = torch.randn(4, 5, requires_grad=True)
    adv = torch.randn(4)
    loss, stats = compute_ppo_loss(logp, logp.detach(), adv)
    assert torch.allclose(loss, -adv.mean(), atol=1e-6)  # ratio 1 everywhere: loss = -mean A
    assert float(stats["policy/ratio_mean"]) == pytest.approx(1.0)
    assert float(stats["policy/clip_frac"]) == 0.0 and float(stats["policy/approx_kl"]) == 0.0
    loss.backward()
    # d/dlogp_t of -A·r/20 at r = 1 is -A/20
    assert torch.allclose(logp.grad, (-adv / 20).unsqueeze(1).expand(4, 5), atol=1e-6)


def test_ppo_hand_values_positive_and_negative_advantage():
    # old = 0; ratios 1, 1.5, 0.5; clip_eps 0.2 -> clip range [0.8, 1.2]
    logp = t([[0.0, LOG(1.5), LOG(0.5)]], grad=True)
    # A = +1: ℓ = max(-r, -clip(r)) = -1, max(-1.5, -1.2) = -1.2, max(-0.5, -0.8) = -0.5 -> mean -0.9
    loss, stats = compute_ppo_loss(logp, torch.zeros(1, 3, dtype=F64), t([1.0]))
    assert close(loss, -0.9) and close(stats["policy/clip_frac"], 1 / 3)
    assert close(stats["policy/ratio_mean"], 1.0) and close(stats["policy/ratio_max"], 1.5)
    # approx_kl = mean(r - 1 - log r) = (0 + 0.5 - 0.405465 + (-0.5) + 0.693147) / 3 = 0.0958940
    assert close(stats["policy/approx_kl"], (0.5 - LOG(1.5) - 0.5 - LOG(0.5)) / 3)
    loss.backward()
    # clipped token gets no gradient; unclipped: -A·r / 3
    assert torch.allclose(logp.grad, t([[-1 / 3, 0.0, -0.5 / 3]]))
    # A = -1: ℓ = 1, max(1.5, 1.2) = 1.5, max(0.5, 0.8) = 0.8 -> mean 1.1
    loss, stats = compute_ppo_loss(logp, torch.zeros(1, 3, dtype=F64), t([-1.0]))
    assert close(loss, 1.1) and close(stats["policy/clip_frac"], 1 / 3)


def test_ppo_clipping_bounds():
    torch.manual_seed(1)
    old = torch.randn(8, 16, dtype=F64)
    logp = old + 3 * torch.randn(8, 16, dtype=F64)  # ratios far outside the clip range
    adv = torch.randn(8, 16, dtype=F64)
    loss, _ = compute_ppo_loss(logp, old, adv, clip_eps=0.2, agg="token-mean")
    r = torch.exp(logp - old)
    # The pessimistic surrogate is never below the clipped one: ℓ ≥ -A·clip(r)
    lower = (-adv * r.clamp(0.8, 1.2)).mean()
    assert float(loss) >= float(lower) - 1e-12
    # With positive advantages, increasing r past 1+ε can never decrease the loss below -A(1+ε).
    loss_pos, _ = compute_ppo_loss(old + 5.0, old, torch.ones(8, dtype=F64))
    assert close(loss_pos, -1.2)


def test_ppo_clip_higher():
    # eps 0.2, eps_high 0.28: A=+1, r=1.5 -> max(-1.5, -1.28) = -1.28; A=-1, r=0.7 -> max(0.7, 0.8) = 0.8
    logp = t([[LOG(1.5)], [LOG(0.7)]])
    loss, stats = compute_ppo_loss(logp, torch.zeros(2, 1, dtype=F64), t([1.0, -1.0]), clip_eps_high=0.28)
    assert close(loss, (-1.28 + 0.8) / 2) and close(stats["policy/clip_frac"], 1.0)


def test_ppo_dual_clip():
    # A = -1, ratios 4 and 2, eps 0.2, c = 3: max(4, 1.2) = 4 -> min(4, 3) = 3; max(2, 1.2) = 2 -> 2
    logp = t([[LOG(4.0), LOG(2.0)]], grad=True)
    loss, stats = compute_ppo_loss(logp, torch.zeros(1, 2, dtype=F64), t([-1.0]), dual_clip=3.0)
    assert close(loss, 2.5) and close(stats["policy/dual_clip_frac"], 0.5)
    loss.backward()
    assert torch.allclose(logp.grad, t([[0.0, 2.0 / 2]]))  # dual-clipped token is constant
    # positive advantages are untouched by the dual clip: max(-4, -1.2) = -1.2; max(-2, -1.2) = -1.2
    loss, _ = compute_ppo_loss(logp, torch.zeros(1, 2, dtype=F64), t([1.0]), dual_clip=3.0)
    assert close(loss, -1.2)
    with pytest.raises(ValueError, match="dual_clip"):
        compute_ppo_loss(logp, logp.detach(), t([1.0]), dual_clip=0.5)


def test_ppo_unclipped_analytic_gradient():
    torch.manual_seed(2)
    logp = torch.randn(3, 7, dtype=F64, requires_grad=True)
    old = logp.detach() + 0.5 * torch.randn(3, 7, dtype=F64)
    adv = torch.randn(3, dtype=F64)
    mask = torch.rand(3, 7) > 0.3
    loss, _ = compute_ppo_loss(logp, old, adv, mask, clip_eps=None)
    loss.backward()
    r = torch.exp(logp.detach() - old)
    expected = -adv[:, None] * r * mask / mask.sum()  # ∂/∂logp of Σ(-A·r·m)/Σm
    assert torch.allclose(logp.grad, expected)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_gradcheck(agg):
    torch.manual_seed(3)
    old = torch.randn(3, 5, dtype=F64)
    # ratios in [0.9, 1.1] ∪ clearly outside [0.8, 1.2]: away from the kinks at the clip bounds
    offsets = torch.tensor([0.05, -0.05, 0.5, -0.6, 0.0], dtype=F64).repeat(3, 1)
    logp = (old + offsets).requires_grad_()
    adv = torch.randn(3, 5, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda lp: compute_ppo_loss(lp, old, adv, mask, agg=agg)[0], (logp,))


# ------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------


def test_grpo_gradient_flow():
    torch.manual_seed(4)
    logp = torch.randn(4, 6, requires_grad=True)
    old = logp.detach() + 0.01 * torch.randn(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False
    adv = compute_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])).reshape(-1)
    loss, _ = compute_grpo_loss(logp, old, adv, mask, ref_logprobs=old, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[:, :4].abs() > 0).all() and (logp.grad[:, 4:] == 0).all()


def test_grpo_hand_value_with_kl():
    # ratio 1, advantages +1/-1 -> surrogate -mean(A) = 0; k3 with ref - logp = log 2 is 1 - log 2 = 0.306853
    logp = torch.zeros(2, 2, dtype=F64, requires_grad=True)
    ref = torch.full((2, 2), LOG(2.0), dtype=F64)
    loss, stats = compute_grpo_loss(logp, logp.detach(), t([1.0, -1.0]), ref_logprobs=ref, kl_coef=0.1)
    assert close(stats["loss/policy"], 0.0) and close(stats["loss/kl"], 1 - LOG(2.0))
    assert close(loss, 0.1 * (1 - LOG(2.0)))
    loss.backward()
    # ∂/∂logp of -A·r/4 + 0.1·(e^(ref-logp) - (ref-logp) - 1)/4 = -A/4 + 0.1·(1 - 2)/4
    assert torch.allclose(logp.grad, t([[-0.25 - 0.025] * 2, [0.25 - 0.025] * 2]))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_grpo_kl_uses_same_agg(kind):
    torch.manual_seed(5)
    logp, old, ref = (torch.randn(3, 4, dtype=F64) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.randn(3, dtype=F64)
    for agg in AGG_MODES:
        base, _ = compute_grpo_loss(logp, old, adv, mask, agg=agg)
        loss, stats = compute_grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.3, kl_estimator=kind, agg=agg)
        expected_kl = agg_loss(kl_penalty(logp, ref, kind), mask, agg)
        assert close(stats["loss/kl"], expected_kl, 1e-10)
        assert close(loss, base + 0.3 * expected_kl, 1e-10)


def test_grpo_accepts_b_g_l():
    torch.manual_seed(6)
    B, G, L = 3, 4, 5
    logp = torch.randn(B, G, L, dtype=F64, requires_grad=True)
    old, ref = torch.randn(B, G, L, dtype=F64), torch.randn(B, G, L, dtype=F64)
    mask = torch.rand(B, G, L) > 0.3
    adv = torch.randn(B, G, dtype=F64)
    loss3, stats3 = compute_grpo_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.05)
    flat = lambda x: x.reshape(B * G, L)
    loss2, stats2 = compute_grpo_loss(
        flat(logp), flat(old), adv.reshape(-1), flat(mask), ref_logprobs=flat(ref), kl_coef=0.05
    )
    assert close(loss3, loss2, 1e-12) and close(stats3["loss/kl"], stats2["loss/kl"], 1e-12)
    # [B·G] advantages with [B, G, L] inputs, and token-level [B, G, L] advantages
    assert close(compute_grpo_loss(logp, old, adv.reshape(-1), mask)[0], compute_grpo_loss(logp, old, adv, mask)[0])
    tok = adv[..., None].expand(B, G, L)
    assert close(compute_grpo_loss(logp, old, tok, mask)[0], compute_grpo_loss(logp, old, adv, mask)[0], 1e-12)
    loss3.backward()
    assert logp.grad.shape == (B, G, L) and torch.isfinite(logp.grad).all()


def test_grpo_gradcheck_with_kl():
    torch.manual_seed(7)
    old = torch.randn(4, 3, dtype=F64)
    logp = (old + 0.05 * torch.randn(4, 3, dtype=F64)).requires_grad_()  # inside the clip range
    ref, adv = torch.randn(4, 3, dtype=F64), torch.randn(4, dtype=F64)
    fn = lambda lp: compute_grpo_loss(lp, old, adv, ref_logprobs=ref, kl_coef=0.2, agg="seq-mean-token-mean")[0]
    assert torch.autograd.gradcheck(fn, (logp,))


# ------------------------------------------------------------------------------------------------
# M2PO
# ------------------------------------------------------------------------------------------------


def test_m2po_trust_region_hand_values():
    # A = +1, d = [0.1, 0.2, 0.3, -0.4]; candidates (A>0, d>0): tokens 0..2 with v = .01, .04, .09.
    # mean(.01, .04, .09) = .0467 > .04 -> mask v = .09; mean(.01, .04) = .025 <= .04 -> stop. M = [1,1,0,1]
    d = [0.1, 0.2, 0.3, -0.4]
    logp = t([d], grad=True)
    loss, stats = compute_m2po_loss(logp, torch.zeros(1, 4, dtype=F64), t([1.0]), m2_threshold=0.04)
    # ℓ = -M·A·e^d, token-mean over all 4 valid tokens: -(e^.1 + e^.2 + e^-.4) / 4 = -0.7492235
    expected = -(math.exp(0.1) + math.exp(0.2) + math.exp(-0.4)) / 4
    assert close(loss, expected)
    assert close(stats["m2po/masked_frac"], 0.25)
    assert close(stats["m2po/m2"], (0.01 + 0.04 + 0.09 + 0.16) / 4)  # over all valid tokens, before masking
    loss.backward()
    assert torch.allclose(logp.grad, t([[-math.exp(0.1) / 4, -math.exp(0.2) / 4, 0.0, -math.exp(-0.4) / 4]]))


def test_m2po_trust_region_negative_advantage_and_no_masking():
    # A = -1, d = [-0.1, -0.3, 0.5]: candidates (A<0, d<0) are tokens 0, 1 with v = .01, .09;
    # mean .05 > .04 -> mask token 1. Token 2 (v = .25) is no candidate and is kept.
    keep = m2po_trust_region_mask(t([[-0.1, -0.3, 0.5]]), t([[-1.0]]), torch.ones(1, 3, dtype=torch.bool), 0.04)
    assert keep.tolist() == [[True, False, True]]
    # threshold above the candidates' mean: nothing masked
    keep = m2po_trust_region_mask(t([[-0.1, -0.3, 0.5]]), t([[-1.0]]), torch.ones(1, 3, dtype=torch.bool), 0.05)
    assert keep.all()


def test_m2po_trust_region_with_clip():
    # d = [0.1, 0.2, 0.3, -0.4] as above, clip_eps 0.15 -> [0.85, 1.15]: r = 1.105 (in range) -> -1.105;
    # 1.221 -> -1.15; token 2 masked; 0.670 -> max(-0.670, -0.85) = -0.670.
    # loss = -(1.105171 + 1.15 + 0.670320) / 4 = -0.731373
    logp = t([[0.1, 0.2, 0.3, -0.4]])
    loss, stats = compute_m2po_loss(logp, torch.zeros(1, 4, dtype=F64), t([1.0]), clip_eps=0.15)
    assert close(loss, -(math.exp(0.1) + 1.15 + math.exp(-0.4)) / 4)
    assert close(stats["policy/clip_frac"], 0.5)  # tokens 1 and 2 sit on the clipped branch


def test_m2po_ratio_sq_threshold_masking():
    # r = 1, 3, 1.5 -> r² = 1, 9, 2.25; threshold 4 masks token 1.
    # ℓ (clip 0.2) on kept tokens: -1, max(-1.5, -1.2) = -1.2 -> Σ / max(1, 2) = -1.1
    logp = t([[0.0, LOG(3.0), LOG(1.5)]], grad=True)
    loss, stats = compute_m2po_loss(logp, torch.zeros(1, 3, dtype=F64), t([1.0]), masking="ratio_sq")
    assert close(loss, -1.1) and close(stats["m2po/masked_frac"], 1 / 3)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-0.5, 0.0, 0.0]]))  # masked and clipped tokens carry no gradient
    # everything masked -> 0, no NaN
    loss, stats = compute_m2po_loss(t([[LOG(3.0)]]), t([[0.0]]), t([1.0]), masking="ratio_sq")
    assert float(loss) == 0.0 and close(stats["m2po/masked_frac"], 1.0)


def naive_m2po_keep(d, adv, valid, thr):
    """Algorithm 1 of arXiv 2510.01161, literally: drop the largest-v candidate until the mean fits.
    Ties: drop the later position first (the batched version keeps earlier positions)."""
    v = [x * x for x in d]
    kept = [i for i in range(len(d)) if valid[i] and ((adv[i] > 0 and d[i] > 0) or (adv[i] < 0 and d[i] < 0))]
    dropped = set()
    while kept and sum(v[i] for i in kept) / len(kept) > thr:
        worst = max(kept, key=lambda i: (v[i], i))
        kept.remove(worst)
        dropped.add(worst)
    return [i not in dropped for i in range(len(d))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(), n=st.integers(1, 4), length=st.integers(1, 6), thr=st.floats(0.001, 0.6), token_adv=st.booleans()
)
def test_m2po_trust_region_matches_naive_reference(data, n, length, thr, token_adv):
    vals = st.one_of(st.floats(-1.0, 1.0, allow_nan=False), st.sampled_from([0.0, 0.1, -0.1, 0.2, 0.5]))
    d = data.draw(st.lists(vals, min_size=n * length, max_size=n * length))
    valid = data.draw(st.lists(st.booleans(), min_size=n * length, max_size=n * length))
    adv_row = data.draw(
        st.lists(
            st.sampled_from([-1.0, -0.5, 0.0, 0.7, 2.0]),
            min_size=n * length if token_adv else n,
            max_size=n * length if token_adv else n,
        )
    )
    adv_tok = adv_row if token_adv else [a for a in adv_row for _ in range(length)]
    # Exclude inputs where some prefix mean lands within rounding of the threshold.
    v_cand = sorted(x * x for x, ok, a in zip(d, valid, adv_tok) if ok and ((a > 0 and x > 0) or (a < 0 and x < 0)))
    assume(all(abs(sum(v_cand[:k]) / k - thr) > 1e-9 for k in range(1, len(v_cand) + 1)))

    adv_t = t(adv_row).reshape(n, length) if token_adv else t(adv_row).reshape(n, 1)
    keep = m2po_trust_region_mask(t(d).reshape(n, length), adv_t, torch.tensor(valid).reshape(n, length), thr)
    assert keep.reshape(-1).tolist() == naive_m2po_keep(d, adv_tok, valid, thr)

    # and the loss built on it: masked_frac = dropped / valid, m2 = mean d² over valid tokens
    logp = t(d).reshape(n, length)
    mask = torch.tensor(valid).reshape(n, length)
    _, stats = compute_m2po_loss(logp, torch.zeros_like(logp), adv_t, mask, m2_threshold=thr)
    n_valid = sum(valid)
    dropped = sum(1 for k, ok in zip(keep.reshape(-1).tolist(), valid) if ok and not k)
    assert close(stats["m2po/masked_frac"], dropped / n_valid if n_valid else 0.0, 1e-9)
    assert close(stats["m2po/m2"], sum(x * x for x, ok in zip(d, valid) if ok) / n_valid if n_valid else 0.0, 1e-9)


def test_m2po_gradcheck():
    torch.manual_seed(8)
    beh = torch.randn(4, 6, dtype=F64)
    logp = (beh + 0.4 * torch.randn(4, 6, dtype=F64)).requires_grad_()
    adv = torch.randn(4, dtype=F64)
    _, stats = compute_m2po_loss(logp, beh, adv)
    assert float(stats["m2po/masked_frac"]) > 0  # the mask is active in this example
    assert torch.autograd.gradcheck(lambda lp: compute_m2po_loss(lp, beh, adv)[0], (logp,))


def _stale_batch(seed=14, n=12, length=7):
    """A stale batch: log-ratios of ~0.6 nats, unequal lengths (one empty row), KL reference, TIS."""
    g = torch.Generator().manual_seed(seed)
    beh = torch.randn(n, length, dtype=F64, generator=g) - 1.0
    logp = beh + 0.6 * torch.randn(n, length, dtype=F64, generator=g)
    ref = beh + 0.3 * torch.randn(n, length, dtype=F64, generator=g)
    roll = beh + 0.1 * torch.randn(n, length, dtype=F64, generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    lengths[3] = 0
    mask = torch.arange(length)[None, :] < lengths[:, None]
    adv = torch.randn(n, dtype=F64, generator=g)
    return logp, beh, adv, mask, ref, roll


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss", ["ppo", "grpo", "m2po-trust_region", "m2po-ratio_sq"])
def test_micro_batch_losses_sum_exactly_to_the_full_batch(loss, agg):
    """Per-micro-batch losses with the step's normalisers (and, for M2PO, the step's keep mask) sum to the
    full-batch loss, gradients included, for every loss and aggregation (with KL on; rollout corrections:
    tests/test_correction.py)."""
    name, _, masking = loss.partition("-")
    options = {"masking": masking, "clip_eps": None if masking == "trust_region" else 0.2, "m2_threshold": 0.05}
    cfg = AlgorithmConfig(loss=name, loss_options=options if masking else {}, agg=agg, kl_coef=0.1)
    logp, beh, adv, mask, ref, roll = _stale_batch()
    logp = logp.requires_grad_()
    full, full_stats = compute_policy_loss(cfg, logp, beh, adv, mask, ref, roll, norm_len=9)
    (full_grad,) = torch.autograd.grad(full, logp)

    kw = {"norm_len": 9, "global_norm": global_normalisers(mask)}
    step = step_keep_mask(cfg, logp, beh, adv, mask)
    assert (step is None) == (name != "m2po")
    total, pg, kl = 0.0, 0.0, 0.0
    for s in range(0, 12, 5):
        rows = slice(s, s + 5)
        if step is not None:
            kw.update(keep_mask=step[0][rows], kept_norm=step[1])
        part, stats = compute_policy_loss(
            cfg, logp[rows], beh[rows], adv[rows], mask[rows], ref[rows], roll[rows], **kw
        )
        total, pg, kl = total + part, pg + stats["loss/policy"], kl + stats["loss/kl"]
    (part_grad,) = torch.autograd.grad(total, logp)
    assert close(total, full, 1e-12)
    assert close(pg, full_stats["loss/policy"], 1e-12) and close(kl, full_stats["loss/kl"], 1e-12)
    assert torch.allclose(part_grad, full_grad, atol=1e-12, rtol=0)
    if name == "m2po":
        # the step's mask is what the loss computes on the full batch, and it masks something
        keep = m2po_keep_mask(logp, beh, adv, mask, 0.05, masking, cfg.loss_options.ratio_sq_threshold)
        assert torch.equal(keep, step[0]) and float(full_stats["m2po/masked_frac"]) > 0


@pytest.mark.parametrize("masking", ["trust_region", "ratio_sq"])
def test_m2po_mask_of_micro_batches_is_not_the_step_mask(masking):
    """Why the keep mask is computed once per step: from a micro-batch's rows alone it differs, and so
    does the loss (the second moment and the kept-token count are statistics of the whole batch)."""
    logp, beh, adv, mask, _, _ = _stale_batch()
    step = m2po_keep_mask(logp, beh, adv, mask, 0.05, masking)
    per_micro = torch.cat(
        [
            m2po_keep_mask(logp[s : s + 5], beh[s : s + 5], adv[s : s + 5], mask[s : s + 5], 0.05, masking)
            for s in range(0, 12, 5)
        ]
    )
    if masking == "trust_region":
        assert not torch.equal(per_micro & mask, step & mask)
    else:  # ratio_sq keeps per token, so the mask agrees; its normaliser (kept tokens) is batch-wide
        assert torch.equal(per_micro, step)
    full, _ = compute_m2po_loss(logp, beh, adv, mask, 0.05, masking)
    norm = global_normalisers(mask)
    kept_norm = global_normalisers(step.double() * mask)
    naive = sum(
        compute_m2po_loss(
            logp[s : s + 5], beh[s : s + 5], adv[s : s + 5], mask[s : s + 5], 0.05, masking, global_norm=norm
        )[0]
        for s in range(0, 12, 5)
    )
    exact = sum(
        compute_m2po_loss(
            logp[s : s + 5],
            beh[s : s + 5],
            adv[s : s + 5],
            mask[s : s + 5],
            0.05,
            masking,
            global_norm=norm,
            keep_mask=step[s : s + 5],
            kept_norm=kept_norm,
        )[0]
        for s in range(0, 12, 5)
    )
    assert close(exact, full, 1e-12) and not close(naive, full, 1e-6)


def test_step_keep_mask_only_for_m2po():
    logp, beh, adv, mask, _, _ = _stale_batch()
    assert step_keep_mask(AlgorithmConfig(loss="ppo"), logp, beh, adv, mask) is None
    m2po = AlgorithmConfig(loss="m2po", loss_options={"masking": "ratio_sq"})
    keep, kept_norm = step_keep_mask(m2po, logp, beh, adv, mask)
    assert keep.dtype == torch.bool and keep.shape == mask.shape
    assert close(kept_norm["global_tokens"], (keep & mask).sum(), 1e-12)
    with pytest.raises(ValueError, match="keep_mask"):
        compute_policy_loss(AlgorithmConfig(loss="grpo"), logp, beh, adv, mask, keep_mask=keep)
    with pytest.raises(ValueError, match="keep_mask"):
        compute_m2po_loss(logp, beh, adv, mask, keep_mask=keep[:, :3])


# ------------------------------------------------------------------------------------------------
# Options shared by every loss: GSPO, TIS, KL, padding, empty masks, zero advantages
# ------------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio():
    # log ratios [log 2, 0] -> s = exp(log 2 / 2) = √2 = 1.41421; eps 0.5: inside [0.5, 1.5]
    logp = t([[LOG(2.0), 0.0]], grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    loss, stats = compute_ppo_loss(logp, old, t([1.0]), clip_eps=0.5, importance_level="sequence")
    assert close(loss, -math.sqrt(2)) and close(stats["policy/ratio_mean"], math.sqrt(2))
    loss.backward()
    # loss = -s; ∂s/∂logp_t = s / |y| = √2 / 2
    assert torch.allclose(logp.grad, t([[-math.sqrt(2) / 2] * 2]))
    # eps 0.2: s clipped per sequence to 1.2 for both tokens
    loss, stats = compute_ppo_loss(logp, old, t([1.0]), importance_level="sequence")
    assert close(loss, -1.2) and close(stats["policy/clip_frac"], 1.0)
    # padding does not enter the sequence mean
    padded = t([[LOG(2.0), 0.0, 5.0]])
    loss, _ = compute_ppo_loss(
        padded,
        torch.zeros(1, 3, dtype=F64),
        t([1.0]),
        clip_eps=0.5,
        mask=torch.tensor([[True, True, False]]),
        importance_level="sequence",
    )
    assert close(loss, -math.sqrt(2))


def test_gspo_gradcheck_all_losses():
    torch.manual_seed(9)
    old = torch.randn(3, 4, dtype=F64)
    logp = (old + 0.05 * torch.randn(3, 4, dtype=F64)).requires_grad_()
    adv, mask = torch.randn(3, dtype=F64), torch.rand(3, 4) > 0.2
    for _, fn in all_losses():
        f = lambda lp: fn(lp, old, adv, mask, importance_level="sequence", agg="seq-mean-token-mean")[0]
        assert torch.autograd.gradcheck(f, (logp,))


def test_tis_truncated_weights():
    # old = 0, rollout = log 4 -> w = 1/4; rollout = -log 4 -> w = 4, capped at 2. r = 1, A = 1:
    # ℓ = -w -> (-0.25 - 2) / 2 = -1.125
    logp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    rollout = t([[LOG(4.0), -LOG(4.0)]])
    for name, fn in all_losses():
        loss, stats = fn(logp, logp.detach(), t([1.0]), rollout_logprobs=rollout, tis_cap=2.0)
        assert close(loss, -1.125), name
        assert close(stats["tis/weight_mean"], 1.125) and close(stats["tis/capped_frac"], 0.5)
        # without a cap (or without rollout log-probs) TIS is off
        assert close(fn(logp, logp.detach(), t([1.0]), rollout_logprobs=rollout)[0], -1.0)
        assert close(fn(logp, logp.detach(), t([1.0]), tis_cap=2.0)[0], -1.0)


@pytest.mark.parametrize("name,fn", all_losses(), ids=LOSS_IDS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_zero_mask_gives_zero_loss_and_grads(name, fn, agg):
    logp = torch.randn(3, 4, requires_grad=True)
    garbage = torch.full((3, 4), float("nan"))
    loss, stats = fn(
        logp,
        garbage,
        torch.randn(3),
        torch.zeros(3, 4, dtype=torch.bool),
        agg=agg,
        ref_logprobs=garbage,
        kl_coef=0.1,
        rollout_logprobs=garbage,
        tis_cap=2.0,
        importance_level="sequence" if agg == "seq-mean-token-mean" else "token",
    )
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.equal(logp.grad, torch.zeros(3, 4))
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name,fn", all_losses(), ids=LOSS_IDS)
def test_padding_garbage_does_not_leak(name, fn):
    torch.manual_seed(10)
    logp = torch.randn(2, 5, dtype=F64, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(2, 5, dtype=F64)
    ref = torch.randn(2, 5, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    clean, _ = fn(logp, old, t([1.0, -0.5]), mask, ref_logprobs=ref, kl_coef=0.1)
    dirty_old = old.masked_fill(~mask, float("-inf"))
    dirty_ref = ref.masked_fill(~mask, float("nan"))
    dirty, _ = fn(logp, dirty_old, t([1.0, -0.5]), mask, ref_logprobs=dirty_ref, kl_coef=0.1)
    dirty.backward()
    assert close(clean, dirty, 1e-12)
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()


@pytest.mark.parametrize("name,fn", all_losses(), ids=LOSS_IDS)
def test_backward_with_zero_advantages(name, fn):
    torch.manual_seed(11)
    logp = torch.randn(4, 8, requires_grad=True)
    old = logp.detach() + 0.2 * torch.randn(4, 8)
    loss, stats = fn(logp, old, torch.zeros(4))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(logp.grad, torch.zeros(4, 8))
    for key, value in stats.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
        assert torch.isfinite(value), key
    assert {"loss/policy", "policy/clip_frac", "policy/approx_kl", "policy/ratio_mean"} <= set(stats)


def test_loss_argument_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="aggregation"):
        compute_ppo_loss(x, x, torch.zeros(2), agg="sum")
    with pytest.raises(ValueError, match="masking"):
        compute_m2po_loss(x, x, torch.zeros(2), masking="other")
    with pytest.raises(ValueError, match="importance_level"):
        compute_grpo_loss(x, x, torch.zeros(2), importance_level="token-seq")
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_grpo_loss(x, x, torch.zeros(2), kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages"):
        compute_ppo_loss(x, x, torch.zeros(5))
    with pytest.raises(ValueError, match="old_logprobs"):
        compute_ppo_loss(x, torch.zeros(3, 2), torch.zeros(2))


# ------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------


def _inputs(seed=12):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(4, 6, dtype=F64, generator=g)
    old = logp + 0.3 * torch.randn(4, 6, dtype=F64, generator=g)
    ref = logp + 0.3 * torch.randn(4, 6, dtype=F64, generator=g)
    adv = torch.randn(4, dtype=F64, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    return logp, old, adv, mask, ref


def test_registry_dispatch_matches_direct_calls():
    logp, old, adv, mask, ref = _inputs()
    assert {"ppo", "grpo", "m2po"} <= set(POLICY_LOSSES)  # and those the tests register
    options = {"clip_eps": 0.1, "clip_eps_high": 0.3, "dual_clip": 3.0}
    cfg = AlgorithmConfig(loss="ppo", loss_options=options, agg="seq-mean-token-sum")
    got, _ = compute_policy_loss(cfg, logp, old, adv, mask)
    want, _ = compute_ppo_loss(logp, old, adv, mask, 0.1, 0.3, 3.0, "seq-mean-token-sum")
    assert close(got, want, 1e-12)
    cfg = AlgorithmConfig(loss="m2po", loss_options={"clip_eps": None, "m2_threshold": 0.02})
    got, stats = compute_policy_loss(cfg, logp, old, adv, mask)
    assert close(got, compute_m2po_loss(logp, old, adv, mask, m2_threshold=0.02)[0], 1e-12)
    assert "m2po/masked_frac" in stats
    cfg = AlgorithmConfig(loss="m2po", loss_options={"masking": "ratio_sq", "ratio_sq_threshold": 1.5})
    got, _ = compute_policy_loss(cfg, logp, old, adv, mask)
    assert close(
        got, compute_m2po_loss(logp, old, adv, mask, masking="ratio_sq", clip_eps=0.2, ratio_sq_threshold=1.5)[0], 1e-12
    )
    # a rollout correction: the ratio against the trainer's log-probs (detached), the advantages times w
    cfg = AlgorithmConfig(loss="grpo", importance_level="sequence", rollout_correction={"mode": "tis"})
    got, stats = compute_policy_loss(cfg, logp, old, adv, mask, rollout_logprobs=ref)
    w = torch.exp((logp.detach() - ref).clamp(-20, 20)).clamp(max=2.0)
    want = compute_grpo_loss(logp, logp.detach(), adv[:, None] * w, mask, importance_level="sequence")[0]
    assert close(got, want, 1e-12)
    assert "correction/weight_mean" in stats
    with pytest.raises(ValueError, match="unknown policy loss"):
        compute_policy_loss(SimpleNamespace(loss="a2c"), logp, old, adv)


@pytest.mark.parametrize("loss", ["ppo", "grpo", "m2po"])
def test_registry_adds_kl_for_every_loss(loss):
    logp, old, adv, mask, ref = _inputs()
    base, _ = compute_policy_loss(AlgorithmConfig(loss=loss), logp, old, adv, mask)
    cfg = AlgorithmConfig(loss=loss, kl_coef=0.5, kl_estimator="k2")
    with_kl, stats = compute_policy_loss(cfg, logp, old, adv, mask, ref_logprobs=ref)
    kl = agg_loss(kl_penalty(logp, ref, "k2"), mask, "token-mean")
    assert close(stats["loss/kl"], kl, 1e-12) and close(with_kl, base + 0.5 * kl, 1e-12)
    # no reference log-probs given: no KL term
    assert close(compute_policy_loss(cfg, logp, old, adv, mask)[0], base, 1e-12)


# ------------------------------------------------------------------------------------------------
# Advantages
# ------------------------------------------------------------------------------------------------


def test_grpo_advantages_group_batch_none():
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    signs = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    # group mean .5; the sample std (the default, / (G - 1)) √(1/3) -> ±√3/2; the population std .5 -> ±1
    assert torch.allclose(compute_grpo_advantages(r, eps=0.0), signs * math.sqrt(3) / 2)
    assert torch.allclose(compute_grpo_advantages(r, eps=0.0, unbiased=False), signs)
    assert torch.allclose(compute_grpo_advantages(r, scale="none"), 0.5 * signs)
    # the default eps 1e-4 (TRL's): .5 / (√(1/3) + 1e-4)
    assert torch.allclose(compute_grpo_advantages(r), signs * 0.5 / (math.sqrt(1 / 3) + 1e-4), rtol=0, atol=1e-6)
    # batch: centered [[.5, -.5], [0, 0]] / std of [1, 0, 3, 3]: population √1.6875, sample √2.25 = 1.5
    r2 = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    centered = torch.tensor([[0.5, -0.5], [0.0, 0.0]])
    assert torch.allclose(compute_grpo_advantages(r2, eps=0.0, scale="batch"), centered / 1.5)
    expected = centered / math.sqrt(1.6875)
    assert torch.allclose(compute_grpo_advantages(r2, eps=0.0, scale="batch", unbiased=False), expected)
    with pytest.raises(ValueError, match="scale"):
        compute_grpo_advantages(r, scale="rank")


def test_rloo_advantages():
    # R_i - mean of the other three: 1 - 1/3, 0 - 2/3
    got = compute_rloo_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    assert torch.allclose(got, torch.tensor([[2 / 3, -2 / 3, 2 / 3, -2 / 3]]))


def test_constant_groups_and_single_sample_groups_are_exactly_zero():
    const = torch.full((3, 5), 0.1)  # float mean of 0.1s is not exactly 0.1
    for scale in ("group", "batch", "none"):
        assert torch.equal(compute_grpo_advantages(const, scale=scale), torch.zeros(3, 5))
        assert torch.equal(compute_grpo_advantages(torch.tensor([[0.3], [0.9]]), scale=scale), torch.zeros(2, 1))
    assert torch.equal(compute_rloo_advantages(const), torch.zeros(3, 5))
    assert torch.equal(compute_rloo_advantages(torch.tensor([[0.3], [0.9]])), torch.zeros(2, 1))


def test_rloo_takes_no_scale_or_eps():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    for option in ({"scale": "batch"}, {"eps": 0.1}, {"unbiased": False}):
        with pytest.raises(ValueError, match="'rloo' takes no option"):
            compute_advantages("rloo", r, **option)
    # from a config: the estimator gets the options it takes, and only those
    assert torch.equal(advantages_from_config(AlgorithmConfig(advantage="rloo"), r), compute_rloo_advantages(r))
    cfg = AlgorithmConfig(advantage_options={"scale": "none", "eps": 0.5})
    assert torch.equal(advantages_from_config(cfg, r), compute_grpo_advantages(r, scale="none"))
    cfg = AlgorithmConfig(advantage_options={"scale": "group", "eps": 0.5})
    assert torch.equal(advantages_from_config(cfg, r), compute_grpo_advantages(r, eps=0.5))
    cfg = AlgorithmConfig(advantage_options={"unbiased": False})
    assert torch.equal(advantages_from_config(cfg, r), compute_grpo_advantages(r, unbiased=False))


@pytest.mark.parametrize("field,value", [("scale", "batch"), ("scale", "none"), ("eps", 0.01), ("unbiased", "false")])
def test_config_refuses_advantage_options_rloo_ignores(field, value):
    key = f"algorithm.advantage_options.{field}"
    with pytest.raises(ConfigError, match=f"{key} has no effect with algorithm.advantage 'rloo'"):
        load_config(None, ["algorithm.advantage=rloo", f"{key}={value}"])
    assert load_config(None, [f"{key}={value}"]).algorithm.advantage == "grpo"  # fine with grpo
    # a config dumped whole (checkpoint, Prefect form) holds its options and stays valid
    cfg = load_config(None, ["algorithm.advantage=rloo"])
    assert validate_config(cfg.model_dump(mode="json")).algorithm.advantage == "rloo"
    # and may be switched to another estimator: options at their defaults do not stand in the way
    dumped = load_config(None).model_dump(mode="json")
    dumped["algorithm"]["advantage"] = "rloo"
    assert validate_config(dumped).algorithm.advantage_options == AlgorithmOptions()


def test_compute_advantages_by_name():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    assert {"grpo", "rloo", "gae"} <= set(ADVANTAGE_ESTIMATORS)
    assert torch.equal(compute_advantages("grpo", r, scale="none"), compute_grpo_advantages(r, scale="none"))
    assert torch.equal(compute_advantages("rloo", r), compute_rloo_advantages(r))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("vtrace", r)
    with pytest.raises(ValueError, match="compute_gae_advantages"):  # needs values: not from rewards alone
        compute_advantages("gae", r)


# ------------------------------------------------------------------------------------------------
# Device: the hot path never synchronises with the host
# ------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_losses_do_not_sync_on_cuda():
    dev = "cuda"
    logp = torch.randn(8, 32, device=dev, requires_grad=True)
    old, ref, roll = (torch.randn(8, 32, device=dev) for _ in range(3))
    adv, mask = torch.randn(8, device=dev), torch.rand(8, 32, device=dev) > 0.2
    calls = [
        lambda fn=fn, agg=agg: fn(
            logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, rollout_logprobs=roll, tis_cap=2.0, agg=agg
        )
        for _, fn in all_losses()
        for agg in AGG_MODES
    ]

    def micro_batch(cfg):  # the step's normalisers and M2PO mask, then the loss of 4 of the 8 rows
        kw = {"norm_len": 32, "global_norm": global_normalisers(mask)}
        step = step_keep_mask(cfg, logp, old, adv, mask)
        if step is not None:
            kw.update(keep_mask=step[0][:4], kept_norm=step[1])
        return compute_policy_loss(cfg, logp[:4], old[:4], adv[:4], mask[:4], ref[:4], roll[:4], **kw)

    cfgs = [
        AlgorithmConfig(loss=loss, loss_options=options, agg=agg, kl_coef=0.1, rollout_correction={"mode": mode})
        for loss, options in (("ppo", {}), ("m2po", {"masking": "trust_region"}), ("m2po", {"masking": "ratio_sq"}))
        for agg in AGG_MODES
        for mode in ("none", "tis", "mis")
    ]
    calls += [lambda cfg=cfg: micro_batch(cfg) for cfg in cfgs]
    for call in calls:  # warm-up (allocator, kernels)
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            loss, stats = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.device.type == "cuda" for v in stats.values())
