"""Log-probabilities of responses under a policy: padded rows (`sequence_logprobs`), one packed row per
micro-batch (`packed_sequence_logprobs`, padding-free training), the per-token helper both use, and how rows are
packed. The distribution is the one the rollout engine sampled from (`rollout.base.processed_logits`)."""

from __future__ import annotations

from typing import Optional

import torch

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
    """
    sampling = sampling or SamplingParams(temperature=temperature)
    P = prompt_ids.shape[1]
    L = response_ids.shape[1]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()
    positions = (attn.cumsum(-1) - 1).clamp_(min=0)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=False).logits
    return token_logprobs(logits[:, P - 1 : P - 1 + L, :], response_ids, sampling, with_entropy)


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


def packed_sequence_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    temperature: float = 1.0,
    with_entropy: bool = False,
    sampling: Optional[SamplingParams] = None,
):
    """`sequence_logprobs` without computing on padding: the same outputs ([N, L], 0 where response_mask is
    False) from a forward pass over the sequences packed end to end.

    Each sequence (its real prompt tokens, then its response tokens) keeps its own position ids 0..n-1 and is
    placed whole in a row of a token budget (the longest sequence; first fit, longest first), so a forward
    pass costs about the kept tokens rather than rows x the longest row. No attention mask is passed: the
    model separates the sequences of a row by where their position ids restart (transformers' packed-sequence
    masks for sdpa / eager, the varlen kernels for flash attention); `packing_isolates` checks that a model
    does. Only the positions that predict a response token are read from the logits."""
    sampling = sampling or SamplingParams(temperature=temperature)
    dev = prompt_ids.device
    N, L = response_ids.shape
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
    logits = hidden_logits[row_t[i], off_t[i] + prompt_lens[i] + j - 1]
    values, ent = token_logprobs(logits, response_ids[i, j], sampling, with_entropy)
    logprobs = torch.zeros((N, L), dtype=values.dtype, device=dev).index_put((i, j), values)
    entropy = None if ent is None else torch.zeros((N, L), dtype=ent.dtype, device=dev).index_put((i, j), ent)
    return logprobs, entropy


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


@torch.no_grad()
def packing_isolates(model) -> bool:
    """Whether `model` keeps packed sequences apart (attention within each sequence, as its position ids
    restart): two short sequences' logits packed in one row equal their logits alone. Remembered per model."""
    known = getattr(model, "_atrlhf_packing_isolates", None)
    if known is not None:
        return known
    was_training = model.training
    model.eval()
    try:
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
        ok = bool((packed.float() - ref).abs().max() <= tol)
    finally:
        model.train(was_training)
    model._atrlhf_packing_isolates = ok
    return ok
