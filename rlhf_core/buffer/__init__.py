"""Thread-safe replay buffers between rollout workers (producers) and the trainer (consumer).

BoundedReplayBuffer      FIFO of items, oldest dropped on overflow.
VersionedReplayBuffer    + policy versions: stale items refused on push and evicted on set_version.
GroupAwareReplayBuffer   collects the G completions of each prompt; hands out whole groups with GRPO
                         advantages.

All share one contract: `push` never blocks; `sample(n, timeout=None)` returns at once with what is
there, or with timeout > 0 waits (at most that long) for enough; `close()` wakes waiting samplers;
`stats()` satisfies pushed == sampled + evicted_stale + dropped_overflow + size + pending at every
moment (counted in items).
"""

from rlhf_core.buffer.group import GroupAwareReplayBuffer, GroupEntry
from rlhf_core.buffer.replay import BoundedReplayBuffer, VersionedReplayBuffer

__all__ = ["BoundedReplayBuffer", "VersionedReplayBuffer", "GroupAwareReplayBuffer", "GroupEntry"]
