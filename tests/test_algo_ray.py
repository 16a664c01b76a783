"""Issue 28's parts on the Ray runtime (a real local Ray instance): PPO with a critic, DAPO's filtering with
exact accounting, overlong shaping, the truncated mask, async/mismatch_kl and the staleness autopilot."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
from tests.ledger_checks import assert_ledger_balances

ray = pytest.importorskip("ray")


from rlhf_core.distributed import run_distributed  # noqa: E402
from tests.test_distributed import tiny_cfg  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray instance

COMMON = [
    "trainer.total_steps=8",
    "trainer.prompts_per_step=4",
    "rollout.prompts_per_batch=4",
    "rollout.samples_per_prompt=4",
    "algorithm.advantage=gae",
    "algorithm.loss=ppo",
    "critic.lr=0.001",
    "algorithm.filter_groups=true",
    "algorithm.mask_truncated=true",
    "reward.overlong={buffer_len: 3, penalty: 0.5}",  # lengths vary: most groups carry a signal
    "eval.every=0",
    "checkpoint.every=0",
]


USER_LOSS = """
import torch
from pydantic import Field

from rlhf_core.algorithms import AlgorithmOptions, register_policy_loss


class UserPGOptions(AlgorithmOptions):
    scale: float = Field(1.0, gt=0)


@register_policy_loss("user_pg_test", options=UserPGOptions)
def user_pg(inputs, options):
    valid = inputs.valid() > 0
    adv = inputs.advantages.reshape(inputs.logprobs.shape[0], -1)
    per_token = torch.where(valid, -options.scale * adv * inputs.logprobs, torch.zeros_like(inputs.logprobs))
    stats = {"user_pg/scale": torch.tensor(options.scale)}
    return inputs.add_kl(inputs.aggregate(per_token), stats), stats
"""


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_critic_filtering_and_autopilot_on_ray(ray_local, tmp_path, mode):
    pilot = [
        "runtime.max_staleness=1",
        "runtime.autopilot.enabled=true",
        "runtime.autopilot.min_staleness=0",
        "runtime.autopilot.max_staleness=3",
        "runtime.autopilot.cooldown_steps=1",
        "runtime.autopilot.target_m2=10.0",  # the mismatch never passes it: the bound can only rise
    ]
    # lockstep trains with a user's loss given as a file path: imported in the trainer actor's process, its options
    # (a class of that file, in the config) shipped by value
    user_loss = tmp_path / "user_loss.py"
    user_loss.write_text(USER_LOSS)
    own = [f"algorithm.loss={user_loss}:user_pg_test", "algorithm.loss_options={scale: 0.5}"]
    cfg = tiny_cfg(tmp_path, *COMMON, *(pilot if mode == "async" else ["runtime.max_staleness=0", *own]))
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["steps"] == 8
    metrics = result["metrics"]
    if mode == "lockstep":  # the user's loss ran in the trainer actor, with the option the config gave it
        assert [m["user_pg/scale"] for m in metrics] == pytest.approx([0.5] * 8), metrics[0]
    for key in (
        "critic/value_loss",
        "critic/vf_clipfrac",
        "critic/explained_variance",
        "critic/values_mean",
        "async/mismatch_kl",
        "reward/overlong",
        "response/truncated_frac",
    ):
        assert any(key in m for m in metrics), key
    assert all(m["async/mismatch_kl"] >= 0 for m in metrics if "async/mismatch_kl" in m)
    rec = result["reconcile"]
    assert_ledger_balances(rec)  # filtered groups are counted: nothing lost, nothing twice
    assert rec["trained"] == 8 * cfg.trainer.prompts_per_step
    assert rec["filtered"] == result["final_poll"]["buffer"]["filtered_groups"]
    hist = result["final_poll"]["trainer"]["staleness_hist"]
    if mode == "async":
        bounds = [m["async/max_staleness"] for m in metrics if "async/max_staleness" in m]
        assert bounds and all(0 <= b <= 3 for b in bounds)
        assert max(hist) <= max(bounds)  # never staler than the bound in force (at most the ceiling)
        raised = [e for e in result["health_events"] if e["kind"].startswith("autopilot_")]
        assert all(e["kind"] == "autopilot_raise" and "waited" in e["detail"] for e in raised)
        assert "buffer/filtered_groups_frac" in metrics[-1]
    else:
        assert max(hist) == 0
