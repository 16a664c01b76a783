"""A sharded trainer group (FSDP2 over 2 gloo ranks, real torch.distributed) makes exactly the update of one
Trainer on the whole batch, for every loss; its weight sync and checkpoints are those of one process, and a
checkpoint saved with 2 ranks resumes with 1 and the other way round. With LoRA too: a frozen sharded base, the
adapters sharded and trained, the KL reference the same model with its adapters disabled, the adapters alone
synced and checkpointed (PEFT format). PPO with a critic (GAE) too: the critic is sharded on the same ranks,
its values gathered so that GAE and its whitening see the whole batch; the policy's and the critic's
weights, the critic's metrics and its checkpointed state (weights, AdamW, counters) are those of one process.

The two ranks run once per module (one spawn: every case in turn), each with the whole batch, training on its
half of the rows in 3 micro-batches of 8; the reference is one plain Trainer (no FSDP) with the whole batch in
one micro-batch. The batch is stale (ratios != 1), of rows of different lengths and three rows without valid
tokens (unevenly spread over the ranks: the seq-mean denominators are not row counts), and the gradient is
clipped (the global norm is over the clip). Tolerance: float32, the same arithmetic up to summation order
(matmuls over 24 rows instead of 48, reductions across ranks): metrics agree to rel 1e-5 / abs 1e-6 and the
weights after 3 AdamW steps to atol 1e-6 (measured: ~2e-8; the GAE case 1.2e-7 for the policy, 1.9e-7 for the
critic: the advantages pass through the gathered values and a whitening), while the steps move the weights by
~3e-4. The critic's 4 micro-batches of 6 rows per rank are against one of 48.
"""

from __future__ import annotations

import copy
import re
import shutil
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_core.config import load_config
from rlhf_core.data import collate_prompts
from rlhf_core.model.lora import ADAPTER_DIR, adapter_state_dict, apply_lora
from rlhf_core.model.policy import load_policy
from rlhf_core.model.sharding import is_dtensor, iter_full_tensors
from rlhf_core.rollout import HFEngine, SamplingParams
from rlhf_core.run.build import build_critic
from rlhf_core.run.checkpoint import CheckpointError, CheckpointState, load_checkpoint, read_checkpoint, save_checkpoint
from rlhf_core.trainer import Trainer

# ~40 s on 2 shared cores (two spawned ranks import torch and transformers): over the unit tier's budget
pytestmark = pytest.mark.slow

RANKS = 2
STEPS = 3
G = 4
BASE = [
    f"rollout.samples_per_prompt={G}",
    "trainer.prompts_per_step=12",
    "rollout.max_new_tokens=8",
    "trainer.lr=1e-4",
    "trainer.grad_clip=0.2",
]
CASES = {  # GRPO and PPO share their code: GRPO with a KL term, PPO without one
    "grpo-kl-seq-mean-token-mean": [
        "algorithm.loss=grpo",
        "algorithm.kl_coef=0.05",
        "algorithm.agg=seq-mean-token-mean",
    ],
    "ppo-seq-mean-token-sum-norm": ["algorithm.loss=ppo", "algorithm.agg=seq-mean-token-sum-norm"],
    "m2po-trust_region-kl": [
        "algorithm.loss=m2po",
        "algorithm.loss_options.masking=trust_region",
        "algorithm.loss_options.clip_eps=null",
        "algorithm.kl_coef=0.05",
    ],
    "m2po-ratio_sq": [
        "algorithm.loss=m2po",
        "algorithm.loss_options.masking=ratio_sq",
        "algorithm.agg=seq-mean-token-sum",
    ],
    # LoRA on a sharded base (frozen base shards, trainable adapter shards); the KL reference is the same
    # sharded model with its adapters disabled. Adapters on every linear layer, lm_head (tied) included.
    "lora-grpo-kl": [
        "algorithm.loss=grpo",
        "algorithm.kl_coef=0.05",
        "model.lora.r=4",
        "model.lora.alpha=8",
        "model.lora.target_modules=[q_proj,v_proj,down_proj,lm_head]",
        "trainer.lr=1e-3",
        "trainer.grad_clip=0.05",  # the adapters' gradient is smaller (B starts at 0): the clip stays active
    ],
    "lora-m2po": [
        "algorithm.loss=m2po",
        "model.lora.r=4",
        "model.lora.alpha=8",
        "trainer.lr=1e-3",
        "trainer.grad_clip=0.04",  # below its first step's norm (0.048 with the sample std): the clip is active
    ],
    # PPO with a learned critic: the values (rank rows, gathered) make GAE advantages whitened over the whole
    # batch; the critic trains alone in step 1 (its warm-up), then with the policy
    "ppo-gae-critic": [
        "algorithm.loss=ppo",
        "algorithm.advantage=gae",
        "algorithm.advantage_options.lam=0.95",
        "critic.lr=1e-3",
        "critic.warmup_steps=1",
    ],
}
# no KL: a resumed run's reference is its resumed weights, with N ranks or one; full weights and LoRA adapters
RESUME_CASES = ("m2po-ratio_sq", "lora-m2po", "ppo-gae-critic")
# 24 rows per rank: 3 micro-batches (the policy's and the critic's); one process: the whole batch at once
SHARDED_MICRO = ("trainer.micro_batch_size=8",)
SINGLE_MICRO = ("trainer.micro_batch_size=128",)
METRICS = (
    "loss/total",
    "loss/policy",
    "loss/kl",
    "policy/grad_norm",
    "policy/entropy",
    "policy/ratio_mean",
    "policy/ratio_max",
    "policy/clip_frac",
    "policy/approx_kl",
    "m2po/m2",
    "m2po/masked_frac",
    "trainer/step_finite",
    "version",
    "critic/value_loss",
    "critic/vf_clipfrac",
    "critic/explained_variance",
    "critic/values_mean",
    "critic/grad_norm",
    "critic/policy_trains",
)
WEIGHT_ATOL = 1e-6


def make_cfg(case: str, micro: tuple[str, ...]):
    return load_config(None, [*BASE, *CASES[case], *micro])


def fresh_policy(policy_dir, cfg=None):
    """The tiny policy; with cfg.model.lora its adapters, initialised alike in every process (seed 0)."""
    model = load_policy(policy_dir, dtype="float32", device="cpu")[0]
    if cfg is not None and cfg.model.lora is not None:
        torch.manual_seed(0)
        model = apply_lora(model, cfg.model.lora)
    return model


def trainer_for(policy_dir, case: str, micro: tuple[str, ...], group=None) -> Trainer:
    """The case's Trainer; with algorithm.advantage 'gae' its critic as every run builds it (on `group`)."""
    cfg = make_cfg(case, micro)
    model = fresh_policy(policy_dir, cfg)
    return Trainer(model, cfg, 0, group=group, critic=build_critic(cfg, model, policy_dir, group=group))


def critic_state(trainer: Trainer):
    """The critic's checkpointed state (whole tensors; a collective when sharded), None without a critic."""
    return None if trainer.critic is None else trainer.critic.state_dict()


def _rank_main(rank: int, port: int, policy_dir: str, work: str) -> None:
    """One trainer rank: every case for STEPS steps, then the two checkpoint round trips."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    group = dist.group.WORLD
    try:
        batch = torch.load(f"{work}/batch.pt", weights_only=False)
        out: dict = {}
        for case in CASES:
            trainer = trainer_for(policy_dir, case, SHARDED_MICRO, group)
            metrics = [trainer.train_step(batch) for _ in range(STEPS)]
            weights, sync = trainer.full_weights(), trainer.state_dict_for_sync()  # collectives: every rank
            out[case] = {"metrics": metrics, "weights": weights, "sync": sync, "critic": critic_state(trainer)}
            if trainer.critic is not None:  # its parameters are this rank's shards, not a whole copy per rank
                out[case]["critic_sharded"] = all(is_dtensor(p) for p in trainer.critic.model.parameters())
        for case in RESUME_CASES:
            # saved with 2 ranks after STEPS - 1 steps (the parent resumes it with one process)
            trainer = trainer_for(policy_dir, case, SHARDED_MICRO, group)
            for _ in range(STEPS - 1):
                trainer.train_step(batch)
            state, weights = trainer.state_dict(), trainer.full_weights()
            if rank == 0:
                saved = f"{work}/saved_by_2_{case}"
                save_checkpoint(saved, trainer.model, CheckpointState(state, {}, {}), weights=weights)
            # saved by one process after STEPS - 1 steps, resumed here with 2 ranks for the last step
            trainer = trainer_for(policy_dir, case, SHARDED_MICRO, group)
            resumed = load_checkpoint(f"{work}/saved_by_1_{case}", trainer.model, critic=trainer.critic)
            trainer.load_state_dict(resumed.trainer)
            metrics = [trainer.train_step(batch)]
            out[f"resumed_by_2_{case}"] = {
                "metrics": metrics,
                "weights": trainer.full_weights(),
                "critic": critic_state(trainer),
            }
            if trainer.critic is not None:  # a critic of other shapes: refused on every rank before any load
                before = trainer.full_weights()
                try:
                    load_checkpoint(f"{work}/bad_critic", trainer.model, critic=trainer.critic)
                    out["bad_critic"] = None
                except CheckpointError as exc:
                    out["bad_critic"] = str(exc)
                after = trainer.full_weights()
                out["bad_critic_policy_unchanged"] = all(torch.equal(v, after[k]) for k, v in before.items())
        out["gathered"] = dict(_gather_odd_shapes(group))
        if rank == 0:
            torch.save(out, f"{work}/sharded.pt")
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


def odd_tensors() -> dict[str, torch.Tensor]:
    """Shapes whose dim 0 does not split evenly over 2 ranks (1 row: one rank's shard is empty), two dtypes,
    and one tensor over the packing threshold."""
    g = torch.Generator().manual_seed(5)
    return {
        "one_row": torch.randn(1, 3, generator=g),
        "odd_rows": torch.randn(5, 2, generator=g),
        "vector": torch.randn(7, generator=g),
        "double": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "big": torch.randn(64, 64, generator=g),
        "after_big": torch.randn(3, 2, generator=g),
    }


def _gather_odd_shapes(group):
    """`iter_full_tensors` of `odd_tensors` sharded on dim 0 (FSDP2's layout), with tiny packing limits so
    that they are cut into several buckets and "big" goes alone."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group, "cpu")
    named = [(k, distribute_tensor(v, mesh, [Shard(0)])) for k, v in odd_tensors().items()]
    return iter_full_tensors(named, group, small_bytes=8 << 10, bucket_bytes=64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def batch(tiny_policy_dir, tiny_tokenizer, max3_prompts):
    """48 rows (12 prompts x G) of different lengths, behaviour log-probs ~0.5 nats off the policy, rows 5,
    20 (rank 0) and 41 (rank 1) without a valid token, rewards 1 on every third row."""
    tok = tiny_tokenizer
    engine = HFEngine(fresh_policy(tiny_policy_dir), tok.eos_token_id, tok.pad_token_id, seed=3)
    b = engine.generate(collate_prompts(max3_prompts[0][8:20], tok.pad_token_id), G, SamplingParams(max_new_tokens=8))
    assert b.response_lengths.min() < b.response_lengths.max()
    b.rewards = (torch.arange(len(b)) % 3 == 0).float()
    noise = 0.5 * torch.randn(b.behavior_logprobs.shape, generator=torch.Generator().manual_seed(0))
    b.behavior_logprobs = torch.where(b.response_mask, b.behavior_logprobs + noise, b.behavior_logprobs)
    b.response_mask = b.response_mask.clone()
    b.response_mask[[5, 20, 41]] = False
    b.response_lengths = b.response_mask.sum(-1)
    return b


@pytest.fixture(scope="module")
def single(tiny_policy_dir, batch):
    """The reference: per case, one plain Trainer's metrics of each step, weights and sync dict after STEPS."""
    out = {}
    for case in CASES:
        trainer = trainer_for(tiny_policy_dir, case, SINGLE_MICRO)
        metrics = []
        for step in range(STEPS):
            metrics.append(trainer.train_step(batch))
            if case in RESUME_CASES and step == STEPS - 2:
                out[f"state_before_last_{case}"] = copy.deepcopy(trainer.state_dict())
                out[f"model_before_last_{case}"] = copy.deepcopy(trainer.model)
        out[case] = {
            "metrics": metrics,
            "weights": trainer.full_weights(),
            "sync": trainer.state_dict_for_sync(),
            "critic": critic_state(trainer),
        }
    return out


@pytest.fixture(scope="module")
def sharded(tiny_policy_dir, batch, single, tmp_path_factory):
    """The same cases on 2 FSDP2 ranks (one spawn), and their checkpoint round trips."""
    work = tmp_path_factory.mktemp("sharded")
    torch.save(batch, work / "batch.pt")
    for case in RESUME_CASES:
        state = CheckpointState(single[f"state_before_last_{case}"], {}, {})
        save_checkpoint(work / f"saved_by_1_{case}", single[f"model_before_last_{case}"], state)
    # the GAE case's checkpoint with a critic body one column narrower (what another critic.path would hold)
    shutil.copytree(work / "saved_by_1_ppo-gae-critic", work / "bad_critic")
    bad = torch.load(work / "bad_critic" / "state.pt", weights_only=True)
    critic_weights = bad["trainer"]["critic"]["weights"]
    critic_weights["body.embed_tokens.weight"] = critic_weights["body.embed_tokens.weight"][:, :-1].clone()
    torch.save(bad, work / "bad_critic" / "state.pt")
    mp.spawn(_rank_main, args=(_free_port(), str(tiny_policy_dir), str(work)), nprocs=RANKS, join=True)
    out = torch.load(work / "sharded.pt", weights_only=False)
    out["work"] = work
    return out


def assert_same_metrics(got: dict, want: dict, step: int) -> None:
    for key in METRICS:
        assert (key in got) == (key in want), key
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), f"step {step + 1}: {key}"


def assert_same_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=WEIGHT_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def assert_same_optimizer_state(got: dict, want: dict) -> None:
    """The optimizer state of one process: the same groups, and whole tensors equal within WEIGHT_ATOL."""
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, s in want["state"].items():
        for k, v in s.items():
            torch.testing.assert_close(got["state"][i][k], v, atol=WEIGHT_ATOL, rtol=0)


def assert_same_critic(got, want) -> None:
    """A critic's state (`Critic.state_dict`): weights, AdamW state and counters of one process; None alike."""
    assert (got is None) == (want is None)
    if want is not None:
        assert got["updates"] == want["updates"]
        assert_same_weights(got["weights"], want["weights"])
        assert_same_optimizer_state(got["optimizer"], want["optimizer"])


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_make_the_update_of_one(case, sharded, single, tiny_policy_dir):
    got, want = sharded[case], single[case]
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"])):
        assert_same_metrics(g, w, step)
    cfg = make_cfg(case, SINGLE_MICRO)
    assert want["metrics"][0]["policy/grad_norm"] > cfg.trainer.grad_clip  # the clip is active: the norm is global
    if case.startswith("m2po"):
        assert want["metrics"][-1]["m2po/masked_frac"] > 0  # the batch-wide mask is active
    if "kl" in case:
        assert want["metrics"][-1]["loss/kl"] > 0
    assert_same_weights(got["weights"], want["weights"])
    # the weights moved by far more than the tolerance: agreement is not that of two untouched models
    start = fresh_policy(tiny_policy_dir, cfg)
    start = adapter_state_dict(start) if cfg.model.lora else start.state_dict()  # LoRA: the adapters only
    moved = max(float((want["weights"][k] - start[k]).abs().max()) for k in want["weights"])
    assert moved > 100 * WEIGHT_ATOL
    assert_same_critic(got["critic"], want["critic"])
    if want["critic"] is not None:
        assert got["critic_sharded"]
        last = want["metrics"][-1]
        assert last["critic/value_loss"] > 0 and last["critic/explained_variance"] != 0
        assert want["metrics"][0]["critic/grad_norm"] > cfg.trainer.grad_clip  # the critic's clip is active too
        assert [m["critic/policy_trains"] for m in want["metrics"]] == [0.0, 1.0, 1.0]
        start = build_critic(cfg, fresh_policy(tiny_policy_dir), tiny_policy_dir).model.state_dict()
        moved = max(float((want["critic"]["weights"][k] - start[k]).abs().max()) for k in start)
        assert moved > 100 * WEIGHT_ATOL


@pytest.mark.parametrize("case", list(CASES))
def test_weight_sync_of_a_sharded_trainer_is_whole(case, sharded, single):
    """Every rank gathers the whole tensors: the names, shapes and values one process ships."""
    got, want = sharded[case]["sync"], single[case]["sync"]
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape and got[name].is_contiguous()
        torch.testing.assert_close(got[name], want[name], atol=WEIGHT_ATOL, rtol=0)


@pytest.mark.parametrize("case", RESUME_CASES)
def test_checkpoint_saved_by_two_ranks_resumes_with_one(case, sharded, single, batch, tiny_policy_dir):
    path = sharded["work"] / f"saved_by_2_{case}"
    state, weights = read_checkpoint(path, fresh_policy(tiny_policy_dir, make_cfg(case, SINGLE_MICRO)))
    if "lora" in case:  # the PEFT adapter, as one process writes it
        assert (path / ADAPTER_DIR / "adapter_config.json").is_file() and not (path / "policy.safetensors").exists()
        assert state.lora["r"] == 4 and all("lora_" in k for k in weights)
    # the same layout as one process writes: whole tensors, the optimizer state of one process
    want_state = single[f"state_before_last_{case}"]
    assert_same_optimizer_state(state.trainer["optimizer"], want_state["optimizer"])
    assert_same_critic(state.trainer.get("critic"), want_state.get("critic"))  # the critic's too
    assert (state.version, state.step) == (STEPS - 1, STEPS - 1)
    trainer = trainer_for(tiny_policy_dir, case, SINGLE_MICRO)
    trainer.load_state_dict(load_checkpoint(path, trainer.model, critic=trainer.critic).trainer)
    assert_same_metrics(trainer.train_step(batch), single[case]["metrics"][-1], STEPS - 1)
    assert_same_weights(trainer.full_weights(), single[case]["weights"])
    assert_same_critic(critic_state(trainer), single[case]["critic"])


@pytest.mark.parametrize("case", RESUME_CASES)
def test_checkpoint_saved_by_one_process_resumes_with_two_ranks(case, sharded, single):
    got = sharded[f"resumed_by_2_{case}"]
    assert_same_metrics(got["metrics"][0], single[case]["metrics"][-1], STEPS - 1)
    assert_same_weights(got["weights"], single[case]["weights"])
    assert_same_critic(got["critic"], single[case]["critic"])


def test_sharded_ranks_refuse_a_mismatched_critic_before_any_load(sharded):
    """The critic's saved weights are checked against the sharded critic's whole shapes (a DTensor's shape, not
    this rank's shard): the matching checkpoints above resume, one whose critic differs fails on every rank
    naming the critic and the parameter, the policy's shards untouched."""
    message = sharded["bad_critic"]
    assert message is not None and "critic" in message and "bad_critic" in message
    found = re.search(r"body\.embed_tokens\.weight: \[(\d+), (\d+)\] vs \[(\d+), (\d+)\]", message)
    assert found, message
    vocab_saved, width_saved, vocab_live, width_live = map(int, found.groups())
    assert vocab_saved == vocab_live and width_saved + 1 == width_live  # whole shapes on both sides
    assert sharded["bad_critic_policy_unchanged"]


def test_shards_of_any_shape_and_dtype_gather_whole(sharded):
    """Packed small shards (several buckets, uneven and empty shards, two dtypes) and a large one alone come
    back as the tensors that were sharded."""
    got, want = sharded["gathered"], odd_tensors()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0)


# ------------------------------------------------------------------------------------- NCCL (2 CUDA devices)
NCCL_CASES = ("grpo-kl-seq-mean-token-mean", "m2po-trust_region-kl", "lora-grpo-kl")
NCCL_WEIGHT_ATOL = 1e-5  # CUDA kernels sum in a different order for 24 rows than for 48


def _nccl_rank_main(rank: int, port: int, policy_dir: str, work: str) -> None:
    """One CUDA rank of an NCCL group: NCCL_CASES for STEPS steps each."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        batch = torch.load(f"{work}/batch.pt", weights_only=False)
        out = {}
        for case in NCCL_CASES:
            cfg = make_cfg(case, SHARDED_MICRO)
            trainer = Trainer(fresh_policy(policy_dir, cfg).to(f"cuda:{rank}"), cfg, 0, group=dist.group.WORLD)
            metrics = [trainer.train_step(batch) for _ in range(STEPS)]
            out[case] = {"metrics": metrics, "weights": trainer.full_weights(), "sync": trainer.state_dict_for_sync()}
        if rank == 0:
            torch.save(out, f"{work}/nccl.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group of 2 ranks needs two CUDA devices")
def test_two_cuda_ranks_over_nccl_make_the_update_of_one_gpu(tiny_policy_dir, batch, tmp_path):
    """N = 2 over NCCL (one rank per GPU) against N = 1 on one GPU: the same metrics and weights
    (scripts/gpu_checks.sh runs this where two GPUs are present)."""
    want = {}
    for case in NCCL_CASES:
        cfg = make_cfg(case, SINGLE_MICRO)
        trainer = Trainer(fresh_policy(tiny_policy_dir, cfg).to("cuda:0"), cfg, 0)
        metrics = [trainer.train_step(batch) for _ in range(STEPS)]
        want[case] = {"metrics": metrics, "weights": trainer.full_weights(), "sync": trainer.state_dict_for_sync()}
    torch.save(batch, tmp_path / "batch.pt")
    mp.spawn(_nccl_rank_main, args=(_free_port(), str(tiny_policy_dir), str(tmp_path)), nprocs=RANKS, join=True)
    got = torch.load(tmp_path / "nccl.pt", weights_only=False)
    for case in NCCL_CASES:
        for step, (g, w) in enumerate(zip(got[case]["metrics"], want[case]["metrics"])):
            for key in METRICS:
                if key in w:
                    assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), f"{case} step {step + 1}: {key}"
        for part in ("weights", "sync"):
            assert sorted(got[case][part]) == sorted(want[case][part])
            for name, tensor in want[case][part].items():
                torch.testing.assert_close(got[case][part][name], tensor, atol=NCCL_WEIGHT_ATOL, rtol=0)
