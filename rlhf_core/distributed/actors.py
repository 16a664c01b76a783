"""Ray actors around the core workers: prompt queue, experience buffer, weight store, rollout, trainer.

The rollout and trainer loops are long-running actor methods; the actors are threaded
(`max_concurrency`), so control calls (stats, stop, load weights, publish, evaluate, checkpoint) stay
answerable while a loop runs. Every blocking wait has a timeout and a message naming what it waited for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import fields
from pathlib import Path
from typing import Optional

import ray
import torch

from rlhf_core.buffer import VersionedReplayBuffer
from rlhf_core.data import Prompt, PromptSource
from rlhf_core.types import Experience, RolloutBatch, cat_rollouts

log = logging.getLogger("rlhf_core.distributed")


class WaitTimeout(TimeoutError):
    """A blocking wait ran past runtime.wait_timeout_s."""


def get_or_fail(ref, timeout_s: float, what: str):
    """ray.get with a timeout whose error names what was waited for."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what} (runtime.wait_timeout_s)") from None


def pack_state_dict(state_dict: dict[str, torch.Tensor]) -> dict:
    """CPU tensors as numpy views, which Ray's object store serialises and reads back zero-copy.

    bfloat16 has no numpy dtype: it travels as int16 bits and is viewed back on arrival.
    """
    out = {}
    for k, t in state_dict.items():
        if t.dtype == torch.bfloat16:
            out[k] = ("bfloat16", t.view(torch.int16).numpy())
        else:
            out[k] = ("", t.numpy())
    return out


def unpack_state_dict(packed: dict) -> dict[str, torch.Tensor]:
    """Inverse of pack_state_dict. Tensors share the (read-only) object-store memory: copy, don't write."""
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable numpy arrays: we only read them
        for k, (kind, arr) in packed.items():
            t = torch.from_numpy(arr)
            out[k] = t.view(torch.bfloat16) if kind == "bfloat16" else t
    return out


def pack_groups(groups: list[Experience]) -> list:
    """Experience groups with their tensors as numpy arrays, for a push or a take through Ray.

    Pickling a small torch tensor costs ~50x a numpy array (~100 us against ~2 us), and every group
    (~10 tensors) crosses two hops (rollout -> buffer -> trainer): as tensors that was ~80 ms per hop for
    16 groups on a loaded 2-core machine, as arrays ~3 ms (benchmarks/pipeline.py).
    """
    out = []
    for g in groups:
        tensors = {f.name: getattr(g.batch, f.name) for f in fields(g.batch)}
        if not all(t is None or (isinstance(t, torch.Tensor) and t.device.type == "cpu") for t in tensors.values()):
            out.append(g)  # not plain CPU tensors: let Ray pickle it as it is
            continue
        out.append({"batch": pack_state_dict({k: t.detach() for k, t in tensors.items() if t is not None}),
                    "prompt_id": g.prompt_id, "policy_version": g.policy_version})
    return out


def group_rows(group) -> int:
    """Completions in a group, packed (pack_groups) or not."""
    if isinstance(group, Experience):
        return len(group)
    return int(group["batch"]["response_ids"][1].shape[0])


def unpack_groups(packed: list) -> list[Experience]:
    """Inverse of pack_groups. Tensors get their own writable memory (received arrays may be read-only)."""

    def tensors(arrays: dict) -> dict[str, torch.Tensor]:
        writable = {k: (kind, arr if arr.flags.writeable else arr.copy()) for k, (kind, arr) in arrays.items()}
        return unpack_state_dict(writable)

    out = []
    for item in packed:
        if isinstance(item, Experience):
            out.append(item)
            continue
        out.append(Experience(batch=RolloutBatch(**tensors(item["batch"])), prompt_id=item["prompt_id"],
                              policy_version=item["policy_version"]))
    return out


# --------------------------------------------------------------------------------------------- queue
class PromptQueue:
    """Prompts waiting for a rollout worker. The flow schedules (`top_up`); when it does not, `get`
    refills from the seeded source itself, so the loop never waits on the flow."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.source = PromptSource(prompts, seed=seed)
        self.by_uid = {p.uid: p for p in prompts}
        self.queue: deque[Prompt] = deque()
        self.lock = threading.Lock()
        self.scheduled = 0
        self.served = 0

    def top_up(self, n: int) -> int:
        with self.lock:
            new = self.source.next(n)
            self.queue.extend(new)
            self.scheduled += len(new)
            return len(new)

    def get(self, n: int) -> list[Prompt]:
        with self.lock:
            if len(self.queue) < n:
                new = self.source.next(n - len(self.queue))
                self.queue.extend(new)
                self.scheduled += len(new)
            out = [self.queue.popleft() for _ in range(min(n, len(self.queue)))]
            self.served += len(out)
            return out

    def size(self) -> int:
        return len(self.queue)

    def stats(self) -> dict:
        return {"queued": len(self.queue), "scheduled": self.scheduled, "served": self.served,
                "epoch": self.source.epoch}

    def state_dict(self) -> dict:
        with self.lock:
            return {"source": self.source.state_dict(), "queued": [p.uid for p in self.queue]}

    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            self.source.load_state_dict(state["source"])
            self.queue = deque(self.by_uid[u] for u in state["queued"])


# --------------------------------------------------------------------------------------------- buffer
class ExperienceBuffer:
    """A VersionedReplayBuffer of prompt groups, plus admission control.

    Admission (the capacity rule AReaL uses): a rollout worker may start a batch of n groups only while
    admitted + n <= (max_staleness + version + 1) x prompts_per_step + wasted, so at steady state nothing
    is generated that could not be consumed within max_staleness (wasted = evicted + dropped groups, which
    are re-admitted so that eviction can never starve the trainer).
    """

    def __init__(self, max_size: int, max_staleness: int, prompts_per_step: int, admission: bool = True):
        self.buf = VersionedReplayBuffer(max_size, max_staleness)
        self.max_staleness = max_staleness
        self.admission_window = max_staleness
        self.prompts_per_step = prompts_per_step
        self.admission = admission
        self.admitted = 0
        self.paused = False
        self.lock = threading.Lock()
        self.version = 0
        self.weights_version = 0
        self.samples_pushed = 0
        self.given_back = 0

    def capacity(self) -> int:
        # Counted against the newest PUBLISHED weights (what new samples will be generated with), not the
        # trainer's version: with sync_every > 1 the two differ and the trainer's would admit stale work.
        s = self.buf.stats()
        wasted = s["evicted_stale"] + s["dropped_overflow"]
        return (self.admission_window + self.weights_version + 1) * self.prompts_per_step + wasted

    def set_admission_window(self, versions: int) -> None:
        """How many versions ahead of the published weights rollout may run (<= max_staleness, the hard bound)."""
        self.admission_window = max(0, min(int(versions), self.max_staleness))

    def set_weights_version(self, version: int) -> None:
        self.weights_version = max(self.weights_version, int(version))

    def advance(self, version: int, published_version: Optional[int] = None) -> int:
        """After a trainer step, in one round trip: the consumer's version (evicting what became stale)
        and, when the step published weights, their version for admission. Returns the number evicted."""
        if published_version is not None:
            self.set_weights_version(published_version)
        return self.set_version(version)

    def try_admit(self, n_groups: int) -> bool:
        with self.lock:
            if self.paused:
                return False
            if self.admission and self.admitted + n_groups > self.capacity():  # would be consumed too stale
                return False
            self.admitted += n_groups
            return True

    def release(self, n_groups: int) -> None:
        """Return an admission that will not be used (a worker loop stopping with one granted ahead)."""
        with self.lock:
            self.admitted = max(0, self.admitted - int(n_groups))

    def set_paused(self, paused: bool) -> None:
        self.paused = bool(paused)

    def push(self, groups: list) -> int:
        """Groups as pack_groups made them (or Experience objects). They are stored as they come: the
        buffer reads only policy_version, so a group crosses rollout -> buffer -> trainer without being
        unpacked and packed again in between."""
        accepted = 0
        for g in groups:
            accepted += bool(self.buf.push(g))
            self.samples_pushed += group_rows(g)
        return accepted

    def take(self, n: int, timeout_s: float, for_version: Optional[int] = None) -> list[Experience]:
        """Exactly n groups, oldest first (packed: unpack_groups), or [] if they did not arrive within timeout_s.

        for_version: the trainer version that will consume them (default: the buffer's version). The
        trainer prefetches the batch for V + 1 while step V trains; groups too stale for V + 1 are
        evicted on the way, so every group taken satisfies the staleness bound at the version that
        trains on it, while the buffer's own version stays V (pushes of V stay welcome, and a skipped
        step can still take for V)."""
        return self.buf.take_for(n, self.version if for_version is None else for_version, timeout_s)

    def give_back(self, groups: list) -> int:
        """Groups a take handed out that will not be trained on (the trainer stopped with a batch
        prefetched): back to the front of the buffer, uncounted from consumed. Returns how many went back."""
        back = self.buf.requeue(groups)
        self.given_back += len(groups)
        return back

    def set_version(self, version: int) -> int:
        """The consumer's version. Never moves back: the trainer's publish thread and a publish the flow
        asked for may report versions out of order."""
        with self.lock:
            self.version = max(self.version, int(version))
            return self.buf.set_version(self.version)

    def stats(self) -> dict:
        s = self.buf.stats()
        s.update({"admitted": self.admitted, "capacity": self.capacity(), "paused": self.paused,
                  "admission_window": self.admission_window,
                  "samples_pushed": self.samples_pushed, "given_back": self.given_back})
        return s


# --------------------------------------------------------------------------------------------- weights
class WeightStore:
    """The latest published weights: an object reference (one ray.put of a CPU state dict) and its version."""

    def __init__(self):
        self.version = -1
        self.ref = None
        self.published = 0
        self.publish_s_total = 0.0

    def publish(self, version: int, ref_box: list, publish_s: float) -> None:
        # the ref arrives inside a list so that Ray passes the reference instead of resolving it
        if version > self.version:
            self.version, self.ref = int(version), ref_box[0]
        self.published += 1
        self.publish_s_total += publish_s

    def get_if_newer(self, version: int):
        if self.ref is None or self.version <= version:
            return None
        return self.version, [self.ref]

    def stats(self) -> dict:
        return {"version": self.version, "published": self.published,
                "publish_s_mean": self.publish_s_total / self.published if self.published else 0.0}


# --------------------------------------------------------------------------------------------- rollout
class RolloutActor:
    """A RolloutWorker in its own process: loads the newest weights between batches, asks admission,
    takes prompts, generates, scores, pushes groups. Restarted by Ray if it dies."""

    def __init__(self, cfg, policy_dir: str, index: int, buffer, queue, store):
        from rlhf_core.models import load_policy
        from rlhf_core.reward import build_reward_fn
        from rlhf_core.rollout import RolloutWorker, SamplingParams, build_engine

        torch.set_num_threads(cfg.cluster.torch_threads)
        self.cfg, self.index = cfg, index
        self.buffer, self.queue, self.store = buffer, queue, store
        seed = cfg.trainer.seed + 1000 * (index + 1)
        torch.manual_seed(seed)
        model, tok = load_policy(policy_dir, dtype=cfg.model.dtype, device=cfg.model.device,
                                 trust_remote_code=cfg.model.trust_remote_code)
        reward_fn = build_reward_fn(cfg.reward, tok, tok.eos_token_id, cfg.rollout.max_new_tokens)
        engine = build_engine(cfg, model, tok, model_path=policy_dir, seed=seed)
        self.worker = RolloutWorker(engine, reward_fn, SamplingParams.from_config(cfg.rollout),
                                    cfg.rollout.samples_per_prompt, tok.pad_token_id, cfg.data.max_prompt_tokens)
        self.stop_event = threading.Event()
        self.timeout = cfg.runtime.wait_timeout_s
        self.syncs: list[dict] = []
        self.groups_pushed = 0
        self.pending_push = None  # (future, n_groups) of a push not yet confirmed (async loop only)
        self._push_pool = None  # the async loop's push thread, made on first use
        # seconds outside generation, by phase (stats: per batch): where the rollout's cycle goes
        self.phase_s = {"weights": 0.0, "prompts": 0.0, "split": 0.0, "push": 0.0}
        self.work_started: Optional[float] = None  # wall clock of the first batch: busy_frac's denominator
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.loop_running = False

    def ping(self) -> dict:
        return {"index": self.index, "restarted": self.restarted, "version": self.worker.version}

    def maybe_load_weights(self) -> bool:
        """Between batches only: adopt the newest published weights if they are newer than ours."""
        asked = time.perf_counter()
        found = get_or_fail(self.store.get_if_newer.remote(self.worker.version), self.timeout, "the weight store")
        if found is None:
            self.phase_s["weights"] += time.perf_counter() - asked
            return False
        version, (ref,) = found
        start = time.perf_counter()
        state_dict = unpack_state_dict(get_or_fail(ref, self.timeout, f"weights of version {version}"))
        fetched = time.perf_counter()
        self.worker.load_weights(state_dict, version)
        done = time.perf_counter()
        self.syncs.append({"version": version, "fetch_s": fetched - start, "load_s": done - fetched, "stall_s": done - start})
        self.phase_s["weights"] += done - asked
        return True

    def generate_once(self, n_prompts: int, wait: bool = True, prompts_ref=None) -> int:
        """Take n prompts, generate, push. Returns groups generated (sync mode calls this directly).

        wait=False (the async loop) packs and pushes on a helper thread and does not wait for the buffer to
        accept this push, only for the previous one: at most one push is in flight, pushes stay in order,
        and a failed push surfaces a batch later.
        prompts_ref: a prompt-queue request already sent (the async loop sends it beside the weights check).
        """
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        prompts = get_or_fail(prompts_ref or self.queue.get.remote(n_prompts), self.timeout, "prompts from the prompt queue")
        t1 = time.perf_counter()
        self.phase_s["prompts"] += t1 - t0
        if not prompts:
            return 0
        busy_before = self.worker.busy_s
        groups = self.worker.generate_groups(prompts)
        t2 = time.perf_counter()
        self.phase_s["split"] += (t2 - t1) - (self.worker.busy_s - busy_before)  # what generate_groups adds to rollout()
        self.confirm_push()
        if wait:
            self._push(groups)
            self.groups_pushed += len(groups)
        else:  # packing, serialising and the buffer's answer happen on the push thread, beside the next batch
            if self._push_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._push_pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-push")
            self.pending_push = (self._push_pool.submit(self._push, groups), len(groups))
        self.phase_s["push"] += time.perf_counter() - t2
        return len(groups)

    def _push(self, groups: list[Experience]) -> None:
        get_or_fail(self.buffer.push.remote(pack_groups(groups)), self.timeout, "the replay buffer to accept a push")

    def confirm_push(self) -> None:
        """Wait for the push in flight, if any, and count its groups."""
        if self.pending_push is not None:
            future, n_groups = self.pending_push
            self.pending_push = None
            future.result()  # a failed push surfaces here, a batch later
            self.groups_pushed += n_groups

    def run_loop(self) -> dict:
        """Generate continuously until stop(); idle time (admission denied, weights loading) is counted.

        Round trips overlap where the order allows: the prompt request goes out beside the weights check,
        and the next batch's admission request goes out before this batch generates, so its answer is
        waiting when generation ends. The staleness bound does not rest on admission (the buffer evicts
        and the trainer checks), and the batch still loads the newest weights when it starts; what an
        early grant can cost is one batch generated after a pause or a narrowed admission window. A
        grant the loop does not use is released when it ends."""
        self.stop_event.clear()
        self.loop_running = True
        n = self.cfg.rollout.prompts_per_batch
        admit_ref = None
        try:
            while not self.stop_event.is_set():
                t0 = time.perf_counter()
                admitted = get_or_fail(admit_ref or self.buffer.try_admit.remote(n), self.timeout,
                                       "admission from the replay buffer")
                admit_ref = None
                if not admitted:
                    self.stop_event.wait(0.005)
                    self.worker.add_idle(time.perf_counter() - t0)
                    continue
                self.worker.add_idle(time.perf_counter() - t0)
                prompts_ref = self.queue.get.remote(n)
                self.maybe_load_weights()  # admitted against version v: weights >= v are published, load them
                admit_ref = self.buffer.try_admit.remote(n)
                self.generate_once(n, wait=False, prompts_ref=prompts_ref)
            self.confirm_push()
        finally:
            self.loop_running = False
            if admit_ref is not None:
                self._release_unused(admit_ref, n)
        return self.stats()

    def _release_unused(self, admit_ref, n: int) -> None:
        """Return a grant for a batch that will not be generated, so the capacity stays exact (best effort:
        the loop may be ending because the buffer is unreachable)."""
        try:
            if get_or_fail(admit_ref, self.timeout, "admission from the replay buffer"):
                get_or_fail(self.buffer.release.remote(n), self.timeout, "the replay buffer to release an admission")
        except Exception as exc:
            log.warning("rollout worker %d could not release an unused admission: %s", self.index, exc)

    def stop(self) -> None:
        self.stop_event.set()

    def stats(self) -> dict:
        s = self.worker.stats()
        stalls = [x["stall_s"] for x in self.syncs]
        s.update({"index": self.index, "restarted": self.restarted, "groups_pushed": self.groups_pushed,
                  "syncs": len(self.syncs), "sync_stall_s_mean": sum(stalls) / len(stalls) if stalls else 0.0,
                  "sync_stall_s_max": max(stalls) if stalls else 0.0,
                  "batch_s_mean": s["busy_s"] / s["batches"] if s["batches"] else 0.0,
                  "phase_s_per_batch": {k: v / s["batches"] if s["batches"] else 0.0 for k, v in self.phase_s.items()},
                  "loop_running": self.loop_running, "busy_frac": busy_fraction(s["busy_s"], self.work_started)})
        return s

    def rng_state(self) -> torch.Tensor:
        return self.worker.engine.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.worker.engine.generator.set_state(state)

    def crash(self) -> None:
        """Fault-injection hook: die the way a segfault or an OOM kill would."""
        _die()


# --------------------------------------------------------------------------------------------- trainer
class TrainerActor:
    """The Trainer in its own process: takes whole batches of groups, steps, publishes weights."""

    def __init__(self, cfg, policy_dir: str, heldout: list[Prompt], buffer, store):
        from rlhf_core.models import load_policy
        from rlhf_core.reward import build_reward_fn
        from rlhf_core.rollout import HFEngine
        from rlhf_core.trainer import Trainer

        torch.set_num_threads(cfg.cluster.torch_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.cfg, self.buffer, self.store, self.heldout = cfg, buffer, store, heldout
        self.policy_dir = policy_dir
        self.model, self.tokenizer = load_policy(policy_dir, dtype=cfg.model.dtype, device=cfg.model.device,
                                                 trust_remote_code=cfg.model.trust_remote_code)
        self.trainer = Trainer(self.model, cfg, self.tokenizer.pad_token_id)
        self.reward_fn = build_reward_fn(cfg.reward, self.tokenizer, self.tokenizer.eos_token_id, cfg.rollout.max_new_tokens)
        self.eval_engine = HFEngine(self.model, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, seed=cfg.trainer.seed)
        self.lock = threading.Lock()  # one of: train step, evaluation, checkpoint, export
        self.stop_event = threading.Event()
        self.metrics: list[dict] = []
        self.idle_s = 0.0
        self.work_started: Optional[float] = None  # wall clock of the first step: busy_frac's denominator
        self.timeout = cfg.runtime.wait_timeout_s
        self.error: Optional[str] = None
        self.staleness_hist: dict[int, int] = {}
        self.last_publish_s: Optional[float] = None

    def publish(self) -> float:
        """Publish the current weights now (the flow's "sync sooner"); returns seconds. Waits for a
        running step to finish, so the snapshot is never torn."""
        start = time.perf_counter()
        with self.lock:
            snapshot, version = self.trainer.state_dict_for_sync(), self.trainer.version
        self._ship(version, snapshot, published=True)
        return time.perf_counter() - start

    def _ship(self, version: int, snapshot: Optional[dict], published: bool) -> None:
        """After a step (or a publish request): one ray.put of the CPU snapshot, registered in the weight
        store, then the buffer's version update, in that order: the buffer learns the published version
        (for admission) only after the store holds the weights, so a worker admitted against version v
        always finds weights >= v. Records the publish seconds in self.last_publish_s."""
        start = time.perf_counter()
        if snapshot is not None:
            ref = ray.put(pack_state_dict(snapshot))
            get_or_fail(self.store.publish.remote(version, [ref], time.perf_counter() - start),
                        self.timeout, "the weight store to register a publish")
        get_or_fail(self.buffer.advance.remote(version, version if published else None), self.timeout,
                    "the replay buffer version update")
        if snapshot is not None:
            self.last_publish_s = time.perf_counter() - start

    def _take_batch(self, wait_s: float, for_version: Optional[int] = None) -> list[Experience]:
        """prompts_per_step groups from the buffer, unpacked, or [] if they did not arrive within wait_s."""
        return unpack_groups(get_or_fail(self.buffer.take.remote(self.cfg.trainer.prompts_per_step, wait_s, for_version),
                                         wait_s + self.timeout, "a batch from the replay buffer"))

    def train_once(self, wait_s: Optional[float] = None) -> Optional[dict]:
        """Take prompts_per_step groups (waiting up to wait_s), train one step, publish by sync_every, in
        lockstep: everything is done when it returns (sync mode)."""
        t0 = time.perf_counter()
        self.work_started = self.work_started or t0
        groups = self._take_batch(wait_s if wait_s is not None else self.timeout)
        self.idle_s += time.perf_counter() - t0
        return self._train_on(groups, t0) if groups else None

    def _train_on(self, groups: list[Experience], t0: float, shipper=None) -> dict:
        """One trainer step on these groups (t0: when waiting for them began). The weights snapshot (when
        sync_every says so) is taken at once; shipping it and advancing the buffer happen here, or on the
        `shipper` executor while the next step runs."""
        t1 = time.perf_counter()
        with self.lock:
            batch = cat_rollouts([g.batch for g in groups], self.tokenizer.pad_token_id)
            consumer_version = self.trainer.version
            staleness = consumer_version - batch.policy_version
            if int(staleness.max()) > self.cfg.runtime.max_staleness:  # the buffer guarantees this; never train on it
                raise RuntimeError(f"staleness bound violated: tau={int(staleness.max())} > max_staleness")
            for tau, count in zip(*torch.unique(staleness, return_counts=True)):
                self.staleness_hist[int(tau)] = self.staleness_hist.get(int(tau), 0) + int(count)
            m = self.trainer.train_step(batch)
            version = self.trainer.version
            due = bool(m["trainer/step_finite"]) and version % self.cfg.runtime.sync_every == 0
            # copied now, under the lock: the next optimizer step changes the weights in place
            snapshot = self.trainer.state_dict_for_sync() if due else None
        (shipper or self._ship)(version, snapshot, due)
        if due and self.last_publish_s is not None:
            m["sync/latency_s"] = self.last_publish_s  # in async mode: the latest publish that has completed
        t2 = time.perf_counter()
        m.update({"time/train_s": t2 - t1, "time/wait_s": t1 - t0, "step": self.trainer.step,
                  "throughput/samples_per_s": len(batch) / max(1e-9, t2 - t0),
                  "throughput/tokens_per_s": batch.num_tokens / max(1e-9, t2 - t0)})
        self.metrics.append(m)
        return m

    def run_loop(self, total_steps: int) -> dict:
        """Train until total_steps or stop(), continuously (async mode).

        Two helper threads keep the data plane off the trainer's critical path: with runtime.prefetch
        one takes (and unpacks) the batch for version V + 1 while step V trains, and one ships each
        published snapshot and advances the buffer, one at a time and in order, while the next step
        trains. A batch still prefetched when the loop ends goes back to the buffer; the last publish
        completes first.
        """
        from concurrent.futures import ThreadPoolExecutor

        self.stop_event.clear()
        wait_s = 0.5
        nxt = None
        shipping = None  # the publish in flight, if any

        def ship(version, snapshot, published):
            # one publish in flight: at most two snapshots exist (shipping, and this one), and a failed
            # publish or buffer update surfaces here, a step later
            nonlocal shipping
            if shipping is not None:
                shipping.result()
            shipping = shipper_pool.submit(self._ship, version, snapshot, published)

        try:
            with ThreadPoolExecutor(1, thread_name_prefix="trainer-prefetch") as take_pool, \
                    ThreadPoolExecutor(1, thread_name_prefix="trainer-publish") as shipper_pool:
                try:
                    while self.trainer.step < total_steps and not self.stop_event.is_set():
                        t0 = time.perf_counter()
                        self.work_started = self.work_started or t0
                        fut = nxt or take_pool.submit(self._take_batch, wait_s, self.trainer.version)
                        nxt = None
                        groups = fut.result()
                        self.idle_s += time.perf_counter() - t0
                        if not groups:
                            continue
                        if self.cfg.runtime.prefetch and self.trainer.step + 1 < total_steps:
                            nxt = take_pool.submit(self._take_batch, wait_s, self.trainer.version + 1)
                        self._train_on(groups, t0, shipper=ship)
                except BaseException:
                    self._settle(shipping, nxt, quiet=True)  # the loop's own error is the one to report
                    raise
                self._settle(shipping, nxt, quiet=False)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        return self.stats()

    def _settle(self, shipping, prefetched, quiet: bool) -> None:
        """When the loop ends: wait for the publish in flight, then return a prefetched, untrained batch
        to the buffer so that the accounting still adds up. quiet: log failures instead of raising them."""
        def attempt(fn, what: str):
            try:
                return fn()
            except Exception as exc:
                if not quiet:
                    raise
                log.warning("%s failed while the trainer loop was ending: %s", what, exc)
                return None

        try:
            if shipping is not None:
                attempt(shipping.result, "a weights publish")
        finally:  # even when a publish failed: the accounting must still add up
            groups = attempt(prefetched.result, "the prefetched take") if prefetched is not None else None
            if groups:
                attempt(lambda: get_or_fail(self.buffer.give_back.remote(pack_groups(groups)), self.timeout,
                                            "the replay buffer to take back a prefetched batch"), "the give-back")

    def stop(self) -> None:
        self.stop_event.set()

    def drain_metrics(self) -> list[dict]:
        out, self.metrics = self.metrics, []
        return out

    def evaluate(self) -> dict:
        from rlhf_core.loop import evaluate

        with self.lock:
            return evaluate(self.eval_engine, self.heldout, self.reward_fn, self.tokenizer.pad_token_id,
                            self.cfg.rollout.max_new_tokens, max_prompt_tokens=self.cfg.data.max_prompt_tokens)

    def checkpoint(self, path: str, extra: dict) -> str:
        from rlhf_core.checkpoint import capture_rng, save_checkpoint

        with self.lock:
            state = {"trainer": self.trainer.state_dict(), "rng": capture_rng(), **extra}
            return str(save_checkpoint(path, self.model, state))

    def restore(self, path: str) -> dict:
        """Validate, then restore weights/optimizer/versions/RNG; returns the checkpoint state for the others."""
        from rlhf_core.checkpoint import load_weights_into, read_checkpoint, restore_rng

        with self.lock:
            state, weights = read_checkpoint(path, self.model)
            load_weights_into(self.model, weights)
            self.trainer.load_state_dict(state["trainer"])
            restore_rng(state["rng"])
        return {k: v for k, v in state.items() if k not in ("trainer", "rng")}

    def export(self, path: str) -> str:
        with self.lock:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out)
            self.tokenizer.save_pretrained(out)
            return str(out)

    def stats(self) -> dict:
        s = self.trainer.stats()
        s.update({"idle_s": self.idle_s, "busy_frac": busy_fraction(s["busy_s"], self.work_started), "error": self.error,
                  "staleness_hist": dict(self.staleness_hist), "consecutive_skips": self.trainer.consecutive_skips})
        return s

    def version(self) -> int:
        return self.trainer.version

    def crash(self) -> None:
        """Fault-injection hook: die the way a segfault or an OOM kill would."""
        _die()


def busy_fraction(busy_s: float, since: Optional[float]) -> float:
    """Busy seconds over wall-clock seconds since the role's first piece of work: every wait, round trip,
    weight load and transfer counts as not busy, so the figure cannot flatter the pipeline."""
    if since is None:
        return 0.0
    return min(1.0, busy_s / max(1e-9, time.perf_counter() - since))


def _die() -> None:
    import os

    os._exit(1)
