"""Multi-turn trajectories, token-in/token-out: the engine generates, the environment (in its process pool)
answers, for several turns; the trajectory is kept as token ids and handed to training as one RolloutBatch.

Layout of a trajectory's row in the batch:
  prompt_ids         the opening prompt (the row's own prompt ids, or reset's messages through the template)
  response_ids       every token after it, in order: model turn, observation, model turn, ...
  response_mask      True on all of them (they are attended to)
  loss_mask          True on the model's tokens only: the ids the engine generated, as generated
  behavior_logprobs  the engine's log-probabilities of the model's tokens (0 elsewhere)
  token_versions     the version of the weights that generated each model token; an observation token has the
                     version of the model token before it (masked out of the loss, it neither ages nor
                     freshens the row); policy_version is the oldest model token's

A model turn is never decoded and re-tokenized: its action text is decoded once, for the environment only.
An observation is tokenized once through the chat template (`ChatFormat.observation_ids`). Episodes run
concurrently: the driver generates for the trajectories whose environment has answered as soon as at least
as many are ready as are still waiting, so one slow environment step does not hold up the others.

Partial rollouts (`run(..., between_steps=fn)`, the hook of the single-turn path): a trajectory in flight adopts
newer weights between its turns, with any engine, and within a turn, between decode steps, where the engine
takes the hook. Each turn is generated from the trajectory's ids so far, prefilled afresh by the engine (no KV
cache or prefix computed under older weights is carried from one turn to the next), so every token's
behaviour log-prob is that of the version it is stamped with.

How an episode ends, and what follows (docs/environments.md, "Failures"):
  done    the environment said so (or gave no observation);
  cut     env.max_turns reached, or the next observation or model turn would pass env.max_total_tokens:
          `truncated` (masked by algorithm.mask_truncated), and an environment defining finish(reason) is asked
          for a final reward, added to its rewards;
  failed  an environment call raised, overran env.step_timeout_s, returned something malformed, or its process
          died while running it: `error`, `error_kind` (the group is left out of training).
Its environment's close() runs once however it ended, the run stopping included. A trajectory whose process
was lost while it ran another's call is replayed into a fresh instance (replay.py) and goes on, or, where the
replay differs, starts again from reset (same row); neither is a failure. The run stops with
EnvError after supervision.max_consecutive_failures failed calls in a row (a successful step clears the count, a
successful reset does not), carrying the environment's last error (message, file:line).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from rlhf_core.config.base import MAX_CONSECUTIVE_FAILURES
from rlhf_core.data.prompts import Prompt, collate_prompts, prompt_row
from rlhf_core.env.chat import ChatFormat
from rlhf_core.env.checks import ERROR_KINDS
from rlhf_core.env.pool import EnvPool
from rlhf_core.rollout import replay
from rlhf_core.rollout.generate import generate
from rlhf_core.rollout.multiturn_batch import Trajectory, Turn, last_turn_batch

_eids = itertools.count()
MAX_RESTARTS = 3  # an episode whose process is lost under it more often than this fails (process_died)


class EnvError(RuntimeError):
    """The environment failed supervision.max_consecutive_failures calls in a row (the message has its error)."""


class EnvRunner:
    """Runs trajectories of the configured environment with an engine (`run`).

    engine: anything with generate(PromptBatch, samples_per_prompt, SamplingParams) -> RolloutBatch and a
    `version`; tokenizer: the policy's; stop_ids: the run's stop set."""

    def __init__(
        self,
        env_cfg,
        tokenizer,
        stop_ids: Sequence[int],
        workers: Optional[int] = None,
        where: str = "model",
        max_failures: int = MAX_CONSECUTIVE_FAILURES,
    ):
        """workers: the process pool's size (None: env.workers); max_failures: failed calls in a row that stop the
        run (supervision.max_consecutive_failures)."""
        self.cfg = env_cfg
        self.tokenizer = tokenizer
        self.stop_ids = [int(i) for i in stop_ids]
        self.pad_token_id = tokenizer.pad_token_id
        tools = None
        if env_cfg.tools:
            from rlhf_core.env.tools import tool_schemas

            tools = tool_schemas([(t.path, t.name) for t in env_cfg.tools])
        self.chat = ChatFormat(tokenizer, self.stop_ids, tools=tools, where=where)
        self.max_failures = max_failures
        limit = env_cfg.max_total_tokens
        model_limit = getattr(tokenizer, "model_max_length", None)
        if limit is None and isinstance(model_limit, int) and model_limit < 1_000_000:
            limit = model_limit
        self.max_total_tokens = limit
        self.pool = EnvPool(
            env_cfg.class_path,
            env_cfg.class_name,
            env_cfg.instance_kwargs(),
            env_cfg.workers if workers is None else workers,
            env_cfg.step_timeout_s,
            env_cfg.max_observation_chars,
        )
        self.consecutive_failures = 0  # failed environment calls in a row, across the run
        self.error_counts = dict.fromkeys(ERROR_KINDS, 0)  # failed trajectories over the run, by kind
        self.last_eval: list[Trajectory] = []  # the latest evaluation's episodes (MLflow traces)
        self.steps = 0
        self.replayed = 0  # episodes whose exchange was replayed into a fresh instance (replay.py)
        self.retried = 0  # failed training episodes started again in their group's slot (env/episodes_retried)
        self._grader = None

    @property
    def errors(self) -> int:
        """Failed trajectories over the run (env/errors)."""
        return sum(self.error_counts.values())

    def metrics(self) -> dict[str, float]:
        """env/errors and env/errors/<kind> (failed trajectories in the run so far), env/process_restarts,
        env/episodes_replayed (lost with their process and replayed, rather than started again),
        env/episodes_retried (failed training episodes started again in their group's slot)."""
        out = {"env/errors": float(self.errors)}
        out.update({f"env/errors/{kind}": float(n) for kind, n in self.error_counts.items()})
        out["env/process_restarts"] = float(self.pool.replaced)
        out["env/episodes_replayed"] = float(self.replayed)
        out["env/episodes_retried"] = float(self.retried)
        return out

    def close(self) -> None:
        self.pool.close()

    # ------------------------------------------------------------------ trajectories, batched or streamed
    def run(
        self, engine, prompts: Sequence[Prompt], samples_per_prompt: int, sampling, between_steps=None, retries=0
    ) -> list[Trajectory]:
        """samples_per_prompt trajectories per prompt (contiguous per prompt), run to their end; each one's
        environment is closed however it ended (an exception out of here included).

        between_steps (partial rollouts): returns None or (state_dict, version) for the engine to adopt; asked
        before every turn and, where the engine takes it, between its decode steps (see the module doc)."""
        from rlhf_core.rollout.episode_stream import run_episodes

        return run_episodes(self, engine, prompts, samples_per_prompt, sampling, between_steps, retries)

    def new_trajectory(self, p: Prompt) -> Trajectory:
        return Trajectory(prompt=p, row=prompt_row(p), eid=next(_eids))

    def aborted(self, exc: BaseException) -> None:
        """The episodes' driver stops on `exc` (their environments are closed): EnvError also ends the pool."""
        if isinstance(exc, EnvError):
            self.close()

    def stream(
        self, engine, samples_per_prompt: int, sampling, feed, emit, between_steps=None, retries: int = 0
    ) -> None:
        """Episodes without a batch barrier (`rlhf_core.rollout.episode_stream.stream`): `feed(groups_in_flight)`
        gives more prompts (a list; None: no more ever), `emit(group)` gets each prompt's trajectories once all
        ended."""
        from rlhf_core.rollout.episode_stream import stream

        stream(self, engine, samples_per_prompt, sampling, feed, emit, between_steps, retries)

    def _take_reply(self, t: Trajectory, reply) -> str:
        """Apply an environment reply; returns who the trajectory waits for now: 'model' (its next turn), 'env'
        (a restart's reset, a finish) or 'end'."""
        if t.replaying is not None or reply.restart:  # its process was lost: replay its exchange, else restart
            turn = replay.take(self, t, reply) if t.replaying is not None else replay.start(self, t, reply.op)
            if turn is not None:
                return turn
            if t.restarts >= MAX_RESTARTS:
                return self._fail(  # another call's crash each time: not this environment's failure in a row
                    t, reply.op, f"its environment process was lost {t.restarts + 1} times", "process_died", False
                )
            t.restart()
            self.pool.reset(t.eid, t.row)
            return "env"
        self.steps += 1
        if reply.error is not None:
            return self._fail(t, reply.op, reply.error, reply.kind or "raised")
        if reply.op == "reset":
            t.opening = reply.value
            return self._opened(t, reply.value)
        if reply.op == "finish":
            if reply.value is not None:
                t.finish_reward = reply.value
                t.env_rewards.append(reply.value)
            return "end"
        self.consecutive_failures = 0
        observation, reward, done, info = reply.value
        t.answers.append(reply.value)
        t.env_rewards.append(reward)
        t.info = info
        calls = info.get("tool_calls", 0)
        t.tool_calls += len(calls) if isinstance(calls, (list, tuple)) else int(calls or 0)
        if t.transcript:
            t.transcript[-1].reward = reward
            if isinstance(calls, (list, tuple)):
                t.transcript[-1].tool_calls = list(calls)
        if done or observation is None:
            t.done = True
            return "end"
        if t.turns >= self.cfg.max_turns:
            return self._cut(t, "max_turns")
        messages = self.chat.as_messages(observation, self.cfg.observation_role)
        last = t.ids[t.last_turn[1] - 1] if t.ids else None
        try:
            obs_ids = self.chat.observation_ids(messages, last)
        except Exception as exc:  # noqa: BLE001 - the template's own error (an unknown role, ...): this trajectory's
            return self._fail(
                t, "step", f"its observation cannot be rendered: {type(exc).__name__}: {exc}", "bad_result"
            )
        if self.max_total_tokens is not None and t.length + len(obs_ids) >= self.max_total_tokens:
            return self._cut(t, "max_total_tokens")
        t.ids += obs_ids
        t.model += [False] * len(obs_ids)
        t.logprobs += [0.0] * len(obs_ids)
        # the version of the model token before it (of the model's turn, when that turn generated none)
        t.versions += [t.versions[-1] if t.versions else t.transcript[-1].version] * len(obs_ids)
        for m in messages:
            t.transcript.append(Turn(str(m.get("role")), str(m.get("content"))))
        return "model"

    def _fail(self, t: Trajectory, op: str, error: str, kind: str, charged: bool = True) -> str:
        """Trajectory t failed (an environment call, or what it returned); at supervision.max_consecutive_failures
        failed calls in a row the run stops with EnvError carrying the environment's error. charged=False: a
        failure that is not the environment's call's (lost with processes other calls crashed) is counted, but
        not as a failed call in a row."""
        t.error, t.error_kind = f"{op}: {error}", kind
        self.error_counts[kind] += 1
        self.consecutive_failures += int(charged)
        if self.consecutive_failures >= self.max_failures:
            raise EnvError(
                f"environment {self.cfg.description} failed "
                f"{self.consecutive_failures} calls in a row (supervision.max_consecutive_failures="
                f"{self.max_failures}); the last ({kind}): {t.error}"
            )
        return "end"

    def _cut(self, t: Trajectory, reason: str) -> str:
        """Trajectory t is cut short (`reason`): truncated; an environment with finish(reason) is asked for a
        final reward."""
        t.truncated, t.cut = True, reason
        if self.pool.has_finish:
            self.pool.finish(t.eid, reason)
            return "env"
        return "end"

    def _opened(self, t: Trajectory, opening) -> str:
        p = t.prompt
        if isinstance(opening, str) and opening in (p.text, t.row.get("prompt")):
            t.prompt_ids = list(p.prompt_ids)  # the row's own prompt, as the data pipeline tokenized it
            opening = p.messages or [{"role": "user", "content": p.prompt_text or p.text}]
            t.transcript += [Turn(str(m.get("role")), str(m.get("content"))) for m in opening]
        else:
            messages = self.chat.as_messages(opening, "user")
            try:
                t.prompt_ids = self.chat.prompt_ids(messages)
            except Exception as exc:  # noqa: BLE001 - the template's own error: this trajectory's
                return self._fail(
                    t, "reset", f"its result cannot be rendered: {type(exc).__name__}: {exc}", "bad_result"
                )
            t.transcript += [Turn(str(m.get("role")), str(m.get("content"))) for m in messages]
        if self.max_total_tokens is not None and t.length >= self.max_total_tokens:
            text = f"the opening prompt has {t.length} tokens, env.max_total_tokens={self.max_total_tokens}"
            return self._fail(t, "reset", text, "bad_result")
        return "model"

    def _generate(self, engine, batch: list[Trajectory], sampling, between_steps=None) -> list[Trajectory]:
        """One model turn for each trajectory of `batch`; sends each action to its environment. Returns the
        trajectories now waiting for the environment."""
        budgets = [
            sampling.max_new_tokens
            if self.max_total_tokens is None
            else min(sampling.max_new_tokens, self.max_total_tokens - t.length)
            for t in batch
        ]
        contexts = [Prompt(uid=i, prompt_ids=t.prompt_ids + t.ids, answers=[]) for i, t in enumerate(batch)]
        pb = collate_prompts(contexts, self.pad_token_id)
        params = replace(sampling, max_new_tokens=max(budgets))
        if between_steps is not None:
            # partial rollouts, between turns: possible with any engine, as the turn is prefilled afresh
            update = between_steps()
            if update is not None:
                engine.load_weights(*update)
        out = generate(engine, pb, 1, params, between_steps)  # and within the turn, where the engine can
        ids_rows = out.response_ids.tolist()
        logp_rows = out.behavior_logprobs.tolist()
        version_rows = out.versions_per_token().tolist()
        row_versions = out.policy_version.tolist()
        lengths = out.response_lengths.tolist()
        sent = []
        for t, ids, logps, versions, row_version, n, budget in zip(
            batch, ids_rows, logp_rows, version_rows, row_versions, lengths, budgets
        ):
            n = min(int(n), budget)
            turn = ids[:n]
            start = len(t.ids)
            t.ids += turn
            t.model += [True] * n
            t.logprobs += logps[:n]
            t.versions += versions[:n]
            t.last_turn = (start, start + n)
            t.turns += 1
            text = self.tokenizer.decode([i for i in turn if i not in self.stop_ids], skip_special_tokens=True)
            first, last = (versions[0], versions[n - 1]) if n else (row_version, row_version)
            t.transcript.append(Turn("assistant", text, version=int(first), last_version=int(last)))
            ended = bool(turn) and turn[-1] in self.stop_ids
            if not ended and self.max_total_tokens is not None and t.length >= self.max_total_tokens:
                # the model's turn was cut at the budget: the trajectory ends here
                if self._cut(t, "max_total_tokens") == "env":
                    sent.append(t)
                else:
                    self.pool.close_episode(t.eid)
                continue
            t.sent.append(text)
            self.pool.step(t.eid, text)
            sent.append(t)
        return sent

    def _grade(self, trajs: Sequence[Trajectory]) -> None:
        """info["success"] of the episodes whose environment asked for it with info["check_answer"] (the expected
        answer, as ToolEnv does): the project's answer matcher on the last model turn, the `contains` component
        of rlhf_core/reward/text (the answer as a whole number or word; number forms equal: 1,000 = 1000, 5 is
        not 15)."""
        todo = [t for t in trajs if t.error is None and str(t.info.get("check_answer") or "").strip()]
        if not todo:
            return
        from rlhf_core.config import RewardConfig
        from rlhf_core.reward.answers import patterns_from_texts
        from rlhf_core.reward.components import build_reward_fn, prepare_patterns

        if self._grader is None:
            self._grader = build_reward_fn(RewardConfig(components={"contains": 1.0}), self.tokenizer, self.stop_ids, 1)
        answers = [str(t.info.pop("check_answer")) for t in todo]
        batch = last_turn_batch(todo, self.pad_token_id, 0)
        patterns = prepare_patterns(self._grader, patterns_from_texts(self.tokenizer, answers))
        _, components = self._grader(batch.response_ids, patterns)
        for t, value in zip(todo, components["contains"].tolist()):
            t.info["success"] = value > 0
