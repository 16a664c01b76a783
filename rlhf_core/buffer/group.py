"""GroupAwareReplayBuffer: collects the G completions of each prompt and hands out whole groups.

Completions of many prompts arrive interleaved. Each waits in a partial group (counted in `pending`)
until the G-th completion of its prompt arrives; then the whole group moves, in the same locked step,
to the ready queue (counted in `size`). `sample` hands out whole groups, oldest first, each with its
GRPO advantages.

Advantages are a pure function of the group's rewards, so they are computed when the group is handed
out rather than when it completes: one `compute_grpo_advantages` call over every group of the sample
([n_groups, G]), outside the lock, and never for a group that is later dropped. The values are those of
a per-group call (scale "group" normalises each row on its own; at most a float32 ulp of difference
from the batched reduction), and a group of equal rewards gets exactly 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlhf_core.algorithms.advantages import compute_grpo_advantages
from rlhf_core.algorithms.options import GRPO_STD_EPS
from rlhf_core.buffer._base import LockedBuffer, VersionWindow, read_field, read_version


class GroupEntry(Sequence):
    """One complete group: a sequence of its G items (len, iteration, indexing) plus

    prompt_id:      the prompt all G items answer.
    items:          list of the G items, in arrival order.
    rewards:        FloatTensor [G] the items' rewards (set when sampled).
    advantages:     FloatTensor [G] GRPO advantages of `rewards` (set when sampled).
    policy_version: the oldest (min) policy_version of its items; None if the items carry none.
    """

    __slots__ = ("prompt_id", "items", "rewards", "advantages", "policy_version", "_reward_values")

    def __init__(self, prompt_id: Any, items: list, reward_values: list[float], policy_version: int | None):
        self.prompt_id = prompt_id
        self.items = items
        self.policy_version = policy_version
        self.rewards: torch.Tensor | None = None
        self.advantages: torch.Tensor | None = None
        self._reward_values = reward_values

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]

    def __iter__(self):
        return iter(self.items)

    def __repr__(self) -> str:
        return (
            f"GroupEntry(prompt_id={self.prompt_id!r}, size={len(self.items)}, "
            f"policy_version={self.policy_version}, rewards={self._reward_values})"
        )


class _Partial:
    __slots__ = ("items", "rewards", "min_version")

    def __init__(self) -> None:
        self.items: list = []
        self.rewards: list[float] = []
        self.min_version: int | None = None


def _prompt_key(item: Any) -> Any:
    prompt_id = read_field(item, "prompt_id")
    return prompt_id.item() if isinstance(prompt_id, torch.Tensor) else prompt_id


def _write_advantage(item: Any, advantage: float) -> None:
    """Best effort: key "advantage" on dicts, attribute `advantage` otherwise; skipped if immutable."""
    if isinstance(item, dict):
        item["advantage"] = advantage
        return
    try:
        item.advantage = advantage
    except (AttributeError, TypeError):
        pass


class GroupAwareReplayBuffer(LockedBuffer, VersionWindow):
    """Thread-safe buffer of complete prompt groups.

    Public API, not used by the training runtime (its rollout workers push whole groups into a
    `VersionedReplayBuffer`): it is for engines that stream completions one at a time and is measured
    by `benchmarks/buffer.py` (group push/sample and 8-producer throughput) and checked by
    `scripts/verify_gpu.py` (section [4], groups holding device tensors); docs/architecture.md says
    when to use it.

    group_size:    G, completions per prompt; a group is ready when its G-th item arrives.
    max_size:      bound on ready items; overflow drops the oldest ready groups (counted by item).
                   Partial groups are not bounded by it (they are counted in `pending`).
    max_staleness: None, or the staleness limit: with consumer version V (`set_version`), an item or
                   group of version v is fresh while v >= V - max_staleness. Stale pushes are refused,
                   and `set_version` evicts stale partial and ready groups (counted in evicted_stale
                   by item). With a limit set, every item must carry policy_version.
    adv_eps:       eps of compute_grpo_advantages(rewards, eps=adv_eps, scale="group") (the sample std, as the
                   'grpo' estimator's default; adv_eps defaults to its eps, GRPO_STD_EPS).

    Items expose prompt_id and reward (and policy_version) as attributes or dict keys. Each sampled
    item gets its advantage written back (attribute `advantage`, key "advantage" for dicts) when it
    can take it.
    """

    def __init__(
        self,
        group_size: int,
        max_size: int,
        max_staleness: int | None = None,
        adv_eps: float = GRPO_STD_EPS,
        version: int = 0,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_size < group_size:
            raise ValueError(f"max_size ({max_size}) must hold at least one group of {group_size}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        super().__init__()
        self._group_size = int(group_size)
        self._max_size = int(max_size)
        self._max_staleness = max_staleness
        self._adv_eps = adv_eps
        self._version = int(version)
        self._min_fresh = self._fresh_bound()
        self._pending: dict[Any, _Partial] = {}
        self._ready: deque[GroupEntry] = deque()
        self._size = 0  # items in ready groups
        self._pending_items = 0  # items in partial groups

    @property
    def group_size(self) -> int:
        return self._group_size

    @property
    def max_size(self) -> int:
        return self._max_size

    def __len__(self) -> int:
        """Items in ready groups."""
        return self._size

    def push(self, item: Any) -> bool:
        """Add one completion. False when it is stale (counted) or the buffer is closed."""
        prompt_id = _prompt_key(item)
        reward = float(read_field(item, "reward"))
        version = read_version(item, required=self._max_staleness is not None)
        with self._lock:
            if self._closed:
                self._rejected_closed += 1
                return False
            self._pushed += 1
            if version is not None and version < self._min_fresh:
                self._evicted_stale += 1
                return False
            partial = self._pending.get(prompt_id)
            if partial is None:
                partial = self._pending[prompt_id] = _Partial()
            partial.items.append(item)
            partial.rewards.append(reward)
            if version is not None and (partial.min_version is None or version < partial.min_version):
                partial.min_version = version
            if len(partial.items) < self._group_size:
                self._pending_items += 1
                return True
            del self._pending[prompt_id]
            self._pending_items -= self._group_size - 1
            self._add_ready(GroupEntry(prompt_id, partial.items, partial.rewards, partial.min_version))
        return True

    def push_many(self, items: Iterable[Any]) -> int:
        """`push` each item in order; returns how many were accepted."""
        return sum(self.push(item) for item in items)

    def push_group(self, items: Iterable[Any]) -> bool:
        """Insert one complete group (exactly G items of one prompt) straight into the ready queue,
        independently of any partial group of that prompt. False when stale (all G counted) or closed."""
        items = list(items)
        if len(items) != self._group_size:
            raise ValueError(f"push_group needs exactly {self._group_size} items, got {len(items)}")
        keys = [_prompt_key(item) for item in items]
        if any(key != keys[0] for key in keys):
            raise ValueError(f"push_group items answer different prompts: {sorted(set(map(repr, keys)))}")
        rewards = [float(read_field(item, "reward")) for item in items]
        versions = [read_version(item, required=self._max_staleness is not None) for item in items]
        known = [v for v in versions if v is not None]
        version = min(known) if known else None
        with self._lock:
            if self._closed:
                self._rejected_closed += len(items)
                return False
            self._pushed += len(items)
            if version is not None and version < self._min_fresh:
                self._evicted_stale += len(items)
                return False
            self._add_ready(GroupEntry(keys[0], items, rewards, version))
        return True

    def _add_ready(self, entry: GroupEntry) -> None:
        """With the lock held: append a complete, fresh group (already counted in pushed)."""
        ready = self._ready
        ready.append(entry)
        self._size += len(entry)
        while self._size > self._max_size:
            dropped = len(ready.popleft())
            self._size -= dropped
            self._dropped_overflow += dropped
        if self._waiters:
            self._not_empty.notify_all()

    def sample(self, n_groups: int, timeout: float | None = None, min_groups: int = 1) -> list[GroupEntry]:
        """Remove and return up to `n_groups` whole groups, oldest first, with rewards and advantages set.

        timeout None or 0: return at once with what is ready (possibly []).
        timeout > 0: first wait until at least min(min_groups, n_groups) groups are ready, the buffer
                     is closed, or `timeout` seconds pass; then return what is ready.
        timeout math.inf: wait without a deadline (close() still wakes it).
        """
        if n_groups < 0:
            raise ValueError(f"n_groups must be >= 0, got {n_groups}")
        with self._lock:
            capacity = self._max_size // self._group_size
            groups = self._wait_and_take(self._ready, n_groups, timeout, min_groups, capacity)
            taken = sum(len(g) for g in groups)
            self._size -= taken
            self._sampled += taken
        if groups:
            self._attach_advantages(groups)
        return groups

    def _attach_advantages(self, groups: list[GroupEntry]) -> None:
        """Outside the lock: the groups belong to the caller now."""
        rewards = torch.tensor([g._reward_values for g in groups], dtype=torch.float32)
        advantages = compute_grpo_advantages(rewards, eps=self._adv_eps, scale="group")
        for group, group_rewards, group_advantages, values in zip(groups, rewards, advantages, advantages.tolist()):
            group.rewards = group_rewards
            group.advantages = group_advantages
            for item, value in zip(group.items, values):
                _write_advantage(item, value)

    def set_version(self, version: int) -> int:
        """Set the consumer's policy version and evict the partial and ready groups it makes stale;
        returns how many items were evicted."""
        with self._lock:
            self._version = int(version)
            self._min_fresh = bound = self._fresh_bound()
            if self._max_staleness is None:
                return 0
            evicted = 0
            stale_prompts = [
                key
                for key, partial in self._pending.items()
                if partial.min_version is not None and partial.min_version < bound
            ]
            for key in stale_prompts:
                evicted += len(self._pending.pop(key).items)
            self._pending_items -= evicted
            ready = self._ready
            if any(g.policy_version is not None and g.policy_version < bound for g in ready):
                keep = [g for g in ready if g.policy_version is None or g.policy_version >= bound]
                ready_evicted = self._size - sum(len(g) for g in keep)
                ready.clear()
                ready.extend(keep)
                self._size -= ready_evicted
                evicted += ready_evicted
            self._evicted_stale += evicted
        return evicted

    def clear(self) -> None:
        """Drop every ready and partial group and start the counters afresh (a new accounting period);
        the version, settings and closed flag stay."""
        with self._lock:
            self._pending.clear()
            self._ready.clear()
            self._size = self._pending_items = 0
            self._reset_counters()

    def stats(self) -> dict:
        with self._lock:
            out = self._counters()
            out.update(
                size=self._size,
                pending=self._pending_items,
                ready_groups=len(self._ready),
                pending_groups=len(self._pending),
                group_size=self._group_size,
                max_size=self._max_size,
                version=self._version,
                max_staleness=self._max_staleness,
            )
            return out
