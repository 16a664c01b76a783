"""The Ray runtime on a real local Ray instance (num_cpus=2): staleness bound, restarts, both modes learn,
clear errors for bad clusters. One Ray instance serves the module; each run creates and kills its actors."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray")

from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.distributed import ClusterError, DistributedRun, run_distributed  # noqa: E402
from rlhf_core.distributed.actors import pack_state_dict, unpack_state_dict  # noqa: E402


def tiny_cfg(tmp_path, *overrides):
    return load_config("configs/tiny.yaml", [
        f"run.output_dir={tmp_path}", "cluster.num_cpus=2", "data.eval_size=100", "supervision.supervise_interval_s=0.2",
        "runtime.wait_timeout_s=60", *overrides])


def assert_all_dead(actors, within_s: float = 30.0) -> None:
    """Every actor handle answers with RayActorError (killed, not merely idle) within `within_s`:
    ray.kill is asynchronous, so a call made right after it may still be served."""
    assert actors
    deadline = time.monotonic() + within_s
    for actor in actors:
        while True:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"{actor} is still alive {within_s:g} s after teardown"
            time.sleep(0.2)


def test_async_run_bounds_staleness_and_reconciles(ray_local, tmp_path):
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=25", "runtime.max_staleness=1", "rollout.prompts_per_batch=8")
    launched = []
    result = run_distributed(cfg, poll_interval_s=0.2, on_launch=lambda run: launched.extend(run.handle.actors))
    assert result["steps"] == 25
    hist = result["final_poll"]["trainer"]["staleness_hist"]
    assert hist and max(hist) <= 1, hist                     # every consumed sample: tau <= tau_max
    assert sum(hist.values()) == 25 * cfg.batch_size          # ... and every consumed sample is counted
    per_step = [m["async/staleness_max"] for m in result["metrics"]]
    assert len(per_step) == 25 and max(per_step) <= 1
    rec = result["reconcile"]
    assert rec["consumed"] == 25 * cfg.trainer.prompts_per_step
    assert rec["generated"] == rec["consumed"] + rec["evicted"] + rec["dropped"] + rec["buffered"] + rec["in_flight"]
    assert_all_dead(launched)                                 # teardown killed exactly our actors
    assert ray.is_initialized()                               # ... and left the Ray it did not start running


def test_stopping_mid_run_gives_the_prefetched_batch_back(ray_local, tmp_path):
    """The trainer prefetches batch V + 1 while V trains; stopping must not count that batch as consumed.
    A rollout far faster than the trainer keeps the buffer stocked, so a batch is prefetched at the stop."""
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=500", "runtime.max_staleness=2", "rollout.prompts_per_batch=8",
                   "rollout.engine=random", "rollout.random_tokens_per_s=1000000")
    assert cfg.runtime.prefetch
    with DistributedRun(cfg) as run:
        run.launch()
        run.start()
        deadline = time.monotonic() + 120
        while run.poll()["step"] < 5:
            assert time.monotonic() < deadline, "the async run made no progress"
            time.sleep(0.2)
        run.stop()
        final = run.poll()
        rec = run.reconcile(final)
    steps = final["step"]
    assert 5 <= steps < 500
    assert final["buffer"]["given_back"] == cfg.trainer.prompts_per_step   # the prefetched batch went back
    assert rec["consumed"] == steps * cfg.trainer.prompts_per_step    # trained on, not merely taken
    assert rec["generated"] == rec["consumed"] + rec["evicted"] + rec["dropped"] + rec["buffered"] + rec["in_flight"]
    assert rec["in_flight"] >= 0
    # the rollout loop asks admission for its next batch before generating this one; stopping returns it
    assert final["buffer"]["admitted"] == rec["generated"]


def test_narrowed_admission_window_bounds_staleness_tighter(ray_local, tmp_path):
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=12", "runtime.max_staleness=2", "rollout.prompts_per_batch=8")
    result = run_distributed(cfg, poll_interval_s=0.2, on_launch=lambda run: run.set_admission_window(0))
    assert result["final_poll"]["buffer"]["admission_window"] == 0
    assert set(result["final_poll"]["trainer"]["staleness_hist"]) == {0}   # generated with the weights it trains


def test_killed_rollout_worker_is_restarted_and_run_completes(ray_local, tmp_path):
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=30", "cluster.max_restarts=2")
    events = []
    with DistributedRun(cfg) as run:
        run.launch()
        run.start()
        killed = False
        deadline = time.monotonic() + 240
        while not run.done and time.monotonic() < deadline:
            poll = run.poll()
            events.extend(poll["events"])
            if not killed and poll["step"] >= 5:
                run.workers[0].crash.remote()
                killed = True
            time.sleep(0.2)
        assert run.done, "run did not complete after a worker was killed"
        assert run.restarts == [1]
    kinds = [e["kind"] for e in events]
    assert "rollout_worker_died" in kinds and "rollout_worker_restarted" in kinds


def test_trainer_failure_ends_run_with_clear_error_and_keeps_checkpoint(ray_local, tmp_path):
    from rlhf_core.checkpoint import read_checkpoint
    from rlhf_core.distributed import RunFailed

    cfg = tiny_cfg(tmp_path, "trainer.total_steps=500")
    with DistributedRun(cfg) as run:
        run.launch()
        run.start()
        while run.poll()["step"] < 3:
            time.sleep(0.1)
        ckpt = run.checkpoint(tmp_path / "ckpt")
        run.trainer.crash.remote()
        with pytest.raises(RunFailed, match="trainer failed"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                run.poll()
                time.sleep(0.2)
    state, _ = read_checkpoint(ckpt)
    assert state["trainer"]["step"] >= 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_both_modes_learn(ray_local, tmp_path, mode):
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=70", f"runtime.mode={mode}", "trainer.lr=0.0005")
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["eval/accuracy_start"] <= 0.3
    assert result["eval/accuracy"] >= result["eval/accuracy_start"] + 0.3, result["eval/accuracy"]
    if mode == "sync":
        assert set(result["final_poll"]["trainer"]["staleness_hist"]) == {0}


def test_bad_cluster_address_fails_fast(tmp_path):
    cfg = tiny_cfg(tmp_path, "cluster.address=ray://127.0.0.1:1")
    start = time.monotonic()
    with pytest.raises(ClusterError, match="127.0.0.1:1"):
        DistributedRun(cfg).launch()
    assert time.monotonic() - start < 30


def test_too_few_resources_is_a_clear_error(ray_local, tmp_path):
    cfg = tiny_cfg(tmp_path, "rollout.num_workers=3")
    run = DistributedRun(cfg)
    with pytest.raises(ClusterError, match="not enough resources.*CPU: need 4"):
        run.launch()
    assert run.handle is None and run.workers == []          # nothing was created


def test_state_dict_packing_round_trips_bfloat16():
    import torch

    sd = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.arange(4)}
    back = unpack_state_dict(pack_state_dict(sd))
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k])


def test_experience_buffer_prefetch_take_and_give_back_keep_the_bound_and_the_accounting():
    """The trainer's prefetch: take for version V + 1 while V trains; give back an untrained batch."""
    from rlhf_core.distributed.actors import ExperienceBuffer, pack_groups, unpack_groups
    from tests.test_buffer import make_experience

    buf = ExperienceBuffer(max_size=16, max_staleness=1, prompts_per_step=2, admission=False)
    buf.set_version(3)
    buf.push(pack_groups([make_experience(i, v, [1.0, 0.0]) for i, v in enumerate([2, 3, 3, 4])]))
    got = unpack_groups(buf.take(2, timeout_s=0.1, for_version=4))   # for consumer version 4: version 2 is stale
    assert [g.policy_version for g in got] == [3, 3]
    assert all(4 - g.policy_version <= 1 for g in got)
    assert buf.stats()["version"] == 3 and buf.stats()["evicted_stale"] == 1   # asking ahead moves nothing
    assert buf.give_back(pack_groups(got)) == 2
    s = buf.stats()
    assert (s["sampled"], s["size"], s["given_back"]) == (0, 3, 2)
    assert s["pushed"] == s["sampled"] + s["evicted_stale"] + s["dropped_overflow"] + s["size"]
    assert [g.prompt_id for g in unpack_groups(buf.take(3, timeout_s=0.1))] == [1, 2, 3]
    buf.advance(5)
    buf.advance(4)                                                     # reported out of order: never moves back
    assert buf.stats()["version"] == 5

    # tau = 0 and a step that does not count: the prefetch asked for V + 1, which never comes; the trainer
    # takes for V again and finds V's data, because asking ahead did not make the buffer refuse it
    strict = ExperienceBuffer(max_size=16, max_staleness=0, prompts_per_step=2, admission=False)
    strict.set_version(3)
    assert strict.take(2, timeout_s=0.05, for_version=4) == []
    assert strict.push(pack_groups([make_experience(i, 3, [1.0, 0.0]) for i in range(2)])) == 2
    assert [g.policy_version for g in unpack_groups(strict.take(2, timeout_s=0.1, for_version=3))] == [3, 3]

    admission = ExperienceBuffer(max_size=16, max_staleness=0, prompts_per_step=2)
    assert admission.try_admit(2) and not admission.try_admit(1)      # capacity (0 + 0 + 1) x 2 groups
    admission.release(2)
    assert admission.try_admit(2) and admission.stats()["admitted"] == 2
