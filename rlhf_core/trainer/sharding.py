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

Parameters, gradients and AdamW state are DTensors sharded on dim 0 (`fully_shard` per decoder layer, then
the root). `full_tensor` gathers one whole tensor; every rank must call it (a collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
            "backward are collectives): give the step more rows or raise trainer.micro_batch_size"
        )
    base, extra = divmod(n, n_micro)
    out, lo = [], rows.start
    for i in range(n_micro):
        hi = lo + base + (1 if i < extra else 0)
        out.append(slice(lo, hi))
        lo = hi
    return out


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: modules of the classes HF lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
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


def iter_whole_parameters(model: torch.nn.Module):
    """(name, whole tensor) of every parameter of `model` (tied ones once, `named_parameters`' names).

    A model sharded by `shard_model` is gathered one FSDP module at a time: `unshard()` (one all-gather of
    all that module's parameters, not one collective per tensor), its parameters yielded, `reshard()`. Every
    rank must iterate it to the end (a collective), and each yielded tensor is valid only until the next
    one is requested: copy what you keep. An unsharded model yields its parameters as they are."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield from model.named_parameters()
        return
    seen: set[str] = set()
    fsdp = [(prefix, m) for prefix, m in model.named_modules() if isinstance(m, FSDPModule)]
    for prefix, module in reversed(fsdp):  # inner modules (decoder layers) first, the root last
        module.unshard()
        try:
            for name, p in module.named_parameters(prefix=prefix):
                if name not in seen:  # the root's walk reaches the layers' (resharded) parameters again
                    seen.add(name)
                    yield name, p
        finally:
            module.reshard()


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
