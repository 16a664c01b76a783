"""Replay buffers: FIFO and overflow, staleness boundaries, group assembly and advantages, waiting and
closing, thread safety, and the accounting invariant under random operation sequences."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rlhf_core.algorithms.advantages import compute_grpo_advantages
from rlhf_core.buffer import BoundedReplayBuffer, GroupAwareReplayBuffer, GroupEntry, VersionedReplayBuffer
from rlhf_core.types import Experience, RolloutBatch


@dataclass
class Sample:
    id: int
    prompt_id: int = 0
    reward: float = 0.0
    policy_version: int = 0
    advantage: Optional[float] = None


def balanced(stats: dict) -> bool:
    return stats["pushed"] == (
        stats["sampled"] + stats["evicted_stale"] + stats["dropped_overflow"] + stats["size"] + stats["pending"]
    )


def make_experience(prompt_id: int, version: int, rewards: list[float]) -> Experience:
    n = len(rewards)
    batch = RolloutBatch(
        prompt_ids=torch.zeros(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.zeros(n, 3, dtype=torch.long),
        response_mask=torch.ones(n, 3, dtype=torch.bool),
        behavior_logprobs=torch.zeros(n, 3),
        response_lengths=torch.full((n,), 3),
        group_ids=torch.zeros(n, dtype=torch.long),
        policy_version=torch.full((n,), version),
        rewards=torch.tensor(rewards),
    )
    return Experience(batch=batch, prompt_id=prompt_id, policy_version=version)


# ---------------------------------------------------------------- BoundedReplayBuffer


def test_bounded_fifo_and_overflow_discards_oldest():
    buf = BoundedReplayBuffer(3)
    for i in range(5):
        assert buf.push(i)
    assert len(buf) == 3
    s = buf.stats()
    assert (s["dropped_overflow"], s["size"], s["pending"]) == (2, 3, 0) and balanced(s)
    assert buf.sample(2) == [2, 3]
    assert buf.sample(10) == [4]
    assert buf.sample(1) == [] and buf.sample(0) == []
    assert buf.stats()["sampled"] == 3 and balanced(buf.stats())


def test_bounded_push_many_counts_overflow_including_its_own_items():
    buf = BoundedReplayBuffer(4)
    assert buf.push_many([0, 1, 2]) == 3
    assert buf.push_many(iter(range(3, 9))) == 6  # 9 items into 4 slots: 5 oldest dropped
    assert buf.sample(10) == [5, 6, 7, 8]
    s = buf.stats()
    assert (s["pushed"], s["dropped_overflow"], s["sampled"]) == (9, 5, 4) and balanced(s)


def test_clear_empties_and_starts_a_new_accounting_period():
    buf = VersionedReplayBuffer(4, max_staleness=1)
    buf.set_version(5)
    buf.push_many([{"policy_version": 5}] * 6)
    buf.clear()
    s = buf.stats()
    assert len(buf) == 0 and s["pushed"] == s["dropped_overflow"] == 0 and s["version"] == 5 and balanced(s)


def test_sample_without_timeout_returns_at_once_and_timeout_is_bounded():
    buf = BoundedReplayBuffer(8)
    t0 = time.monotonic()
    assert buf.sample(4) == []
    assert buf.sample(4, timeout=0) == []
    assert time.monotonic() - t0 < 0.05
    t0 = time.monotonic()
    assert buf.sample(4, timeout=0.1) == []
    assert 0.09 <= time.monotonic() - t0 < 1.0
    buf.push("a")  # min_items not reached by the deadline: what is there comes back
    t0 = time.monotonic()
    assert buf.sample(4, timeout=0.1, min_items=3) == ["a"]
    assert 0.09 <= time.monotonic() - t0 < 1.0


def test_waiting_sampler_wakes_on_push():
    buf = BoundedReplayBuffer(8)
    threading.Timer(0.05, buf.push_many, args=([1, 2],)).start()
    t0 = time.monotonic()
    assert buf.sample(4, timeout=0.2, min_items=2) == [1, 2]
    assert time.monotonic() - t0 < 0.2


@pytest.mark.parametrize(
    "make",
    [
        lambda: BoundedReplayBuffer(8),
        lambda: VersionedReplayBuffer(8, max_staleness=1),
        lambda: GroupAwareReplayBuffer(2, 8),
    ],
)
def test_close_wakes_a_waiting_sampler_and_refuses_pushes(make):
    buf = make()
    result = {}

    def wait():
        t0 = time.monotonic()
        result["got"] = buf.sample(4, timeout=math.inf)
        result["waited"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    buf.close()
    waiter.join(timeout=1.0)
    assert not waiter.is_alive() and result["got"] == [] and result["waited"] < 1.0
    item = {"id": 0, "policy_version": 0, "prompt_id": 0, "reward": 1.0}
    assert buf.push(item) is False
    s = buf.stats()
    assert s["closed"] and s["pushed"] == 0 and s["rejected_closed"] == 1 and balanced(s)
    assert buf.sample(1, timeout=0.2) == []  # closed: no waiting


# ---------------------------------------------------------------- VersionedReplayBuffer


def test_versioned_staleness_boundaries_are_exact():
    buf = VersionedReplayBuffer(100, max_staleness=2)
    assert buf.set_version(10) == 0
    assert buf.push(Sample(0, policy_version=8))  # 10 - 2: still fresh
    assert not buf.push(Sample(1, policy_version=7))  # 10 - 3: stale, refused and counted
    assert buf.push({"id": 2, "policy_version": 9})
    assert buf.push(Sample(3, policy_version=12))
    s = buf.stats()
    assert (s["pushed"], s["evicted_stale"], s["size"], s["version"], s["max_staleness"]) == (4, 1, 3, 10, 2)
    assert buf.set_version(11) == 1  # version 8 is now 11 - 3
    got = buf.sample(10)
    assert [x.id if isinstance(x, Sample) else x["id"] for x in got] == [2, 3]
    assert buf.stats()["evicted_stale"] == 2 and balanced(buf.stats())


def test_versioned_push_many_filters_stale_and_set_version_can_go_back():
    buf = VersionedReplayBuffer(10, max_staleness=0)
    buf.set_version(3)
    assert buf.push_many([{"policy_version": v} for v in (1, 2, 3, 3, 4)]) == 3
    s = buf.stats()
    assert (s["pushed"], s["evicted_stale"], s["size"]) == (5, 2, 3) and balanced(s)
    assert buf.set_version(1) == 0  # nothing becomes stale going back
    assert buf.set_version(4) == 2
    assert buf.sample(10) == [{"policy_version": 4}]


def test_versioned_requires_policy_version():
    buf = VersionedReplayBuffer(4, max_staleness=1)
    with pytest.raises(AttributeError, match="policy_version"):
        buf.push({"id": 1})
    with pytest.raises(AttributeError, match="policy_version"):
        buf.push(object())
    assert buf.stats()["pushed"] == 0  # a refused malformed item never entered
    buf.push({"policy_version": torch.tensor(0)})  # integer tensors and numpy ints are fine


def test_versioned_with_experience_items():
    buf = VersionedReplayBuffer(8, max_staleness=1)
    old, new = make_experience(1, 0, [1.0, 0.0]), make_experience(2, 2, [0.0, 0.0])
    buf.push(old)
    buf.push(new)
    assert buf.set_version(2) == 1
    assert buf.sample(4) == [new]


# ---------------------------------------------------------------- GroupAwareReplayBuffer


def test_group_emits_only_when_full():
    buf = GroupAwareReplayBuffer(group_size=4, max_size=16)
    for i in range(3):
        buf.push(Sample(i, prompt_id=7, reward=float(i)))
        assert buf.sample(1) == [] and len(buf) == 0
    s = buf.stats()
    assert (s["pending"], s["pending_groups"], s["size"]) == (3, 1, 0) and balanced(s)
    buf.push(Sample(3, prompt_id=7, reward=3.0))
    s = buf.stats()
    assert (s["pending"], s["size"], s["ready_groups"]) == (0, 4, 1) and balanced(s)
    [group] = buf.sample(5)
    assert isinstance(group, GroupEntry) and group.prompt_id == 7 and len(group) == 4
    assert [x.id for x in group] == [0, 1, 2, 3] and group[1].id == 1 and group.items[3].id == 3
    assert torch.equal(group.rewards, torch.tensor([0.0, 1.0, 2.0, 3.0]))
    expected = compute_grpo_advantages(group.rewards, scale="group")
    assert torch.allclose(group.advantages, expected, atol=1e-6)
    assert group.advantages.dtype == torch.float32 and abs(float(group.advantages.mean())) < 1e-6
    assert [x.advantage for x in group] == pytest.approx(group.advantages.tolist())


def test_group_zero_variance_rewards_get_exact_zero_advantages():
    buf = GroupAwareReplayBuffer(group_size=5, max_size=20)
    for reward in (0.1, 1.0, 0.0):
        for _ in range(5):
            buf.push({"prompt_id": reward, "reward": reward, "policy_version": 0})
    groups = buf.sample(3)
    assert len(groups) == 3
    for group in groups:
        assert torch.equal(group.advantages, torch.zeros(5))
        assert not torch.isnan(group.advantages).any()
        assert all(item["advantage"] == 0.0 for item in group)


def test_group_single_completion_groups_are_zero_not_nan():
    buf = GroupAwareReplayBuffer(group_size=1, max_size=4)
    buf.push(Sample(0, reward=3.0))
    [group] = buf.sample(1)
    assert torch.equal(group.advantages, torch.zeros(1))


def test_group_interleaved_prompts_complete_in_completion_order():
    buf = GroupAwareReplayBuffer(group_size=3, max_size=30)
    order = ["a", "b", "c", "a", "b", "a", "c", "b", "c"]  # a completes first, then b, then c
    for i, prompt in enumerate(order):
        buf.push({"id": i, "prompt_id": prompt, "reward": float(i), "policy_version": i % 2})
    groups = buf.sample(10)
    assert [g.prompt_id for g in groups] == ["a", "b", "c"]
    assert [[x["id"] for x in g] for g in groups] == [[0, 3, 5], [1, 4, 7], [2, 6, 8]]
    assert [g.policy_version for g in groups] == [0, 0, 0]  # the oldest item's version
    for g in groups:
        assert torch.allclose(g.advantages, compute_grpo_advantages(g.rewards), atol=1e-6)


def test_group_prompt_ids_as_tensors_group_by_value():
    buf = GroupAwareReplayBuffer(group_size=2, max_size=4)
    buf.push({"prompt_id": torch.tensor(5), "reward": torch.tensor(1.0)})
    buf.push({"prompt_id": torch.tensor(5), "reward": torch.tensor(0.0)})
    [group] = buf.sample(1)
    assert group.prompt_id == 5 and group.policy_version is None


def test_group_stale_partial_and_ready_groups_are_evicted():
    buf = GroupAwareReplayBuffer(group_size=3, max_size=30, max_staleness=1)
    for i in range(3):
        buf.push(Sample(i, prompt_id=0, policy_version=0))  # ready, version 0
    buf.push(Sample(10, prompt_id=1, policy_version=1))  # partial, version 1
    buf.push(Sample(11, prompt_id=2, policy_version=0))  # partial, version 0
    buf.push(Sample(12, prompt_id=2, policy_version=2))  # its oldest item decides: 0
    assert buf.set_version(1) == 0  # 0 is still 1 - 1
    assert buf.set_version(2) == 5  # ready group (3) + partial of prompt 2 (2)
    s = buf.stats()
    assert (s["evicted_stale"], s["size"], s["pending"], s["pending_groups"]) == (5, 0, 1, 1) and balanced(s)
    assert not buf.push(Sample(20, prompt_id=1, policy_version=0))  # stale push refused
    assert buf.push(Sample(21, prompt_id=1, policy_version=1))
    assert buf.push(Sample(22, prompt_id=1, policy_version=2))
    [group] = buf.sample(2)
    assert [x.id for x in group] == [10, 21, 22] and group.policy_version == 1
    assert balanced(buf.stats()) and buf.stats()["evicted_stale"] == 6


def test_group_with_staleness_requires_versions():
    buf = GroupAwareReplayBuffer(group_size=2, max_size=4, max_staleness=1)
    with pytest.raises(AttributeError, match="policy_version"):
        buf.push({"prompt_id": 0, "reward": 1.0})
    with pytest.raises(AttributeError, match="reward"):
        GroupAwareReplayBuffer(2, 4).push({"prompt_id": 0})


def test_group_overflow_drops_oldest_ready_groups_by_item():
    buf = GroupAwareReplayBuffer(group_size=2, max_size=5)
    for prompt in range(4):
        for k in range(2):
            buf.push(Sample(2 * prompt + k, prompt_id=prompt, reward=float(k)))
    s = buf.stats()
    assert (s["size"], s["ready_groups"], s["dropped_overflow"]) == (4, 2, 4) and balanced(s)
    assert [g.prompt_id for g in buf.sample(4)] == [2, 3]


def test_push_group_is_atomic_and_validated():
    buf = GroupAwareReplayBuffer(group_size=3, max_size=9, max_staleness=0)
    buf.push(Sample(0, prompt_id=1, reward=5.0))  # a partial of the same prompt is left alone
    assert buf.push_group([Sample(i, prompt_id=1, reward=float(i)) for i in range(1, 4)])
    s = buf.stats()
    assert (s["pushed"], s["size"], s["pending"]) == (4, 3, 1) and balanced(s)
    with pytest.raises(ValueError, match="exactly 3"):
        buf.push_group([Sample(0), Sample(1)])
    with pytest.raises(ValueError, match="different prompts"):
        buf.push_group([Sample(0, prompt_id=1), Sample(1, prompt_id=2), Sample(2, prompt_id=1)])
    buf.set_version(1)
    assert not buf.push_group([Sample(i, prompt_id=2, policy_version=1 - (i == 0)) for i in range(3)])
    s = buf.stats()
    assert s["evicted_stale"] == 3 + 1 + 3 and s["size"] == 0 and s["pending"] == 0 and balanced(s)


def test_group_with_experience_items_and_immutable_items():
    buf = GroupAwareReplayBuffer(group_size=2, max_size=4)
    a, b = make_experience(9, 0, [1.0, 1.0]), make_experience(9, 0, [0.0, 0.0])
    buf.push(a)
    buf.push(b)
    [group] = buf.sample(1)
    assert list(group) == [a, b] and torch.allclose(group.rewards, torch.tensor([1.0, 0.0]))
    half = 0.5 / (math.sqrt(0.5) + 1e-4)  # ±.5 over the sample std of [1, 0] (√.5) + eps 1e-4
    assert a.advantage == pytest.approx(half) and b.advantage == pytest.approx(-half)

    @dataclass(frozen=True)
    class Frozen:
        prompt_id: int
        reward: float

    buf.push_group([Frozen(1, 0.0), Frozen(1, 1.0)])  # advantage cannot be written back: skipped
    [group] = buf.sample(1)
    assert group.advantages.tolist() == pytest.approx([-half, half])


# ---------------------------------------------------------------- threads


def _run_threads(buffer, shares, consume_batch, flatten, check_batch=None):
    """8 producers push their shares; 2 consumers sample until everything is produced and drained; a
    monitor checks the invariant meanwhile. Returns each consumer's items in the order it got them.
    check_batch(batch, version_before) sees every batch and the buffer's version read before sampling."""
    consumed: list[list] = [[], []]
    done = threading.Event()
    violations, errors = [], []

    def produce(share):
        for item in share:
            buffer.push(item)

    def consume(slot):
        try:
            while True:
                before = getattr(buffer, "version", None)
                batch = buffer.sample(consume_batch, timeout=0.02)
                if check_batch:
                    check_batch(batch, before)
                consumed[slot].extend(flatten(batch))
                if not batch and done.is_set() and len(buffer) == 0:
                    return
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    def monitor():
        while not done.is_set():
            s = buffer.stats()
            if not balanced(s):
                violations.append(s)
            time.sleep(0.001)

    producers = [threading.Thread(target=produce, args=(s,)) for s in shares]
    others = [threading.Thread(target=consume, args=(i,)) for i in range(2)] + [threading.Thread(target=monitor)]
    for t in producers + others:
        t.start()
    for t in producers:
        t.join(timeout=15)
    done.set()
    for t in others:
        t.join(timeout=15)
    assert not any(t.is_alive() for t in producers + others)
    if errors:
        raise errors[0]
    assert not violations, violations[:3]
    return consumed


def test_bounded_stress_8_producers_2_consumers_loses_and_duplicates_nothing():
    buf = BoundedReplayBuffer(64)  # small, so overflow happens too
    shares = [[{"id": (p, i)} for i in range(1500)] for p in range(8)]
    per_consumer = _run_threads(buf, shares, 16, lambda b: b)
    ids = [x["id"] for got in per_consumer for x in got]
    produced = {x["id"] for share in shares for x in share}
    assert len(ids) == len(set(ids)) and set(ids) <= produced
    s = buf.stats()
    assert s["pushed"] == len(produced) and s["sampled"] == len(ids)
    assert s["dropped_overflow"] == len(produced - set(ids))  # consumed + dropped == produced
    assert s["size"] == 0 and balanced(s)
    for got in per_consumer:  # FIFO: each consumer sees every producer's items in push order
        for p in range(8):
            mine = [x["id"][1] for x in got if x["id"][0] == p]
            assert mine == sorted(mine)


def test_versioned_stress_never_hands_out_stale_items():
    buf = VersionedReplayBuffer(256, max_staleness=2)
    shares = [[Sample((p, i), policy_version=i // 100) for i in range(1000)] for p in range(8)]
    stop = threading.Event()

    def bump():
        step = 0
        while not stop.is_set():
            step += 1
            buf.set_version(step // 8)
            time.sleep(0.002)

    def check(batch, version_before):
        # the version only grows: an item stale when sampled is stale against any earlier version
        assert all(x.policy_version >= version_before - 2 for x in batch)

    bumper = threading.Thread(target=bump)
    bumper.start()
    try:
        per_consumer = _run_threads(buf, shares, 32, lambda b: b, check)
    finally:
        stop.set()
        bumper.join()
    ids = [x.id for got in per_consumer for x in got]
    assert len(ids) == len(set(ids))
    s = buf.stats()
    assert s["pushed"] == 8000 == s["sampled"] + s["evicted_stale"] + s["dropped_overflow"]
    assert s["sampled"] == len(ids) and s["size"] == 0 and balanced(s)


def test_group_stress_whole_groups_only():
    G = 4
    buf = GroupAwareReplayBuffer(G, max_size=64)
    shares = []
    for p in range(8):  # each producer interleaves the completions of its prompts, 5 prompts at a time
        prompts = [(p, k) for k in range(60)]
        shares.append(
            [
                {"id": (pid, j), "prompt_id": pid, "reward": float(j % 2)}
                for start in range(0, 60, 5)
                for j in range(G)
                for pid in prompts[start : start + 5]
            ]
        )

    def check(batch, _):
        for g in batch:
            assert len(g) == G and all(x["prompt_id"] == g.prompt_id for x in g)
            assert torch.allclose(g.advantages, compute_grpo_advantages(g.rewards), atol=1e-6)
            assert [x["advantage"] for x in g] == pytest.approx(g.advantages.tolist())

    per_consumer = _run_threads(buf, shares, 4, lambda b: [x for g in b for x in g], check)
    ids = [x["id"] for got in per_consumer for x in got]
    produced = {x["id"] for share in shares for x in share}
    assert len(ids) == len(set(ids))
    s = buf.stats()
    assert s["dropped_overflow"] == len(produced - set(ids)) and s["pending"] == 0 and balanced(s)


# ---------------------------------------------------------------- random operation sequences


class BufferMachine(RuleBasedStateMachine):
    """Drives the three buffers with the same random operations and checks each against a plain
    reference model: contents, order, every counter, and the accounting invariant after every step."""

    @initialize(max_size=st.integers(1, 8), group_size=st.integers(1, 3), max_staleness=st.none() | st.integers(0, 2))
    def setup(self, max_size, group_size, max_staleness):
        self.G, self.max_staleness = group_size, max_staleness
        self.max_size, self.group_max = max_size, max(max_size, group_size)
        self.bounded = BoundedReplayBuffer(max_size)
        self.versioned = VersionedReplayBuffer(max_size, max_staleness)
        self.group = GroupAwareReplayBuffer(group_size, self.group_max, max_staleness)
        self.next_id, self.version, self.closed = 0, 0, False
        self.model = {
            name: {"pushed": 0, "sampled": 0, "evicted_stale": 0, "dropped_overflow": 0, "rejected_closed": 0}
            for name in ("bounded", "versioned", "group")
        }
        self.fifo, self.vfifo = [], []  # items of bounded / versioned
        self.pending, self.ready = {}, []  # group: prompt -> items, and ready groups (lists of items)

    def _item(self, prompt_id, version, reward):
        self.next_id += 1
        return {"id": self.next_id, "prompt_id": prompt_id, "policy_version": version, "reward": reward}

    def _fresh(self, version):
        return self.max_staleness is None or version >= self.version - self.max_staleness

    def _model_push(self, item):
        mb, mv, mg = self.model["bounded"], self.model["versioned"], self.model["group"]
        if self.closed:
            for m in (mb, mv, mg):
                m["rejected_closed"] += 1
            return
        mb["pushed"] += 1
        self.fifo.append(item["id"])
        if len(self.fifo) > self.max_size:
            self.fifo.pop(0)
            mb["dropped_overflow"] += 1
        mv["pushed"] += 1
        mg["pushed"] += 1
        if not self._fresh(item["policy_version"]):
            mv["evicted_stale"] += 1
            mg["evicted_stale"] += 1
            return
        self.vfifo.append((item["id"], item["policy_version"]))
        if len(self.vfifo) > self.max_size:
            self.vfifo.pop(0)
            mv["dropped_overflow"] += 1
        part = self.pending.setdefault(item["prompt_id"], [])
        part.append(item)
        if len(part) == self.G:
            del self.pending[item["prompt_id"]]
            self._model_ready(part)

    def _model_ready(self, group):
        self.ready.append(group)
        while sum(map(len, self.ready)) > self.group_max:
            self.model["group"]["dropped_overflow"] += len(self.ready.pop(0))

    item_args = dict(prompt_id=st.integers(0, 3), version=st.integers(0, 6), reward=st.sampled_from([0.0, 0.5, 1.0]))

    @rule(**item_args)
    def push(self, prompt_id, version, reward):
        item = self._item(prompt_id, version, reward)
        accepted = [self.bounded.push(dict(item)), self.versioned.push(dict(item)), self.group.push(dict(item))]
        expect_fresh = not self.closed and self._fresh(version)
        assert accepted == [not self.closed, expect_fresh, expect_fresh]
        self._model_push(item)

    @rule(specs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.sampled_from([0.0, 1.0])), max_size=5))
    def push_many(self, specs):
        items = [self._item(*spec) for spec in specs]
        self.bounded.push_many([dict(x) for x in items])
        self.versioned.push_many([dict(x) for x in items])
        self.group.push_many([dict(x) for x in items])
        for item in items:
            self._model_push(item)

    @rule(
        prompt_id=st.integers(10, 12),
        version=st.integers(0, 6),
        rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=3, max_size=3),
    )
    def push_group(self, prompt_id, version, rewards):
        items = [self._item(prompt_id, version, r) for r in rewards[: self.G]]
        accepted = self.group.push_group([dict(x) for x in items])
        mg = self.model["group"]
        if self.closed:
            mg["rejected_closed"] += self.G
            assert not accepted
            return
        mg["pushed"] += self.G
        assert accepted == self._fresh(version)
        if accepted:
            self._model_ready(items)
        else:
            mg["evicted_stale"] += self.G

    @rule(n=st.integers(0, 5))
    def sample(self, n):
        got = [x["id"] for x in self.bounded.sample(n)]
        assert got == self.fifo[:n]
        del self.fifo[:n]
        self.model["bounded"]["sampled"] += len(got)
        got = [x["id"] for x in self.versioned.sample(n)]
        assert got == [i for i, _ in self.vfifo[:n]]
        del self.vfifo[:n]
        self.model["versioned"]["sampled"] += len(got)
        groups = self.group.sample(n)
        assert [[x["id"] for x in g] for g in groups] == [[x["id"] for x in g] for g in self.ready[:n]]
        for g in groups:
            assert torch.allclose(g.advantages, compute_grpo_advantages(g.rewards), atol=1e-6)
            assert not torch.isnan(g.advantages).any()
            assert [x["advantage"] for x in g] == pytest.approx(g.advantages.tolist())
        del self.ready[:n]
        self.model["group"]["sampled"] += sum(map(len, groups))

    @rule(version=st.integers(0, 8))
    def set_version(self, version):
        self.version = version
        evicted_v = self.versioned.set_version(version)
        evicted_g = self.group.set_version(version)
        keep = [(i, v) for i, v in self.vfifo if self._fresh(v)]
        assert evicted_v == len(self.vfifo) - len(keep)
        self.vfifo = keep
        expected_g = 0
        if self.max_staleness is not None:
            for prompt in [
                p for p, part in self.pending.items() if not self._fresh(min(x["policy_version"] for x in part))
            ]:
                expected_g += len(self.pending.pop(prompt))
            keep_groups = [g for g in self.ready if self._fresh(min(x["policy_version"] for x in g))]
            expected_g += sum(map(len, self.ready)) - sum(map(len, keep_groups))
            self.ready = keep_groups
        assert evicted_g == expected_g
        self.model["versioned"]["evicted_stale"] += evicted_v
        self.model["group"]["evicted_stale"] += evicted_g

    @rule()
    def clear(self):
        for buf in (self.bounded, self.versioned, self.group):
            buf.clear()
        self.fifo, self.vfifo, self.pending, self.ready = [], [], {}, []
        for m in self.model.values():
            m.update(pushed=0, sampled=0, evicted_stale=0, dropped_overflow=0, rejected_closed=0)

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self):
        for buf in (self.bounded, self.versioned, self.group):
            buf.close()
        self.closed = True

    @invariant()
    def accounting_matches_the_model(self):
        sizes = {
            "bounded": (len(self.fifo), 0),
            "versioned": (len(self.vfifo), 0),
            "group": (sum(map(len, self.ready)), sum(map(len, self.pending.values()))),
        }
        for name, buf in (("bounded", self.bounded), ("versioned", self.versioned), ("group", self.group)):
            s = buf.stats()
            assert balanced(s), (name, s)
            assert (s["size"], s["pending"]) == sizes[name] and len(buf) == s["size"], (name, s)
            m = self.model[name]
            assert {k: s[k] for k in m} == m, (name, s, m)


BufferMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_buffer_accounting_random_sequences = BufferMachine.TestCase


def test_requeue_puts_items_back_in_front_in_order_and_uncounts_them():
    buf = BoundedReplayBuffer(8)
    buf.push_many([Sample(i) for i in range(5)])
    taken = buf.sample(3)
    assert buf.requeue(taken) == 3
    s = buf.stats()
    assert (s["sampled"], s["size"]) == (0, 5) and balanced(s)
    assert [x.id for x in buf.sample(5)] == [0, 1, 2, 3, 4]  # as if never sampled: order kept
    with pytest.raises(ValueError, match="only 5 were ever sampled"):
        buf.requeue([Sample(i) for i in range(6)])


def test_requeue_into_a_full_buffer_drops_the_oldest_given_back_items():
    buf = BoundedReplayBuffer(4)
    buf.push_many([Sample(i) for i in range(4)])
    taken = buf.sample(3)
    buf.push_many([Sample(i) for i in range(4, 6)])  # 3 items now, room for 1
    assert buf.requeue(taken) == 1
    s = buf.stats()
    assert (s["sampled"], s["dropped_overflow"], s["size"]) == (0, 2, 4) and balanced(s)
    assert [x.id for x in buf.sample(4)] == [2, 3, 4, 5]  # the newest given-back item went in front


def test_versioned_requeue_evicts_what_went_stale_meanwhile():
    buf = VersionedReplayBuffer(8, max_staleness=1)
    buf.push_many([Sample(i, policy_version=v) for i, v in enumerate([0, 1, 2])])
    taken = buf.sample(3)
    buf.set_version(2)  # version 0 is now 2 - 2: stale
    assert buf.requeue(taken) == 2
    s = buf.stats()
    assert (s["sampled"], s["evicted_stale"], s["size"]) == (0, 1, 2) and balanced(s)
    assert buf.set_version(3) == 1  # requeued items still take part in eviction
    assert [x.id for x in buf.sample(4)] == [2]


def test_take_for_a_later_version_evicts_what_is_too_stale_for_it_but_keeps_the_buffers_version():
    buf = VersionedReplayBuffer(8, max_staleness=1, version=3)
    buf.push_many([Sample(i, policy_version=v) for i, v in enumerate([2, 3, 2, 4])])
    got = buf.take_for(2, version=4, timeout=0.0)  # version 2 is 4 - 2: too stale for 4
    assert [x.id for x in got] == [1, 3]
    s = buf.stats()
    assert (s["version"], s["evicted_stale"], s["sampled"], s["size"]) == (3, 2, 2, 0) and balanced(s)
    assert buf.push(Sample(4, policy_version=2))  # still fresh for the buffer's own version 3
    assert buf.take_for(2, version=3, timeout=0.0) == []  # exactly n, or nothing
    assert len(buf) == 1


def test_take_for_waits_for_enough_fresh_items_and_honours_close():
    buf = VersionedReplayBuffer(8, max_staleness=0, version=0)
    pusher = threading.Timer(0.05, lambda: buf.push_many([Sample(i, policy_version=1) for i in range(2)]))
    pusher.start()
    assert [x.id for x in buf.take_for(2, version=1, timeout=5.0)] == [0, 1]
    pusher.join()
    closer = threading.Timer(0.05, buf.close)
    closer.start()
    start = time.monotonic()
    assert buf.take_for(1, version=1, timeout=30.0) == []  # woken by close, not by the deadline
    assert time.monotonic() - start < 10
    closer.join()
    with pytest.raises(ValueError, match="n must be >= 1"):
        buf.take_for(0, version=1, timeout=0.0)
