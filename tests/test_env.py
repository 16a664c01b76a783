"""Multi-turn environments: config, chat-template tokenization, token-in/token-out trajectories, failures,
timeouts and concurrent episodes (real spawned environment processes, the real chat model and HF engine)."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError, TrainConfig, validate_config
from rlhf_core.data.prompts import Prompt
from rlhf_core.env.chat import ChatFormat, ChatFormatError
from rlhf_core.model.policy import load_policy, stop_token_ids
from rlhf_core.rollout import HFEngine, RolloutWorker, SamplingParams
from rlhf_core.rollout.multiturn import EnvError, EnvRunner
from rlhf_core.rollout.multiturn_batch import trajectory_batch
from rlhf_core.trainer import sequence_logprobs
from rlhf_core.usercode import load_attr, load_env_class
from tests.ledger_checks import assert_ledger_balances

FIXTURES = str(Path(__file__).parent / "env_fixtures.py")


def env_config(name: str, max_failures: int = 20, **env) -> TrainConfig:
    return validate_config(
        {
            "env": {"path": FIXTURES, "name": name, **env},
            "rollout": {"max_new_tokens": 6, "samples_per_prompt": 2, "temperature": 1.0},
            "supervision": {"max_consecutive_failures": max_failures},
        }
    )


@pytest.fixture(scope="module")
def chat(chat_policy_dir):
    model, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    return model, tok, stop_token_ids(chat_policy_dir, tok)


class RecordingEngine(HFEngine):
    """HFEngine that keeps every generated row (ids, log-probs) in call order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[list[int]], list[list[int]], list[list[float]]]] = []

    def generate(self, prompts, samples_per_prompt, sampling):
        out = super().generate(prompts, samples_per_prompt, sampling)
        contexts = [row[m].tolist() for row, m in zip(prompts.prompt_ids, prompts.prompt_mask)]
        ids = [r[m].tolist() for r, m in zip(out.response_ids, out.response_mask)]
        logps = [r[m].tolist() for r, m in zip(out.behavior_logprobs, out.response_mask)]
        self.calls.append((contexts, ids, logps))
        return out


def prompts_for(tok, n: int) -> list[Prompt]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"count to {i + 2}"}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(Prompt(i, tok(text, add_special_tokens=False)["input_ids"], [], text, str(i + 2), {}, messages))
    return out


def runner_for(cfg: TrainConfig, tok, stops, workers: int = 1) -> EnvRunner:
    return EnvRunner(cfg.env, tok, stops, workers, max_failures=cfg.supervision.max_consecutive_failures)


# ------------------------------------------------------------------------------------------------ config
def test_env_config_names_the_field(tmp_path):
    assert not TrainConfig().env.enabled
    assert TrainConfig.model_validate({"env": {"tools": [{"path": FIXTURES, "name": "add"}]}}).env.class_name == (
        "ToolEnv"
    )
    with pytest.raises(ConfigError, match="env.path is empty and env.name 'Nope' is not a built-in"):
        validate_config({"env": {"name": "Nope"}})
    with pytest.raises(ConfigError, match="env.path: 'missing.py' is neither"):
        validate_config({"env": {"name": "X", "path": "missing.py"}})
    with pytest.raises(ConfigError, match="env.name: .* defines no class named 'Missing'"):
        validate_config({"env": {"name": "Missing", "path": FIXTURES}})
    with pytest.raises(ConfigError, match="class NoStep .* has no step method"):
        validate_config({"env": {"name": "NoStep", "path": FIXTURES}})
    with pytest.raises(ConfigError, match=r"env.tools\[0\].name: .* defines no function named 'nope'"):
        validate_config({"env": {"tools": [{"path": FIXTURES, "name": "nope"}]}})
    with pytest.raises(ConfigError, match="env.max_turns"):
        validate_config({"env": {"name": "CountEnv", "path": FIXTURES, "max_turns": 0}})
    with pytest.raises(ConfigError, match="env.max_total_tokens"):
        validate_config({"env": {"max_total_tokens": 1}})
    with pytest.raises(ConfigError, match="env.max_total_tokens"):  # the old key, moved there
        validate_config({"rollout": {"max_total_tokens": 1}})


# ------------------------------------------------------------------------------------------- chat format
@pytest.mark.parametrize("fixture", ["chat_policy_dir", "base_chat_policy_dir"])
def test_observation_ids_continue_the_conversation_exactly(fixture, request):
    """Prompt ids + the model's turn as the engine would generate it (content, then its stop token) + the
    observation's ids equal the tokenization of the whole conversation rendered at once: prefix ids match."""
    path = request.getfixturevalue(fixture)
    _, tok = load_policy(path, dtype="float32", device="cpu")
    stops = stop_token_ids(path, tok)
    fmt = ChatFormat(tok, stops)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    conversation = [{"role": "user", "content": "max of 3, 72, 5? Answer with #### n."}]
    ids = fmt.prompt_ids(conversation)
    for action, observation in [("I guess 5", "too low"), (" #### 72\n", "right: 72 is the maximum, 1,000 no")]:
        ids += tok(action, add_special_tokens=False)["input_ids"] + [im_end]  # what the engine generates
        conversation += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        ids += fmt.observation_ids([{"role": "user", "content": observation}], im_end)
        whole = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ids == tok(whole, add_special_tokens=False)["input_ids"]
    # a turn cut before its stop token gets the whole end of turn from the template (masked: not the model's)
    text = fmt.observation_text([{"role": "user", "content": "x"}], last_model_token=tok.encode("a")[0])
    assert text.startswith("<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


def test_a_model_without_a_chat_template_or_tool_format_is_refused(chat_policy_dir):
    _, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    saved = tok.chat_template
    try:
        tok.chat_template = None
        with pytest.raises(ChatFormatError, match="needs the model's chat template"):
            ChatFormat(tok, [0])
        tok.chat_template = saved.replace("tools", "t00ls").replace("<tool_call>", "<t>")
        with pytest.raises(ChatFormatError, match="env.tools: the chat template of .* has no tool format"):
            ChatFormat(tok, [0], tools=[{"type": "function", "function": {"name": "f"}}])
    finally:
        tok.chat_template = saved


# ------------------------------------------------------------------------------- token-in / token-out
def test_trained_ids_are_the_generated_ids_and_observations_are_masked(chat):
    model, tok, stops = chat
    cfg = env_config("CountEnv", kwargs={"turns": 3}, max_turns=3)
    engine = RecordingEngine(model, stops, tok.pad_token_id, seed=0)
    runner = runner_for(cfg, tok, stops)
    try:
        prompts = prompts_for(tok, 4)  # one trajectory each: a context identifies its row below
        trajs = runner.run(engine, prompts, 1, SamplingParams.from_config(cfg.rollout))
    finally:
        runner.close()
    assert [t.error for t in trajs] == [None] * 4
    batch = trajectory_batch(trajs, tok.pad_token_id, engine.version)
    # every generated row, by its context, in order: what the engine produced for that trajectory
    generated: dict[tuple, tuple] = {}
    for contexts, ids, logps in engine.calls:
        for c, i, lp in zip(contexts, ids, logps):
            generated[tuple(c)] = (i, lp)
    for row, t in enumerate(trajs):
        assert t.turns == 3 and t.env_rewards == [1.0, 1.0, 1.0] and t.done
        n = len(t.ids)
        ids = batch.response_ids[row, :n].tolist()
        model_mask = batch.loss_mask[row, :n]
        assert batch.response_mask[row, :n].all() and not batch.response_mask[row, n:].any()
        context = list(t.prompt_ids)
        pos = 0
        for turn in range(3):
            gen_ids, gen_logps = generated[tuple(context)]
            # the model's tokens: exactly the generated ids, trained on, with their behaviour log-probs
            assert ids[pos : pos + len(gen_ids)] == gen_ids
            assert model_mask[pos : pos + len(gen_ids)].all()
            assert batch.behavior_logprobs[row, pos : pos + len(gen_ids)].tolist() == pytest.approx(gen_logps)
            context += gen_ids
            pos += len(gen_ids)
            if turn < 2:  # then the observation: masked out, its ids the template's for 'turn <t>'
                obs = runner.chat.observation_ids([{"role": "user", "content": f"turn {turn + 1}"}], gen_ids[-1])
                assert ids[pos : pos + len(obs)] == obs
                assert not model_mask[pos : pos + len(obs)].any()
                assert batch.behavior_logprobs[row, pos : pos + len(obs)].abs().sum() == 0
                context += obs
                pos += len(obs)
        assert pos == n
        assert all(turn.version == 0 for turn in t.transcript if turn.role == "assistant")
    # without partial rollouts every token is of the engine's one version
    assert torch.equal(batch.token_versions, torch.zeros_like(batch.response_ids))
    assert torch.equal(batch.policy_version, torch.zeros(4, dtype=torch.long))
    # the trainer's view of the same ids: on-policy, its log-probs of the model's tokens are the engine's
    with torch.no_grad():
        logps, _ = sequence_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, temperature=1.0
        )
    m = batch.loss_mask
    assert torch.allclose(logps[m], batch.behavior_logprobs[m], atol=1e-4)


class WeightVersions:
    """Weights of policy versions 0, 1, 2, ...: version 0 is the model's own, each later one the model's moved by
    noise of its own (made on first use, then kept for the on-policy check)."""

    def __init__(self, model):
        self.base = {k: v.clone() for k, v in model.state_dict().items()}
        self.states = {0: self.base}

    def __getitem__(self, version: int) -> dict:
        if version not in self.states:
            g = torch.Generator().manual_seed(version)
            self.states[version] = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in self.base.items()}
        return self.states[version]

    def hook(self, engine, every: int):
        """between_steps handing over the next version (after the engine's) at every `every`-th call."""
        calls = []

        def between_steps():
            calls.append(1)
            if len(calls) % every:
                return None
            return self[engine.version + 1], engine.version + 1

        return between_steps


class TurnAtATimeEngine:
    """The HF engine behind a generate that ignores between_steps (as the protocol lets an engine that cannot adopt
    weights mid-generation): weights can change between turns only."""

    def __init__(self, engine: HFEngine):
        self.engine = engine
        self.device = engine.device

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, state_dict, version: int) -> None:
        self.engine.load_weights(state_dict, version)

    def generate(self, prompts, samples_per_prompt, sampling, between_steps=None):
        return self.engine.generate(prompts, samples_per_prompt, sampling)


@pytest.mark.parametrize("mid_turn", [False, True], ids=["between_turns", "mid_turn"])
def test_partial_rollouts_adopt_weights_between_turns_and_mid_turn(chat, mid_turn):
    """rollout.partial_rollout with an environment, through the rollout worker's hook path (the Ray rollout
    actor passes its weight-store hook the same way): weights handed over between turns (any engine) and
    between decode steps (the HF engine) are adopted while trajectories are in flight. Each model token keeps
    the version that generated it, observation tokens the version of the model token before them, the row's
    policy_version is its oldest model token's, and every behaviour log-prob is that of the weights of the
    token's recorded version (recomputed with a model holding them)."""
    from rlhf_core.config import RewardConfig
    from rlhf_core.env.score import trajectory_record
    from rlhf_core.reward.components import build_reward_fn

    model, tok, stops = chat
    cfg = env_config("CountEnv", kwargs={"turns": 3}, max_turns=3)
    sampling = SamplingParams.from_config(cfg.rollout)
    weights = WeightVersions(model)
    hf = HFEngine(copy.deepcopy(model), stops, tok.pad_token_id, seed=0)
    engine = hf if mid_turn else TurnAtATimeEngine(hf)
    reward = build_reward_fn(RewardConfig(), tok, stops, sampling.max_new_tokens)
    worker = RolloutWorker(engine, reward, sampling, 2, tok.pad_token_id, env=runner_for(cfg, tok, stops))
    try:
        batch, _ = worker.rollout(prompts_for(tok, 2), between_steps=weights.hook(hf, every=3 if mid_turn else 1))
    finally:
        worker.close()
    trajs = worker.last_trajectories
    assert len(trajs) == 4 and all(t.turns == 3 and t.error is None for t in trajs)
    versions, model_mask = batch.token_versions, batch.loss_mask
    assert (hf.weight_updates > 0) == mid_turn
    spans = []  # per trajectory, per model turn: the versions of its tokens
    for row, t in enumerate(trajs):
        n = len(t.ids)
        v, m = versions[row, :n], model_mask[row, :n]
        assert v.tolist() == t.versions
        assert bool((v[1:] >= v[:-1]).all())  # a trajectory never goes back to older weights
        # observation positions: masked out, with the version of the model token before them
        before = torch.where(m, v, -1).cummax(0).values
        assert bool((v[~m] == before[~m]).all())
        assert int(batch.policy_version[row]) == int(v[m].min())
        assert trajectory_record(t)["policy_version"] == int(batch.policy_version[row])
        runs = itertools.groupby(zip(v.tolist(), m.tolist()), key=lambda pair: pair[1])
        turns = [[version for version, _ in run] for is_model, run in runs if is_model]
        assert [turn.version for turn in t.transcript if turn.role == "assistant"] == [x[0] for x in turns]
        spans.append(turns)
    assert len({int(x) for x in versions[model_mask]}) > 2  # several versions were adopted
    if mid_turn:  # some turn's tokens are of two versions: adopted between decode steps
        assert any(len(set(turn)) > 1 for turns in spans for turn in turns)
    else:  # every turn of one version, a newer one each turn (the hook hands one over before every turn)
        assert all(len(set(turn)) == 1 for turns in spans for turn in turns)
        assert all(a[0] < b[0] for turns in spans for a, b in zip(turns, turns[1:]))
    # on-policy per token: recomputed with the weights of each token's recorded version
    reference = copy.deepcopy(model)
    worst = 0.0
    for version in sorted({int(x) for x in versions[model_mask]}):
        reference.load_state_dict(weights[version])
        with torch.no_grad():
            logps, _ = sequence_logprobs(
                reference,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.response_ids,
                batch.response_mask,
                sampling=sampling,
            )
        where = model_mask & (versions == version)
        worst = max(worst, float((logps[where] - batch.behavior_logprobs[where]).abs().max()))
    assert worst <= 1e-5, worst


def test_trajectory_ends_truncated_at_max_total_tokens(chat):
    model, tok, stops = chat
    prompts = prompts_for(tok, 1)
    limit = len(prompts[0].prompt_ids) + 8
    cfg = validate_config(
        {
            "env": {
                "path": FIXTURES,
                "name": "CountEnv",
                "kwargs": {"turns": 10},
                "max_turns": 10,
                "max_total_tokens": limit,
            },
            "rollout": {"max_new_tokens": 6, "samples_per_prompt": 2},
        }
    )
    runner = runner_for(cfg, tok, stops)
    try:
        trajs = runner.run(
            HFEngine(model, stops, tok.pad_token_id, seed=1), prompts, 4, SamplingParams.from_config(cfg.rollout)
        )
    finally:
        runner.close()
    for t in trajs:
        assert t.error is None and t.truncated and not t.done
        assert t.length <= limit
        assert t.turns < 10


# ---------------------------------------------------------------------------------- failures, timeouts
def run_env(chat, name: str, n: int = 1, G: int = 2, workers: int = 1, **env):
    model, tok, stops = chat
    cfg = env_config(name, **env)
    runner = runner_for(cfg, tok, stops, workers)
    try:
        trajs = runner.run(
            HFEngine(model, stops, tok.pad_token_id, seed=0), prompts_for(tok, n), G, SamplingParams(max_new_tokens=4)
        )
        return runner, trajs
    finally:
        runner.close()


def test_a_step_that_raises_ends_the_trajectory_and_counts(chat):
    runner, trajs = run_env(chat, "CountEnv", kwargs={"turns": 3, "fail_at": 2})
    for t in trajs:
        assert t.error.startswith("step: ValueError: boom at step 2 (at ") and "env_fixtures.py" in t.error
        assert t.turns == 2 and t.error_kind == "raised"
    assert runner.errors == 2 and runner.metrics()["env/errors/raised"] == 2


def test_a_step_past_its_timeout_fails_sync_and_async(chat):
    # the plain step overruns its thread: the runner's close() waits for it to end (sleep 2 s, past 0.5 s)
    runner, trajs = run_env(chat, "CountEnv", kwargs={"sleep": 2}, step_timeout_s=0.5)
    assert all("timed out after 0.5 s (env.step_timeout_s)" in t.error for t in trajs)
    assert runner.metrics()["env/errors/timeout"] == 2
    runner, trajs = run_env(chat, "AsyncSleepEnv", kwargs={"sleep": 5}, step_timeout_s=0.5)
    assert all("timed out after 0.5 s (env.step_timeout_s)" in t.error for t in trajs)
    # a fast coroutine env with the row's own prompt: completes
    runner, trajs = run_env(chat, "AsyncSleepEnv", kwargs={"sleep": 0, "turns": 2})
    assert [t.error for t in trajs] == [None, None] and all(t.turns == 2 for t in trajs)


def test_an_env_that_blocks_its_process_is_killed_and_replaced(chat, monkeypatch):
    """Both episodes share one process; the first step blocks its event loop, so the second's never starts: the
    first fails (timeout), the second is replayed in the new process (reset, then its step again: nothing of the
    model's is generated again), and blocks that one too."""
    import rlhf_core.env.pool as pool

    monkeypatch.setattr(pool, "KILL_GRACE_S", 0.5)
    runner, trajs = run_env(chat, "BlockingEnv", step_timeout_s=0.5)
    assert all("killed and replaced" in t.error and t.error_kind == "timeout" for t in trajs)
    assert sorted(t.replays for t in trajs) == [0, 1] and all(t.restarts == 0 for t in trajs)
    assert runner.pool.replaced == 2
    assert runner.metrics()["env/errors/timeout"] == 2 and runner.metrics()["env/process_restarts"] == 2


def test_a_bad_step_result_names_what_is_wrong(chat):
    _, trajs = run_env(chat, "BadResultEnv")
    assert all("step's reward is 'not a number' (str), not a number" in t.error for t in trajs)
    assert all(t.error_kind == "bad_result" for t in trajs)


def test_consecutive_failures_stop_the_run_with_the_envs_error(chat):
    with pytest.raises(
        EnvError,
        match=r"failed 3 calls in a row \(supervision.max_consecutive_failures=3\); the last \(raised\): step: Val",
    ):
        run_env(chat, "CountEnv", n=2, kwargs={"fail_at": 1}, max_failures=3)


def test_a_slow_episode_does_not_stall_the_others_of_its_process(chat, tmp_path):
    """One process holds all four episodes; the slow one's first step returns only after the three others
    finished their three turns each: they ran while it waited."""
    runner, trajs = run_env(
        chat, "MarkerEnv", G=4, workers=1, kwargs={"dir": str(tmp_path), "fast": 3}, step_timeout_s=60
    )
    assert [t.error for t in trajs] == [None] * 4
    slow = [t for t in trajs if t.info.get("fast_done_first")]
    assert len(slow) == 1 and slow[0].turns == 1
    assert sorted(t.turns for t in trajs) == [1, 3, 3, 3]


# ------------------------------------------------------------------------------------ single-process loop
def loop_cfg(tmp_path, name: str, max_failures: int = 20, **env):
    from rlhf_core.config import load_config

    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "model.preset=micro-chat",
            "data.task=max3_chat",
            "data.eval_size=4",
            "reward.components={answer_after_marker: 1.0}",
            "rollout.max_new_tokens=6",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_batch=2",
            "env.workers=1",
            f"supervision.max_consecutive_failures={max_failures}",
            "eval.every=1",
            "checkpoint.every=0",
        ],
    )
    cfg.env = cfg.env.model_validate({"path": FIXTURES, "name": name, **env})
    return cfg


def test_run_sync_trains_on_trajectories(tmp_path):
    from rlhf_core.loop import build_run, generate_step_batch, run_sync

    cfg = loop_cfg(tmp_path, "CountEnv", kwargs={"turns": 2, "reward": 0.5}, max_turns=3, reward_weight=2.0)
    parts = build_run(cfg)
    seen = []
    try:
        result = run_sync(cfg, parts=parts, on_step=seen.append)
        batch, _ = generate_step_batch(parts)
    finally:
        parts.worker.close()
    assert result["steps"] == 2
    for m in seen:
        assert m["env/turns_mean"] == 2 and m["reward/env"] == 1.0 and m["env/errors"] == 0
        assert m["env/tool_calls_mean"] == 0 and m["env/truncated_frac"] == 0
    # the trajectory reward: env rewards x env.reward_weight + the configured reward of the last model turn
    assert torch.allclose(batch.rewards, 2.0 * 1.0 + batch.reward_components[:, 0])
    assert batch.loss_mask is not None and (batch.loss_mask & ~batch.response_mask).sum() == 0
    assert batch.loss_mask.sum() < batch.response_mask.sum()  # observations are context, not trained on
    # evaluation runs the episodes greedily: CountEnv reports success at its last step
    assert result["eval/accuracy"] == 1.0 and result["eval/turns_mean"] == 2


def test_groups_with_a_failed_trajectory_are_left_out(tmp_path):
    """An episode that fails is started again in its group's slot (EPISODE_RETRIES times, training only); a group
    is left out when one of its slots failed every try. Here every episode fails."""
    from rlhf_core.loop import build_run
    from rlhf_core.rollout.worker import EPISODE_RETRIES

    cfg = loop_cfg(tmp_path, "CountEnv", kwargs={"turns": 3, "fail_at": 2}, max_failures=100)
    parts = build_run(cfg)
    try:
        trajs = parts.worker.env.run(parts.engine, parts.train_prompts[:2], 2, parts.worker.sampling)
        assert all(t.error for t in trajs) and parts.worker.env.retried == 0  # run() alone: no retries
        batch, _ = parts.worker.rollout(parts.train_prompts[:2])
        metrics = parts.worker.env_metrics
        assert len(batch) == 0 and metrics["env/errors"] == 4 + 4 * (1 + EPISODE_RETRIES)
        assert metrics["env/episodes_retried"] == 4 * EPISODE_RETRIES
    finally:
        parts.worker.close()


@pytest.mark.slow
def test_the_ray_runtime_runs_environments(ray_local, tmp_path):
    """Rollout workers run the episodes (their own environment pools), the trainer trains on trajectories and
    logs env/* and reward/env from the groups, held-out evaluation runs the episodes greedily. With partial
    rollouts on, the workers' weight-store hook reaches the episodes (weights may change between turns and
    within them) and every model token trained on is within the staleness bound."""
    from rlhf_core.distributed import run_distributed

    cfg = loop_cfg(tmp_path, "CountEnv", kwargs={"turns": 2, "reward": 0.5}, max_turns=3)
    cfg = validate_config(
        {
            **cfg.model_dump(mode="json"),
            "cluster": {"num_cpus": 2},
            "supervision": {"supervise_interval_s": 0.2},
            "runtime": {"max_staleness": 1, "wait_timeout_s": 60},
            "trainer": {**cfg.trainer.model_dump(mode="json"), "total_steps": 3},
            "rollout": {**cfg.rollout.model_dump(mode="json"), "partial_rollout": True},
        }
    )
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["steps"] == 3
    for m in result["metrics"]:
        assert m["env/turns_mean"] == 2 and m["reward/env"] == 1.0 and m["env/truncated_frac"] == 0
        assert m["env/errors"] == 0
        assert m["async/token_staleness_max"] <= 1
    assert result["eval/accuracy"] == 1.0 and result["eval/turns_mean"] == 2
    # the final evaluation's traced episodes: generated by the trainer's version 3 (every trace said 0 before)
    records = result["eval/trajectories"]
    assert records and all(r["policy_version"] == r["policy_version_last"] == 3 for r in records)
    assert {(r["trained_at"], r["ended"]) for r in records} == {("eval", "done")}
    rec = result["reconcile"]
    assert_ledger_balances(rec)


# ------------------------------------------------------------------------------------------ atrlhf score
def test_atrlhf_score_replays_a_trajectory_file(tmp_path, capsys):
    import json

    from flows.cli import main
    from rlhf_core.env.score import write_trajectories
    from rlhf_core.rollout.multiturn_batch import Trajectory, Turn

    t = Trajectory(prompt=Prompt(0, [1], []), row={"answer": "3"})
    t.transcript = [Turn("user", "count to 3"), Turn("assistant", "one", version=2), Turn("user", "turn 1")]
    t.transcript += [Turn("assistant", "two", version=2)]
    t.env_rewards, t.turns = [1.0, 1.0], 2
    path = write_trajectories(tmp_path / "trajectories.jsonl", [t, t])
    with path.open("a") as f:  # a line whose recorded observation differs from what the env says now
        f.write(json.dumps({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "no"}]}))
        f.write("\n")
    env = [f"env.path={FIXTURES}", "env.name=CountEnv", "env.kwargs={turns: 2}", "env.workers=1"]
    assert main(["score", "--input", str(path), "--json", "--set", *env]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert [r["env_reward"] for r in rows] == [2.0, 2.0, 1.0] and [r["turns"] for r in rows] == [2, 2, 1]
    assert [r["success"] for r in rows] == [True, True, False]
    assert [r["observations_match"] for r in rows] == [True, True, False]
    assert out["mean"]["reward/env"] == pytest.approx(5 / 3)
    (tmp_path / "bad.jsonl").write_text('{"messages": "x"}\n')
    assert main(["score", "--input", str(tmp_path / "bad.jsonl"), "--set", *env]) == 1
    assert "bad.jsonl:1: 'messages' must be a list" in capsys.readouterr().err


def test_the_multiturn_recipe_and_its_environment():
    """configs/tiny-multiturn.yaml validates; examples/envs/reveal.py scores the observation's question only."""
    from rlhf_core.config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "tiny-multiturn.yaml"))
    assert cfg.env.enabled and cfg.env.max_turns == 2 and cfg.runtime.max_staleness == 0
    path = str(Path(__file__).resolve().parents[1] / cfg.env.path)
    env = load_env_class(path, cfg.env.name)(seed=0)
    assert env.reset({"prompt": "max of 1, 2, 3? Answer with #### n."}) == "max of 1, 2, 3? Answer with #### n."
    observation, reward, done, _ = env.step("#### 3")
    assert reward == 0.0 and not done and observation.startswith("max of ")
    right = max(env.numbers)
    assert env.step(f"so #### {right}") == (None, 1.0, True, {"success": True})
    assert load_attr(path, "blind_best", "env.path")() == pytest.approx(0.271)


@pytest.mark.slow
def test_the_multiturn_recipe_learns_to_read_the_observation(tmp_path):
    """The shipped recipe, shortened to 50 RL steps: held-out greedy episodes reach at least twice what the
    best observation-blind policy scores (the 0.271 of always answering 9); docs/benchmarks.md has the curve
    (0.71-0.85 at step 25, 0.98-0.99 at 50: 30 steps, tried, reached only 0.42 on a CI machine)."""
    from rlhf_core.config import load_config
    from rlhf_core.loop import build_run, run_sync

    root = Path(__file__).resolve().parents[1]
    sets = [f"run.output_dir={tmp_path}", "trainer.total_steps=50", "eval.every=0", "data.eval_size=100"]
    cfg = load_config(str(root / "configs" / "tiny-multiturn.yaml"), sets)
    cfg.env.path = str(root / cfg.env.path)
    parts = build_run(cfg)
    try:
        result = run_sync(cfg, parts=parts)
    finally:
        parts.worker.close()
    assert result["steps"] == 50
    blind = load_attr(cfg.env.path, "blind_best", "env.path")()
    assert blind == pytest.approx(0.271)
    assert result["eval/accuracy"] >= 2 * blind, result
