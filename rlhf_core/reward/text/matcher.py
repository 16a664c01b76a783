"""The matcher: the text components of one tokenizer and marker (`TextMatcher`), their tables on each device,
and the responses prepared once per call for all of them (`Rows`)."""

from __future__ import annotations

import secrets
import threading
import weakref
from dataclasses import dataclass, field, replace

import torch

from rlhf_core.reward.text.answers import (
    ANSWER_WINDOW_BYTES,
    AnswerHints,
    AnswerText,
    PreparedText,
    answer_fields,
    answer_text,
    distinct_texts,
    finish_answers,
    matches_answer,
    static_width,
)
from rlhf_core.reward.text.contains import contains_windows
from rlhf_core.reward.text.formats import FORMAT_WINDOW_MAX, format_tokens, format_windows
from rlhf_core.reward.text.numbers import BUCKETS
from rlhf_core.reward.text.tables import lookup
from rlhf_core.reward.text.vocab import VocabBytes, automaton, full_text, tokens_to_bytes
from rlhf_core.reward.text.windows import CAN_END, FORMAT0, STOP, last_marker, scan

BUFFER_SHAPES = 4
"""On CPU, the scan's and contains' buffers are kept (per thread) for this many distinct batch shapes."""
_TEXT = ":text"  # text_hints key suffix (after the matcher's token) of its PreparedText


@dataclass
class Rows:
    """Responses prepared for the text components by one `TextMatcher.rows` call: ids (as given), the per-token
    codes of `scan` and the first stop of each row (n_valid)."""

    ids: torch.Tensor
    codes: torch.Tensor
    n_valid: torch.Tensor
    index: torch.Tensor  # int32 id + 1, 0 outside the vocabulary (on CPU index and codes are buffers reused by
    # the next `rows` call)


@dataclass
class TextMatcher:
    """The text components of one tokenizer and marker, tables cached per device (rlhf_core.reward.text)."""

    vocab: VocabBytes
    format_bytes: list[bytes]
    answer_window_bytes: int = ANSWER_WINDOW_BYTES
    format_automata: list = field(default_factory=list, repr=False)
    format_windowed: bool = False
    first_table: torch.Tensor | None = field(default=None, repr=False)  # int32 [V]: see contains_windows
    _on_device: dict = field(default_factory=dict, repr=False)
    _answers: dict = field(default_factory=dict, repr=False)
    # names this matcher's AnswerHints: random, so that patterns prepared in one process never carry hints a
    # different matcher of another process would take for its own (a pickled copy keeps the name: same tables)
    token: str = field(default_factory=lambda: secrets.token_hex(8), repr=False)

    @classmethod
    def build(cls, tokenizer, marker: str, format_sequences=()) -> TextMatcher:
        vb = VocabBytes.build(tokenizer, marker)
        flat = vb.flat.numpy().tobytes()
        table = [flat[o : o + n] for o, n in zip(vb.offsets.tolist(), vb.lengths.tolist())]
        fmt = [s.encode("utf-8") for s in format_sequences]
        automata = [(*automaton(table, b), len(b)) for b in fmt if b]
        V = len(table)
        windowed = len(automata) <= FORMAT_WINDOW_MAX[0] and all(
            int((a[1].view(V, -1) >= 0).any(dim=1).sum()) <= FORMAT_WINDOW_MAX[1] * V for a in automata
        )
        first = []
        for b in table:
            lead = b.lstrip(b" \t\n\r\x0b\x0c")
            money = lead[1:].lstrip(b" \t\n\r\x0b\x0c") if lead[:1] == b"$" else lead
            first.append(
                int(BUCKETS[lead[0]]) | int(BUCKETS[money[0]]) if money else (int(BUCKETS[lead[0]]) if lead else 0)
            )
        return cls(
            vb,
            fmt,
            format_automata=automata,
            format_windowed=windowed,
            first_table=torch.tensor(first, dtype=torch.int32),
        )

    def on(self, device) -> tuple[VocabBytes, list]:
        """(VocabBytes, format automata) on `device`, copied once; the automata tables by id + 1 (the byte-less
        last id's rows first, for `scan`'s index)."""
        device = torch.device(device)
        if device not in self._on_device:
            automata = [(*(torch.cat([t[-a[3] :], t]).to(device) for t in a[:3]), a[3]) for a in self.format_automata]
            self._on_device[device] = (self.vocab.to(device), automata)
        return self._on_device[device]

    def codes_table(self, device, stop_ids: tuple[int, ...]) -> torch.Tensor:
        """`scan`'s table of per-token codes (uint8 [V + 1] by id + 1: CAN_END, STOP and the format texts' bits) for
        these stop ids, on `device`, made once."""
        key = (torch.device(device), stop_ids)
        if key not in self._on_device:
            V = self.vocab.lengths.numel()
            table = self.vocab.can_end.to(torch.uint8) * CAN_END
            if self.format_windowed:
                for i, a in enumerate(self.format_automata):
                    can, m = FORMAT0 << 3 * i, a[3]
                    ends = a[1].view(V, m) >= 0
                    adv = (a[0].view(V, m) >= 1).any(dim=1) | (self.vocab.lengths == 0)
                    table |= ends.any(dim=1).to(torch.uint8) * can
                    table |= ends[:, 0].to(torch.uint8) * (can << 1)
                    table |= adv.to(torch.uint8) * (can << 2)
            for s in stop_ids:
                if 0 <= s < V - 1:
                    table[s] |= STOP
            self._on_device[key] = torch.cat([table[-1:], table]).to(device)  # entry 0: ids outside [0, V)
        return self._on_device[key]

    def _cpu_buffers(self, name: str, ids: torch.Tensor, dtypes) -> tuple[torch.Tensor, ...] | None:
        """Buffers of ids' shape for `name`, one per dtype, kept per thread and reused by the next call with that
        shape (on CPU a fresh multi-MB buffer costs page faults on every call, more than the pass that fills it),
        for the last BUFFER_SHAPES shapes asked for (the oldest shape's are dropped: batches of ever new lengths
        do not pile up buffers); None on an accelerator, whose caching allocator already reuses memory."""
        if ids.device.type != "cpu":
            return None
        kept = self._on_device.setdefault(("buffers", name, threading.get_ident()), {})
        key = (tuple(ids.shape), tuple(dtypes))
        buffers = kept.pop(key, None)
        if buffers is None:
            buffers = tuple(torch.empty(ids.shape, dtype=d) for d in dtypes)
            while len(kept) >= BUFFER_SHAPES:
                kept.pop(next(iter(kept)))
        kept[key] = buffers  # the most recent last
        return buffers

    def rows(self, ids: torch.Tensor, stop_ids) -> Rows:
        """The one pass over all tokens (`scan`): codes and the first stop of each row. Stop ids outside the
        tokenizer are never found (ids there read as the byte-less token)."""
        stop_ids = tuple(int(s) for s in stop_ids)
        scratch = self._cpu_buffers("scan", ids, (torch.int32, torch.uint8))
        codes, n_valid, index = scan(self.codes_table(ids.device, stop_ids), ids.contiguous(), scratch=scratch)
        return Rows(ids, codes, n_valid, index)

    def prepare(self, patterns):
        """`patterns` (PackedPatterns) with this matcher's AnswerHints attached, read on the host: call it where the
        patterns are packed, once per prompt batch (before they go to the device, repeat_interleave keeps them).
        The hints make the answers' windows as wide as the answers (not the static bound) and skip the number /
        text matching a batch has no answer for. Patterns already on a device are returned as they are (reading
        them there would be a sync). The hints describe the patterns as prepared: prepare again after changing
        their tensors in place."""
        if patterns.tokens.device.type != "cpu":
            return patterns
        vb, _ = self.on("cpu")
        tokens, lengths = patterns.tokens, patterns.lengths
        N, K, Q = tokens.shape
        text = {}
        if tokens.numel() == 0:
            hints = AnswerHints(1, False, False, 1)
        else:
            tok = tokens.clamp(-1, vb.V - 1).add(1)
            n_bytes = (lookup(vb.lengths1, tok) * (torch.arange(Q) < lengths.unsqueeze(-1))).sum(-1)
            width = int(n_bytes.max().clamp(max=static_width(vb, Q)))
            lit, lit_len, canon, is_num = fields_ = answer_fields(vb, tokens, lengths, max(1, width))
            keep = distinct_texts(lit, lit_len)
            hints = AnswerHints(
                width=width,
                any_num=bool(is_num.any()),
                any_text=bool(((lit_len > 0) & ~is_num).any()),
                alternatives=max(1, int(keep.sum(1).max())) if N else 1,
            )
            # the answers' text as a reward call would make it from these hints, made here once per prompt batch
            text = {self.token + _TEXT: PreparedText(finish_answers(*fields_, hints, keep), tokens, lengths)}
        return replace(patterns, text_hints={**(patterns.text_hints or {}), self.token: hints, **text})

    def answers(self, ids: torch.Tensor, patterns) -> AnswerText:
        """AnswerText of the packed patterns, cached while the same pattern tensors (same version) are used."""
        vb, _ = self.on(ids.device)
        tokens, lengths = patterns.tokens, patterns.lengths
        hints = getattr(patterns, "text_hints", None) or {}
        prepared = hints.get(self.token + _TEXT)
        if isinstance(prepared, PreparedText) and prepared.belongs_to(tokens, lengths):
            return prepared.text  # made by prepare on the host, moved and repeated with these tensors
        hints = hints.get(self.token)
        key = (id(tokens), id(lengths), hints)
        hit = self._answers.get(key)
        if hit is not None:
            t_ref, l_ref, versions, ans = hit
            if t_ref() is tokens and l_ref() is lengths and versions == (tokens._version, lengths._version):
                return ans
        ans = answer_text(vb, tokens, lengths, hints=hints)
        if len(self._answers) >= 8:
            self._answers.pop(next(iter(self._answers)))
        self._answers[key] = (weakref.ref(tokens), weakref.ref(lengths), (tokens._version, lengths._version), ans)
        return ans

    def answer_after_marker(self, rows: Rows, ans: AnswerText) -> torch.Tensor:
        """1.0 where the text right after the LAST marker (before the first stop) is an answer alternative."""
        ids, n_valid = rows.ids, rows.n_valid
        vb, _ = self.on(ids.device)
        N, L = ids.shape
        if L == 0 or not vb.marker:
            return torch.zeros(N, device=ids.device)
        width = ans.width + self.answer_window_bytes
        found, tok, offset = last_marker(vb, rows.index, rows.codes, n_valid)
        A = min(width + 1, L)  # one token and byte more: a window the text runs past is told from one it fills
        idx = (tok.unsqueeze(1) + torch.arange(A, device=ids.device)).clamp_(max=L - 1)
        window = rows.index.gather(1, idx)  # ids + 1
        n_tok = (n_valid - tok).clamp(min=0)
        x, x_len = tokens_to_bytes(vb, window, n_tok, offset, width + 1, shifted=True)
        cut = (x_len > width) | (n_tok > A)  # the text goes on past the window
        return (matches_answer(x, x_len, ans, whole=False, cut=cut) & found).float()

    def exact_match(self, rows: Rows, ans: AnswerText) -> torch.Tensor:
        """1.0 where the whole response (up to its first stop) is an answer alternative (see matches_answer)."""
        ids, n_valid = rows.ids, rows.n_valid
        vb, _ = self.on(ids.device)
        N, L = ids.shape
        width = ans.width + self.answer_window_bytes
        A = min(width, L)
        x, x_len = tokens_to_bytes(vb, rows.index[:, :A], n_valid.clamp(max=A), None, width + 1, shifted=True)
        fits = (n_valid <= A) & (x_len <= width)
        return (matches_answer(x[:, : width + 1], x_len.clamp(max=width), ans, whole=True) & fits).float()

    def text(self, rows: Rows):
        """Whole rows as bytes (`full_text`): slow, for reference (contains reads windows instead)."""
        vb, _ = self.on(rows.ids.device)
        return full_text(vb, rows.ids, rows.n_valid)

    def contains(self, rows: Rows, ans: AnswerText) -> torch.Tensor:
        """1.0 where an answer alternative occurs in the response as a whole number / word (`contains_windows`)."""
        vb, _ = self.on(rows.ids.device)
        key = (rows.ids.device, "first")
        if key not in self._on_device:
            t = self.first_table
            self._on_device[key] = torch.cat([t[-1:], t]).to(rows.ids.device)  # entry 0: ids outside [0, V)
        scratch = self._cpu_buffers("contains", rows.ids, (torch.int32,))
        return contains_windows(
            vb, self._on_device[key], rows.index, rows.n_valid, ans, scratch=scratch[0] if scratch else None
        ).float()

    def format(self, rows: Rows) -> torch.Tensor:
        vb, automata = self.on(rows.ids.device)
        if self.format_windowed:
            return format_windows(vb, rows.index, rows.codes, rows.n_valid, automata)
        return format_tokens(vb, rows.index, rows.n_valid, automata)
