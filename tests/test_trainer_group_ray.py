"""cluster.trainer_workers = 2 on a real local Ray instance (2 CPUs): two trainer actors form a gloo group and
shard the policy (and, with algorithm.advantage 'gae', the critic) with FSDP2; the run takes the steps one
trainer takes, its checkpoint resumes with one trainer, and a rank that dies fails the run with a message
naming it."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray")

from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.distributed import DistributedRun, RunFailed  # noqa: E402
from tests.conftest import drive  # noqa: E402

pytestmark = pytest.mark.slow  # starts a local Ray instance


def group_cfg(tmp_path, workers: int, *overrides):
    return load_config(
        "configs/tiny.yaml",
        [
            f"run.output_dir={tmp_path}",
            "cluster.num_cpus=2",
            f"cluster.trainer_workers={workers}",
            "runtime.wait_timeout_s=180",  # also the ranks' rendezvous: a loaded machine starts an actor slowly
            "runtime.max_staleness=0",
            "eval.every=0",
            "data.eval_size=20",
            "trainer.prompts_per_step=4",
            "rollout.prompts_per_batch=4",
            "rollout.samples_per_prompt=4",
            "trainer.micro_batch_size=4",
            *overrides,
        ],
    )


def sync_losses(cfg) -> list[dict]:
    """Every step's metrics of a lockstep run to cfg.trainer.total_steps."""
    with DistributedRun(cfg) as run:
        run.launch()
        return drive(run)


# PPO with a critic: every rank builds the critic (build.build_trainer) and shards it with the policy; the
# overlong penalty makes the untrained policy's rewards (and so the returns and the value loss) non-zero
GAE = (
    "algorithm.advantage=gae",
    "critic.lr=1e-3",
    "reward.overlong={buffer_len: 4, penalty: 1.0}",
    "trainer.total_steps=3",
)


def test_two_trainer_ranks_take_the_steps_of_one_and_their_checkpoint_resumes_with_one(ray_local, tmp_path):
    """Lockstep (max_staleness 0), one rollout worker, the same seeds: the same batches reach both runs, so the
    losses and gradient norms of 2 ranks and of 1 agree step by step (float32 tolerance, see test_sharded_trainer), the
    critic's too; the checkpoint holds the critic and resumes with one trainer."""
    from rlhf_core.run.checkpoint import read_checkpoint

    two = sync_losses(group_cfg(tmp_path / "two", 2, *GAE, "checkpoint.every=2"))
    one = sync_losses(group_cfg(tmp_path / "one", 1, *GAE))
    assert [m["step"] for m in two] == [1, 2, 3]
    assert two[0]["critic/value_loss"] > 0
    for a, b in zip(two, one):
        for key in ("loss/total", "policy/grad_norm", "policy/entropy", "reward/mean", "critic/value_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
        for key in ("critic/grad_norm", "critic/values_mean", "critic/explained_variance"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    ckpt2 = tmp_path / "two" / "checkpoints" / "step_000002"  # the trainer wrote it at step 2
    state, _ = read_checkpoint(ckpt2)
    assert state.step == 2 and state.trainer["critic"]["updates"] == 2
    resumed = group_cfg(tmp_path / "resumed", 1, *GAE)
    with DistributedRun(resumed) as run:
        info = run.launch(resume_from=str(ckpt2))
        assert (info["step"], info["version"]) == (2, 2)
        last = drive(run)[-1]
    assert last["step"] == 3
    assert last["loss/total"] == pytest.approx(one[-1]["loss/total"], rel=1e-4, abs=1e-6)
    assert last["critic/value_loss"] == pytest.approx(one[-1]["critic/value_loss"], rel=1e-4, abs=1e-6)


def test_a_dead_trainer_rank_fails_the_run_naming_it(ray_local, tmp_path):
    """As a trainer failure is reported today (RunFailed "trainer failed: ..."), with the rank and the step;
    the checkpoint written before stays intact."""
    from rlhf_core.run.checkpoint import read_checkpoint

    cfg = group_cfg(tmp_path, 2, "trainer.total_steps=500", "runtime.max_staleness=2")
    with DistributedRun(cfg) as run:
        run.launch()
        run.start()
        while run.poll()["step"] < 2:
            time.sleep(0.1)
        ckpt = run.checkpoint(tmp_path / "ckpt")
        run.trainer_ranks[0].crash.remote()
        # in the step or in the publish after it
        failed = r"(?s)trainer failed: .*trainer rank 1 of 2 died in \w+ at step \d+"
        with pytest.raises(RunFailed, match=failed):
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                run.poll()
                time.sleep(0.2)
    state, _ = read_checkpoint(ckpt)
    assert state.step >= 2
