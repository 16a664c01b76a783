"""Log-probabilities of responses under a policy (`sequence_logprobs`), from one forward pass over the rows laid
out as padded rows, as one packed row per micro-batch (`packed_sequence_logprobs`, padding-free training) or as
one sequence per distinct prompt with its responses after it (`shared_prefix_logprobs`: a GRPO group's prompt
computed once); the per-token helper, and how rows are packed. The distribution is the one the rollout engine
sampled from (`rollout.base.processed_logits`)."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from rlhf_core.model.policy import eval_mode
from rlhf_core.rollout.base import SamplingParams, processed_logits


def sequence_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    temperature: float = 1.0,
    with_entropy: bool = False,
    sampling: Optional[SamplingParams] = None,
    layout: str = "padded",
    plan: Optional[dict] = None,
):
    """Per-token logprobs (and entropies) of `response_ids` given left-padded prompts, in one forward pass.

    prompt_ids/mask: [N, P]; response_ids/mask: [N, L]. Returns (logprobs [N, L], entropy [N, L] or None).

    The log-probabilities are those of the distribution the rollout samples from, so that a ratio compares
    like with like: `sampling` (the run's SamplingParams; without it, `temperature` alone) is applied to the
    current logits exactly as the engine applies it (`rollout.base.processed_logits`: temperature, then the
    min-p / top-k / top-p set of the current logits, renormalised), except that each position's response
    token always stays in the set. On-policy the token is inside the set anyway, so the result equals the
    engine's behaviour logprob; off-policy a token the current policy would have filtered out keeps a finite
    log-probability (its share of the set plus itself) instead of -inf. Gradients flow through the kept
    logits and the renormalisation; the set itself is not differentiated. All positions are processed at
    once (no loop over tokens).

    entropy: of that same truncated, renormalised distribution (the one sampled from), without gradient.

    layout: how the rows are laid out for the forward pass. "padded": the rows as they are. "packed"
    (`packed_sequence_logprobs`) and "shared" (`shared_prefix_logprobs`, with its `plan`) compute nothing on
    padding and return 0 where response_mask is False; the values elsewhere are the same.
    """
    sampling = sampling or SamplingParams(temperature=temperature)
    rows = (prompt_ids, prompt_mask, response_ids, response_mask)
    if layout == "padded":
        return token_logprobs(_padded_logits(model, *rows), response_ids, sampling, with_entropy)
    if layout == "shared":
        plan = plan or shared_prefix_plan(prompt_ids, prompt_mask, response_mask)
    if layout == "shared" and plan is not None:
        logits, at = _shared_prefix_logits(model, *rows, plan)
    elif layout in ("packed", "shared"):  # a plan of None: sharing does not pay, packing does
        logits, at = _packed_logits(model, *rows)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected 'padded', 'packed' or 'shared'")
    values, ent = token_logprobs(logits, response_ids[at], sampling, with_entropy)
    # the response tokens at (rows, columns) `at` put back in the shape of response_ids [N, L] (0 elsewhere)
    logprobs = torch.zeros(response_ids.shape, dtype=values.dtype, device=values.device).index_put(at, values)
    entropy = (
        None if ent is None else torch.zeros(response_ids.shape, dtype=ent.dtype, device=ent.device).index_put(at, ent)
    )
    return logprobs, entropy


def token_logprobs(logits, tokens, sampling: SamplingParams, with_entropy: bool = False):
    """Log-probabilities of `tokens` [...] under `logits` [..., V] processed as the rollout samples them (the
    token itself always kept in the set), and the entropies of that distribution (without gradient; filtered
    tokens, p = 0, contribute 0) or None. Shared by the padded and the packed forward passes."""
    logp_all = torch.log_softmax(processed_logits(logits, sampling, keep=tokens), dim=-1)
    logprobs = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = logp_all.exp()
            entropy = -torch.special.xlogy(probs, probs).sum(-1)
    return logprobs, entropy


def _padded_logits(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """The logits [N, L, V] that predict each response position, from one forward pass over the padded rows."""
    P = prompt_ids.shape[1]
    L = response_ids.shape[1]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()
    positions = (attn.cumsum(-1) - 1).clamp_(min=0)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=False).logits
    return logits[:, P - 1 : P - 1 + L, :]


def _packed_logits(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """The layout "packed": the logits [T, V] that predict the T real response tokens, and where those tokens
    are in response_ids ((rows, columns)), from a forward pass over the sequences packed end to end.

    Each sequence (its real prompt tokens, then its response tokens) keeps its own position ids 0..n-1 and is
    placed whole in a row of a token budget (the longest sequence; first fit, longest first), so a forward
    pass costs about the kept tokens rather than rows x the longest row. No attention mask is passed: the
    model separates the sequences of a row by where their position ids restart (transformers' packed-sequence
    masks for sdpa / eager, the varlen kernels for flash attention); `packing_isolates` checks that a model
    does. Only the positions that predict a response token are read from the logits."""
    dev = prompt_ids.device
    N = response_ids.shape[0]
    full_ids = torch.cat([prompt_ids, response_ids], 1)
    full_mask = torch.cat([prompt_mask, response_mask], 1).bool()
    lens = full_mask.sum(-1)
    prompt_lens = prompt_mask.sum(-1)
    rows, offsets = pack_rows(lens.tolist())
    budget = int(lens.max())
    row_t = torch.tensor(rows, dtype=torch.long, device=dev)
    off_t = torch.tensor(offsets, dtype=torch.long, device=dev)
    # a sequence's real tokens are contiguous in its padded row (a left-padded prompt, a right-padded
    # response), so the masked tokens in row-major order are the sequences one after the other
    seq = torch.repeat_interleave(torch.arange(N, device=dev), lens)
    within = torch.arange(seq.shape[0], device=dev) - (lens.cumsum(0) - lens)[seq]
    input_ids = torch.zeros((max(rows) + 1, budget), dtype=full_ids.dtype, device=dev)
    positions = torch.zeros_like(input_ids)
    input_ids[row_t[seq], off_t[seq] + within] = full_ids[full_mask]
    positions[row_t[seq], off_t[seq] + within] = within
    hidden_logits = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    i, j = response_mask.nonzero(as_tuple=True)  # response token j of row i is predicted one position before it
    return hidden_logits[row_t[i], off_t[i] + prompt_lens[i] + j - 1], (i, j)


packed_sequence_logprobs = functools.partial(sequence_logprobs, layout="packed")
"""`sequence_logprobs` without computing on padding (`_packed_logits`): the same outputs ([N, L], 0 where
response_mask is False)."""


def pack_rows(lengths: list[int]) -> tuple[list[int], list[int]]:
    """Place sequences of `lengths` whole into rows of max(lengths) tokens: first fit, longest first.
    Returns (row, offset) of each sequence, in the input order."""
    budget = max(lengths)
    fill: list[int] = []
    rows, offsets = [0] * len(lengths), [0] * len(lengths)
    for n in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        r = next((r for r, used in enumerate(fill) if used + lengths[n] <= budget), len(fill))
        if r == len(fill):
            fill.append(0)
        rows[n], offsets[n] = r, fill[r]
        fill[r] += lengths[n]
    return rows, offsets


def _once_per_model(model, attr: str, check) -> bool:
    """`check(model)` run once, in eval mode and without gradients (the model's mode put back after), its answer
    remembered on the model as `attr`: how a forward pass's support for a layout is tested before it is used."""
    known = getattr(model, attr, None)
    if known is not None:
        return known
    with eval_mode(model), torch.no_grad():
        ok = bool(check(model))
    setattr(model, attr, ok)
    return ok


def packing_isolates(model) -> bool:
    """Whether `model` keeps packed sequences apart (attention within each sequence, as its position ids
    restart): two short sequences' logits packed in one row equal their logits alone. Remembered per model."""
    return _once_per_model(model, "_atrlhf_packing_isolates", _isolates_packed_sequences)


def _isolates_packed_sequences(model) -> bool:
    dev = next(model.parameters()).device
    V = int(model.get_input_embeddings().weight.shape[0])
    a = (torch.arange(7, device=dev) * 7 + 3) % V
    b = (torch.arange(5, device=dev) * 5 + 1) % V
    alone = [
        model(input_ids=x[None], position_ids=torch.arange(len(x), device=dev)[None], use_cache=False).logits[0]
        for x in (a, b)
    ]
    pos = torch.cat([torch.arange(7, device=dev), torch.arange(5, device=dev)])[None]
    packed = model(input_ids=torch.cat([a, b])[None], position_ids=pos, use_cache=False).logits[0]
    ref = torch.cat(alone).float()
    tol = (1e-4 if ref.dtype == packed.dtype == torch.float32 and alone[0].dtype == torch.float32 else 5e-2) * (
        1 + float(ref.abs().max())
    )
    return bool((packed.float() - ref).abs().max() <= tol)


# Shared prompts: the rows of a GRPO group have one prompt. Its forward pass (and its share of the backward) is
# the same for each of them: computed once per group, its keys and values serve every response of the group.
SHARED_PREFIX_MAX_MASK = 1 << 22  # mask elements of one micro-batch (groups x S x S) above which it is not used
SHARED_PREFIX_MIN_SAVING = 0.2  # the fraction of the packed tokens that sharing must save to be used


def shared_prefix_plan(prompt_ids, prompt_mask, response_mask, force: bool = False) -> Optional[dict]:
    """How a micro-batch's rows would share their prompts, or None when sharing does not pay: one sequence per
    distinct prompt (its real tokens, then every response to it, each with its own position ids continuing
    the prompt's), when that saves at least SHARED_PREFIX_MIN_SAVING of the tokens that packing keeps and its
    attention mask stays within SHARED_PREFIX_MAX_MASK elements (long responses: packing costs less).
    `force`: whenever any two rows share a prompt."""
    prompt_lens = prompt_mask.sum(-1)
    if bool((prompt_lens == 0).any()):
        return None
    keys = torch.where(prompt_mask.bool(), prompt_ids, torch.full_like(prompt_ids, -1))
    uniq, group = torch.unique(keys, dim=0, return_inverse=True)
    G, N = uniq.shape[0], keys.shape[0]
    if G == N:
        return None
    resp_lens = response_mask.sum(-1)
    group_prompt = torch.zeros(G, dtype=prompt_lens.dtype, device=prompt_lens.device).scatter_(0, group, prompt_lens)
    seq_lens = group_prompt.clone().index_add_(0, group, resp_lens)
    packed_tokens = int((prompt_lens + resp_lens).sum())
    S = int(seq_lens.max())
    too_few = int(seq_lens.sum()) > (1 - SHARED_PREFIX_MIN_SAVING) * packed_tokens
    if not force and (too_few or G * S * S > SHARED_PREFIX_MAX_MASK):
        return None
    return {"group": group, "group_prompt": group_prompt, "resp_lens": resp_lens, "G": G, "S": S}


def _shared_prefix_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, plan: dict):
    """The layout "shared" (`_packed_logits`' outputs): each distinct prompt computed once, one sequence per
    prompt, [prompt, response of row a, response of row b, ...], where a response's tokens take the positions
    that follow the prompt and attend to the prompt and to their own response only (a 4D attention mask;
    `prefix_sharing_works` checks that the model honours it); gradients reaching the shared prompt sum over its
    responses, as they would over copies. `plan`: shared_prefix_plan's."""
    dev = prompt_ids.device
    N = response_ids.shape[0]
    group, group_prompt, resp_lens, G, S = (plan[k] for k in ("group", "group_prompt", "resp_lens", "G", "S"))
    # each response's start in its group's sequence: the prompt, then the responses of the rows before it
    order = torch.argsort(group, stable=True)
    lens_sorted = resp_lens[order]
    before = lens_sorted.cumsum(0) - lens_sorted  # over all rows, in group order
    first = torch.full((G,), N, dtype=torch.long, device=dev).scatter_reduce_(
        0, group[order], torch.arange(N, device=dev), "amin"
    )
    start = torch.empty_like(resp_lens)
    start[order] = group_prompt[group[order]] + before - before[first[group[order]]]
    input_ids = torch.zeros((G, S), dtype=prompt_ids.dtype, device=dev)
    positions = torch.zeros((G, S), dtype=torch.long, device=dev)
    owner = torch.full((G, S), -2, dtype=torch.long, device=dev)  # -1 the prompt, r response of row r, -2 padding
    # prompts: the first row of each group stands for it (its real tokens, wherever the padding is)
    rep = order[first]
    pm = prompt_mask[rep].bool()
    g_idx, col = pm.nonzero(as_tuple=True)
    within = (pm.long().cumsum(-1) - 1)[g_idx, col]  # the token's place among the prompt's real tokens
    input_ids[g_idx, within] = prompt_ids[rep][g_idx, col]
    positions[g_idx, within] = within
    owner[g_idx, within] = -1
    i, j = response_mask.nonzero(as_tuple=True)
    rank = (response_mask.long().cumsum(-1) - 1)[i, j]  # the token's place among its response's real tokens
    gi = group[i]
    input_ids[gi, start[i] + rank] = response_ids[i, j]
    positions[gi, start[i] + rank] = group_prompt[gi] + rank
    owner[gi, start[i] + rank] = i
    q, k = owner.unsqueeze(2), owner.unsqueeze(1)
    causal = torch.ones((S, S), dtype=torch.bool, device=dev).tril()
    allowed = causal & (k != -2) & ((k == -1) | (k == q))
    allowed |= torch.eye(S, dtype=torch.bool, device=dev)  # padding attends to itself (no empty row)
    dtype = next(model.parameters()).dtype
    mask = torch.zeros((G, 1, S, S), dtype=dtype, device=dev).masked_fill_(
        ~allowed.unsqueeze(1), torch.finfo(dtype).min
    )
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    # a response's first token is predicted at the prompt's last token, each next one at its own previous token
    at = torch.where(rank == 0, group_prompt[gi] - 1, start[i] + rank - 1)
    return out[gi, at], (i, j)


shared_prefix_logprobs = functools.partial(sequence_logprobs, layout="shared")
"""`sequence_logprobs` with each distinct prompt computed once (`_shared_prefix_logits`): the same outputs ([N, L],
0 where response_mask is False). `plan`: shared_prefix_plan's (computed when not given; the rows are packed
instead when it is None)."""


def prefix_sharing_works(model) -> bool:
    """Whether `model` honours a 4D attention mask with explicit position ids (eager and sdpa attention do;
    flash-attention kernels ignore such masks): two responses sharing one prompt get the log-probs they get
    packed apart. Remembered per model."""
    return _once_per_model(model, "_atrlhf_prefix_sharing", _shares_prefixes)


def _shares_prefixes(model) -> bool:
    dev = next(model.parameters()).device
    V = int(model.get_input_embeddings().weight.shape[0])
    prompt = ((torch.arange(6, device=dev) * 7 + 3) % V).repeat(3, 1)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[2, :2] = 0  # a shorter prompt (left padding), alone in its group
    response = (torch.arange(15, device=dev).view(3, 5) * 5 + 1) % V
    response_mask = torch.ones_like(response)
    response_mask[1, 3:] = 0
    args = (model, prompt, prompt_mask, response, response_mask)
    try:
        plan = shared_prefix_plan(prompt, prompt_mask, response_mask, force=True)
        shared = shared_prefix_logprobs(*args, plan=plan)[0]
    except Exception:  # a model that refuses a 4D mask or explicit position ids
        return False
    apart = sequence_logprobs(*args)[0]
    tol = 1e-4 if shared.dtype == torch.float32 else 5e-2
    return bool(((shared - apart).abs() * response_mask).max() <= tol * (1 + float(apart.abs().max())))


NO_PADDING_FREE_ENV = "ASYNCTENSORRLHF_NO_PADDING_FREE"
"""A benchmark switch, not a config key: 1 trains on padded rows instead of packed sequences (same results,
tests/test_trainer.py), to measure what packing saves. Ray workers inherit it from the driver's environment."""


def padding_free_enabled() -> bool:
    """Whether a Trainer packs a micro-batch's sequences end to end (always, unless NO_PADDING_FREE_ENV is 1)."""
    return os.environ.get(NO_PADDING_FREE_ENV, "") not in ("1", "true", "yes")


def padding_free_logprobs(model):
    """The padding-free forward pass `model` supports: `shared_prefix_logprobs` (rows sharing a prompt compute it
    once, and are packed when that does not pay) where it honours a 4D mask, else `packed_sequence_logprobs`
    where it keeps packed sequences apart, else None (the caller pads)."""
    if not packing_isolates(model):
        return None
    return shared_prefix_logprobs if prefix_sharing_works(model) else packed_sequence_logprobs
