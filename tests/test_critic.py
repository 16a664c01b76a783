"""PPO with a critic (algorithm.advantage 'gae'), DAPO filtering and the truncated mask in the single-process
loop, and async/mismatch_kl: on the tiny policy, through the real entry points."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlhf_core.config import ConfigError
from rlhf_core.loop import build_run, generate_step_batch, restore_run_checkpoint, run_sync, save_run_checkpoint
from rlhf_core.run import build
from rlhf_core.run.checkpoint import CheckpointError, load_checkpoint
from tests.test_loop import small_cfg

GAE = [
    "algorithm.advantage=gae",
    "algorithm.loss=ppo",
    "algorithm.advantage_options.gamma=1.0",
    "algorithm.advantage_options.lam=0.95",
    "critic.lr=0.001",
    "trainer.micro_batch_size=8",
]


def test_gae_run_trains_the_critic_and_resumes_it(tmp_path):
    # overlong shaping makes the rewards (and the returns) non-zero even for the untrained policy
    cfg = small_cfg(tmp_path, *GAE, "critic.warmup_steps=1", "reward.overlong={buffer_len: 4, penalty: 1.0}")
    parts = build_run(cfg)
    policy_before = {k: v.clone() for k, v in parts.model.state_dict().items()}
    critic_before = {k: v.clone() for k, v in parts.trainer.critic.model.state_dict().items()}
    seen = []
    run_sync(cfg, parts=parts, on_step=seen.append)
    for key in ("critic/value_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean"):
        assert key in seen[0] and torch.isfinite(torch.tensor(seen[0][key])), key
    assert seen[0]["critic/values_mean"] == 0.0  # a zero-initialised head: the first values are 0
    assert seen[0]["reward/overlong"] < 0.0 and seen[0]["critic/value_loss"] > 0.0
    assert seen[0]["critic/policy_trains"] == 0.0 and seen[1]["critic/policy_trains"] == 1.0
    assert seen[1]["critic/values_mean"] != 0.0  # the critic trained in step 1 (its warm-up step)
    critic_after = parts.trainer.critic.model.state_dict()
    assert any(not torch.equal(critic_before[k], critic_after[k]) for k in critic_before)
    assert any(not torch.equal(policy_before[k], v) for k, v in parts.model.state_dict().items())
    # the critic is checkpointed with the trainer and resumed with it
    state = load_checkpoint(tmp_path / "checkpoints" / "step_000002", build_run(small_cfg(tmp_path / "x")).model)
    assert (
        set(state.trainer["critic"]) == {"weights", "optimizer", "updates"} and state.trainer["critic"]["updates"] == 2
    )
    resumed = build_run(small_cfg(tmp_path, *GAE, "trainer.total_steps=3"))
    run_sync(resumed.cfg, resume_from=str(tmp_path / "checkpoints" / "step_000002"), parts=resumed)
    assert resumed.trainer.critic.updates == 3
    # a group-advantage checkpoint has no critic to resume
    grpo_dir = tmp_path / "grpo"
    run_sync(small_cfg(grpo_dir, "trainer.total_steps=1"))
    again = build_run(small_cfg(tmp_path / "y", *GAE, "trainer.total_steps=3"))
    with pytest.raises(ValueError, match="holds no critic"):
        run_sync(again.cfg, resume_from=str(grpo_dir / "checkpoints" / "step_000001"), parts=again)


@pytest.fixture(scope="module")
def critic_checkpoints(tmp_path_factory):
    """(run_dir, {name: checkpoint}) of untrained runs sharing run_dir's tiny policy: "gae" (a critic) and
    "grpo" (none), their policy weights moved off the initial ones so that any load into a fresh run shows."""
    root = tmp_path_factory.mktemp("critic_ckpts")
    saved = {}
    for name, overrides in (("gae", GAE), ("grpo", [])):
        parts = build_run(small_cfg(root / "run", *overrides))
        with torch.no_grad():
            for p in parts.model.parameters():
                p.add_(0.5)
        saved[name] = save_run_checkpoint(parts, root / name)
    return root / "run", saved


def _edit_critic(path, edit):
    state = torch.load(path / "state.pt", weights_only=True)
    edit(state["trainer"]["critic"]["weights"])
    torch.save(state, path / "state.pt")


@pytest.mark.parametrize(
    "case, expected",
    [
        ("wider_critic_path", r"body\.embed_tokens\.weight: \[\d+, 32\] vs \[\d+, 64\]"),
        ("reshaped_head", r"value_head\.weight: \[1, 7\] vs \[1, 32\]"),
        ("missing_head_bias", r"missing \['value_head\.bias'\]"),
        ("renamed_head_bias", r"missing \['value_head\.bias'\], unexpected \['value_head\.offset'\]"),
        ("grpo_checkpoint", "holds no critic, but algorithm.advantage is 'gae'"),
    ],
)
def test_a_mismatched_critic_fails_before_any_weight_is_loaded(critic_checkpoints, tmp_path, case, expected):
    """The critic's weights in the trainer state are checked with the policy's, up front: a critic that does not
    fit the configured one fails with CheckpointError naming the checkpoint, the critic and the parameter, and
    neither the live policy nor the live critic has changed."""
    run_dir, saved = critic_checkpoints
    overrides = list(GAE)
    path = saved["grpo" if case == "grpo_checkpoint" else "gae"]
    if case == "wider_critic_path":  # a critic body of another hidden size than the one that was saved
        wide = build.resolve_policy_dir(small_cfg(tmp_path / "wide", "model.preset=word:1x64x2"))
        overrides.append(f"critic.path={wide}")
    elif case != "grpo_checkpoint":
        path = tmp_path / "edited"
        shutil.copytree(saved["gae"], path)
        if case == "reshaped_head":
            _edit_critic(path, lambda w: w.update({"value_head.weight": torch.zeros(1, 7)}))
        elif case == "missing_head_bias":
            _edit_critic(path, lambda w: w.pop("value_head.bias"))
        else:
            _edit_critic(path, lambda w: w.update({"value_head.offset": w.pop("value_head.bias")}))
    parts = build_run(small_cfg(run_dir, *overrides))
    policy = {k: v.clone() for k, v in parts.model.state_dict().items()}
    critic = {k: v.clone() for k, v in parts.trainer.critic.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=expected) as exc:
        restore_run_checkpoint(parts, path)
    assert str(path) in str(exc.value) and "critic" in str(exc.value)
    for k, v in parts.model.state_dict().items():
        assert torch.equal(v, policy[k]), f"policy {k} was loaded before the critic was checked"
    for k, v in parts.trainer.critic.model.state_dict().items():
        assert torch.equal(v, critic[k]), f"critic {k} changed"
    assert parts.trainer.step == 0 and parts.trainer.critic.updates == 0
    # the same checkpoint, unedited, resumes into a run of the critic it was written with
    if case != "grpo_checkpoint":
        fitting = build_run(small_cfg(run_dir, *GAE))
        restore_run_checkpoint(fitting, saved["gae"])
        assert not torch.equal(next(fitting.model.parameters()), next(iter(policy.values())))


def test_a_gae_checkpoint_resumes_a_group_advantage_run_with_a_warning(critic_checkpoints):
    """Switching a run from gae to group advantages keeps the policy and says that the critic is left behind."""
    run_dir, saved = critic_checkpoints
    parts = build_run(small_cfg(run_dir))
    assert parts.trainer.critic is None
    with pytest.warns(UserWarning, match="holds a critic .* the critic is not resumed"):
        restore_run_checkpoint(parts, saved["gae"])
    fresh = build_run(small_cfg(run_dir)).model
    assert not torch.equal(next(parts.model.parameters()), next(fresh.parameters()))  # the policy was loaded


def test_kl_in_reward_penalises_tokens_and_drops_the_kl_loss(tmp_path):
    cfg = small_cfg(tmp_path, *GAE, "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true", "trainer.total_steps=1")
    seen = []
    run_sync(cfg, on_step=seen.append)
    assert "reward/kl_penalty" in seen[0] and seen[0]["reward/kl_penalty"] >= 0.0
    assert "loss/kl" not in seen[0]  # the KL is in the reward, not the loss
    with pytest.raises(ConfigError, match="kl_in_reward needs algorithm.advantage 'gae'"):
        small_cfg(tmp_path, "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true")
    with pytest.raises(ConfigError, match="algorithm.advantage_options.gamma has no effect"):
        small_cfg(tmp_path, "algorithm.advantage_options.gamma=0.9")


def test_mismatch_kl_is_zero_on_policy_and_masked_truncation(tmp_path):
    cfg = small_cfg(tmp_path, "algorithm.mask_truncated=true", "trainer.total_steps=1")
    parts = build_run(cfg)
    batch, _ = generate_step_batch(parts)
    truncated = parts.trainer.truncated_rows(batch)
    # a row is truncated exactly when it is max_new_tokens long without ending in a stop id
    stop = set(parts.trainer.stop_ids.tolist())
    for row in range(len(batch)):
        n = int(batch.response_lengths[row])
        expected = n >= cfg.rollout.max_new_tokens and int(batch.response_ids[row, n - 1]) not in stop
        assert bool(truncated[row]) == expected
    m = parts.trainer.train_step(batch)
    assert m["async/mismatch_kl"] == pytest.approx(0.0, abs=1e-5)  # lockstep: behaviour = current policy
    assert m["async/mismatch_m2"] == pytest.approx(0.0, abs=1e-5)
    assert m["response/truncated_frac"] == pytest.approx(float(truncated.float().mean()))
    # all rows truncated: no loss tokens, so no gradient and a zero policy loss
    batch.response_lengths = torch.full_like(batch.response_lengths, cfg.rollout.max_new_tokens)
    batch.response_ids[:, -1] = 5 if 5 not in stop else 6
    m = parts.trainer.train_step(batch)
    assert m["response/truncated_frac"] == 1.0 and m["loss/policy"] == 0.0 and m["policy/grad_norm"] == 0.0
    # off-policy: the behaviour log-probs of another policy give a positive k3 KL
    batch.behavior_logprobs = batch.behavior_logprobs - 0.5 * batch.response_mask
    parts.trainer.algo.mask_truncated = False
    m = parts.trainer.train_step(batch)
    assert m["async/mismatch_kl"] > 0.05 and m["async/mismatch_m2"] > 0.1


def test_filter_groups_fills_the_step_in_the_single_process_loop(tmp_path):
    # the untrained tiny policy scores all-equal in ~98 % of groups: rounds enough that the step fills whatever
    # the sampler draws (50 were too few once continuous batching drew other samples; the loop stops when full)
    cfg = small_cfg(tmp_path, "algorithm.filter_groups=true", "algorithm.filter_max_rounds=400")
    parts = build_run(cfg)
    batch, stats = generate_step_batch(parts)
    G = cfg.rollout.samples_per_prompt
    rewards = batch.rewards.view(-1, G)
    assert rewards.shape[0] == cfg.trainer.prompts_per_step  # filled to a whole step
    assert not (rewards == rewards[:, :1]).all(dim=1).any()  # no group with all-equal rewards
    assert 0.0 < stats["buffer/filtered_groups_frac"] < 1.0  # the untrained tiny policy mostly scores 0
    # a step that cannot be filled trains on what it kept, or on the last round when nothing passed
    parts.cfg.algorithm.filter_max_rounds = 1
    batch, stats = generate_step_batch(parts)
    assert len(batch) % G == 0 and len(batch) > 0


def test_the_critic_runs_without_dropout_as_the_policy_does(tiny_policy_dir):
    """A critic built from a model with dropout (HF configs default attention_dropout and dropout modules > 0 in
    some architectures): its values in train mode (the update) equal those in eval mode (GAE)."""
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.trainer.critic import Critic, load_value_model

    body_model = load_value_model(tiny_policy_dir, torch.float32, "cpu", False)
    for module in body_model.modules():  # dropout everywhere, as a model card might ship it
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    body_model.body.add_module("extra_dropout", torch.nn.Dropout(0.5))
    critic = Critic(body_model, load_config(None, ["algorithm.advantage=gae"]))
    assert all(m.p == 0 for m in critic.model.modules() if isinstance(m, torch.nn.Dropout))
    ids = torch.randint(3, 10, (2, 6))
    mask = torch.ones_like(ids)
    positions = torch.arange(6).expand(2, 6)
    critic.model.train()
    train_values = critic.model(input_ids=ids, attention_mask=mask, position_ids=positions)
    critic.model.eval()
    torch.testing.assert_close(train_values, critic.model(input_ids=ids, attention_mask=mask, position_ids=positions))
