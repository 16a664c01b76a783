"""The roles as Ray actors, and the only code that imports Ray (the Ray host, rlhf_core/hosts/ray_cluster.py,
calls Ray through calls.py and cluster.py; the console's worker output goes through console.py).

    transport.py  experience and weights packed for Ray's object store (no Ray import)
    calls.py      Ray's calls: actor classes made remote, bounded waits (get_or_fail, ready, WaitTimeout), ActorDied,
                  user modules shipped by value, the fault-injection death
    console.py    Ray's driver output of its workers, routed to the run's console and log (no Ray import)
    rollout_actor.py       the rollout actor (a RolloutWorker in its own process)
    trainer_actor.py       the trainer actor (rank 0 of a sharded trainer group)
    trainer_group.py       ranks 1..N-1 of a sharded trainer group (FSDP2), joining the group
    reward_model_actor.py  the reward-model actor and the rollout worker's client of it
    cluster.py    joining or starting Ray, resources, placement groups and actor placement, teardown

The Ray host over these actors is `rlhf_core.hosts.ray_cluster.DistributedRun` and its driver without Prefect
`rlhf_core.hosts.driver.run_distributed`: both stay importable from here (docs/api.md). The actors wrap
rlhf_core.run.control's objects (and the prompt queue of rlhf_core.data.queue). Importing this package does not
import Ray; the names below load their modules (and Ray) on first use.
"""

from __future__ import annotations

from rlhf_core.lazy import lazy_exports

_LAZY = {
    "ClusterError": "rlhf_core.distributed.cluster",
    "check_resources": "rlhf_core.distributed.cluster",
    "connect": "rlhf_core.distributed.cluster",
    "DistributedRun": "rlhf_core.hosts.ray_cluster",
    "RunFailed": "rlhf_core.run.control",  # every host raises it
    "run_distributed": "rlhf_core.hosts.driver",
}

__all__, __getattr__, __dir__ = lazy_exports(globals(), _LAZY)
