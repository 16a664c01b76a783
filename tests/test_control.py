"""The runtime's control objects and transport packing, in plain Python: no Ray started, none imported."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from rlhf_core.data.queue import PromptQueue
from rlhf_core.distributed.transport import pack_groups, pack_state_dict, unpack_groups, unpack_state_dict
from rlhf_core.run.accounting import group_rows, reconcile, token_ledger
from rlhf_core.run.control import ExperienceBuffer, WeightStore, busy_fraction
from tests.test_buffer import make_experience

REPO = Path(__file__).resolve().parents[1]


def test_control_and_transport_import_no_ray():
    code = (
        "import sys; import rlhf_core.run.control, rlhf_core.distributed.transport, rlhf_core.data.queue, "
        "rlhf_core.loop; "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_the_prompt_queue_and_weight_store_processes_import_no_torch(max3_prompts):
    """Their Ray actors load the class by reference and unpickle the prompts they are given: neither needs torch
    (or transformers), so those two processes stay small (about 125 MB each here instead of about 305 MB)."""
    import pickle

    train, _ = max3_prompts
    code = (
        "import pickle, sys\n"
        "from rlhf_core.data.queue import PromptQueue\n"
        "from rlhf_core.run.control import WeightStore\n"
        "prompts = pickle.loads(sys.stdin.buffer.read())\n"
        "q = PromptQueue(prompts, seed=1); q.top_up(4); served = q.get(6); q.load_state_dict(q.state_dict())\n"
        "store = WeightStore(); store.publish(3, ['ref'], 0.1); assert store.get_if_newer(2) == (3, ['ref'])\n"
        "assert len(served) == 6 and served[0].prompt_ids, served\n"
        "heavy = sorted({'torch', 'transformers', 'ray'} & set(sys.modules))\n"
        "assert not heavy, f'imported {heavy}'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, input=pickle.dumps(train[:20]), capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]


def test_prompt_queue_refills_itself_and_resumes_its_position(max3_prompts):
    train, _ = max3_prompts
    q = PromptQueue(train, seed=3)
    assert q.top_up(5) == 5 and q.size() == 5
    first = q.get(3)  # served from what the flow scheduled
    state = q.state_dict()
    assert state["queued"] == [p.uid for p in q.queue] and len(state["queued"]) == 2
    rest = q.get(6)  # 2 queued + 4 refilled from the source itself
    assert len(rest) == 6 and q.stats()["served"] == 9 and q.stats()["scheduled"] == 9

    again = PromptQueue(train, seed=3)
    again.load_state_dict(state)  # queued prompts first, then the same source order
    assert [p.uid for p in again.get(6)] == [p.uid for p in rest]
    assert len({p.uid for p in first} | {p.uid for p in rest}) == 9  # no prompt served twice in an epoch


def test_weight_store_keeps_the_newest_version_only():
    store = WeightStore()
    assert store.get_if_newer(-1) is None
    store.publish(2, ["ref2"], 0.5)
    store.publish(1, ["ref1"], 0.1)  # a late publish of an older version does not win
    assert store.get_if_newer(0) == (2, ["ref2"]) and store.get_if_newer(2) is None
    assert store.stats() == {"version": 2, "published": 2, "publish_s_mean": 0.3}


def test_busy_fraction_is_bounded():
    assert busy_fraction(5.0, None) == 0.0
    assert busy_fraction(1e9, 0.0) == 1.0


def test_state_dict_packing_round_trips_bfloat16():
    sd = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(4)}
    back = unpack_state_dict(pack_state_dict(sd))
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k])


def test_group_packing_round_trips():
    groups = [make_experience(i, v, [1.0, 0.0, 0.5]) for i, v in enumerate([2, 3])]
    packed = pack_groups(groups)
    assert [group_rows(g) for g in packed] == [3, 3]
    back = unpack_groups(packed)
    for a, b in zip(groups, back):
        assert (a.prompt_id, a.policy_version) == (b.prompt_id, b.policy_version)
        assert torch.equal(a.batch.response_ids, b.batch.response_ids) and torch.equal(a.batch.rewards, b.batch.rewards)


def test_experience_buffer_prefetch_take_and_give_back_keep_the_bound_and_the_accounting():
    """The trainer's prefetch: take for version V + 1 while V trains; give back an untrained batch."""
    buf = ExperienceBuffer(max_size=16, max_staleness=1, prompts_per_step=2)
    buf.set_version(3)
    buf.push(pack_groups([make_experience(i, v, [1.0, 0.0]) for i, v in enumerate([2, 3, 3, 4])]))
    got = unpack_groups(buf.take(2, timeout_s=0.1, for_version=4)[0])  # for consumer version 4: version 2 is stale
    assert [g.policy_version for g in got] == [3, 3]
    assert all(4 - g.policy_version <= 1 for g in got)
    assert buf.stats()["version"] == 3 and buf.stats()["evicted_stale"] == 1  # asking ahead moves nothing
    assert buf.give_back(pack_groups(got)) == 2
    s = buf.stats()
    assert (s["sampled"], s["size"], s["given_back"]) == (0, 3, 2)
    assert s["pushed"] == s["sampled"] + s["evicted_stale"] + s["dropped_overflow"] + s["size"]
    assert [g.prompt_id for g in unpack_groups(buf.take(3, timeout_s=0.1)[0])] == [1, 2, 3]
    buf.advance(5)
    buf.advance(4)  # reported out of order: never moves back
    assert buf.stats()["version"] == 5

    # tau = 0 and a step that does not count: the prefetch asked for V + 1, which never comes; the trainer
    # takes for V again and finds V's data, because asking ahead did not make the buffer refuse it
    strict = ExperienceBuffer(max_size=16, max_staleness=0, prompts_per_step=2)
    strict.set_version(3)
    assert strict.take(2, timeout_s=0.05, for_version=4) == ([], 0)
    assert strict.push(pack_groups([make_experience(i, 3, [1.0, 0.0]) for i in range(2)])) == 2
    assert [g.policy_version for g in unpack_groups(strict.take(2, timeout_s=0.1, for_version=3)[0])] == [3, 3]

    admission = ExperienceBuffer(max_size=16, max_staleness=0, prompts_per_step=2)
    assert admission.try_admit(2) and not admission.try_admit(1)  # capacity (0 + 0 + 1) x 2 groups
    admission.release(2)
    assert admission.try_admit(2) and admission.stats()["admitted"] == 2
    # a group an environment failed is released: room for one group, never a whole batch of 2 (in lockstep the
    # step would wait forever): the part batch that fits is admitted, unless at_least asks for more
    admission.release(1)
    assert admission.try_admit(2, 2) == 0 and admission.try_admit(2) == 1 and admission.try_admit(2) == 0
    assert admission.stats()["admitted"] == 2


def test_reconcile_balances_the_groups_and_shows_one_lost_or_trained_twice():
    """generated = trained + evicted + dropped + filtered + buffered + in_flight, from the buffer's own counts and
    each end's: a group lost between a worker and the buffer leaves `unaccounted` non-zero, one trained twice a
    negative in_flight once the loops have stopped."""
    buf = ExperienceBuffer(max_size=16, max_staleness=1, prompts_per_step=2, filter_groups=True)
    buf.set_version(3)
    rewards = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]  # the fourth: all equal, filtered
    # the first is of version 1, too stale for version 3: refused at the push and counted as evicted
    buf.push(pack_groups([make_experience(i, v, r) for i, (v, r) in enumerate(zip([1, 3, 3, 4, 4], rewards))]))
    assert len(unpack_groups(buf.take(2, timeout_s=0.1)[0])) == 2

    def poll(generated: int, trained: int) -> dict:
        rollout = [{"alive": True, "groups_pushed": generated}, {"alive": False, "groups_pushed": 99}]
        return {"buffer": buf.stats(), "rollout": rollout, "trainer": {"groups_trained": trained}}

    rec = reconcile(poll(generated=5, trained=1))  # one of the two taken is still being trained
    assert {k: v for k, v in rec.items() if not k.endswith(("_samples", "_tokens"))} == {
        "generated": 5,
        "pushed": 4,
        "trained": 1,
        "consumed": 2,
        "evicted": 1,
        "dropped": 0,
        "filtered": 1,
        "buffered": 1,
        "in_flight": 1,
        "unaccounted": 0,
    }
    done = reconcile(poll(generated=5, trained=2))  # the step is done: nothing in flight
    assert (done["in_flight"], done["unaccounted"]) == (0, 0)
    assert reconcile(poll(generated=6, trained=2))["unaccounted"] == 1  # a group a worker pushed went missing
    twice = reconcile(poll(generated=5, trained=3))  # the trainer counted a group it had already trained
    assert (twice["in_flight"], twice["unaccounted"]) == (-1, 0)


def test_the_token_ledger_puts_every_sample_and_token_in_exactly_one_account():
    """Samples (rows) and response tokens, each counted where it happens: pushed, filtered and taken by the run's
    buffer, evicted and dropped by the buffer that held them, trained by the trainer; a batch given back leaves
    in_flight for the buffer again."""
    buf = ExperienceBuffer(max_size=2, max_staleness=1, prompts_per_step=2, filter_groups=True)
    buf.set_version(3)
    groups = [
        make_experience(0, 1, [1.0, 0.0]),  # version 1, too stale for 3: evicted at the push (2 rows)
        make_experience(1, 3, [1.0, 1.0, 1.0]),  # all rewards equal: filtered (3 rows)
        make_experience(2, 3, [1.0, 0.0, 0.0, 0.0]),  # 4 rows, dropped on overflow when two newer arrive
        make_experience(3, 4, [0.0, 1.0]),  # 2 rows
        make_experience(4, 4, [0.5, 0.0, 1.0]),  # 3 rows
    ]
    buf.push(pack_groups(groups))
    taken, _ = buf.take(2, timeout_s=0.1)  # groups 3 and 4; the trainer trains the first, the second in flight
    led = token_ledger(buf.stats(), {"trained_rows": 2, "trained_tokens": 6})
    rows = {"pushed": 14, "trained": 2, "evicted": 2, "dropped": 4, "filtered": 3, "buffered": 0, "in_flight": 3}
    assert {k: led[f"{k}_samples"] for k in rows} == rows and led["unaccounted_samples"] == 0, led
    assert {k: led[f"{k}_tokens"] for k in rows} == {k: 3 * v for k, v in rows.items()}  # 3 tokens a row
    buf.give_back(taken[1:])  # the trainer stopped with it prefetched: back in the buffer
    led = token_ledger(buf.stats(), {"trained_rows": 2, "trained_tokens": 6})
    assert (led["in_flight_samples"], led["buffered_samples"], led["unaccounted_samples"]) == (0, 3, 0), led
    # a trainer that counts rows it never took shows as a negative in_flight (the audit's ledger check fails it)
    assert token_ledger(buf.stats(), {"trained_rows": 5, "trained_tokens": 15})["in_flight_samples"] == -3
    # resumed from a checkpoint whose ledger this was: its accounts go on, what it held buffered is carried
    before = token_ledger(buf.stats(), {"trained_rows": 2, "trained_tokens": 6})
    fresh = ExperienceBuffer(max_size=2, max_staleness=1, prompts_per_step=2)
    fresh.push(pack_groups([make_experience(5, 0, [1.0, 0.0])]))
    taken, _ = fresh.take(1, timeout_s=0.1)
    led = token_ledger(fresh.stats(), {"trained_rows": 2, "trained_tokens": 6, "ledger_carried": before})
    rows = {"pushed": 16, "trained": 4, "evicted": 2, "dropped": 4, "filtered": 3, "buffered": 0, "carried": 3}
    assert {k: led[f"{k}_samples"] for k in rows} == rows and led["unaccounted_samples"] == 0, led


def test_a_worker_whose_loop_was_revoked_but_lived_on_is_counted_once():
    """A loop declared lost in a process that lived on: the buffer counts what it accepted from the revoked lease
    (revoked_groups), refuses its later pushes, and the worker's next loop pushes under a new lease. The worker's
    own count under the revoked lease is left out of `generated`: each group is counted once."""
    buf = ExperienceBuffer(max_size=64, max_staleness=4, prompts_per_step=2)
    groups = [make_experience(i, 0, [1.0, 0.0]) for i in range(5)]
    assert buf.push(pack_groups(groups[:2]), "0-old", 0) == 2
    buf.revoke("0-old")
    assert buf.push(pack_groups(groups[2:3]), "0-old", 1) == 0  # refused: its prompts went back to the queue
    assert buf.push(pack_groups(groups[3:]), "0-new", 0) == 2
    worker = {"alive": True, "groups_pushed": 5, "pushed_by_holder": {"0-old": 3, "0-new": 2}}
    rec = reconcile({"buffer": buf.stats(), "rollout": [worker], "trainer": {"groups_trained": 0}})
    assert rec["generated"] == 4 == rec["buffered"] and rec["unaccounted"] == 0, rec


def test_a_resumed_buffer_admits_only_the_window_ahead():
    """Admission counts groups from version 0: a run resumed at version 300 would have 300 versions of room, and
    admission would never hold rollout back again. `start_at` counts from the resumed version."""
    resumed = ExperienceBuffer(max_size=64, max_staleness=1, prompts_per_step=2)
    resumed.start_at(300)
    assert resumed.try_admit(4) and not resumed.try_admit(1)  # capacity (1 + 300 + 1) x 2 - 300 x 2 = 4 groups
    assert resumed.stats()["admitted"] == 300 * 2 + 4


def test_a_take_returns_the_bound_it_enforced_even_when_the_bound_moves_meanwhile():
    """The buffer is the one owner of the bound: a take answers with the max_staleness it enforced, the one the
    trainer checks its batch against (the autopilot may move the bound while a take waits)."""
    buf = ExperienceBuffer(max_size=16, max_staleness=1, prompts_per_step=2, ceiling=3)
    buf.set_version(4)
    out = {}
    taker = threading.Thread(target=lambda: out.setdefault("got", buf.take(2, timeout_s=30)))
    taker.start()
    time.sleep(0.2)
    assert buf.set_max_staleness(3) == 3  # raised while the take waits: it enforces the bound it began with
    buf.push(pack_groups([make_experience(i, 3, [1.0, 0.0]) for i in range(2)]))
    taker.join(30)
    groups, bound = out["got"]
    assert bound == 1 and [g.policy_version for g in unpack_groups(groups)] == [3, 3]
    assert buf.take(1, timeout_s=0.01) == ([], 3)  # the next take enforces the new one


def test_both_hosts_poll_results_are_assembled_alike():
    """assemble_poll is each host's poll result: the step's metrics get the shared figures (over the live workers)
    and the host's own, the step, version and events move on, and only the Ray host's has `cluster`."""
    from types import SimpleNamespace

    from rlhf_core.run.control import assemble_poll

    buffer = ExperienceBuffer(max_size=16, max_staleness=1, prompts_per_step=2).stats()
    trainer = {"step": 3, "version": 3, "busy_frac": 0.5}
    rollout = [{"alive": True, "busy_frac": 0.8, "env/errors": 1}, {"alive": False, "error": "starting"}]
    keys = ["step", "version", "done", "metrics", "buffer", "queue", "rollout", "trainer", "events", "failed"]
    for cluster in (None, {"rollout_workers": 2}):
        run = SimpleNamespace(last_step=0, last_version=0, _new_events=[{"kind": "k"}], done=False, failed=None)
        poll = assemble_poll(run, [{"loss": 1.0}], trainer, buffer, {}, rollout, {"x": 1}, cluster)
        assert list(poll) == (keys if cluster is None else [*keys[:8], "cluster", *keys[8:]])
        assert poll["events"] == [{"kind": "k"}] and run._new_events == []
        assert (run.last_step, run.last_version) == (3, 3)
        m = poll["metrics"][0]
        assert m["loss"] == 1.0 and m["x"] == 1 and m["util/rollout_busy"] == 0.8 and m["env/errors"] == 1.0
