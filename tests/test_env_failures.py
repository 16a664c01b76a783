"""Environments that fail safely (real spawned environment processes, the real chat model and HF engine): a
failure fails its episode alone, a dead process is replaced and its other episodes start again, every result
is checked where it arrives, every episode is closed once however it ended, an episode cut short is told
(finish) and masked, reset gets the dataset row as data."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from rlhf_core.config import validate_config
from rlhf_core.data.prompts import Prompt
from rlhf_core.model.policy import load_policy, stop_token_ids
from rlhf_core.rollout import HFEngine, SamplingParams
from rlhf_core.rollout.multiturn import EnvError, EnvRunner
from rlhf_core.rollout.multiturn_batch import trajectory_batch

FIXTURES = str(Path(__file__).parent / "env_fixtures.py")


@pytest.fixture(scope="module")
def chat(chat_policy_dir):
    model, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    return model, tok, stop_token_ids(chat_policy_dir, tok)


def prompts_for(tok, n: int) -> list[Prompt]:
    """n plain-text prompts as the data pipeline makes them (text rendered, prompt_text as written); answer i."""
    out = []
    for i in range(n):
        question = f"count to {i + 2}"
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append(Prompt(i, ids, [], text, str(i), {"problem": i}, prompt_text=question))
    return out


def run_env(chat, name: str, n: int = 1, G: int = 2, workers: int = 1, runs: int = 1, max_failures=20, **env):
    """`runs` calls of EnvRunner.run on n prompts x G; returns (runner, trajectories of the last call)."""
    model, tok, stops = chat
    cfg = validate_config({"env": {"path": FIXTURES, "name": name, **env}, "rollout": {"max_new_tokens": 4}})
    runner = EnvRunner(cfg.env, tok, stops, workers, max_failures=max_failures)
    engine = HFEngine(model, stops, tok.pad_token_id, seed=0)
    try:
        for _ in range(runs):
            trajs = runner.run(engine, prompts_for(tok, n), G, SamplingParams(max_new_tokens=4))
        return runner, trajs
    finally:
        runner.close()


def events(dir: Path) -> tuple[collections.Counter, dict]:
    """(count of each event, {instance: [its events]}) from ChaosEnv's logs."""
    counts, by_instance = collections.Counter(), collections.defaultdict(list)
    for log in dir.glob("*.log"):
        for line in log.read_text().splitlines():
            event, instance = line.split()[:2]
            counts[event] += 1
            by_instance[instance].append(event)
    return counts, by_instance


def hangs_lost_with_their_process(dir: Path, hang_s: float) -> int:
    """ChaosEnv's hangs whose process was killed (a crash of any instance there) while the hang still slept: such
    a call may never report its timeout (the crash can come before the timeout fires or its reply is sent), and
    the episode is started again elsewhere rather than failed."""
    lost = 0
    for log in dir.glob("*.log"):
        rows = [line.split() for line in log.read_text().splitlines()]
        crashes = [float(t) for event, _, t in rows if event == "crash"]
        lost += sum(any(0 <= c - float(t) <= hang_s for c in crashes) for event, _, t in rows if event == "hang")
    return lost


def assert_closed_once(by_instance: dict) -> None:
    """Every instance opened was closed exactly once, but those whose process was killed under them."""
    crashed = {i.split("-")[0] for i, ev in by_instance.items() if "crash" in ev}
    for instance, ev in by_instance.items():
        assert "close-again" not in ev, (instance, ev)
        if "open" in ev and instance.split("-")[0] not in crashed:
            assert ev.count("close") == 1, (instance, ev)


# ---------------------------------------------------------------------------------------- failure isolation
@pytest.mark.parametrize("deterministic", [True, False])
def test_a_dead_process_fails_its_episode_alone_and_the_others_go_on(chat, tmp_path, deterministic):
    """Four episodes of 6 turns in one process; the first to step kills it once the three others are in
    mid-episode (waiting in their next step): that episode fails (process_died); the three others are replayed in
    the new process (reset and their answered actions again, each answer as recorded) and go on from where they
    were, nothing of the model's generated again. An environment whose opening differs in the new process (not
    deterministic) is started again from reset instead. One replacement; nothing else is counted."""
    kwargs = {"dir": str(tmp_path), "others": 3, "turns": 6, "tag_opening": not deterministic}
    runner, trajs = run_env(chat, "CrashOnceEnv", G=4, kwargs=kwargs, max_turns=6)
    failed = [t for t in trajs if t.error]
    assert len(failed) == 1 and failed[0].error_kind == "process_died"
    assert "its environment process died (exit code 17) while running this call" in failed[0].error
    others = [t for t in trajs if not t.error]
    assert all(t.done and t.turns == 6 and len(t.env_rewards) == 6 and t.replays == 1 for t in others)
    assert all(t.restarts == (0 if deterministic else 1) for t in others)
    assert runner.metrics() == {
        "env/errors": 1.0,
        "env/errors/raised": 0.0,
        "env/errors/timeout": 0.0,
        "env/errors/bad_result": 0.0,
        "env/errors/process_died": 1.0,
        "env/process_restarts": 1.0,
        "env/episodes_replayed": 3.0 if deterministic else 0.0,
        "env/episodes_retried": 0.0,  # run() alone (an evaluation's): a failed episode stays failed
    }
    counts, by_instance = events(tmp_path)
    # the three opened again to replay (and, where the replay differed, once more from reset)
    assert counts["crash"] == 1 and counts["open"] == 4 + 3 + (0 if deterministic else 3)
    assert_closed_once(by_instance)


def test_episodes_started_again_from_reset_keep_their_group(chat, tmp_path):
    """Two prompts x 2 episodes in one process; the first to step kills it and fails, the three others start again
    from reset (their environment is not deterministic): at least one of them is in the second group. Each keeps
    its place: run() returns both groups, contiguous and complete, each episode with its prompt (a restart
    that forgot its group handed the trainer 2 rows for 4 answers)."""
    kwargs = {"dir": str(tmp_path), "others": 3, "turns": 3, "tag_opening": True}
    runner, trajs = run_env(chat, "CrashOnceEnv", n=2, G=2, kwargs=kwargs, max_turns=3)
    assert [t.group for t in trajs] == [0, 0, 1, 1]
    assert [t.prompt.uid for t in trajs] == [0, 0, 1, 1]
    assert sum(t.restarts for t in trajs) == 3 and sum(bool(t.error) for t in trajs) == 1
    assert any(t.restarts for t in trajs[2:])
    assert all(t.done and t.turns == 3 for t in trajs if not t.error)


def test_a_process_that_dies_with_several_calls_running_charges_one_of_them(chat, tmp_path):
    """Two episodes in one process, their first steps in threads: one waits while the other (started last)
    kills the process. One episode fails (process_died, the message says how many calls were running), the one
    that was only waiting beside it is replayed (reset, its step sent again) and finishes; one replacement.
    (Two, not more: the runner generates for the episodes that are ready once they are at least as many as
    those waiting on the environment, so a third would wait for the first two.)"""
    kwargs = {"dir": str(tmp_path), "others": 1, "turns": 2}
    runner, trajs = run_env(chat, "CrashBesideWaitersEnv", G=2, kwargs=kwargs, max_turns=2)
    failed = [t for t in trajs if t.error]
    assert len(failed) == 1 and failed[0].error_kind == "process_died", [(t.error_kind, t.error) for t in failed]
    assert "(2 calls were running there; this one started last" in failed[0].error
    assert all(t.done and t.replays == 1 and t.restarts == 0 and t.turns == 2 for t in trajs if not t.error)
    metrics = runner.metrics()
    assert metrics["env/errors/process_died"] == 1.0 and metrics["env/process_restarts"] == 1.0
    counts, by_instance = events(tmp_path)
    assert counts["crash"] == 1 and counts["open"] == 2 + 1
    assert_closed_once(by_instance)


def test_hung_plain_steps_retire_their_process_and_never_starve_the_healthy_ones(chat, tmp_path):
    """One environment process, 5 batches of 32 episodes; half of them hang in their first plain step (a thread
    that overruns env.step_timeout_s and cannot be stopped): 80 hung threads, more than a process has (64). The
    hung episodes fail (timeout) and every healthy one ends well in every batch, the last included: the process
    retires once it holds STUCK_THREADS overrun threads (a fresh one takes the new episodes) and goes once its
    episodes have ended. No close() ran beside its instance's step. Nothing is left running."""
    from rlhf_core.env.serve import STUCK_THREADS, THREADS_PER_PROCESS
    from tests.test_env_chaos import children

    before = children()
    model, tok, stops = chat
    cfg = validate_config(
        {
            "env": {"path": FIXTURES, "name": "HangHalfEnv", "kwargs": {"dir": str(tmp_path)}, "step_timeout_s": 0.5},
            "rollout": {"max_new_tokens": 4},
        }
    )
    runner = EnvRunner(cfg.env, tok, stops, 1, max_failures=10_000)
    engine = HFEngine(model, stops, tok.pad_token_id, seed=0)
    try:
        for _ in range(5):
            trajs = runner.run(engine, prompts_for(tok, 8), 4, SamplingParams(max_new_tokens=4))
            hung = [t for t in trajs if t.row["problem"] % 2 == 0]
            healthy = [t for t in trajs if t.row["problem"] % 2 == 1]
            assert all(t.error_kind == "timeout" for t in hung), [t.error for t in hung]
            assert all(t.done and not t.error for t in healthy), [t.error for t in healthy]
        assert runner.pool.recycled >= 1 and sum(not slot.retiring for slot in runner.pool.slots) == 1
        assert 5 * 16 > THREADS_PER_PROCESS > STUCK_THREADS
    finally:
        runner.close()
    events = collections.Counter(
        line.split()[0] for log in tmp_path.glob("*.log") for line in log.read_text().splitlines()
    )
    assert events["hang"] == 5 * 16 and events["close-during-step"] == 0, events
    assert children() <= before


def test_an_instance_held_by_an_overrun_step_is_closed_when_the_pool_stops(tmp_path):
    """A step that overran its timeout (0.3 s) still holds its instance when the pool closes: the process waits
    for that step to end (2 s, past the timeout + 1 s a stop used to wait) and then closes the instance, once and
    never beside the step; the process is gone after close() (the Ray chaos run's instance left unclosed)."""
    import psutil

    from rlhf_core.env.pool import EnvPool

    pool = EnvPool(FIXTURES, "HangHalfEnv", {"dir": str(tmp_path), "hang_s": 2.0}, workers=1, timeout_s=0.3)
    pid = pool.slots[0].process.pid
    replies = []
    try:
        pool.reset(0, {"problem": 0, "prompt": "hi"})
        while not replies:
            replies = pool.poll(1.0)
        pool.step(0, "an action")
        replies = []
        while not replies:
            replies = pool.poll(1.0)
    finally:
        pool.close()
    assert replies[0].kind == "timeout", replies
    logged = [line.split()[0] for line in (tmp_path / f"{pid}.log").read_text().splitlines()]
    assert logged == ["hang", "close"], logged
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_calls_queued_behind_busy_threads_are_not_timed_out_and_every_close_runs(tmp_path):
    """192 episodes in one process, each step a plain call that takes 0.25 s (under the 0.6 s timeout): three
    times the process's 64 threads, so the last calls wait ~0.5 s for a thread. The timeout counts from a call's
    start in its thread: no step times out, and every instance is closed once (on the old code queued calls timed
    out and a queued close was cancelled: the Ray chaos run's hung instances that were never closed)."""
    from rlhf_core.env.pool import EnvPool
    from rlhf_core.env.serve import THREADS_PER_PROCESS

    n = 3 * THREADS_PER_PROCESS
    kwargs = {"dir": str(tmp_path), "turns": 1, "hang": 1.0, "hang_s": 0.25}
    pool = EnvPool(FIXTURES, "ChaosEnv", kwargs, workers=1, timeout_s=0.6)
    errors, live = [], set(range(n))
    try:
        for eid in range(n):
            pool.reset(eid, {"problem": eid, "prompt": "p"})
        while live:
            for reply in pool.poll(1.0):
                if reply.op == "reset" and not reply.error:
                    pool.step(reply.eid, "a")
                    continue
                errors += [reply.error] if reply.error else []
                pool.close_episode(reply.eid)
                live.discard(reply.eid)
    finally:
        pool.close()
    assert not errors, errors[:3]
    counts, by_instance = events(tmp_path)
    assert counts["open"] == counts["close"] == n and counts["hang"] == n, counts
    assert_closed_once(by_instance)


def test_a_suspect_of_an_earlier_death_is_charged_before_the_call_that_started_last():
    """The rule that picks the one trajectory a process's death is charged to: a trajectory that was running at
    an earlier death (and was restarted) is charged first; else the call that started last; nothing running,
    nobody."""
    from types import SimpleNamespace

    from rlhf_core.env.pool import EnvPool

    pool = SimpleNamespace(suspects=set())
    assert EnvPool._culprit(pool, {}) == set()
    assert EnvPool._culprit(pool, {3: 10, 5: 12, 7: 11}) == {5}
    pool.suspects = {7}
    assert EnvPool._culprit(pool, {3: 10, 5: 12, 7: 11}) == {7}


def test_a_successful_reset_does_not_clear_the_failure_count_a_step_does(chat, tmp_path):
    # every step raises: 4 failures per call; the second call trips the limit of 6 (its resets succeed)
    with pytest.raises(EnvError, match=r"failed 6 calls in a row .* the last \(raised\): step: ValueError: "
                       r"injected failure at step 1 \(at .*env_fixtures.py:\d+\)"):  # fmt: skip
        run_env(chat, "ChaosEnv", n=2, runs=2, kwargs={"dir": str(tmp_path), "raises": 1.0}, max_failures=6)
    counts, by_instance = events(tmp_path)
    assert 6 <= counts["raise"] <= 8 and counts["open"] == 8  # the second call's other episodes: reset too
    assert_closed_once(by_instance)  # the run stopped: every episode it opened was closed
    # a step that succeeds clears it: one failure per call (at step 2), never two in a row
    runner, trajs = run_env(chat, "CountEnv", G=1, runs=3, kwargs={"turns": 3, "fail_at": 2}, max_failures=2)
    assert runner.errors == 3 and runner.consecutive_failures == 1


# ------------------------------------------------------------------------------------------ results checked
def test_every_result_is_checked_and_a_bad_one_fails_its_trajectory_alone(chat):
    runner, trajs = run_env(chat, "BadValuesEnv", n=10, G=1, workers=2, max_observation_chars=50)
    expected = [
        "step's observation: message 0 (user) has content 42 (int): expected a string",
        "step's reward is nan, not a finite number",
        "step's done is 'yes' (str), not a bool",
        "step's info is str, not a dict",
        "step's observation has 51 characters, more than env.max_observation_chars=50",
        "step's info['success'] is 'False' (str), not a bool",
        "step's observation: message 0 has role None: expected a non-empty string",
        "step's info['tool_calls'] is 'two': expected a count or a list of calls",
        None,
        "reset's result is 42 (int): expected a string or a list of messages",
    ]
    assert len(trajs) == 10
    for t, want in zip(trajs, expected):
        if want is None:
            assert t.error is None and t.done and t.success is True
        else:
            assert t.error_kind == "bad_result" and want in t.error, (t.error, want)
    assert runner.metrics()["env/errors/bad_result"] == 9 and runner.errors == 9


# ------------------------------------------------------------------------------ closed once, cut, finish
def test_cut_episodes_are_told_masked_and_every_episode_is_closed_once(chat, tmp_path):
    """Cut by env.max_turns and by env.max_total_tokens: finish(reason) is called and its value added to the
    rewards; the rows are marked truncated, which algorithm.mask_truncated masks; failed and timed-out episodes
    are closed too, each once."""
    from rlhf_core.trainer.trainer import Trainer
    from rlhf_core.types import cat_rollouts

    kwargs = {"dir": str(tmp_path), "turns": 9, "finish_reward": 0.5}
    runner, trajs = run_env(chat, "ChaosEnv", G=2, kwargs=kwargs, max_turns=2)
    assert all(t.cut == "max_turns" and t.truncated and not t.done for t in trajs)
    assert all(t.env_rewards == [1.0, 1.0, 0.5] and t.finish_reward == 0.5 for t in trajs)
    model, tok, stops = chat
    limit = len(prompts_for(tok, 1)[0].prompt_ids) + 6
    _, cut = run_env(chat, "ChaosEnv", G=2, kwargs=kwargs, max_turns=9, max_total_tokens=limit)
    assert all(t.cut == "max_total_tokens" and t.truncated and t.env_rewards[-1] == 0.5 for t in cut)
    # failed (raised) and timed out episodes: closed as well
    run_env(chat, "ChaosEnv", G=4, kwargs={**kwargs, "raises": 0.5, "hang": 0.5, "hang_s": 1.5}, step_timeout_s=0.5)
    counts, by_instance = events(tmp_path)
    assert counts["finish-max_turns"] == 2 and counts["finish-max_total_tokens"] == 2
    assert counts["raise"] + counts["hang"] >= 1 and counts["open"] == counts["close"] == 8
    assert_closed_once(by_instance)
    # the trainer masks cut rows (algorithm.mask_truncated), through cat_rollouts as the loop batches them
    batch = trajectory_batch(trajs, tok.pad_token_id, 0)
    assert batch.truncated.tolist() == [True, True]
    cfg = validate_config({"algorithm": {"mask_truncated": True}, "rollout": {"max_new_tokens": 64}})
    trainer = Trainer(model, cfg, tok.pad_token_id, stop_ids=stops)
    both = cat_rollouts([batch, trajectory_batch(cut, tok.pad_token_id, 0)], tok.pad_token_id)
    assert trainer.truncated_rows(both).tolist() == [True] * 4
    batch.truncated = torch.zeros(2, dtype=torch.bool)  # the same rows unmarked: shorter than max_new_tokens
    assert trainer.truncated_rows(batch).tolist() == [False, False]


# ---------------------------------------------------------------------------------------- what reset gets
def test_reset_gets_the_row_as_data_not_the_rendered_prompt(chat):
    """Rows through the data pipeline (row_to_prompt, the chat template and a system prompt): a plain-text row's
    `prompt` is its text as written, a conversation's `prompt` and `messages` its messages; `answer` and the
    other columns as they are. Returning row['prompt'] keeps the pipeline's prompt ids."""
    from rlhf_core.data.rows import RowKeys, row_to_prompt

    model, tok, stops = chat
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5", "level": 3, "tags": ["sum"]},
        {"messages": [{"role": "user", "content": "And 3 + 4?"}], "answer": "7", "source": "x"},
    ]
    prompts = [row_to_prompt(r, f"row {i}", i, tok, RowKeys(), system_prompt="Be brief.") for i, r in enumerate(rows)]
    assert "<|im_start|>" in prompts[0].text  # what the model sees: rendered, with the system prompt
    cfg = validate_config({"env": {"path": FIXTURES, "name": "RowEnv"}})
    runner = EnvRunner(cfg.env, tok, stops, 1)
    try:
        trajs = runner.run(
            HFEngine(model, stops, tok.pad_token_id, seed=0), prompts, 1, SamplingParams(max_new_tokens=4)
        )
    finally:
        runner.close()
    assert [t.info["torch"] for t in trajs] == [False, False]  # an environment process imports no torch
    plain, conversation = (t.info["row"] for t in trajs)
    assert plain == {"prompt": "What is 2 + 3?", "answer": "5", "level": 3, "tags": ["sum"], "index": 0}
    system = {"role": "system", "content": "Be brief."}
    messages = [system, {"role": "user", "content": "And 3 + 4?"}]
    assert conversation == {"prompt": messages, "messages": messages, "answer": "7", "source": "x", "index": 1}
    assert trajs[0].prompt_ids == prompts[0].prompt_ids and trajs[1].prompt_ids == prompts[1].prompt_ids


# ---------------------------------------------------------------------------------------- no batch barrier
def test_streamed_episodes_hand_on_each_group_as_it_ends_while_a_slow_one_runs(chat):
    """EnvRunner.stream: three prompts start, one of them slow (3 s per environment step); the two fast groups are
    handed on at once, and prompts fed after them (the room they freed) run and are handed on too, all before
    the slow group ends: a slow episode holds its own group, not a batch. The same trajectories come back from
    run() (one batch) in the prompts' order."""
    import time

    model, tok, stops = chat
    env = {"path": FIXTURES, "name": "SlowRowEnv", "kwargs": {"slow_problem": 0, "slow_s": 3.0, "turns": 2}}
    cfg = validate_config({"env": {**env, "max_turns": 2}, "rollout": {"max_new_tokens": 4}})
    runner = EnvRunner(cfg.env, tok, stops, 1)
    engine = HFEngine(model, stops, tok.pad_token_id, seed=0)
    prompts = prompts_for(tok, 5)
    queue = [prompts[:3], [], [prompts[3]], [], [prompts[4]]]
    emitted, fed_at = [], []
    start = time.monotonic()

    def feed(in_flight):
        fed_at.append(in_flight)
        if not queue:
            return None
        if in_flight > 1 and not queue[0]:  # hold back until the fast ones ended (room freed)
            return []
        return queue.pop(0)

    def emit(group):
        emitted.append((group[0].prompt.uid, time.monotonic() - start, [t.done for t in group]))

    try:
        runner.stream(engine, 2, SamplingParams(max_new_tokens=4), feed, emit)
        batch = runner.run(engine, prompts[1:3], 2, SamplingParams(max_new_tokens=4, temperature=0.0))
    finally:
        runner.close()
    order = [uid for uid, _, _ in emitted]
    assert sorted(order) == [0, 1, 2, 3, 4] and order[-1] == 0, emitted  # the slow group ends last
    slow_end = emitted[-1][1]
    assert slow_end >= 6.0  # two steps of 3 s
    # the others did not wait for it, not even for its first step (a barrier per turn would hold them past 3 s;
    # 3 s, not 2, so that four fast episodes on a loaded 2-core machine still fit before it)
    assert all(at < 3.0 for uid, at, _ in emitted if uid != 0), emitted
    assert all(all(done) for _, _, done in emitted)
    assert [t.prompt.uid for t in batch] == [1, 1, 2, 2] and all(t.done for t in batch)
