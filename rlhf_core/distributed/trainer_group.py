"""Ranks 1..N-1 of a sharded trainer group (cluster.trainer_workers > 1, FSDP2), and how every rank, rank 0
(the TrainerActor) included, joins the group."""

from __future__ import annotations

import ray

from rlhf_core.distributed.calls import die
from rlhf_core.run import build
from rlhf_core.run.checkpoint import load_checkpoint, restore_rng


def group_address() -> str:
    """tcp://<this node's IP>:<a free port>: where rank 0 of a trainer group meets the others."""
    import socket

    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"tcp://{ip}:{s.getsockname()[1]}"


def join_trainer_group(cfg, model, tokenizer, address: str, rank: int):
    """Join the torch.distributed group of cluster.trainer_workers ranks (NCCL on GPU, gloo on CPU; collectives
    time out after runtime.wait_timeout_s) and build this rank's sharded Trainer of `model` the way one
    process builds its Trainer (`build.build_trainer`: the stop set, and for algorithm.advantage 'gae' the
    critic, sharded on the same group)."""
    from datetime import timedelta

    import torch.distributed as dist

    on_gpu = next(model.parameters()).device.type == "cuda"
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=address,
        rank=rank,
        world_size=cfg.cluster.trainer_workers,
        timeout=timedelta(seconds=cfg.runtime.wait_timeout_s),
    )
    return build.build_trainer(cfg, model, tokenizer, group=dist.group.WORLD)


class TrainerRankActor:
    """Rank r > 0 of a sharded trainer group (cluster.trainer_workers > 1): holds its shard of the policy,
    gradients and optimizer state (and of the critic's, for algorithm.advantage 'gae'), and runs each
    collective operation rank 0 (the TrainerActor) asks for, in rank 0's order, on the same arguments. It
    talks to nothing else."""

    def __init__(self, cfg, policy_dir: str, rank: int, address: str):
        build.setup_process(cfg, cfg.trainer.seed)
        self.rank = rank
        model, tokenizer = build.build_policy(cfg, policy_dir)
        self.trainer = join_trainer_group(cfg, model, tokenizer, address, rank)

    def call(self, name: str, *args) -> None:
        """Run Trainer.<name>(*args) here (rank 0 runs it at the same time); the result stays here."""
        getattr(self.trainer, name)(*args)

    def restore(self, path: str) -> None:
        """This rank's shard of a checkpoint's weights and optimizer state, its versions and RNG."""
        state = load_checkpoint(path, self.trainer.model, critic=self.trainer.critic)
        self.trainer.load_state_dict(state.trainer)
        restore_rng(state.rng["trainer"])

    def ping(self) -> int:
        return self.rank

    def crash(self) -> None:
        """Fault-injection hook: die the way a segfault or an OOM kill would."""
        die()
