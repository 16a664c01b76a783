"""The Ray runtime: the only Ray code.

    transport.py  experience and weights packed for Ray's object store (no Ray import)
    calls.py      a bounded wait on a Ray reference (get_or_fail, WaitTimeout), the fault-injection death
    rollout_actor.py       the rollout actor (a RolloutWorker in its own process)
    trainer_actor.py       the trainer actor (rank 0 of a sharded trainer group)
    trainer_group.py       ranks 1..N-1 of a sharded trainer group (FSDP2), joining the group
    reward_model_actor.py  the reward-model actor and the rollout worker's client of it
    cluster.py    joining or starting Ray, resources, placement groups, teardown
    runtime.py    DistributedRun: launch, loops, poll, sync, checkpoint, teardown
    driver.py     run_distributed: a DistributedRun supervised without Prefect (tests, benchmarks)

The runtime wraps rlhf_core.run.control's objects (and the prompt queue of rlhf_core.data.queue) in Ray actors.
Importing this package does not import Ray; the names below load their modules (and Ray) on first use.
"""

from __future__ import annotations

from rlhf_core.lazy import lazy_exports

_LAZY = {
    "ClusterError": "rlhf_core.distributed.cluster",
    "check_resources": "rlhf_core.distributed.cluster",
    "connect": "rlhf_core.distributed.cluster",
    "DistributedRun": "rlhf_core.distributed.runtime",
    "RunFailed": "rlhf_core.run.control",  # every host raises it
    "run_distributed": "rlhf_core.distributed.driver",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
