"""Rollout correction (algorithm.rollout_correction): oracle tests against verl's formulas, the one place it
enters every loss (the dispatch), micro-batch exactness, and the config (tis_cap migrates)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.algorithms import (
    compute_m2po_loss,
    compute_policy_loss,
    compute_ppo_loss,
    global_normalisers,
    step_keep_mask,
)
from rlhf_core.algorithms.correction import correction_keep, correction_weights
from rlhf_core.algorithms.options import M2POOptions
from rlhf_core.algorithms.policy_loss import m2po_keep_mask
from rlhf_core.config import AlgorithmConfig, ConfigError, validate_config

F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# The oracle: verl's rollout correction, written from verl/trainer/ppo/rollout_corr_helper.py
# (volcengine/verl at 0b4e2a814129c07f016787cbce476132ceb6c5cb; read again in the fork zpqiu/verl at
# 2a36450b7e77a30bc8492c727ce94caa3704b1df): compute_rollout_correction_weights (the IS weights, rollout_is
# "token" or "sequence" = the product of the token ratios, exp of the masked sum; truncated: TIS),
# compute_rollout_rejection_mask (rollout_rs "token", "sequence" (product) or "geometric" (exp of the masked
# mean): keep where lower <= weight <= upper, lower defaulting to 1 / upper; the rejected tokens leave the
# response mask) and compute_rollout_correction_and_rejection_mask (IS weights and the rejection mask together:
# MIS). verl_F.masked_mean divides by mask.sum() + 1e-8. verl has no geometric IS weight: ours (level geometric
# under tis) is the rejection level's weight, truncated.
# --------------------------------------------------------------------------------------------------
SAFETY_BOUND = 20.0


def _verl_masked_mean(values, mask, axis=None):
    s = (values * mask).sum() if axis is None else (values * mask).sum(axis)
    n = mask.sum() if axis is None else mask.sum(axis)
    return s / (n + 1e-8)


def _verl_weights(old_log_prob, rollout_log_prob, response_mask, level):
    """verl's per-token weight before truncation at a level: 'token', 'sequence' (exp of the masked sum of the
    log-ratios: the product), 'geometric' (exp of their masked mean), broadcast over the row."""
    log_ratio = old_log_prob - rollout_log_prob
    if level == "token":
        return torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    if level == "sequence":
        agg = (log_ratio * response_mask).sum(-1).unsqueeze(-1)
    else:
        agg = _verl_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
    return torch.exp(torch.clamp(agg, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)


def verl_rejection_mask(old_log_prob, rollout_log_prob, response_mask, level, lower, upper):
    """compute_rollout_rejection_mask's modified_response_mask: the response mask without the rejected."""
    mask = response_mask.to(old_log_prob.dtype)
    low = 1.0 / upper if lower is None else lower
    rs = _verl_weights(old_log_prob, rollout_log_prob, mask, level)
    return mask * ((rs >= low) & (rs <= upper)).to(mask.dtype)


def verl_reference(old_log_prob, rollout_log_prob, response_mask, mode, level, lower, upper):
    """What verl's loss multiplies each token by: (IS weights · response_mask).clamp(max=threshold), times the
    rejection mask for MIS / IcePop (IcePop: rollout_rs 'token')."""
    mask = response_mask.to(old_log_prob.dtype)
    weights = _verl_weights(old_log_prob, rollout_log_prob, mask, level) * mask
    truncated = weights.clamp(max=upper)
    if mode == "tis":
        return truncated
    rs_level = "token" if mode == "icepop" else level
    keep = verl_rejection_mask(old_log_prob, rollout_log_prob, mask, rs_level, lower, upper)
    return truncated * keep


def _case(seed, n=7, length=9, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(n, length, dtype=F64, generator=g) * 3
    rollout = train + spread * torch.randn(n, length, dtype=F64, generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    adv = torch.randn(n, dtype=F64, generator=g)
    return train, rollout, mask, adv


MODES = [
    ("tis", "token"),
    ("tis", "sequence"),
    ("tis", "geometric"),
    ("mis", "token"),
    ("mis", "sequence"),
    ("mis", "geometric"),
    ("icepop", "token"),
]


@pytest.mark.parametrize("mode,level", MODES)
@pytest.mark.parametrize("bounds", [(None, 2.0), (0.5, 1.5), (0.8, 5.0)])
def test_weights_match_verl_on_random_cases(mode, level, bounds):
    lower, upper = bounds
    for seed in range(20):
        train, rollout, mask, _ = _case(seed, spread=0.2 + 0.1 * (seed % 8))
        got, stats = correction_weights(train, rollout, mask, mode, level, lower, upper)
        want = verl_reference(train, rollout, mask, mode, level, lower, upper)
        assert torch.allclose(got, want, atol=1e-9, rtol=1e-7), (seed, (got - want).abs().max())
        valid = mask.to(F64)
        assert math.isclose(
            float(stats["correction/weight_mean"]), float((want * valid).sum() / valid.sum()), rel_tol=1e-7
        )
        assert math.isclose(float(stats["correction/weight_max"]), float(want.max()), rel_tol=1e-7)


def test_stats_on_a_hand_made_case():
    # ratios e^0, e^1, e^-1, e^2 (token level, upper 2, lower 1/2)
    train = torch.tensor([[0.0, 1.0, -1.0, 2.0]], dtype=F64)
    rollout = torch.zeros_like(train)
    mask = torch.tensor([[True, True, True, False]])
    w, s = correction_weights(train, rollout, mask, "tis", "token", upper=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, math.exp(-1), 0.0]], dtype=F64))
    assert math.isclose(float(s["correction/clipped_frac"]), 1 / 3) and float(s["correction/masked_frac"]) == 0
    assert math.isclose(float(s["correction/weight_max"]), 2.0)
    w, s = correction_weights(train, rollout, mask, "mis", "token", upper=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=F64))  # e and 1/e outside [1/2, 2]
    assert math.isclose(float(s["correction/masked_frac"]), 2 / 3) and float(s["correction/clipped_frac"]) == 0
    # sequence: one weight, the product e^0 · e^1 · e^-1 = 1, inside the bounds; so is the geometric mean
    for level in ("sequence", "geometric"):
        w, _ = correction_weights(train, rollout, mask, "mis", level, upper=2.0)
        assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64))
    # where they differ: ratios e^0.5, e^0.5 -> product e (masked: above 2), geometric mean e^0.5 (kept)
    half = torch.tensor([[0.5, 0.5]], dtype=F64)
    w, s = correction_weights(half, torch.zeros_like(half), None, "mis", "sequence", upper=2.0)
    assert torch.equal(w, torch.zeros_like(half)) and float(s["correction/masked_frac"]) == 1.0
    w, _ = correction_weights(half, torch.zeros_like(half), None, "tis", "sequence", upper=5.0)
    assert torch.allclose(w, torch.full_like(half, math.e))
    w, _ = correction_weights(half, torch.zeros_like(half), None, "mis", "geometric", upper=2.0)
    assert torch.allclose(w, torch.full_like(half, math.exp(0.5)))


def _cfg(loss, mode, level="token", **options):
    return AlgorithmConfig(loss=loss, loss_options=options, rollout_correction={"mode": mode, "level": level})


@pytest.mark.parametrize("mode,level", MODES)
@pytest.mark.parametrize("loss", ["ppo", "grpo", "m2po"])
def test_every_loss_is_corrected_in_the_dispatch(loss, mode, level):
    """The dispatch takes the ratio against the trainer's log-probs and scales each token's term by verl's weight:
    the same as the loss on (logprobs, logprobs.detach(), w·A), gradients included; the KL term is not weighted.
    M2PO keeps its mask on the behaviour ratio (the uncorrected loss's mask)."""
    train, rollout, mask, adv = _case(3)
    logp = train.clone().requires_grad_()
    ref = train - 0.1
    cfg = _cfg(loss, mode, level)
    cfg.kl_coef = 0.1
    got, stats = compute_policy_loss(cfg, logp, rollout, adv, mask, ref_logprobs=ref)
    w = verl_reference(train, rollout, mask, mode, level, None, 2.0)
    fn = compute_m2po_loss if loss == "m2po" else compute_ppo_loss
    kw = {"ref_logprobs": ref, "kl_coef": 0.1}
    if loss == "m2po":
        keep = m2po_keep_mask(logp, rollout, adv, mask, M2POOptions().m2_threshold)
        kw.update(keep_mask=keep, kept_norm=global_normalisers(keep & mask))
    want, _ = fn(logp, logp.detach(), adv[:, None] * w, mask, **kw)
    assert torch.allclose(got, want, atol=1e-12)
    (g1,) = torch.autograd.grad(got, logp)
    (g2,) = torch.autograd.grad(fn(logp, logp.detach(), adv[:, None] * w, mask, **kw)[0], logp)
    assert torch.allclose(g1, g2, atol=1e-12)
    assert {
        "correction/weight_mean",
        "correction/weight_max",
        "correction/clipped_frac",
        "correction/masked_frac",
    } <= set(stats)


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_m2po_with_a_correction_still_masks_on_the_behaviour_ratio_and_is_not_ppo(mode):
    """With a correction the loss's ratio is against the trainer's log-probs (1 at the step): M2PO's second-moment
    mask, taken there, would mask nothing and M2PO would be PPO. It masks on the behaviour ratio instead: on a
    batch drifted past its threshold it masks tokens, and its loss differs from PPO's with the same correction."""
    train, rollout, mask, adv = _case(7, spread=1.5)
    keep = m2po_keep_mask(train, rollout, adv, mask, M2POOptions().m2_threshold)
    assert not bool(keep[mask].all())  # the behaviour ratio has drifted: M2PO masks some tokens
    m2po, stats = compute_policy_loss(_cfg("m2po", mode), train.clone().requires_grad_(), rollout, adv, mask)
    ppo, _ = compute_policy_loss(_cfg("ppo", mode), train.clone().requires_grad_(), rollout, adv, mask)
    assert not torch.allclose(m2po, ppo)
    assert float(stats["m2po/masked_frac"]) > 0, stats


def test_dropped_rejections_leave_the_denominators_as_verl_rejection_sampling_does():
    """mis with rejected 'drop': the loss equals the loss on verl's modified response mask (the rejected tokens
    out of every denominator), while 'zero' keeps them in with a term of 0; both agree on which tokens are out."""
    train, rollout, mask, adv = _case(9, spread=0.8)
    logp = train.clone().requires_grad_()
    for level, upper in (("token", 2.0), ("sequence", 4.0), ("geometric", 1.15)):
        kept = verl_rejection_mask(train, rollout, mask, level, None, upper).bool()
        assert 0 < int(kept.sum()) < int(mask.sum()), level  # the case rejects some tokens, not all
        w = verl_reference(train, rollout, mask, "mis", level, None, upper)
        for agg in ("token-mean", "seq-mean-token-mean"):
            correction = {"mode": "mis", "level": level, "upper": upper, "rejected": "drop"}
            cfg = AlgorithmConfig(loss="ppo", agg=agg, rollout_correction=correction)
            got, _ = compute_policy_loss(cfg, logp, rollout, adv, mask)
            want, _ = compute_ppo_loss(logp, logp.detach(), adv[:, None] * w, kept, agg=agg)
            assert torch.allclose(got, want, atol=1e-12), (level, agg)
            cfg.rollout_correction.rejected = "zero"
            zero, _ = compute_policy_loss(cfg, logp, rollout, adv, mask)
            assert torch.allclose(zero, compute_ppo_loss(logp, logp.detach(), adv[:, None] * w, mask, agg=agg)[0])
            assert not torch.allclose(zero, got)
    with pytest.raises(ConfigError, match="rejected 'drop'"):
        validate_config({"algorithm": {"rollout_correction": {"mode": "tis", "rejected": "drop"}}})


def test_token_advantages_of_a_critic_are_corrected_per_token():
    train, rollout, mask, _ = _case(5)
    adv = torch.randn(train.shape, dtype=F64)
    logp = train.clone().requires_grad_()
    got, _ = compute_policy_loss(_cfg("ppo", "tis"), logp, rollout, adv, mask)
    w = verl_reference(train, rollout, mask, "tis", "token", None, 2.0)
    assert torch.allclose(got, compute_ppo_loss(logp, logp.detach(), adv * w, mask)[0], atol=1e-12)


def test_none_changes_nothing():
    train, rollout, mask, adv = _case(4)
    got, stats = compute_policy_loss(_cfg("ppo", "none"), train, rollout, adv, mask)
    assert torch.equal(got, compute_ppo_loss(train, rollout, adv, mask)[0])
    assert not any(k.startswith("correction/") for k in stats)


@pytest.mark.parametrize(
    "mode,level,rejected", [(m, lv, r) for m, lv in MODES for r in ("zero", "drop") if m != "tis" or r == "zero"]
)
@pytest.mark.parametrize("loss", ["ppo", "m2po"])
def test_micro_batches_sum_to_the_step_with_a_correction(loss, mode, level, rejected):
    """Micro-batches add up to the step's loss; with rejected 'drop' the step's mask (hence its normalisers) is
    the one without the rejected tokens (`correction_keep`, what the trainer does before its micro-batches)."""
    train, rollout, mask, adv = _case(11, n=12)
    logp = train.clone().requires_grad_()
    cfg = _cfg(loss, mode, level)
    cfg.rollout_correction.rejected = rejected
    full, _ = compute_policy_loss(cfg, logp, rollout, adv, mask, norm_len=9)
    step_mask = correction_keep(cfg.rollout_correction, train, rollout, mask)
    if rejected == "drop" and mode == "mis" and level == "token":
        assert int(step_mask.sum()) < int(mask.sum())  # some are dropped here
    kw = {"norm_len": 9, "global_norm": global_normalisers(step_mask)}
    step = step_keep_mask(cfg, logp, rollout, adv, step_mask)
    total = 0.0
    for s in range(0, 12, 5):
        rows = slice(s, s + 5)
        if step is not None:
            kw.update(keep_mask=step[0][rows], kept_norm=step[1])
        total = total + compute_policy_loss(cfg, logp[rows], rollout[rows], adv[rows], step_mask[rows], **kw)[0]
    assert torch.allclose(total, full, atol=1e-12)


def test_config():
    assert AlgorithmConfig().rollout_correction.mode == "none"
    with pytest.raises(ValueError, match="icepop"):
        AlgorithmConfig(rollout_correction={"mode": "icepop", "level": "sequence"})
    with pytest.raises(ValueError, match="below upper"):
        AlgorithmConfig(rollout_correction={"mode": "mis", "lower": 3.0, "upper": 2.0})
    # the old tis_cap loads as the equivalent correction, with a note
    cfg = validate_config({"algorithm": {"tis_cap": 3.0}})
    assert cfg.algorithm.rollout_correction.model_dump() == {
        "mode": "tis",
        "level": "token",
        "lower": None,
        "upper": 3.0,
        "rejected": "zero",
    }
    with pytest.raises(ConfigError):
        validate_config({"algorithm": {"rollout_correction": {"mode": "clip"}}})
