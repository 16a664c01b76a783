"""Each role's cycle, written once and Ray-free: the trainer's and the rollout worker's.

    trainer: take a batch within the bound the buffer enforced -> train -> record -> publish (runtime.sync_every)
             -> checkpoint when due; `checkpoint()` and `restore()` are the one writer and reader of run state.
    rollout: admit -> take prompts -> adopt the newest weights -> generate -> score -> push.

A role talks to its peers (the experience buffer, the weight store, the prompt queue) by method calls only.
In one process the peers are the plain objects (`rlhf_core.run.peers` wraps them in `LocalPeer`); on Ray
they are actor handles behind the adapters of `rlhf_core.distributed.peers`, which also carry the transport
(packing, the object store). Whoever hosts a role (`rlhf_core.run.local`, the Ray actors) only supplies
threads, ranks and stats: a feature written here behaves the same on every host, and lockstep is
runtime.max_staleness 0, not another code path.

Peer calls: `peer.<method>(*args)` waits for the answer; `peer.submit(name, *args).result()` lets a host
overlap round trips (the rollout loop asks admission for its next batch before generating this one).
"""

from rlhf_core.run.rollout_role import RolloutRole
from rlhf_core.run.trainer_role import TRAINED_PROMPTS_FILE, TrainerRole

__all__ = ["TRAINED_PROMPTS_FILE", "RolloutRole", "TrainerRole"]
