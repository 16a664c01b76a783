"""Requests into engine calls: the agent endpoint's batching and its one generation thread.

Requests that arrive together are generated in one engine call. After the first request the batching task
waits until at least as many requests wait as there are open episodes with none in flight (`idle()`), or
`batch_wait_s` has passed, then generates them: those with the same sampling settings (and no seed) in one
call, on one thread of its own (the engine is never called from two threads). With partial rollouts the
rollout worker's weights hook is asked before every call and, where the engine takes it, between its decode
steps; every token keeps the version of the weights that generated it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Optional

import torch

from rlhf_core.agent.segments import Completion
from rlhf_core.data.prompts import Prompt, collate_prompts
from rlhf_core.rollout.base import SamplingParams
from rlhf_core.rollout.generate import generate


@dataclass
class _Job:
    """One request's rows to generate (a prompt per choice) and where the answer goes."""

    rows: list[list[int]]
    max_new: int
    sampling: SamplingParams
    seed: Optional[int]
    top: int
    future: asyncio.Future

    @property
    def key(self) -> tuple:
        s = self.sampling
        return (s.temperature, s.top_p, s.top_k, s.min_p, self.seed, id(self) if self.seed is not None else 0)


class Batcher:
    """Generates requests' rows with `engine` (set by the endpoint's `serve`), batched (module doc)."""

    def __init__(self, stop_ids, pad_token_id: int, batch_wait_s: float, idle: Callable[[], int]):
        self.stop_ids = [int(i) for i in stop_ids]
        self.pad_token_id = int(pad_token_id)
        self.batch_wait_s = float(batch_wait_s)
        self.idle = idle  # open episodes with no request in flight
        self.engine = None
        self.between_steps: Optional[Callable] = None  # partial rollouts: the worker's weights hook
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="agent-generate")
        self._queue: Optional[asyncio.Queue] = None
        self._task: Optional[asyncio.Task] = None

    async def generate(self, rows: list[list[int]], params: SamplingParams, seed: Optional[int], top: int):
        """(a Completion per row, per row the top log-probs at each position or None), once generated."""
        loop = asyncio.get_running_loop()
        if self._task is None:  # made on the endpoint's event loop, at its first request
            self._queue = asyncio.Queue()
            self._task = loop.create_task(self._loop())
        job = _Job(rows, params.max_new_tokens, params, seed, top, loop.create_future())
        await self._queue.put(job)
        return await job.future

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self._queue.get()]
            first = loop.time()
            while True:
                while not self._queue.empty():
                    jobs.append(self._queue.get_nowait())
                if len(jobs) >= self.idle() or loop.time() - first >= self.batch_wait_s:
                    break
                await asyncio.sleep(0.001)
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                try:
                    results = await loop.run_in_executor(self._executor, self._run_engine, group)
                except Exception as exc:  # noqa: BLE001 - every request of the call gets the error
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                for job, result in zip(group, results):
                    if not job.future.done():
                        job.future.set_result(result)

    @torch.no_grad()
    def _run_engine(self, group: list[_Job]) -> list[tuple[list[Completion], list]]:
        """One engine call for the rows of `group` (same sampling settings), on the generation thread."""
        engine = self.engine
        if self.between_steps is not None:  # partial rollouts: newer weights before the call
            update = self.between_steps()
            if update is not None:
                engine.load_weights(*update)
        rows = [r for job in group for r in job.rows]
        pb = collate_prompts([Prompt(uid=i, prompt_ids=r, answers=[]) for i, r in enumerate(rows)], self.pad_token_id)
        params = replace(group[0].sampling, max_new_tokens=max(job.max_new for job in group))
        seed = group[0].seed
        saved = engine.generator.get_state() if seed is not None and hasattr(engine, "generator") else None
        if saved is not None:
            engine.generator.manual_seed(int(seed))
        try:
            out = generate(engine, pb, 1, params, self.between_steps)
        finally:
            if saved is not None:
                engine.generator.set_state(saved)
        ids, logps = out.response_ids.tolist(), out.behavior_logprobs.tolist()
        versions, lengths = out.versions_per_token().tolist(), out.response_lengths.tolist()
        results, r = [], 0
        for job in group:
            completions, tops = [], []
            for prompt in job.rows:
                n = min(int(lengths[r]), job.max_new)
                c = Completion(ids[r][:n], logps[r][:n], versions[r][:n], bool(n) and ids[r][n - 1] in self.stop_ids)
                completions.append(c)
                tops.append(self._top(engine, prompt, c.ids, job.sampling, job.top) if job.top else None)
                r += 1
            results.append((completions, tops))
        return results

    @staticmethod
    def _top(engine, prompt: list[int], ids: list[int], sampling: SamplingParams, k: int) -> list[list[tuple]]:
        """The k most likely tokens and their log-probs at each generated position, under the distribution
        sampled from, at the weights that generated it (the engine's `top_logprobs`)."""
        return engine.top_logprobs(prompt, ids, sampling, k) if ids else []


def cut_at_stop(tokenizer, c: Completion, stops: list[str], stop_ids) -> None:
    """Stop strings: keep the ids up to the first token whose text completes a stop string (they were
    generated, with their log-probs) and the text before the stop string (`c.cut`)."""
    content = c.ids[:-1] if c.ids and c.ids[-1] in stop_ids else c.ids
    text = tokenizer.decode(content, skip_special_tokens=True)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return
    at = min(hits)
    for k in range(1, len(content) + 1):
        if any(s in tokenizer.decode(content[:k], skip_special_tokens=True) for s in stops):
            break
    c.ids, c.logprobs, c.versions = c.ids[:k], c.logprobs[:k], c.versions[:k]
    c.stopped = True
    c.cut = text[:at]
