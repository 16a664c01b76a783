"""data.sampler 'prioritized': prompts drawn by how far from solved they last were, observed from the rollout's
pushed groups, checkpointed with the run and resumed exactly in lockstep."""

from __future__ import annotations

import collections

import pytest
import torch

from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.prompts import PrioritizedSource, Prompt, PromptSource, prompt_source
from rlhf_core.data.queue import PromptQueue
from rlhf_core.loop import build_run, run_sync
from tests.test_checkpoint import small_cfg as checkpoint_cfg


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=100 + i, prompt_ids=[1, 4 + i % 10], answers=[[4 + i % 10]]) for i in range(n)]


def _uids(prompts) -> list[int]:
    return [p.uid for p in prompts]


def test_solved_prompts_come_back_floor_times_as_often_as_unsolved_ones():
    prompts = _prompts(10)
    src = PrioritizedSource(prompts, seed=3, floor=0.1)
    solved, unsolved = _uids(prompts[:5]), _uids(prompts[5:])
    src.observe({**{u: 1.0 for u in solved}, **{u: 0.0 for u in unsolved}})
    counts = collections.Counter(_uids(p for _ in range(4000) for p in src.next(1)))
    ratio = sum(counts[u] for u in solved) / sum(counts[u] for u in unsolved)
    assert 0.08 < ratio < 0.12  # floor 0.1: one solved draw for ten unsolved ones
    assert src.solved_frac() == 0.5 and src.epoch == 400

    # partly solved: weight 1 - success; not yet observed counts as unsolved
    src = PrioritizedSource(prompts[:3], seed=1, floor=0.1)
    src.observe({100: 0.75})  # weight 0.25 against 1 for 101 and 102
    counts = collections.Counter(_uids(p for _ in range(4000) for p in src.next(1)))
    assert 0.2 < counts[100] / counts[101] < 0.3 and 0.9 < counts[101] / counts[102] < 1.1


def test_a_draw_is_distinct_seeded_and_resumes_from_its_state():
    prompts = _prompts(7)
    ref = PrioritizedSource(prompts, seed=5)
    first = _uids(ref.next(7))
    assert sorted(first) == _uids(prompts)  # distinct within a draw
    big = ref.next(16)  # more than the dataset: dataset-sized chunks, each distinct
    assert len(big) == 16 and len(set(_uids(big[:7]))) == 7
    ref.observe({100: 1.0, 101: 0.5, 999: 0.0})  # a uid of another dataset is ignored
    state = ref.state_dict()
    expected = [_uids(ref.next(3)) for _ in range(5)]

    resumed = PrioritizedSource(prompts, seed=0)  # the state's seed wins
    resumed.load_state_dict(state)
    assert [_uids(resumed.next(3)) for _ in range(5)] == expected
    assert state["success"] == {"100": 1.0, "101": 0.5} and state["sampler"] == "prioritized"
    assert _uids(PrioritizedSource(prompts, seed=5).next(7)) == first
    assert _uids(PrioritizedSource(prompts, seed=6).next(7)) != first
    with pytest.raises(ValueError, match="7 prompts.*has 8"):
        PrioritizedSource(_prompts(8)).load_state_dict(state)


def test_rewards_outside_zero_one_are_clamped_with_a_warning_and_bad_settings_are_refused(caplog):
    src = PrioritizedSource(_prompts(3), floor=0.2)
    with caplog.at_level("WARNING"):
        src.observe({100: 3.0, 101: -2.0})
    assert src.success == {100: 1.0, 101: 0.0} and src.clamped == 2
    assert caplog.text.count("success rate in [0, 1], but prompt 100's group had 3: clamped") == 1  # once
    assert list(src._weights) == [0.2, 1.0, 1.0]
    with pytest.raises(ValueError, match="priority_floor"):
        PrioritizedSource(_prompts(3), floor=0.0)
    with pytest.raises(ValueError, match="data.sampler='lifo'"):
        prompt_source(_prompts(3), sampler="lifo")
    assert isinstance(prompt_source(_prompts(3)), PromptSource)
    with pytest.raises(ConfigError, match="data.sampler"):
        load_config(None, ["data.sampler=greedy"])
    with pytest.raises(ConfigError, match="data.priority_floor"):
        load_config(None, ["data.priority_floor=0"])


def test_the_queue_passes_observations_on_and_a_changed_sampler_starts_afresh(caplog):
    q = PromptQueue(_prompts(6), seed=2, sampler="prioritized", floor=0.5)
    served = q.get(4)
    q.observe({p.uid: 1.0 for p in served})
    assert q.stats()["solved_frac"] == pytest.approx(4 / 6)
    state = {**q.state_dict(), "trained": {p.uid: 1 for p in served}}
    again = PromptQueue(_prompts(6), seed=2, sampler="prioritized", floor=0.5)
    assert again.load_state_dict(state) == state["trained"]
    assert again.source.success == q.source.success and _uids(again.get(3)) == _uids(q.get(3))

    epochs = PromptQueue(_prompts(6), seed=2)  # data.sampler changed to 'epochs' on resume
    with caplog.at_level("WARNING"):
        assert epochs.load_state_dict(state) == state["trained"]
    assert "data.sampler=prioritized, this run's by epochs" in caplog.text
    assert _uids(epochs.get(6)) == _uids(PromptSource(_prompts(6), seed=2).next(6))
    assert "solved_frac" not in epochs.stats()


def small_cfg(output_dir, *overrides):
    """test_checkpoint's 4-step micro run, checkpointing at step 2, drawing prompts prioritized."""
    return checkpoint_cfg(output_dir, "data.sampler=prioritized", "data.priority_floor=0.05", *overrides)


def test_a_lockstep_run_draws_by_the_rewards_it_saw_and_resumes_exactly(tmp_path):
    cfg = small_cfg(tmp_path)
    parts = build_run(cfg)
    # half the prompts marked solved before the start (the micro policy solves hardly any in 4 steps): the draws
    # lean on the table, which the checkpoint must carry for the resumed run to draw the same prompts
    marked = {p.uid: 1.0 for p in parts.train_prompts[::2]}
    parts.prompts.observe(marked)
    pushed: list[dict] = []
    observe = parts.prompts.observe
    parts.prompts.observe = lambda scores: (pushed.append(dict(scores)), observe(scores))[1]
    run_sync(cfg, parts=parts)
    final = {k: v.detach().clone() for k, v in parts.model.state_dict().items()}
    history = [dict(m) for m in parts.history]
    # every pushed group was observed with its mean reward, the reward the step metrics report
    assert len(pushed) == 4 and all(len(s) == 4 for s in pushed)
    for scores, m in zip(pushed, history):
        assert sum(scores.values()) / 4 == pytest.approx(m["reward/mean"])
    source = parts.prompts.source
    latest = {u: s for scores in pushed for u, s in scores.items()}
    assert source.success == {**marked, **latest} and source.draws == 4
    assert sum(u in marked for u in latest) < len(latest) / 2  # the marked half drawn less often
    assert history[-1]["data/solved_frac"] == pytest.approx(source.solved_frac())  # the run's metrics show it
    assert history[0]["data/solved_frac"] > 0.4  # the marked half, less any of it drawn and failed

    fresh = build_run(small_cfg(tmp_path))
    resumed = run_sync(cfg, resume_from=str(tmp_path / "checkpoints" / "step_000002"), parts=fresh,
                       checkpoint_dir=tmp_path / "resumed")  # fmt: skip
    assert resumed["steps"] == 4
    assert fresh.prompts.source.success == source.success and fresh.prompts.source.draws == 4
    for a, b in zip(fresh.history, history[2:]):
        assert a["reward/mean"] == b["reward/mean"] and a["loss/policy"] == b["loss/policy"]
    sd = fresh.model.state_dict()
    for k, v in final.items():
        assert torch.equal(sd[k], v), k
