"""GAE (compute_gae_advantages) against a hand-computed case and a plain-Python reference; the value loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.algorithms import compute_gae_advantages, explained_variance, masked_whiten, value_loss


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain Python, one row at a time: only the valid tokens, in order; the value after the last is 0."""
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        valid = [t for t, m in enumerate(m_row) if m]
        adv_row, ret_row = [0.0] * len(m_row), [0.0] * len(m_row)
        running, next_value = 0.0, 0.0
        for t in reversed(valid):
            delta = r_row[t] + gamma * next_value - v_row[t]
            running = delta + gamma * lam * running
            next_value = v_row[t]
            adv_row[t], ret_row[t] = running, running + v_row[t]
        advantages.append(adv_row)
        returns.append(ret_row)
    return advantages, returns


def test_gae_hand_computed():
    # one row, 3 valid tokens then padding; the reward 1 sits on the last response token
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.25, 0.5, 9.0]])  # the padding's value must not matter
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = compute_gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    # t=2: delta = 1 + 0 - 0.5 = 0.5;             A2 = 0.5
    # t=1: delta = 0 + 0.5*0.5 - 0.25 = 0;        A1 = 0 + 0.25*0.5 = 0.125
    # t=0: delta = 0 + 0.5*0.25 - 0.5 = -0.375;   A0 = -0.375 + 0.25*0.125 = -0.34375
    assert adv.tolist() == [[-0.34375, 0.125, 0.5, 0.0]]
    assert ret.tolist() == [[0.15625, 0.375, 1.0, 0.0]]
    # gamma = lam = 1: every advantage is the return-to-go minus the value
    adv, ret = compute_gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    assert adv.tolist() == [[0.5, 0.75, 0.5, 0.0]] and ret.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_gae_masked_gap_is_skipped():
    # a masked position inside the response passes the next valid token's value and advantage through
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 7.0, 0.4]])
    gap = compute_gae_advantages(rewards, values, torch.tensor([[1, 0, 1]]), 0.9, 0.8, whiten=False)
    packed = compute_gae_advantages(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.4]]), torch.ones(1, 2), 0.9, 0.8, whiten=False
    )
    assert torch.allclose(gap[0][:, [0, 2]], packed[0]) and gap[0][0, 1] == 0
    assert torch.allclose(gap[1][:, [0, 2]], packed[1]) and gap[1][0, 1] == 0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    t=st.integers(1, 7),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_gae_matches_plain_python_reference(n, t, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(n, t, generator=g, dtype=torch.float64)
    values = torch.randn(n, t, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) < 0.7
    adv, ret = compute_gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    assert torch.allclose(adv.double(), torch.tensor(ref_adv, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(ret.double(), torch.tensor(ref_ret, dtype=torch.float64), atol=1e-4)
    # whitening: over the valid tokens only, mean 0 and (unbiased) variance 1; masked positions stay 0
    white, ret_w = compute_gae_advantages(rewards, values, mask, gamma, lam, whiten=True)
    assert torch.equal(ret_w, ret)
    valid = [a for row, m_row in zip(ref_adv, mask.tolist()) for a, m in zip(row, m_row) if m]
    assert (white[~mask] == 0).all()
    if len(valid) >= 2:
        mean = sum(valid) / len(valid)
        var = sum((a - mean) ** 2 for a in valid) / (len(valid) - 1)
        expected = [(a - mean) / math.sqrt(var + 1e-8) for a in valid]
        assert torch.allclose(white[mask].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-3)


def test_gae_shape_errors():
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        compute_gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


def test_masked_whiten_ignores_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = masked_whiten(x, torch.tensor([[1, 1, 0]]))
    assert out[0, 2] == 0 and torch.allclose(out[0, :2], torch.tensor([-1.0, 1.0]) / math.sqrt(2.0), atol=1e-5)


def test_value_loss_hand_values_and_clip():
    returns = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    values = torch.tensor([[0.8, 0.1]], requires_grad=True)
    mask = torch.ones(1, 2)
    # unclipped: ½ mean((0.8-1)², (0.1)²) = ½ (0.04 + 0.01) / 2 = 0.0125
    loss, frac = value_loss(values, old, returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.0125) and frac.item() == 0
    # clip 0.5: token 0's value clipped to 0.5 -> (0.5-1)² = 0.25 > 0.04 -> max is 0.25; token 1 unclipped
    loss, frac = value_loss(values, old, returns, mask, clip=0.5)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.01) / 2) and frac.item() == pytest.approx(0.5)
    loss.backward()
    assert values.grad[0, 0] == 0  # the clipped term carries no gradient to values beyond the clip
    # micro-batches with the whole step's token count add up to the whole step
    total = mask.sum()
    a, _ = value_loss(values[:, :1], old[:, :1], returns[:, :1], mask[:, :1], 0.5, total_tokens=total)
    b, _ = value_loss(values[:, 1:], old[:, 1:], returns[:, 1:], mask[:, 1:], 0.5, total_tokens=total)
    assert (a + b).item() == pytest.approx(loss.item())


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0)
    assert explained_variance(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)).item() == 0.0
