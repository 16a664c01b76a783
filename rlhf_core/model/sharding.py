"""A trainer sharded over N ranks of a torch.distributed process group (FSDP2), with exactly the update of one.

Every rank holds the same Trainer config and receives the whole step's batch; rank r trains on its contiguous
slice of rows (`rank_rows`). What makes the update exactly that of one process on the whole batch:

- loss normalisation is the step's: the denominators (`global_normalisers` of the whole step's mask, the
  generation budget, M2PO's kept-token count) are computed from the whole batch every rank holds, and
  M2PO's batch-wide keep mask from every row's current log-probs, gathered across ranks
  (`gather_rows`). Each rank's loss is then its exact share of the step's loss;
- gradients are summed, not averaged, across ranks (`shard_model` sets FSDP's divide factor to 1);
- the clipping norm is the global one (the norm of the sharded DTensor gradients, made whole);
- metrics are reduced across ranks the way micro-batch metrics already are (sums of shares, maxima).

The critic of algorithm.advantage 'gae' (`critic.Critic`) is sharded the same way on the same group: each
rank computes the values of its rows, gathered so that GAE sees the whole batch on every rank, and its
value loss is its share of the step's.

Parameters, gradients and AdamW state are DTensors sharded on dim 0 (`fully_shard` per decoder layer, then
the root). `full_tensor` gathers one whole tensor; every rank must call it (a collective).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

_CACHE = "_atrlhf_adapter_params"  # lora._adapter_params' cache on the model (forget_adapter_params drops it)


def forget_adapter_params(model) -> None:
    """Drop `_adapter_params`' cache of the live adapter parameters: anything that replaces the model's
    parameter objects (FSDP2's `fully_shard` swaps each for a sharded one) calls this, so that syncs and
    checkpoints read the new parameters, not frozen copies of the old ones."""
    model.__dict__.pop(_CACHE, None)


def world(group) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) without one."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def rank_rows(n: int, rank: int, size: int) -> slice:
    """The contiguous rows [lo, hi) of an n-row batch that `rank` of `size` trains on (sizes differ by ≤ 1)."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return slice(lo, lo + base + (1 if rank < extra else 0))


def micro_slices(rows: slice, n_micro: int) -> list[slice]:
    """`rows` cut into `n_micro` contiguous, non-empty micro-batches of near-equal size."""
    n = rows.stop - rows.start
    if n < n_micro:
        raise ValueError(
            f"a rank's {n} rows cannot make the {n_micro} micro-batches every rank must run (FSDP's forward and "
            "backward are collectives): give the step more rows or raise the micro-batch size "
            "(trainer.micro_batch_size, the policy's and the critic's)"
        )
    base, extra = divmod(n, n_micro)
    out, lo = [], rows.start
    for i in range(n_micro):
        hi = lo + base + (1 if i < extra else 0)
        out.append(slice(lo, hi))
        lo = hi
    return out


def rank_micro_slices(n: int, group, micro_batch_size: int) -> list[slice]:
    """This rank's rows of an n-row step (`rank_rows`) in micro-batches of at most `micro_batch_size` rows,
    as many as the widest rank's slice needs: every rank runs the same number of forward and backward passes
    (FSDP's are collectives). Without a group: the whole batch."""
    rank, size = world(group)
    widest = rank_rows(n, 0, size)
    n_micro = max(1, math.ceil((widest.stop - widest.start) / micro_batch_size))
    return micro_slices(rank_rows(n, rank, size), n_micro)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: modules of the classes HF lists in `_no_split_modules`, of
    the model or of any module inside it (the critic's ValueModel wraps an HF body)."""
    names = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: torch.nn.Module, group, device_type: str = "cpu") -> torch.nn.Module:
    """FSDP2 in place: `fully_shard` each decoder layer, then the root (embeddings, norm, head; tied weights
    stay together in the root). Gradients are reduced as a sum: each rank's loss is already its share of the
    step's loss, so the sum is the whole batch's gradient."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    forget_adapter_params(model)  # fully_shard replaced the parameter objects a LoRA model's cache holds
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), or `t` itself."""
    return t.full_tensor() if is_dtensor(t) else t


def iter_full_tensors(named, group, small_bytes: int = 1 << 20, bucket_bytes: int = 32 << 20):
    """(name, whole tensor) for each (name, tensor) of `named` (not in that order), DTensor shards gathered:
    shards under `small_bytes` (norms, biases, LoRA adapters) are packed, up to `bucket_bytes` of one dtype,
    into one flat buffer and all-gathered at once, so many small tensors cost one collective, not one each;
    larger ones are all-gathered one by one (`full_tensor`: packing them costs more copying than it saves,
    benchmarks/sharded_sync.py). Every rank must call it with the same names in the same order (a
    collective). Plain tensors, and any DTensor not sharded on dim 0 alone, go through `full_tensor`."""
    from torch.distributed.tensor import Shard

    _, size = world(group)
    bucket: list = []
    bucket_dtype, filled = None, 0

    def flush():
        yield from _gather_bucket(bucket, group, size)
        bucket.clear()

    for name, t in named:
        flat_ok = (
            group is not None
            and is_dtensor(t)
            and len(t.placements) == 1
            and isinstance(t.placements[0], Shard)
            and t.placements[0].dim == 0
        )
        nbytes = -(-t.shape[0] // size) * (t.numel() // max(1, t.shape[0])) * t.element_size() if flat_ok else 0
        if not flat_ok or nbytes >= small_bytes:
            yield name, full_tensor(t)
            continue
        if bucket and (t.dtype != bucket_dtype or filled + nbytes > bucket_bytes):
            yield from flush()
            filled = 0
        bucket.append((name, t))
        bucket_dtype, filled = t.dtype, filled + nbytes
    if bucket:
        yield from flush()


# torch >= 2.12 names it all_gather_single and deprecates the old name; older releases have the old one only
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_bucket(bucket: list, group, size: int):
    """One all-gather of the padded dim-0 shards of `bucket`'s DTensors; yields (name, whole tensor)."""
    pieces, layout = [], []
    for name, t in bucket:
        rows = t.shape[0]
        chunk = -(-rows // size)  # torch.chunk's sizes, as DTensor shards dim 0
        local = t.to_local()
        padded = local.new_zeros((chunk, *t.shape[1:]))
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1))
        layout.append((name, t.shape, chunk, [max(0, min(chunk, rows - r * chunk)) for r in range(size)]))
    flat = torch.cat(pieces)
    out = flat.new_empty(size * flat.numel())
    _all_gather_flat(out, flat, group=group)
    out = out.view(size, flat.numel())
    offset = 0
    for name, shape, chunk, counts in layout:
        n = chunk * (math.prod(shape[1:]) if len(shape) > 1 else 1)
        parts = out[:, offset : offset + n].reshape(size, chunk, *shape[1:])
        yield name, torch.cat([parts[r, :c] for r, c in enumerate(counts)])
        offset += n


def whole_cpu_copies(named, group, keep: bool = True) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the whole tensors of `named` ((name, tensor) pairs; gathered when sharded,
    `iter_full_tensors`: a collective) where `keep`; {} where not (a rank that holds no copy)."""
    out = {}
    with torch.no_grad():
        for name, whole in iter_full_tensors([(n, t.detach()) for n, t in named], group):
            if keep:
                out[name] = whole.to("cpu", copy=True).contiguous()
    return out


def whole_optimizer_state(optimizer: torch.optim.Optimizer, group) -> dict:
    """optimizer.state_dict() with whole tensors: the same for N ranks as for one process (a collective when
    sharded: every rank calls it)."""
    state = optimizer.state_dict()
    if group is not None:
        state["state"] = {
            i: {k: full_tensor(v).cpu() if is_dtensor(v) else v for k, v in s.items()}
            for i, s in state["state"].items()
        }
    return state


def load_whole_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, group) -> None:
    """Load a whole-tensor optimizer state (`whole_optimizer_state`, of N ranks or one); sharded, each rank
    keeps its shard of every parameter's state (no communication)."""
    if group is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = dict(state)
        state["state"] = {
            i: {
                k: shard_like(v, params[int(i)]) if torch.is_tensor(v) and v.shape == params[int(i)].shape else v
                for k, v in s.items()
            }
            for i, s in state["state"].items()
        }
    optimizer.load_state_dict(state)


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` (a DTensor: this rank's shard of it, cut locally; no communication), or
    `full` itself when `like` is a plain tensor."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def all_reduce_(t: torch.Tensor, group, op=None) -> torch.Tensor:
    """In-place all-reduce (SUM by default) over `group`; a no-op without one."""
    if group is not None:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t


def gather_rows(local: torch.Tensor, n_total: int, group) -> torch.Tensor:
    """The [n_total, ...] tensor whose rows are every rank's `local` rows in rank order (slices of
    `rank_rows`); `local` itself without a group."""
    if group is None:
        return local
    _, size = world(group)
    width = rank_rows(n_total, 0, size).stop  # the largest slice
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    counts = [rank_rows(n_total, r, size).stop - rank_rows(n_total, r, size).start for r in range(size)]
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def reduce_metrics(sums: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Each rank's step metrics combined: maxima for keys ending in "_max", sums otherwise (shares of the
    step's loss, and means weighted by token shares of the whole step). Every rank has the same keys."""
    if group is None or not sums:
        return sums
    keys = sorted(sums)
    maxed = [k for k in keys if k.endswith("_max")]
    summed = [k for k in keys if not k.endswith("_max")]
    out: dict[str, torch.Tensor] = {}
    for names, op in ((summed, dist.ReduceOp.SUM), (maxed, dist.ReduceOp.MAX)):
        if names:
            packed = torch.stack([sums[k].float().reshape(()) for k in names])
            all_reduce_(packed, group, op)
            out.update(zip(names, packed.unbind()))
    return out


def global_grad_norm(params) -> torch.Tensor:
    """The 2-norm of all gradients of `params`, of the whole (unsharded) model: the norm of sharded
    DTensor gradients is reduced across ranks. A plain tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    return full_tensor(norm)
