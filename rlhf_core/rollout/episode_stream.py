"""Episodes without a batch barrier: the environment runner's driver loop (`run_episodes` and `stream`, which
`EnvRunner.run` and `.stream` call too). The rollout's runners call these with the runner, so that an episode's
path goes from here down into the runner's turns and never back.

One loop drives every episode in flight: an episode waits for its environment (its process pool answers
asynchronously) or for the model; the engine generates for those ready as soon as at least as many are ready as
are still waiting, or when no environment answered for IDLE_POLL_S (so a ready episode never waits on a slow
one's environment). New prompts are taken whenever the loop would otherwise only wait (the feed decides how many:
the rollout's admission and the staleness bound live there), and a prompt's group of trajectories is handed on
the moment its last trajectory ends, so one slow episode holds only its own group, not a batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

IDLE_POLL_S = 0.05  # while the feed may still give prompts: how long one wait on the environments lasts at most


def run_episodes(
    runner, engine, prompts: Sequence, samples_per_prompt: int, sampling, between_steps=None, retries: int = 0
) -> list:
    """samples_per_prompt trajectories per prompt (contiguous per prompt), run to their end; each one's
    environment is closed however it ended (an exception out of here included).

    between_steps (partial rollouts): returns None or (state_dict, version) for the engine to adopt; asked
    before every turn and, where the engine takes it, between its decode steps (rlhf_core.rollout.multiturn)."""
    fed = [list(prompts)]
    ended: dict[int, list] = {}
    stream(
        runner,
        engine,
        samples_per_prompt,
        sampling,
        feed=lambda _: fed.pop() if fed else None,
        emit=lambda group: ended.__setitem__(group[0].group, group),
        between_steps=between_steps,
        retries=retries,
    )
    return [t for first in sorted(ended) for t in ended[first]]


def stream(runner, engine, samples_per_prompt: int, sampling, feed, emit, between_steps=None, retries: int = 0) -> None:
    """Episodes without a batch barrier: `feed(groups_in_flight)` is asked for more prompts whenever the
    driver has nothing to wait on and may start more (a list, possibly empty: none now; None: none ever);
    each prompt's samples_per_prompt trajectories start at once; `emit(group)` gets a prompt's trajectories
    as soon as all of them ended (graded), whatever the others in flight are doing. Returns once feed said
    None and every group was emitted. Each environment is closed however its episode ended (an exception
    out of here included). retries: a failed episode is started again (same prompt, from reset) up to this many
    times in its group's slot, so that it costs itself and not its group (training; an evaluation keeps it)."""
    by_eid: dict = {}  # eid -> its Trajectory, while it runs
    waiting: set[int] = set()  # waiting for the environment
    ready: list = []  # waiting for the model
    unopened: list = []  # not reset yet: env.max_sessions episodes are open at once
    opened: set[int] = set()
    groups: dict[int, list] = {}  # first eid -> its group, while any of it runs
    left: dict[int, int] = {}  # first eid -> its trajectories not ended yet
    of_group: dict[int, int] = {}
    exhausted = False
    counter = [0]  # prompts taken so far

    def take_more() -> None:
        nonlocal exhausted
        prompts = feed(len(groups)) if not exhausted else None
        if prompts is None:
            exhausted = True
            return
        for p in prompts:
            trajs = [runner.new_trajectory(p) for _ in range(samples_per_prompt)]
            for t in trajs:
                t.group = counter[0]
            counter[0] += 1
            first = trajs[0].eid
            groups[first], left[first] = trajs, len(trajs)
            for t in trajs:
                by_eid[t.eid], of_group[t.eid] = t, first
            unopened[:0] = reversed(trajs)  # popped from the end: in order

    def open_more(ended=()) -> None:
        opened.difference_update(ended)
        for eid in ended:
            first = of_group.pop(eid)
            t = by_eid.pop(eid)
            if t.error is not None and t.tries < retries:  # in its slot, afresh: the group waits for it
                again = runner.new_trajectory(t.prompt)
                again.tries, again.group = t.tries + 1, t.group
                group = groups[first]
                group[group.index(t)] = again
                by_eid[again.eid], of_group[again.eid] = again, first
                unopened.append(again)
                runner.retried += 1
                continue
            left[first] -= 1
            if not left[first]:
                del left[first]
                group = groups.pop(first)
                runner._grade(group)
                emit(group)
        while unopened and (runner.cfg.max_sessions is None or len(opened) < runner.cfg.max_sessions):
            t = unopened.pop()
            runner.pool.reset(t.eid, t.row)
            waiting.add(t.eid)
            opened.add(t.eid)

    try:
        take_more()
        open_more()
        while waiting or ready or unopened or not exhausted:
            if not exhausted and not ready and not unopened:
                take_more()  # room to start more (the feed decides how many; admission lives there)
                open_more()
            if not (waiting or ready or unopened):
                if exhausted:
                    break
                time.sleep(IDLE_POLL_S / 2)  # nothing in flight, nothing granted yet: ask again shortly (no spin)
                continue
            generate_now = bool(ready) and len(ready) >= len(waiting)
            replies = runner.pool.poll(0.0 if generate_now else (IDLE_POLL_S if ready or not exhausted else 1.0))
            for reply in replies:
                t = by_eid.get(reply.eid)
                if t is None or reply.eid not in waiting:
                    continue
                turn = runner._take_reply(t, reply)
                if turn != "env":
                    waiting.discard(t.eid)
                if turn == "model":
                    ready.append(t)
                elif turn == "end":
                    runner.pool.close_episode(t.eid)
                    open_more([t.eid])
            if ready and (len(ready) >= len(waiting) or not replies):  # or nothing came for IDLE_POLL_S: a
                # lone ready episode does not wait for a slow one's environment
                batch, ready = ready, []
                sent = {t.eid for t in runner._generate(engine, batch, sampling, between_steps)}
                waiting.update(sent)
                open_more([t.eid for t in batch if t.eid not in sent])
    except BaseException as exc:
        for t in by_eid.values():  # the run stops: every episode in flight is closed (once: the pool forgets it)
            runner.pool.close_episode(t.eid)
        runner.aborted(exc)
        raise
