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
from rlhf_core.algorithms.correction import correction_weights
from rlhf_core.config import AlgorithmConfig, ConfigError, validate_config

F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# The oracle: verl's rollout correction, written from verl/trainer/ppo/rollout_corr_helper.py
# (volcengine/verl at 0b4e2a814129c07f016787cbce476132ceb6c5cb): compute_rollout_correction_weights (the IS
# weights, truncated: TIS), compute_rollout_rejection_mask (rollout_rs "token" and "geometric": keep where
# lower <= weight <= upper, lower defaulting to 1 / upper) and compute_rollout_correction_and_rejection_mask
# (IS weights and the rejection mask together: MIS). verl_F.masked_mean divides by mask.sum() + 1e-8.
# --------------------------------------------------------------------------------------------------
SAFETY_BOUND = 20.0


def _verl_masked_mean(values, mask, axis=None):
    s = (values * mask).sum() if axis is None else (values * mask).sum(axis)
    n = mask.sum() if axis is None else mask.sum(axis)
    return s / (n + 1e-8)


def _verl_weights(old_log_prob, rollout_log_prob, response_mask, level):
    """verl's per-token IS weight before truncation: 'token' as in compute_rollout_correction_weights, the
    sequence level as rollout_rs 'geometric' (exp of the masked mean log-ratio, broadcast over the row)."""
    log_ratio = old_log_prob - rollout_log_prob
    if level == "token":
        return torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    log_ratio_mean = _verl_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
    return torch.exp(torch.clamp(log_ratio_mean, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)


def verl_reference(old_log_prob, rollout_log_prob, response_mask, mode, level, lower, upper):
    """What verl's loss multiplies each token by: (IS weights · response_mask).clamp(max=threshold), times the
    rejection mask for MIS / IcePop (IcePop: rollout_rs 'token')."""
    mask = response_mask.to(old_log_prob.dtype)
    weights = _verl_weights(old_log_prob, rollout_log_prob, mask, level) * mask
    truncated = weights.clamp(max=upper)
    if mode == "tis":
        return truncated
    low = 1.0 / upper if lower is None else lower
    rs = _verl_weights(old_log_prob, rollout_log_prob, mask, "token" if mode == "icepop" else level)
    keep = ((rs >= low) & (rs <= upper)).to(mask.dtype)
    return truncated * keep * mask


def _case(seed, n=7, length=9, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(n, length, dtype=F64, generator=g) * 3
    rollout = train + spread * torch.randn(n, length, dtype=F64, generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    adv = torch.randn(n, dtype=F64, generator=g)
    return train, rollout, mask, adv


MODES = [("tis", "token"), ("tis", "sequence"), ("mis", "token"), ("mis", "sequence"), ("icepop", "token")]


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
    # sequence: one weight, exp(mean(0, 1, -1)) = 1, inside the bounds
    w, _ = correction_weights(train, rollout, mask, "mis", "sequence", upper=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64))


def _cfg(loss, mode, level="token", **options):
    return AlgorithmConfig(loss=loss, loss_options=options, rollout_correction={"mode": mode, "level": level})


@pytest.mark.parametrize("mode,level", MODES)
@pytest.mark.parametrize("loss", ["ppo", "grpo", "m2po"])
def test_every_loss_is_corrected_in_the_dispatch(loss, mode, level):
    """The dispatch takes the ratio against the trainer's log-probs and scales each token's term by verl's weight:
    the same as the loss on (logprobs, logprobs.detach(), w·A), gradients included; the KL term is not weighted."""
    train, rollout, mask, adv = _case(3)
    logp = train.clone().requires_grad_()
    ref = train - 0.1
    cfg = _cfg(loss, mode, level)
    cfg.kl_coef = 0.1
    got, stats = compute_policy_loss(cfg, logp, rollout, adv, mask, ref_logprobs=ref)
    w = verl_reference(train, rollout, mask, mode, level, None, 2.0)
    fn = compute_m2po_loss if loss == "m2po" else compute_ppo_loss
    want, _ = fn(logp, logp.detach(), adv[:, None] * w, mask, ref_logprobs=ref, kl_coef=0.1)
    assert torch.allclose(got, want, atol=1e-12)
    (g1,) = torch.autograd.grad(got, logp)
    (g2,) = torch.autograd.grad(fn(logp, logp.detach(), adv[:, None] * w, mask, ref_logprobs=ref, kl_coef=0.1)[0], logp)
    assert torch.allclose(g1, g2, atol=1e-12)
    assert {
        "correction/weight_mean",
        "correction/weight_max",
        "correction/clipped_frac",
        "correction/masked_frac",
    } <= set(stats)


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


@pytest.mark.parametrize("mode,level", MODES)
@pytest.mark.parametrize("loss", ["ppo", "m2po"])
def test_micro_batches_sum_to_the_step_with_a_correction(loss, mode, level):
    train, rollout, mask, adv = _case(11, n=12)
    logp = train.clone().requires_grad_()
    cfg = _cfg(loss, mode, level)
    full, _ = compute_policy_loss(cfg, logp, rollout, adv, mask, norm_len=9)
    kw = {"norm_len": 9, "global_norm": global_normalisers(mask)}
    step = step_keep_mask(cfg, logp, rollout, adv, mask)
    total = 0.0
    for s in range(0, 12, 5):
        rows = slice(s, s + 5)
        if step is not None:
            kw.update(keep_mask=step[0][rows], kept_norm=step[1])
        total = total + compute_policy_loss(cfg, logp[rows], rollout[rows], adv[rows], mask[rows], **kw)[0]
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
    }
    with pytest.raises(ConfigError):
        validate_config({"algorithm": {"rollout_correction": {"mode": "clip"}}})
