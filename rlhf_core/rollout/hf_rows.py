"""HFEngine's continuous batching: the rows decoding together and the KV-cache surgery that drops and appends
them (rlhf_core.rollout.hf)."""

from __future__ import annotations

import torch

NO_CACHE_SURGERY = (
    "this model's KV cache ({}) is not a DynamicCache of full-attention layers, whose rows can be edited: generating "
    "batch at a time, so rollout.engine_kwargs.continuous_batching has no effect, and partial rollouts "
    "(rollout.partial_rollout) adopt new weights only between generation calls (a multi-turn trajectory's between "
    "its turns), never within one"
)


class _NoCacheSurgery(Exception):
    """The model's KV cache is not one whose rows can be dropped and appended (continuous batching)."""


def _supports_cache_surgery(model) -> bool:
    """Whether continuous batching may be used: False once a model's cache turned out not to be a plain
    DynamicCache of full-attention layers (sliding windows, recurrent state)."""
    return getattr(model, "_atrlhf_cache_surgery", True)


def _layers_kv(cache):
    """The cache object, checked to be a DynamicCache whose every layer is a plain DynamicLayer."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or not all(type(layer) is DynamicLayer for layer in layers):
        raise _NoCacheSurgery(type(cache).__name__)
    return cache


class _ActiveRows:
    """The rows decoding together: which sample each is, its tokens so far, its next input token and position,
    its KV-cache rows and their attention mask [B, S] (each row's cache is left-padded to the common width S)."""

    def __init__(self, device: torch.device):
        empty = torch.zeros(0, dtype=torch.long, device=device)
        self.sample, self.count, self.next_token, self.next_pos = empty, empty, empty, empty
        self.ended = torch.zeros(0, dtype=torch.bool, device=device)
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.cache = None

    @property
    def size(self) -> int:
        return self.sample.shape[0]

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the rows where `keep` is True (BoolTensor [B]); drop cache columns no remaining row attends to."""
        idx = keep.nonzero().squeeze(-1)
        for name in ("sample", "count", "next_token", "next_pos", "ended", "mask"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        if self.size == 0:
            self.mask, self.cache = self.mask[:, :0], None
            return
        used = self.mask.any(0)
        first = int(used.long().argmax()) if bool(used.any()) else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
                layer.values = layer.values.index_select(0, idx)[:, :, first:]

    def take_all(self):
        """Remove every row; returns (sample, count, ended) of the rows removed."""
        taken = (self.sample, self.count, self.ended)
        self.keep(torch.zeros_like(self.ended))
        return taken

    def add(self, samples, cache, cache_mask, next_token, next_pos, count, ended) -> None:
        """Append rows whose prefill produced `cache` (or None: nothing prefilled) with mask [j, W]."""
        S, W = self.mask.shape[1], cache_mask.shape[1]
        width = max(S, W)
        own = self.cache if S > 0 and self.size > 0 else None
        new = cache if W > 0 else None
        if own is not None or new is not None:
            merged = own if own is not None else new
            ref = (own if own is not None else new).layers
            for i, layer in enumerate(merged.layers):
                ks, vs = [], []
                for c, n in ((own, self.size), (new, len(samples))):
                    if n == 0:
                        continue
                    k0, v0 = ref[i].keys, ref[i].values
                    if c is None:
                        k = k0.new_zeros((n, k0.shape[1], width, k0.shape[3]))
                        v = v0.new_zeros((n, v0.shape[1], width, v0.shape[3]))
                    else:
                        k, v = c.layers[i].keys, c.layers[i].values
                        if k.shape[2] < width:
                            pad = width - k.shape[2]
                            k = torch.cat([k.new_zeros((*k.shape[:2], pad, k.shape[3])), k], 2)
                            v = torch.cat([v.new_zeros((*v.shape[:2], pad, v.shape[3])), v], 2)
                    ks.append(k)
                    vs.append(v)
                layer.keys = torch.cat(ks, 0) if len(ks) > 1 else ks[0]
                layer.values = torch.cat(vs, 0) if len(vs) > 1 else vs[0]
            self.cache = merged
        else:
            self.cache = None
        pad_own = self.mask.new_zeros((self.size, width - S))
        pad_new = cache_mask.new_zeros((len(samples), width - W))
        self.mask = torch.cat([torch.cat([pad_own, self.mask], 1), torch.cat([pad_new, cache_mask.long()], 1)], 0)
        self.sample = torch.cat([self.sample, samples])
        self.count = torch.cat([self.count, count])
        self.ended = torch.cat([self.ended, ended])
        self.next_token = torch.cat([self.next_token, next_token])
        self.next_pos = torch.cat([self.next_pos, next_pos])
