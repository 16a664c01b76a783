"""DAPO: dynamic sampling (algorithm.filter_groups) with exact admission accounting, the overlong shaping at its
edges, and the truncated-sample mask. The buffer tests use the plain-Python control objects (no Ray)."""

from __future__ import annotations

import threading

import pytest
import torch

from rlhf_core.config import ConfigError, load_config
from rlhf_core.distributed.transport import pack_groups, unpack_groups
from rlhf_core.run.control import ExperienceBuffer
from tests.ledger_checks import assert_ledger_balances
from tests.test_buffer import make_experience


def _groups(rewards_per_group, version=0, start=0):
    return pack_groups([make_experience(start + i, version, r) for i, r in enumerate(rewards_per_group)])


def test_filtered_groups_count_as_consumed_for_admission():
    buf = ExperienceBuffer(max_size=64, max_staleness=0, prompts_per_step=2, filter_groups=True)
    assert buf.try_admit(2) and not buf.try_admit(1)  # capacity (0 + 0 + 1) x 2
    # both admitted groups come back constant: not stored, and their capacity is re-admitted
    assert buf.push(_groups([[1.0, 1.0], [0.0, 0.0]])) == 0
    s = buf.stats()
    assert (s["size"], s["filtered_groups"], s["filtered_groups_frac"]) == (0, 2, 1.0)
    assert s["capacity"] == 4 and buf.try_admit(2)  # the step is filled from further groups: no deadlock
    assert buf.push(_groups([[1.0, 0.0], [0.0, 0.0]], start=2)) == 1
    # capacity 5 = 2 + 3 filtered: exactly one more group, granted as a batch of one (a worker that waited for a
    # whole batch's room deadlocked a lockstep run whose step lacked one group)
    assert buf.try_admit(2) == 1 and buf.try_admit(1) == 0
    assert buf.push(_groups([[0.5, 0.0]], start=4)) == 1
    got = unpack_groups(buf.take(2, timeout_s=0.1)[0])
    assert [g.prompt_id for g in got] == [2, 4]
    s = buf.stats()
    # conservation: every pushed group is trained (sampled), filtered, evicted, dropped or buffered
    assert s["sampled"] + s["filtered_groups"] + s["evicted_stale"] + s["dropped_overflow"] + s["size"] == 5
    assert s["filtered_groups_frac"] == pytest.approx(3 / 5)
    # no capacity leaks: after the step (version 1, weights 1) the window is exactly one more step's worth
    buf.advance(1, 1)
    assert buf.capacity() - buf.stats()["admitted"] == 2


def test_without_filtering_constant_groups_are_kept():
    buf = ExperienceBuffer(max_size=8, max_staleness=0, prompts_per_step=2)
    assert buf.push(_groups([[1.0, 1.0]])) == 1 and buf.stats()["filtered_groups"] == 0


def test_a_waiting_trainer_is_filled_by_later_groups():
    """The trainer waits on a take while filtered groups arrive: it returns as soon as enough pass."""
    buf = ExperienceBuffer(max_size=64, max_staleness=2, prompts_per_step=2, filter_groups=True)
    out = {}
    taker = threading.Thread(target=lambda: out.setdefault("got", buf.take(2, timeout_s=30)[0]))
    taker.start()
    buf.push(_groups([[1.0, 1.0]] * 3))  # filtered
    buf.push(_groups([[1.0, 0.0]], start=3))
    buf.push(_groups([[0.0, 0.0], [0.0, 1.0]], start=4))
    taker.join(30)
    assert [g.prompt_id for g in unpack_groups(out["got"])] == [3, 5]
    assert buf.stats()["filtered_groups"] == 4


def test_set_max_staleness_moves_the_bound_and_admission():
    buf = ExperienceBuffer(max_size=64, max_staleness=1, prompts_per_step=2, ceiling=4)
    buf.set_version(4)
    buf.push(_groups([[1.0, 0.0]] * 2, version=3))
    assert buf.set_max_staleness(9) == 4  # clamped to the ceiling
    assert buf.stats()["max_staleness"] == 4
    assert buf.capacity() == (4 + 0 + 1) * 2
    assert buf.set_max_staleness(0) == 0  # lowering evicts what the new bound makes stale, at once
    s = buf.stats()
    assert (s["size"], s["evicted_stale"], s["max_staleness"]) == (0, 2, 0)
    assert buf.capacity() == (0 + 0 + 1) * 2 + 2  # admission counts with the bound (2 evicted: re-admitted)


def test_spent_filter_rounds_train_on_the_groups_there_are():
    """A saturated task under filter_groups: once filter_max_rounds x prompts_per_step groups arrived since the
    last take, a step trains on the groups that passed, or on the newest filtered ones when none did (as the
    config says, on every host), instead of waiting forever; the accounting still adds up."""
    buf = ExperienceBuffer(max_size=64, max_staleness=0, prompts_per_step=2, filter_groups=True, filter_max_rounds=2)
    buf.push(_groups([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))  # 3 of the 4 groups the rounds allow: wait
    assert buf.take(2, timeout_s=0.2) == ([], 0)
    buf.push(_groups([[1.0, 1.0]], start=3))  # the rounds are spent with one group passed
    got, bound = buf.take(2, timeout_s=0.5)
    assert [g.prompt_id for g in unpack_groups(got)] == [2] and bound == 0
    buf.push(_groups([[1.0, 1.0]] * 4, start=4))  # none passes: the newest filtered ones are trained
    got, _ = buf.take(2, timeout_s=0.5)
    assert [g.prompt_id for g in unpack_groups(got)] == [6, 7]
    s = buf.stats()
    assert s["short_takes"] == 2 and s["filtered_groups"] == 3 + 2  # 2 of the 7 filtered were trained after all
    assert s["sampled"] + s["filtered_groups"] + s["evicted_stale"] + s["dropped_overflow"] + s["size"] == 8


def test_filter_and_overlong_config():
    cfg = load_config(None, ["algorithm.filter_groups=true", "reward.overlong={buffer_len: 2, penalty: 0.5}"])
    assert cfg.algorithm.filter_groups and cfg.reward.overlong.buffer_len == 2
    assert cfg.reward.column_names()[-1] == "overlong"
    with pytest.raises(ConfigError, match="buffer_len"):
        load_config(None, ["reward.overlong={buffer_len: 9}", "rollout.max_new_tokens=4"])


def test_overlong_penalty_edges():
    from rlhf_core.reward.overlong import overlong_penalty

    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10])
    # max_new_tokens 10, buffer 4: none up to 6, then linear to -penalty at 10
    out = overlong_penalty(lengths, max_new_tokens=10, buffer_len=4, penalty=2.0)
    assert out.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5, -1.0, -1.5, -2.0])
    # buffer_len = max_new_tokens: the penalty starts at 0 tokens
    assert overlong_penalty(torch.tensor([0, 2, 4]), 4, 4, 1.0).tolist() == pytest.approx([0.0, -0.5, -1.0])
    # never below -penalty (a longer length cannot happen, but the shape is bounded)
    assert overlong_penalty(torch.tensor([12]), 10, 4, 2.0).tolist() == [-2.0]


def test_an_unscored_group_is_not_filtered():
    g = make_experience(0, 0, [1.0, 1.0])
    g.batch.rewards = None
    buf = ExperienceBuffer(max_size=8, max_staleness=0, prompts_per_step=1, filter_groups=True)
    assert buf.push(pack_groups([g])) == 1 and buf.stats()["filtered_groups"] == 0


SATURATED = [
    "reward.components={exact_match: 0.0}",  # every reward 0: every group has equal rewards
    "algorithm.filter_groups=true",
    "algorithm.filter_max_rounds=2",
    "runtime.max_staleness=0",
    "trainer.total_steps=4",
    "trainer.prompts_per_step=4",
    "rollout.prompts_per_batch=4",
    "rollout.samples_per_prompt=4",
    "eval.every=0",
    "checkpoint.every=0",
    "data.eval_size=8",
]


@pytest.mark.slow
def test_a_saturated_task_trains_on_what_it_has_on_both_hosts(ray_local, tmp_path):
    """filter_groups on a task where every group is filtered: after filter_max_rounds steps' worth of groups each
    step trains on the newest filtered ones, in lockstep, on the in-process host and on Ray alike (a Ray lockstep
    run failed with RunFailed where the config and the in-process loop trained on what they had)."""
    from rlhf_core.distributed import run_distributed
    from rlhf_core.loop import build_run, run_sync

    local_cfg = load_config("configs/tiny.yaml", [f"run.output_dir={tmp_path / 'local'}", *SATURATED])
    parts = build_run(local_cfg)
    assert run_sync(local_cfg, parts=parts)["steps"] == 4
    # every step a short take; half the groups generated were left out (the other half trained on after all)
    assert parts.buffer.stats()["short_takes"] == 4 and parts.history[-1]["buffer/filtered_groups_frac"] == 0.5

    ray_cfg = load_config(
        "configs/tiny.yaml",
        [f"run.output_dir={tmp_path / 'ray'}", "cluster.num_cpus=2", "runtime.wait_timeout_s=60", *SATURATED],
    )
    result = run_distributed(ray_cfg, poll_interval_s=0.2)
    assert result["steps"] == 4
    assert result["final_poll"]["buffer"]["short_takes"] >= 4
    assert_ledger_balances(result["reconcile"])
