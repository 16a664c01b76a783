"""The text components (rlhf_core/reward/text/) against a plain Python reference on the decoded bytes, on fuzzed
batches: texts in several tokenizations, special tokens and ids outside the vocabulary, stops anywhere, rows
shorter than a block and longer than every window, int32 / int64 ids, prepared and unprepared patterns. Rows
where a documented window limit bites (docs/rewards.md: more candidate blocks after the marker than are read,
more candidates after an occurrence) are left out of the comparison, and most rows are compared. Also: the one
pass over the tokens (`scan`) against the same reference, and the CPU buffers stay bounded."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
import torch
from test_reward_text import _byte_tokens, bpe_tok, word_tok  # noqa: F401 (fixtures)

from rlhf_core.config import RewardConfig
from rlhf_core.reward.answers import patterns_from_texts
from rlhf_core.reward.components import build_reward_fn
from rlhf_core.reward.text import (
    BUFFER_SHAPES,
    CONTAINS_BLOCKS,
    CONTAINS_MAX_BYTES,
    CONTAINS_WINDOWS,
    FORMAT_BLOCKS,
    MARKER_BLOCK_TOKENS,
    MARKER_BLOCKS,
    TextMatcher,
    scan,
    token_bytes,
)
from rlhf_core.reward.text.numbers import byte_bucket

COMPONENTS = ("answer_after_marker", "exact_match", "contains", "format")
ANSWERS = ["72", "1,000", "1000", "-5", "0.50", "7", "Paris", "x y", "007", "3.14159", "1234567890123456789012"]
WORDS = ["so", "the", "is", "Paris", "Parisian", "apples", "$", ".", ",", "-", "=", "\n", "x", "y", "72", "720",
         "7.2", "0.72", "7,200", "1,000", "1000.", "72.000000", "72.0000", "-72", "7 2", "#", "##", "###", "####",
         "# #", "$72", "72abc", "1234567890123456789012", "0.5", "007", "3.14159", ".0", "<tag>",
         "</answer>"]  # fmt: skip
SPACES = b" \t\n\r\x0b\x0c"
MARKER = b"####"
_NUMBER = re.compile(rb"[ \t\n\r\x0b\x0c$]*(-?)([0-9][0-9.,]*)")
_ALNUM = rb"[A-Za-z0-9\x80-\xff]"


# ------------------------------------------------------------------------------------------------------------
# The reference: what a grader reading the decoded text decides (docs/rewards.md), in plain Python
# ------------------------------------------------------------------------------------------------------------


def _number_at(text: bytes):
    """(value, end) of the number at the start of text (after spaces and '$'), value None when there is none;
    end: past the run of digits, ',' and '.' (trailing punctuation included)."""
    m = _NUMBER.match(text)
    if not m:
        return None, 0
    body = m.group(2).rstrip(b".,")
    dot = body.find(b".")
    if body.count(b".") > 1 or (dot >= 0 and b"," in body[dot:]):
        return None, m.end()
    value = Decimal(body.replace(b",", b"").decode())
    return (-value if m.group(1) else value), m.end()


def _is_alnum(b: bytes) -> bool:
    return bool(b) and re.fullmatch(_ALNUM, b[:1]) is not None


class Reference:
    """The components on decoded bytes. table: token_bytes of the tokenizer; stops: the stop ids."""

    def __init__(self, table: list[bytes], stops: list[int]):
        self.table, self.stops = table, set(stops)

    def tokens(self, row: list[int]) -> list[bytes]:
        """Each token's bytes up to the first stop (ids outside the vocabulary: no bytes)."""
        out = []
        for i in row:
            if i in self.stops and 0 <= i < len(self.table):
                break
            out.append(self.table[i] if 0 <= i < len(self.table) else b"")
        return out

    def alternatives(self, tokens: torch.Tensor, lengths: torch.Tensor) -> list[tuple[bytes, Decimal | None]]:
        """A row's answer alternatives as the grader reads them: stripped text, and its value if it is a number."""
        out = []
        for seq, n in zip(tokens.tolist(), lengths.tolist()):
            text = b"".join(self.table[t] for t in seq[:n]).strip(SPACES)
            if text:
                value, end = _number_at(text)
                out.append((text, value if end == len(text) else None))
        return out

    def answer_after_marker(self, text: bytes, alts) -> float:
        at = text.rfind(MARKER)
        if at < 0:
            return 0.0
        after = text[at + len(MARKER) :]
        value, _ = _number_at(after)
        word = after.lstrip(SPACES)
        for lit, num in alts:
            if num is not None:
                if value is not None and value == num:
                    return 1.0
            elif word.startswith(lit) and not _is_alnum(word[len(lit) : len(lit) + 1]):
                return 1.0
        return 0.0

    def exact_match(self, text: bytes, alts) -> float:
        value, end = _number_at(text)
        for lit, num in alts:
            if num is not None:
                if value is not None and value == num and not text[end:].strip(SPACES):
                    return 1.0
            elif text.strip(SPACES) == lit:
                return 1.0
        return 0.0

    def contains_at(self, text: bytes, alts) -> list[int]:
        """Start offsets of the occurrences of an alternative as a whole number / word ('.0' to '.0000' may end a
        number)."""
        starts = []
        for lit, _ in alts:
            if len(lit) > CONTAINS_MAX_BYTES:
                continue
            before = rb"(?<!" + _ALNUM + rb")(?<!-)(?<![0-9][.,])"
            after = rb"(?:\.0{1,4}(?!" + _ALNUM + rb")|(?!" + _ALNUM + rb")(?![.,][0-9]))"
            starts += [m.start() for m in re.finditer(before + re.escape(lit) + after, text)]
        return sorted(starts)

    @staticmethod
    def format(text: bytes, texts: list[bytes]) -> float:
        at = 0
        for t in texts:
            found = text.find(t, at)
            if found < 0:
                return 0.0
            at = found + len(t)
        return 1.0


# ------------------------------------------------------------------------------------------------------------
# Which rows a window limit may decide differently (left out of the comparison)
# ------------------------------------------------------------------------------------------------------------


def _can_end(b: bytes) -> bool:
    """Whether a token can end a marker occurrence: it starts with '#' (the bytes before it may hold the rest),
    or holds the whole marker."""
    return b.startswith(b"#") or MARKER in b


def _starts(toks: list[bytes]) -> list[int]:
    out, at = [], 0
    for b in toks:
        out.append(at)
        at += len(b)
    return out


def _token_at(starts: list[int], toks: list[bytes], offset: int) -> int:
    """The token holding byte `offset`."""
    return max(i for i, s in enumerate(starts) if s <= offset and (toks[i] or s == offset))


def _marker_read(toks: list[bytes], text: bytes) -> bool:
    """Whether the last marker lies in the marker search's windows: its last byte's token is in one of the last
    MARKER_BLOCKS blocks holding a token that may end one."""
    at = text.rfind(MARKER)
    if at < 0:
        return True
    starts = _starts(toks)
    end_tok = _token_at(starts, toks, at + len(MARKER) - 1)
    later = {p // MARKER_BLOCK_TOKENS for p in range(end_tok, len(toks)) if _can_end(toks[p])}
    return len(later) <= MARKER_BLOCKS


def _format_read(toks: list[bytes], text: bytes) -> bool:
    """Whether the first marker-text occurrence lies in the first FORMAT_BLOCKS blocks holding a token that may
    end one (the windowed format search reads at most those, for a one-text format)."""
    at = text.find(MARKER)
    if at < 0:
        return True
    starts = _starts(toks)
    end_tok = _token_at(starts, toks, at + len(MARKER) - 1)
    earlier = {p // MARKER_BLOCK_TOKENS for p in range(end_tok + 1) if _can_end(toks[p])}
    return len(earlier) <= FORMAT_BLOCKS


def _contains_read(toks: list[bytes], starts_at: list[int], alts, firsts: list[int]) -> bool:
    """Whether contains' windows decide the row as the reference does: every occurrence starts where a token's
    text starts (after its leading whitespace, or after a '$' there), and the last one's token is among the last
    CONTAINS_WINDOWS candidates (tokens whose first bytes may start an alternative: `firsts`, the matcher's
    first_table of each token) of the last CONTAINS_BLOCKS blocks holding one."""
    if not starts_at:
        return True
    starts = _starts(toks)
    heads = {}
    for i, b in enumerate(toks):
        lead = len(b) - len(b.lstrip(SPACES))
        heads[starts[i] + lead] = i
        if b[lead : lead + 1] == b"$":
            heads[starts[i] + lead + 1] = i
    if any(s not in heads for s in starts_at):
        return False
    mask = 0
    for lit, _ in alts:
        mask |= 1 << byte_bucket(lit[0])
    last = heads[starts_at[-1]]
    cands = [p for p in range(last, len(toks)) if firsts[p] & mask]
    return len(cands) <= CONTAINS_WINDOWS and len({p // MARKER_BLOCK_TOKENS for p in cands}) <= CONTAINS_BLOCKS


# ------------------------------------------------------------------------------------------------------------
# Fuzzed batches
# ------------------------------------------------------------------------------------------------------------


def _tokenize(tokenizer, text: str, how: str) -> list[int]:
    """The text in one of three tokenizations (the encoder's, byte by byte, each space-separated piece alone)."""
    if how == "canonical":
        return list(tokenizer.encode(text, add_special_tokens=False))
    if how == "bytes":
        vocab = tokenizer.get_vocab()
        return [vocab[c] for c in _byte_tokens(text)]
    words = text.split(" ")
    return [t for i, w in enumerate(words) for t in tokenizer.encode((" " if i else "") + w, add_special_tokens=False)]


def _fuzz_batch(tokenizer, table, g, N: int, L: int, stops: list[int]):
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    specials = [i for i in tokenizer.all_special_ids if i not in stops]
    V = len(tokenizer)
    rows, answers = [], []
    for _ in range(N):
        answer = pick(ANSWERS)
        parts = [pick(WORDS) for _ in range(int(torch.randint(0, 3 * L // 4 + 2, (1,), generator=g)))]
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # markers with an answer at random places
            spelled = pick([answer, "$" + answer, answer + ".", " " + answer + ".0", pick(ANSWERS), answer + "0"])
            parts.insert(int(torch.randint(len(parts) + 1, (1,), generator=g)), pick(["####", "####", "###"]) + spelled)
        text = (
            " ".join(parts) if torch.rand(1, generator=g) < 0.85 else pick([answer, " " + answer + " ", "$" + answer])
        )
        ids = _tokenize(tokenizer, text, pick(["canonical", "bytes", "pieces"]))
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):  # byte-less tokens and stray ids
            at = int(torch.randint(len(ids) + 1, (1,), generator=g))
            near = [table[i] for i in ids[max(0, at - 3) : at + 3] if 0 <= i < len(table)]
            if any(b"#" in b for b in near):  # not inside a marker: its last token looks back 3 tokens only
                continue
            ids.insert(
                at,
                pick(specials + [V + 3, -1, -7, 10**6] + ([pick(stops)] if torch.rand(1, generator=g) < 0.3 else [])),
            )
        if torch.rand(1, generator=g) < 0.2:  # no stop at all in some rows: text up to the row's end
            while len(ids) < L:
                ids += _tokenize(tokenizer, " " + " ".join(pick(WORDS) for _ in range(8)), "canonical")
            ids = [i if i not in stops else pick(specials) for i in ids[:L]]
        else:  # a few byte-less tokens at most before the stop (many would hide the text before them: documented)
            ids = ids[:L] + [pick(stops)] * (L - len(ids[:L]))
        rows.append(ids)
        answers.append(answer)
    return torch.tensor(rows), answers


@pytest.mark.parametrize("fmt", [["####"], ["a", "e", "####"]], ids=["windowed", "every_token"])
def test_components_equal_the_python_reference_on_fuzzed_batches(bpe_tok, word_tok, fmt):  # noqa: F811
    """Every component equals the reference on every row no window limit decides, for both format paths
    (windows: a rare last byte; every token: common ones), row lengths shorter than a block, not a multiple of
    it and longer than every window, both tokenizers, int64 and int32 ids, unprepared and prepared patterns."""
    g = torch.Generator().manual_seed(len(fmt))
    for tokenizer in (bpe_tok, word_tok):
        stops = [tokenizer.eos_token_id] + (
            [tokenizer.convert_tokens_to_ids("<|endoftext|>")] if tokenizer is bpe_tok else []
        )
        reward = build_reward_fn(RewardConfig(components=dict.fromkeys(COMPONENTS, 1.0), format_sequences=fmt),
                                 tokenizer, stops, 64)  # fmt: skip
        assert reward.text.format_windowed == (fmt == ["####"])
        table = token_bytes(tokenizer)
        ref = Reference(table, stops)
        first_table = reward.text.first_table
        compared, hits = dict.fromkeys(COMPONENTS, 0), dict.fromkeys(COMPONENTS, 0.0)
        total = 0
        for L in (1, 5, 17, 45, 160):
            ids, answers = _fuzz_batch(tokenizer, table, g, 48, L, stops)
            packed = patterns_from_texts(tokenizer, answers)
            for patterns, dtype in ((packed, torch.int64), (reward.prepare(packed), torch.int32)):
                got = {k: v.tolist() for k, v in reward(ids.to(dtype), patterns)[1].items()}
                for r, row in enumerate(ids.tolist()):
                    toks = ref.tokens(row)
                    text = b"".join(toks)
                    alts = ref.alternatives(packed.tokens[r], packed.lengths[r])
                    firsts = [int(first_table[i]) if 0 <= i < len(first_table) - 1 else 0 for i in row[: len(toks)]]
                    occurrences = ref.contains_at(text, alts)
                    want = {
                        "answer_after_marker": ref.answer_after_marker(text, alts),
                        "exact_match": ref.exact_match(text, alts),
                        "contains": float(bool(occurrences)),
                        "format": ref.format(text, [s.encode() for s in fmt]),
                    }
                    read = {
                        "answer_after_marker": _marker_read(toks, text),
                        "exact_match": True,
                        "contains": _contains_read(toks, occurrences, alts, firsts),
                        "format": fmt != ["####"] or _format_read(toks, text),
                    }
                    total += 1
                    for name in COMPONENTS:
                        if read[name]:
                            label = (name, L, dtype, tokenizer.name_or_path, text, answers[r])
                            assert got[name][r] == want[name], label
                            compared[name] += 1
                            hits[name] += want[name]
        assert all(n >= 0.6 * total for n in compared.values()), (compared, total)  # most rows are compared
        assert all(v > 0 for v in hits.values()), hits  # and not all misses


def test_scan_equals_the_reference(bpe_tok):  # noqa: F811
    """The one pass: index = id + 1 (ids outside the vocabulary read as a byte-less id), the first stop of each row
    (L when none), the stop and can-end-a-marker bits of each token; the caller's ids are never written."""
    tm = TextMatcher.build(bpe_tok, "####")
    table = token_bytes(bpe_tok)
    eos = bpe_tok.eos_token_id
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.int64, torch.int32):
        ids = torch.randint(-3, len(bpe_tok) + 5, (9, 37), generator=g).to(dtype)
        ids[::2, 11] = eos
        before = ids.clone()
        rows = tm.rows(ids, [eos])
        assert torch.equal(ids, before)
        for r, row in enumerate(ids.tolist()):
            inside = [0 <= i < len(table) for i in row]
            # negative ids read entry 0, ids past the vocabulary the extra byte-less id's (len(table) + 1)
            want = [i + 1 if ok else (0 if i < 0 else len(table) + 1) for i, ok in zip(row, inside)]
            assert rows.index[r].tolist() == want
            assert int(rows.n_valid[r]) == next((p for p, i in enumerate(row) if i == eos), len(row))
            codes = rows.codes[r].tolist()
            assert codes[37:] == [0] * (len(codes) - 37)
            for p, (i, ok) in enumerate(zip(row, inside)):
                assert bool(codes[p] & 2) == (i == eos), (p, i)
                assert bool(codes[p] & 1) == (ok and _can_end(table[i])), (p, i)
        direct = scan(tm.codes_table(ids.device, (eos,)), ids)  # without buffers (the device path)
        assert torch.equal(direct[1], rows.n_valid) and torch.equal(direct[2], rows.index)


def test_cpu_buffers_are_kept_for_the_last_few_batch_shapes_only(bpe_tok):  # noqa: F811
    """Batches of ever new lengths do not pile up scan buffers: the last BUFFER_SHAPES shapes' are kept, and a
    shape asked for again reuses its buffers."""
    tm = TextMatcher.build(bpe_tok, "####")
    eos = bpe_tok.eos_token_id
    first = tm.rows(torch.full((3, 16), eos), [eos]).index
    for L in range(17, 17 + BUFFER_SHAPES - 1):
        tm.rows(torch.full((3, L), eos), [eos])
    assert tm.rows(torch.full((3, 16), eos), [eos]).index.data_ptr() == first.data_ptr()  # kept: reused
    for L in range(40, 40 + 2 * BUFFER_SHAPES):
        tm.rows(torch.full((3, L), eos), [eos])
    kept = [v for k, v in tm._on_device.items() if isinstance(k, tuple) and k[0] == "buffers"]
    assert kept and all(len(shapes) == BUFFER_SHAPES for shapes in kept)
