"""A role's peers in one process (the in-process and threads hosts): the plain control objects of
rlhf_core.run.control behind the peer interface the roles call (`rlhf_core.run.roles`); on Ray the same interface is
rlhf_core.distributed.peers, over actor handles."""

from __future__ import annotations

from typing import Optional

from rlhf_core.run.control import WeightStore


class Done:
    """An answer already there (the in-process form of a remote call in flight)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class LocalPeer:
    """A plain object as a role's peer: method calls go straight through; `submit` answers at once."""

    def __init__(self, obj):
        self.obj = obj

    def submit(self, name: str, *args) -> Done:
        return Done(getattr(self.obj, name)(*args))

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.obj, name)


class LocalWeights(LocalPeer):
    """The weight store in one process: it holds the published state dict itself (None when the engine shares
    the trainer's model)."""

    def __init__(self):
        super().__init__(WeightStore())

    def publish(self, version: int, state_dict: Optional[dict]) -> None:
        self.obj.publish(version, [state_dict], 0.0)

    def fetch_if_newer(self, version: int):
        found = self.obj.get_if_newer(version)
        return None if found is None else (found[0], found[1][0])

    poll_newer = fetch_if_newer


def shared_model_snapshot() -> None:
    """The trainer role's weight snapshot when the rollout engine generates with the trainer's own model: nothing to
    publish but the version."""
    return None
