"""The roles' peers on Ray: actor handles behind the method-call interface of `rlhf_core.run.roles`.

Each adapter turns `peer.method(*args)` into a bounded remote call (runtime.wait_timeout_s, an error naming
what was waited for) and carries the transport: groups are packed for the object store on the way to the
buffer and unpacked on the way out; weights go through one `ray.put` of a packed CPU state dict.
"""

from __future__ import annotations

import time

import ray

from rlhf_core.distributed.calls import get_or_fail
from rlhf_core.distributed.transport import pack_groups, pack_state_dict, unpack_groups, unpack_state_dict


class Pending:
    """A remote call in flight: `.result()` waits for it (bounded)."""

    def __init__(self, ref, timeout_s: float, what: str):
        self.ref, self.timeout_s, self.what = ref, timeout_s, what

    def result(self):
        return get_or_fail(self.ref, self.timeout_s, self.what)


class RemotePeer:
    """An actor handle: `peer.name(*args)` waits for the answer; `peer.submit(name, *args)` does not."""

    def __init__(self, handle, timeout_s: float, what: str):
        self.handle, self.timeout_s, self.what = handle, timeout_s, what

    def submit(self, name: str, *args) -> Pending:
        return Pending(getattr(self.handle, name).remote(*args), self.timeout_s, f"{self.what} ({name})")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args: self.submit(name, *args).result()


class RemoteBuffer(RemotePeer):
    """The experience buffer actor: groups packed on the way in, unpacked on the way out."""

    def __init__(self, handle, timeout_s: float):
        super().__init__(handle, timeout_s, "the replay buffer")

    def push(self, groups: list, holder=None, batch: int = 0) -> int:
        return self.submit("push", pack_groups(groups), holder, batch).result()

    def give_back(self, groups: list) -> int:
        return self.submit("give_back", pack_groups(groups)).result()

    def take(self, n: int, wait_s: float, for_version=None) -> tuple[list, int]:
        groups, bound = get_or_fail(
            self.handle.take.remote(n, wait_s, for_version), wait_s + self.timeout_s, "a batch from the replay buffer"
        )
        return unpack_groups(groups), bound


class RemoteWeights(RemotePeer):
    """The weight store actor: a publish is one ray.put of the packed CPU snapshot, registered with its version;
    `poll_newer` (partial rollouts, between decode steps) keeps one request in flight and never waits."""

    POLL_EVERY_S = 0.02

    def __init__(self, handle, timeout_s: float):
        super().__init__(handle, timeout_s, "the weight store")
        self._newer_ref = None
        self._newer_asked = 0.0

    def publish(self, version: int, state_dict: dict) -> None:
        start = time.perf_counter()
        ref = ray.put(pack_state_dict(state_dict))
        # the ref travels inside a list so that Ray passes the reference instead of resolving it
        self.submit("publish", version, [ref], time.perf_counter() - start).result()

    def _fetch(self, found):
        version, (ref,) = found
        return version, unpack_state_dict(get_or_fail(ref, self.timeout_s, f"weights of version {version}"))

    def fetch_if_newer(self, version: int):
        found = self.submit("get_if_newer", version).result()
        return None if found is None else self._fetch(found)

    def poll_newer(self, version: int):
        now = time.perf_counter()
        ref = self._newer_ref
        if ref is None:
            if now - self._newer_asked >= self.POLL_EVERY_S:
                self._newer_ref, self._newer_asked = self.handle.get_if_newer.remote(version), now
            return None
        if not ray.wait([ref], timeout=0)[0]:
            return None
        self._newer_ref = None
        found = get_or_fail(ref, self.timeout_s, "the weight store")
        if found is None or found[0] <= version:
            return None
        return self._fetch(found)
