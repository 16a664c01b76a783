"""Experience and weights packed for transport through Ray's object store.

CPU tensors travel as numpy arrays, which Ray serialises and reads back zero-copy: pickling a small torch
tensor costs ~50x a numpy array, and every group crosses two hops (rollout -> buffer -> trainer). Nothing
here imports Ray; the actors call these on both ends of a hop.
"""

from __future__ import annotations

import warnings
from dataclasses import fields

import torch

from rlhf_core.types import Experience, RolloutBatch


def pack_state_dict(state_dict: dict[str, torch.Tensor]) -> dict:
    """CPU tensors as numpy views, which Ray's object store serialises and reads back zero-copy.

    bfloat16 has no numpy dtype: it travels as int16 bits and is viewed back on arrival.
    """
    out = {}
    for k, t in state_dict.items():
        if t.dtype == torch.bfloat16:
            out[k] = ("bfloat16", t.view(torch.int16).numpy())
        else:
            out[k] = ("", t.numpy())
    return out


def unpack_state_dict(packed: dict) -> dict[str, torch.Tensor]:
    """Inverse of pack_state_dict. Tensors share the (read-only) object-store memory: copy, don't write."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable numpy arrays: we only read them
        for k, (kind, arr) in packed.items():
            t = torch.from_numpy(arr)
            out[k] = t.view(torch.bfloat16) if kind == "bfloat16" else t
    return out


def pack_groups(groups: list[Experience]) -> list:
    """Experience groups with their tensors as numpy arrays, for a push or a take through Ray.

    Pickling a small torch tensor costs ~50x a numpy array (~100 us against ~2 us), and every group
    (~10 tensors) crosses two hops (rollout -> buffer -> trainer): as tensors that was ~80 ms per hop for
    16 groups on a loaded 2-core machine, as arrays ~3 ms (benchmarks/pipeline.py).
    """
    out = []
    for g in groups:
        tensors = {f.name: getattr(g.batch, f.name) for f in fields(g.batch)}
        if not all(t is None or (isinstance(t, torch.Tensor) and t.device.type == "cpu") for t in tensors.values()):
            out.append(g)  # not plain CPU tensors: let Ray pickle it as it is
            continue
        out.append(
            {
                "batch": pack_state_dict({k: t.detach() for k, t in tensors.items() if t is not None}),
                "prompt_id": g.prompt_id,
                "policy_version": g.policy_version,
            }
        )
    return out


def unpack_groups(packed: list) -> list[Experience]:
    """Inverse of pack_groups. Tensors get their own writable memory (received arrays may be read-only)."""

    def tensors(arrays: dict) -> dict[str, torch.Tensor]:
        writable = {k: (kind, arr if arr.flags.writeable else arr.copy()) for k, (kind, arr) in arrays.items()}
        return unpack_state_dict(writable)

    out = []
    for item in packed:
        if isinstance(item, Experience):
            out.append(item)
            continue
        out.append(
            Experience(
                batch=RolloutBatch(**tensors(item["batch"])),
                prompt_id=item["prompt_id"],
                policy_version=item["policy_version"],
            )
        )
    return out
