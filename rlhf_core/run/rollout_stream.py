"""The rollout worker's loop for environment episodes without a batch barrier (`RolloutRole.run` with env set).

The worker keeps rollout.prompts_per_batch x (1 + runtime.max_staleness) groups of episodes in flight (what the
staleness bound admits for it): whenever fewer are, it asks admission for the difference (the bound lives there,
as for batches), takes that many prompts, each under a lease of its own, and starts their episodes; a group is
scored and pushed the moment its last episode ends, so one slow episode holds only its own group. While episodes
keep failing (a retried episode per group started, over the stream so far), and until one batch's worth of
groups has ended, it keeps one batch's worth instead:
depth before breadth, so that groups complete instead of every group advancing at once, and each environment
process hosts fewer episodes (a process crash replays every episode it hosted). Newer weights are adopted between
turns (as partial rollouts do: each token keeps the version that generated it, and a group is as old as its
oldest token). Leases end out of order: each push (or a group that failed) settles its lease in the replay
buffer, so that a lost worker's prompts in flight are requeued exactly (`ExperienceBuffer.settled_leases`,
`PromptQueue.requeue`).
"""

from __future__ import annotations

import time

REFUSED_WAIT_S = 0.01  # after admission refused: the next ask waits this long (the trainer frees room per step)
FAILING_RETRIES_PER_GROUP = 1.0  # at this many retried episodes per group started: one batch's worth in flight


def run_streaming(role) -> None:
    """Drive `role.worker`'s environment stream until role.stop(); the episodes in flight then finish and push."""
    # as many groups as the staleness bound admits for this worker's share: a step's worth per version it spans
    batch = role.cfg.rollout.prompts_per_batch
    full = batch * (1 + role.cfg.runtime.max_staleness)
    env = role.worker.env
    retried_at_start, started, ended = env.retried, [0], [0]

    def target() -> int:  # one batch's worth until a batch's worth ended without failing much, then the full width
        retried = env.retried - retried_at_start
        healthy = ended[0] >= batch and retried < FAILING_RETRIES_PER_GROUP * started[0]
        return full if healthy else batch

    lease_of: dict[int, list[int]] = {}  # prompt uid -> its leases in flight (a prompt may be in flight twice)
    settled: list[int] = []  # leases done since the last prompt request (sent with it, for the queue to drop)
    refused_at = [0.0]

    def feed(in_flight: int):
        if role.stop_event.is_set():
            return None
        room = target() - in_flight
        if room <= 0 or time.perf_counter() - refused_at[0] < REFUSED_WAIT_S:
            return []
        granted = role._admit(room).result()
        if not granted:
            refused_at[0] = time.perf_counter()
            return []
        asks = []
        for _ in range(granted):  # a lease per group: groups end in any order
            asks.append((role.ask_prompts(1, settled=list(settled) if role.holder else None), role.batches))
            settled.clear()
        prompts = []
        for call, lease in asks:
            got = call.result()
            if not got:  # no prompt for this lease: its admission is free again
                role._release(1, lease)
                continue
            lease_of.setdefault(got[0].uid, []).append(lease)
            prompts.append(got[0])
        started[0] += len(prompts)
        return prompts

    def emit(prompt, groups: list) -> None:
        ended[0] += 1
        lease = lease_of[prompt.uid].pop(0)
        if not lease_of[prompt.uid]:
            del lease_of[prompt.uid]
        if groups:
            role._push(groups, lease)
            role._count_push(len(groups), role.holder)
        else:  # the group failed (an environment error): its admission is free again, its lease done
            role._release(1, lease)
        settled.append(lease)

    between_steps = role._between_steps
    role.worker.stream_env_groups(feed, emit, between_steps=between_steps)
