"""Trajectories as tensors: one RolloutBatch of whole trajectories (training), one of their last model turns
(the configured rewards), and their env/* metrics. Layout: rlhf_core/rollout/multiturn.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rlhf_core.types import RolloutBatch

if TYPE_CHECKING:
    from rlhf_core.rollout.multiturn import Trajectory


def trajectory_batch(trajs: Sequence[Trajectory], pad_token_id: int, version: int, device="cpu") -> RolloutBatch:
    """The trajectories as one RolloutBatch (rows in order; group_ids by prompt, contiguous). token_versions:
    each id's version (`Trajectory.versions`); policy_version: the oldest model token's, `version` for a row
    without one; padding carries the row's policy_version (as RolloutBatch documents). truncated: the rows cut
    by env.max_turns or env.max_total_tokens (algorithm.mask_truncated)."""
    N = len(trajs)
    P = max(1, max(len(t.prompt_ids) for t in trajs))
    L = max(1, max(len(t.ids) for t in trajs))
    prompt_ids = torch.full((N, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((N, P), dtype=torch.bool)
    ids = torch.full((N, L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((N, L), dtype=torch.bool)
    loss_mask = torch.zeros((N, L), dtype=torch.bool)
    logps = torch.zeros((N, L), dtype=torch.float32)
    versions = torch.full((N, L), int(version), dtype=torch.long)
    for i, t in enumerate(trajs):
        if t.prompt_ids:
            prompt_ids[i, P - len(t.prompt_ids) :] = torch.tensor(t.prompt_ids)
            prompt_mask[i, P - len(t.prompt_ids) :] = True
        n = len(t.ids)
        if n:
            ids[i, :n] = torch.tensor(t.ids)
            mask[i, :n] = True
            loss_mask[i, :n] = torch.tensor(t.model, dtype=torch.bool)
            logps[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
            versions[i, :n] = torch.tensor(t.versions, dtype=torch.long)
    # a trajectory is as old as its oldest model token (the buffer's staleness bound then holds per token)
    oldest = versions.masked_fill(~loss_mask, torch.iinfo(torch.long).max).amin(-1)
    policy_version = torch.where(loss_mask.any(-1), oldest, int(version))
    versions = torch.where(mask, versions, policy_version[:, None])
    groups, g, previous = [], -1, None
    for t in trajs:
        if t.prompt is not previous:
            g += 1
            previous = t.prompt
        groups.append(g)
    return RolloutBatch(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        response_ids=ids.to(device),
        response_mask=mask.to(device),
        behavior_logprobs=logps.to(device),
        response_lengths=mask.sum(-1).to(device),
        group_ids=torch.tensor(groups, dtype=torch.long, device=device),
        policy_version=policy_version.to(device),
        prompt_uids=torch.tensor([t.prompt.uid for t in trajs], dtype=torch.long, device=device),
        loss_mask=loss_mask.to(device),
        token_versions=versions.to(device),
        truncated=torch.tensor([bool(t.truncated) for t in trajs], dtype=torch.bool, device=device),
    )


def last_turn_batch(trajs: Sequence[Trajectory], pad_token_id: int, version: int, device="cpu") -> RolloutBatch:
    """Each trajectory's last model turn as a one-turn RolloutBatch (prompt: everything before it), for the
    configured reward components and functions."""
    rows = []
    for t in trajs:
        s, e = t.last_turn
        rows.append((t.prompt_ids + t.ids[:s], t.ids[s:e]))
    N = len(rows)
    P = max(1, max(len(p) for p, _ in rows))
    L = max(1, max(len(r) for _, r in rows))
    prompt_ids = torch.full((N, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((N, P), dtype=torch.bool)
    ids = torch.full((N, L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((N, L), dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        if p:
            prompt_ids[i, P - len(p) :] = torch.tensor(p)
            prompt_mask[i, P - len(p) :] = True
        if r:
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = True
    return RolloutBatch(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        response_ids=ids.to(device),
        response_mask=mask.to(device),
        behavior_logprobs=torch.zeros((N, L), device=device),
        response_lengths=mask.sum(-1).to(device),
        group_ids=torch.zeros(N, dtype=torch.long, device=device),
        policy_version=torch.full((N,), int(version), dtype=torch.long, device=device),
    )


def trajectory_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """env/turns_mean, env/tool_calls_mean, env/truncated_frac and reward/env (unweighted) over trajectories."""
    n = max(1, len(trajs))
    return {
        "env/turns_mean": sum(t.turns for t in trajs) / n,
        "env/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
        "env/truncated_frac": sum(t.truncated for t in trajs) / n,
        "reward/env": sum(t.env_reward for t in trajs) / n,
    }
