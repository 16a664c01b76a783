"""The agent runner: each episode is the user's `async def run(client, row, **kwargs)` against the policy's
OpenAI-compatible endpoint (`rlhf_core.agent.server`), and its recorded requests become training segments
(`rlhf_core.agent.segments`).

For each episode the runner opens an episode on the endpoint (its own base URL, `/episodes/<id>/v1`), makes an
`openai.AsyncOpenAI` on it with the run's key (no retries: a retried request would be recorded twice) and
awaits the agent under `agent.timeout_s`. The agent returns the reward (a number), `{"reward": r, "metrics":
{...}}`, or None after posting the reward to `<base_url>/reward` (a returned value wins over a posted one).
Episodes run concurrently on one event loop (a thread of the runner's); the endpoint batches their requests.

Failures: an agent that raises, returns something else, or runs past `agent.timeout_s` fails its episode
alone (agent/errors, agent/timeouts): the group of that episode is left out of training (an infrastructure
failure is not a bad answer, as with environments) and the other groups train. An agent that blocks its
event loop (a blocking call in a coroutine) is given up on after the timeout plus `BLOCKED_GRACE_S`: its
episodes fail and the next batch runs on a fresh event loop. `supervision.max_consecutive_failures` failed episodes
in a row stop the run with the agent's error. With `agent.error_reward` set, an agent that raises (a framework's
error for malformed model output, e.g. DSPy's AdapterParseError) does not fail its episode: the episode trains
on what it generated with that reward (agent/errors_rewarded), so the policy learns from the bad output. Each
distinct error of a batch is printed once with how many episodes it ended (`report_errors`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import inspect
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Optional

import torch

from rlhf_core.agent.segments import EpisodeLog, as_metrics, as_reward, episode_batch, split_by_group
from rlhf_core.agent.server import AgentServer
from rlhf_core.config.base import MAX_CONSECUTIVE_FAILURES
from rlhf_core.data.prompts import Prompt, prompt_row
from rlhf_core.env.score import EVAL_TRAJECTORIES, TRACED_TRAJECTORIES
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.rollout.episodes import Collected
from rlhf_core.usercode import load_attr

log = logging.getLogger("rlhf_core.agent")
MAX_ERROR_TEXTS = 100  # distinct error texts a runner keeps (the first ones; later new ones are not kept)
ERROR_TEXT_CHARS = 500

BLOCKED_GRACE_S = 5.0  # past timeout_s, how long a batch waits for an event loop an agent blocks


class AgentError(RuntimeError):
    """The agent failed supervision.max_consecutive_failures episodes in a row (the message has its error)."""


def load_agent(path: str, name: str):
    fn = load_attr(path, name, "agent")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent: {name} in {path} must be an `async def run(client, row, **kwargs)` function")
    return fn


def _shared_pool(openai):
    """The episodes' one connection pool: an `openai.DefaultAsyncHttpxClient` that an episode's client cannot close
    (an agent that closes its client, `async with client:` or `await client.close()`, would otherwise close every
    other episode's connections); the runner closes it (`close_pool`)."""

    class SharedPool(openai.DefaultAsyncHttpxClient):
        async def aclose(self) -> None:  # an episode's client closing: the pool stays open for the others
            return None

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedPool()


class AgentRunner:
    """Runs the configured agent's episodes on the endpoint (`run`), and is the rollout worker's and the
    evaluator's way to them (`rollout`, `evaluate`)."""

    def __init__(
        self,
        agent_cfg,
        tokenizer,
        stop_ids: Sequence[int],
        model_name: str = "policy",
        max_context: Optional[int] = None,
        max_failures: int = MAX_CONSECUTIVE_FAILURES,
    ):
        """max_context: most tokens of a request's prompt plus completion (env.max_total_tokens; None: the
        model's); max_failures: failed episodes in a row that stop the run (supervision.max_consecutive_failures)."""
        self.cfg = agent_cfg
        self.max_failures = max_failures
        self.fn = load_agent(agent_cfg.path, agent_cfg.name)
        self.server = AgentServer(
            tokenizer,
            stop_ids,
            model_name=model_name,
            max_context=max_context,
            max_requests=agent_cfg.max_requests,
        )
        self.errors = 0  # failed episodes over the run (agent/errors), timeouts included
        self.timeouts = 0  # of which past agent.timeout_s (agent/timeouts)
        self.consecutive_failures = 0
        self.errors_rewarded = 0  # episodes whose agent raised, scored agent.error_reward (agent/errors_rewarded)
        self.error_texts: collections.Counter = collections.Counter()  # "<fate>: <error>" -> episodes it ended
        self.last_episodes: list[EpisodeLog] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._http = None  # the episodes' one HTTP connection pool, on the event loop that made it: (loop, client)

    # ------------------------------------------------------------------ episodes
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or not self._loop.is_running():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="agent-episodes", daemon=True).start()
            self._loop = loop
        return self._loop

    def run(
        self, engine, prompts: Sequence[Prompt], samples_per_prompt: int, sampling: SamplingParams, between_steps=None
    ) -> list[EpisodeLog]:
        """samples_per_prompt episodes per prompt (contiguous per prompt), run to their end, generating with
        `engine` under `sampling` (the endpoint's training settings) and `between_steps` (partial rollouts)."""
        self.server.start()
        self.server.serve(engine, sampling=sampling, between_steps=between_steps)
        episodes = [
            EpisodeLog(secrets.token_hex(8), prompt_row(p), p) for p in prompts for _ in range(samples_per_prompt)
        ]
        for e in episodes:
            self.server.open_episode(e)
        loop = self._event_loop()
        futures = [asyncio.run_coroutine_threadsafe(self._episode(e), loop) for e in episodes]
        _, late = concurrent.futures.wait(futures, timeout=self.cfg.timeout_s + BLOCKED_GRACE_S)
        if late:  # the event loop is blocked (time.sleep in a coroutine): give up on it, use a fresh one next
            for e, f in zip(episodes, futures):
                if f in late and e.error is None:
                    e.error, e.timed_out = (
                        f"the agent blocked its event loop past agent.timeout_s={self.cfg.timeout_s:g}",
                        True,
                    )
                    f.cancel()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        for e in episodes:
            self.server.close_episode(e.eid)
        self._count(episodes)
        self.last_episodes = episodes
        return episodes

    async def _episode(self, e: EpisodeLog) -> None:
        import openai

        start = time.perf_counter()
        client = openai.AsyncOpenAI(
            base_url=self.server.episode_url(e.eid),
            api_key=self.server.key,
            max_retries=0,
            timeout=self.cfg.timeout_s,
            http_client=self._http_client(),
        )
        try:
            value = await asyncio.wait_for(self.fn(client, copy.deepcopy(e.row), **self.cfg.kwargs), self.cfg.timeout_s)
            self._finish(e, value)
        except asyncio.TimeoutError:
            if time.perf_counter() - start >= self.cfg.timeout_s:
                e.error, e.timed_out = f"the agent ran past agent.timeout_s={self.cfg.timeout_s:g}", True
            else:
                e.error = "TimeoutError raised by the agent"
        except Exception as exc:  # noqa: BLE001 - the agent's failure is its episode's alone
            if self.cfg.error_reward is None:
                e.error = f"{type(exc).__name__}: {exc}"
            else:  # scored, not failed: the model's output made the agent raise
                e.raised, e.reward, e.metrics = f"{type(exc).__name__}: {exc}", float(self.cfg.error_reward), {}
        finally:
            e.latency_s = time.perf_counter() - start
            self.server.close_episode(e.eid)  # the client is not closed: its connection pool is the episodes' one

    def _http_client(self):
        """The episodes' one HTTP client, made on the running event loop at its first episode. An `AsyncOpenAI` per
        episode (each on its episode's base URL) over one connection pool: a client of its own per episode loaded
        the system's CA certificates each time (an SSL context per client, ~25 ms), which was most of an agent
        rollout's time on CPU (docs/benchmarks.md)."""
        import openai

        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop:
            self._http = (loop, _shared_pool(openai))
        return self._http[1]

    @staticmethod
    def _finish(e: EpisodeLog, value) -> None:
        """The episode's reward and metrics from what the agent returned (or posted)."""
        if value is None:
            if e.posted is None:
                raise ValueError("the agent returned None and posted no reward to <base_url>/reward")
            e.reward, e.metrics = e.posted["reward"], e.posted["metrics"]
        elif isinstance(value, dict):
            if "reward" not in value:
                raise ValueError(f"the agent returned a dict without 'reward' (keys: {sorted(value)})")
            e.reward, e.metrics = as_reward(value["reward"]), as_metrics(value.get("metrics"))
        else:
            e.reward = as_reward(value)

    def _count(self, episodes: list[EpisodeLog]) -> None:
        for text in report_errors(episodes, f"agent {self.cfg.name}"):
            if text in self.error_texts or len(self.error_texts) < MAX_ERROR_TEXTS:
                self.error_texts[text] += 1
        self.errors_rewarded += sum(e.raised is not None for e in episodes)
        for e in episodes:
            if e.error is None:
                self.consecutive_failures = 0
                continue
            self.errors += 1
            self.timeouts += int(e.timed_out)
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.max_failures:
                raise AgentError(
                    f"agent {self.cfg.name} ({self.cfg.path}) failed {self.consecutive_failures} episodes in a row "
                    f"(supervision.max_consecutive_failures={self.max_failures}): {e.error}"
                )

    def stats(self) -> dict:
        """agent/errors and agent/timeouts: failed episodes over the run so far; agent/errors_rewarded: episodes
        whose agent raised, scored agent.error_reward; agent_error_texts: each distinct error ("failed: ..." or
        "raised: ...") and how many episodes it ended (the run's MLflow artifact agent_errors.json)."""
        return {
            "agent/errors": float(self.errors),
            "agent/timeouts": float(self.timeouts),
            "agent/errors_rewarded": float(self.errors_rewarded),
            "agent_error_texts": dict(self.error_texts),
        }

    def close(self) -> None:
        self.server.close()
        if self._http is not None and self._http[0].is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._http[1].close_pool(), self._http[0]).result(timeout=5)
            except Exception:  # noqa: BLE001 - closing: a pool that does not close in time is dropped
                pass
        self._http = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    # ------------------------------------------------------------------ the rollout worker's hook
    def collect(self, context, prompts: Sequence[Prompt], between_steps=None) -> Collected:
        """The prompts' episodes (an `EpisodeRunner`, rlhf_core.rollout.episodes): episodes -> segments -> one batch
        (its groups block-major, `rlhf_core.agent.segments`), each row rewarded with its episode's reward; a group
        with a failed episode is left out. Columns: the reward's (NaN: not scored with an agent), then the agent's
        (on each episode's first row; NaN on its other rows, so that their means are per episode)."""
        G = context.samples_per_prompt
        episodes = self.run(context.engine, prompts, G, context.sampling, between_steps=between_steps)
        groups = [episodes[g * G : (g + 1) * G] for g in range(len(prompts))]
        kept = [group for group in groups if not any(e.error for e in group)]
        version = int(context.engine.version)
        device = getattr(context.engine, "device", "cpu")
        if not kept:
            batch, _ = episode_batch(groups[:1], context.pad_token_id, version, device)
            batch = batch.select(torch.arange(0, device=batch.response_ids.device))
            return Collected(batch, torch.zeros(0, device=batch.response_ids.device), {})
        batch, owners = episode_batch(kept, context.pad_token_id, version, device)
        dev = batch.response_ids.device

        def column(value) -> torch.Tensor:
            return torch.tensor([value(e) if first else float("nan") for e, first in owners], device=dev)

        rewards = torch.tensor([e.reward for e, _ in owners], dtype=torch.float32, device=dev)
        components = {
            "agent": column(lambda e: e.reward),
            "agent/requests_mean": column(lambda e: e.requests),
            "agent/prefix_breaks": column(lambda e: e.prefix_breaks),
            "agent/latency_s": column(lambda e: e.latency_s),
        }
        nan = torch.full((len(owners),), float("nan"), device=dev)
        for name in context.component_names or []:
            components.setdefault(name, nan)
        return Collected(batch, rewards, components)

    @staticmethod
    def split(batch, samples_per_prompt: int = 0) -> list:
        """One Experience per prompt, of any number of rows (an episode's segments: not G per prompt)."""
        return split_by_group(batch)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, engine, prompts: Sequence[Prompt], max_new_tokens: int) -> dict:
        """Each held-out prompt's episode run once, greedily. eval/accuracy: the fraction whose metrics say
        success (metrics["success"]) or, without one, whose reward is positive; a failed episode is not
        solved. Also eval/reward_mean, eval/requests_mean, eval/agent_errors."""
        greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        episodes = self.run(engine, prompts, 1, greedy)
        n = max(1, len(episodes))

        def solved(e: EpisodeLog) -> bool:
            if e.error is not None:
                return False
            return bool(e.metrics["success"]) if "success" in e.metrics else e.reward > 0

        return {
            "eval/accuracy": sum(solved(e) for e in episodes) / n,
            "eval/reward_mean": sum(e.reward or 0.0 for e in episodes) / n,
            "eval/requests_mean": sum(e.requests for e in episodes) / n,
            "eval/agent_errors": float(sum(e.error is not None for e in episodes)),
            # the first few episodes as trajectory-file records (not a metric): logged as MLflow traces
            EVAL_TRAJECTORIES: [episode_record(e) for e in episodes[:TRACED_TRAJECTORIES]],
        }


def episode_record(e: EpisodeLog) -> dict:
    """An episode as a trajectory-file record (rlhf_core.env.score.trajectory_record's keys), for its MLflow
    trace (tracking.traces): `messages`, each request's new messages (all of them when it rewrote the history)
    then its first choice's reply with the versions of its first and last tokens and its tool calls; and
    `requests`, one entry per request (`request_record`), which the trace makes one span each."""
    messages, requests, shown = [], [], []
    for i, call in enumerate(e.calls):
        sent = call.messages or [{"role": "user", "content": call.text or ""}]
        new = sent[len(shown) :] if sent[: len(shown)] == shown else sent
        new = [{"role": m["role"], "content": m.get("content", "")} for m in new]
        reply = (
            call.replies[0] if call.replies else {"role": "assistant", "content": call.texts[0] if call.texts else ""}
        )
        entry = request_record(i, call, new, reply)
        requests.append(entry)
        messages += new
        messages.append(
            {
                "role": "assistant",
                "content": entry["reply"]["content"],
                "policy_version": entry["reply_version_first"],
                "policy_version_last": entry["reply_version_last"],
                "tool_calls": entry["reply"]["tool_calls"],
            }
        )
        shown = list(sent) + [reply]
    firsts = [r["policy_version_first"] for r in requests if r["policy_version_first"] is not None]
    lasts = [r["policy_version_last"] for r in requests if r["policy_version_last"] is not None]
    if e.error is None:
        ended = "done"
    else:
        ended = "failed: timeout" if e.timed_out else "failed: error"
    return {
        "row": {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in e.row.items()},
        "messages": messages,
        "reward": e.reward,
        "turns": e.requests,
        "tool_calls": sum(len(m.get("tool_calls") or []) for m in messages),
        "success": bool(e.metrics["success"]) if "success" in e.metrics else None,
        "error": e.error,
        "policy_version": min(firsts) if firsts else None,
        "policy_version_last": max(lasts) if lasts else None,
        "trained_at": "eval",
        "ended": ended,
        "metrics": dict(e.metrics),
        "requests": requests,
        "prefix_breaks": e.prefix_breaks,
        "segments": len(e.segments),
        "latency_s": e.latency_s,
    }


def request_record(index: int, call, new: list[dict], reply: dict) -> dict:
    """One request of an episode: its new input messages, its first choice's reply (content and tool calls),
    its prompt and completion token counts (completion: every choice's, as the response's `usage` counts),
    the versions of the weights that generated its first and last tokens (over its choices; the first
    choice's alone as `reply_version_*`), its latency, and whether it started a segment (`new_segment`) that
    broke the episode's prefix (`prefix_break`)."""
    first = call.completions[0] if call.completions else None
    versions = [c.versions for c in call.completions if c.versions]
    return {
        "index": index,
        "kind": "chat" if call.messages is not None else "text",
        "messages": new,
        "reply": {
            "content": reply.get("content", "") or "",
            "tool_calls": [dict(c["function"]) for c in reply.get("tool_calls") or []],
        },
        "choices": len(call.completions),
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": sum(len(c.ids) for c in call.completions),
        "policy_version_first": min(v[0] for v in versions) if versions else None,
        "policy_version_last": max(v[-1] for v in versions) if versions else None,
        "reply_version_first": first.versions[0] if first is not None and first.versions else None,
        "reply_version_last": first.versions[-1] if first is not None and first.versions else None,
        "started_ns": call.started_ns,
        "latency_s": call.latency_s,
        "new_segment": call.new_segment,
        "prefix_break": call.prefix_break,
    }


class AgentEvaluator:
    """Held-out evaluation with an agent (`build.build_evaluator`): `evaluator()` runs the held-out episodes
    greedily with the engine's current weights."""

    def __init__(self, runner: AgentRunner, engine, prompts: list[Prompt], max_new_tokens: int):
        self.runner, self.engine, self.prompts, self.max_new_tokens = runner, engine, prompts, max_new_tokens

    def __call__(self) -> dict:
        return self.runner.evaluate(self.engine, self.prompts, self.max_new_tokens)


def report_errors(episodes: Sequence[EpisodeLog], who: str) -> list[str]:
    """Each distinct error of one batch of episodes, once, on the console: how many episodes it ended and what
    became of them (failed and left out, or scored agent.error_reward). Returns one "<fate>: <error>" per
    episode that ended with an error (the error cut to ERROR_TEXT_CHARS)."""
    texts = collections.Counter((e.error or e.raised, e.error is None) for e in episodes if e.error or e.raised)
    for (text, scored), n in texts.items():
        fate = "raised (scored agent.error_reward)" if scored else "failed (left out of training)"
        log.warning("%s: %d of %d episode(s) %s: %s", who, n, len(episodes), fate, text)
    return [
        f"{'raised' if scored else 'failed'}: {text[:ERROR_TEXT_CHARS]}"
        for (text, scored), n in texts.items()
        for _ in range(n)
    ]
