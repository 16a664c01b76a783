"""Tensor-native rewards: edge cases, semantics of every component, agreement with naive references."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedTokenizerFast

from rlhf_core.config import ConfigError, RewardConfig, load_config
from rlhf_core.reward.answer_forms import answer_variants, number_forms
from rlhf_core.reward.answers import continuation_token_ids, patterns_from_texts, whitespace_token_ids
from rlhf_core.reward.components import (
    REWARD_COMPONENTS,
    answer_after_marker_reward,
    build_reward_fn,
    exact_match_reward,
    format_reward,
    length_penalty,
)
from rlhf_core.reward.tensor_native import pack_patterns, tensor_native_reward, valid_lengths
from rlhf_core.types import PackedPatterns

EOS = 0
T = torch.tensor
HYP = settings(max_examples=120, deadline=None)


def ids(*rows):
    return T(list(rows), dtype=torch.long)


def pats(*rows):
    return [T(p, dtype=torch.long) for p in rows]


# ---------------------------------------------------------------------------------------------------
# Naive pure-Python references
# ---------------------------------------------------------------------------------------------------


def trim(row, eos):
    return row[: row.index(eos)] if eos in row else row


def occurs_at(t, p, s):
    return len(p) > 0 and t[s : s + len(p)] == p


def ref_contains(row, alts, eos):
    t = trim(row, eos)
    return float(any(occurs_at(t, p, s) for p in alts for s in range(len(t))))


def ref_exact(row, alts, eos):
    t = trim(row, eos)
    return float(any(len(p) > 0 and t == p for p in alts))


def ref_marker(row, alts, eos, markers, cont, ws=None):
    t = trim(row, eos)
    ends = [s + len(m) for m in markers for s in range(len(t)) if occurs_at(t, m, s)]
    if not ends:
        return 0.0
    starts = [max(ends)]
    if ws is not None:
        s = starts[0]
        while s < len(t) and t[s] in ws:
            s += 1
        starts.append(s)
    for s in starts:
        for p in alts:
            if occurs_at(t, p, s) and (s + len(p) == len(t) or t[s + len(p)] not in cont):
                return 1.0
    return 0.0


def ref_format(row, eos, seqs):
    t = trim(row, eos)
    pos = 0
    for q in seqs:
        if not q:
            continue
        found = next((s for s in range(pos, len(t)) if occurs_at(t, q, s)), None)
        if found is None:
            return 0.0
        pos = found + len(q)
    return 1.0


def ref_length_penalty(row, eos, target, max_length):
    n = row.index(eos) + 1 if eos in row else len(row)
    if n <= target:
        return 0.0
    return -min(1.0, (n - target) / max(1, max_length - target))


def as_rows(t):
    return [r for r in t.tolist()]


# ---------------------------------------------------------------------------------------------------
# Edge cases of tensor_native_reward
# ---------------------------------------------------------------------------------------------------


def test_empty_pattern_scores_zero():
    assert tensor_native_reward(ids([1, 2, 3, EOS]), pats([]), EOS).tolist() == [0.0]


def test_pattern_longer_than_sequence_scores_zero():
    assert tensor_native_reward(ids([1, 2]), pats([1, 2, 3]), EOS).tolist() == [0.0]
    assert tensor_native_reward(ids([1, 2, EOS, 3]), pats([1, 2, EOS]), EOS).tolist() == [0.0]


def test_no_eos_counts_whole_row():
    assert tensor_native_reward(ids([5, 6, 7, 8]), pats([7, 8]), EOS).tolist() == [1.0]


def test_pattern_after_first_eos_is_ignored():
    assert tensor_native_reward(ids([1, EOS, 7, 8]), pats([7, 8]), EOS).tolist() == [0.0]
    # a pattern straddling the first EOS does not count either
    assert tensor_native_reward(ids([1, 7, EOS, 8]), pats([7, EOS, 8]), EOS).tolist() == [0.0]


def test_pattern_at_very_beginning():
    assert tensor_native_reward(ids([7, 8, 1, 2, EOS]), pats([7, 8]), EOS).tolist() == [1.0]


def test_pattern_at_very_end_before_eos():
    assert tensor_native_reward(ids([1, 2, 7, 8, EOS]), pats([7, 8]), EOS).tolist() == [1.0]
    assert tensor_native_reward(ids([1, 2, 7, 8]), pats([7, 8]), EOS).tolist() == [1.0]


def test_multiple_eos_stops_at_first():
    assert tensor_native_reward(ids([1, EOS, 7, EOS, 8]), pats([7]), EOS).tolist() == [0.0]
    assert tensor_native_reward(ids([7, EOS, 1, EOS, 8]), pats([7]), EOS).tolist() == [1.0]


def test_heterogeneous_batch():
    batch = ids([1, 2, 3, EOS, 0], [4, 4, 4, 4, 4], [9, EOS, 9, 9, 9], [3, 3, 1, 2, EOS])
    out = tensor_native_reward(batch, pats([2, 3], [4, 4, 4, 4, 4], [9, 9], [1, 2, 3]), EOS)
    assert out.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out.dtype == torch.float32 and out.shape == (4,)


def test_empty_batch_and_empty_rows():
    empty = torch.zeros(0, 5, dtype=torch.long)
    for fn in (tensor_native_reward, exact_match_reward):
        assert fn(empty, [], EOS).shape == (0,)
        assert fn(
            empty, PackedPatterns(torch.zeros(0, 1, 3, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long)), EOS
        ).shape == (0,)
    no_tokens = torch.zeros(2, 0, dtype=torch.long)
    assert tensor_native_reward(no_tokens, pats([1], []), EOS).tolist() == [0.0, 0.0]
    assert exact_match_reward(no_tokens, pats([1], []), EOS).tolist() == [0.0, 0.0]
    assert answer_after_marker_reward(no_tokens, pats([1], [1]), EOS, T([9]), T([1])).tolist() == [0.0, 0.0]
    assert format_reward(no_tokens, EOS, [T([1])]).tolist() == [0.0, 0.0]
    assert format_reward(no_tokens, EOS, []).tolist() == [1.0, 1.0]
    assert length_penalty(no_tokens, EOS, 0).tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------------
# Alternatives and input forms
# ---------------------------------------------------------------------------------------------------


def test_alternatives_any_match_scores():
    batch = ids([1, 2, 3, EOS], [4, 5, 6, EOS], [7, 7, 7, 7])
    alts = [[T([9]), T([2, 3])], [T([9, 9]), T([])], [T([8]), T([7, 7, 7, 7]), T([7, 7])]]
    assert tensor_native_reward(batch, alts, EOS).tolist() == [1.0, 0.0, 1.0]


def test_all_input_forms_agree():
    rng = random.Random(0)
    B, L = 32, 12
    batch = torch.randint(0, 4, (B, L), generator=torch.Generator().manual_seed(0))
    single = [T([rng.randrange(4) for _ in range(rng.randrange(0, 4))], dtype=torch.long) for _ in range(B)]
    packed = pack_patterns(single)
    Q = packed.tokens.shape[2]
    expected = [ref_contains(r, [p.tolist()], EOS) for r, p in zip(as_rows(batch), single)]
    forms = [
        single,
        [[p] for p in single],
        [p.tolist() for p in single],
        packed,
        (packed.tokens[:, 0], packed.lengths[:, 0]),
        (packed.tokens, packed.lengths),
        (packed.tokens.to(torch.int32), packed.lengths),
    ]
    for form in forms:
        assert tensor_native_reward(batch, form, EOS).tolist() == expected
        assert exact_match_reward(batch, form, EOS).tolist() == [
            ref_exact(r, [p.tolist()], EOS) for r, p in zip(as_rows(batch), single)
        ]
    assert Q == max(1, max(len(p) for p in single))


def test_pack_patterns_layout():
    packed = pack_patterns([[T([1, 2]), T([3])], T([4, 5, 6]), []])
    assert packed.tokens.shape == (3, 2, 3) and packed.lengths.tolist() == [[2, 1], [3, 0], [0, 0]]
    assert packed.tokens[1, 0].tolist() == [4, 5, 6]
    assert pack_patterns(packed) is packed
    with pytest.raises(ValueError):
        pack_patterns((torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError):
        tensor_native_reward(ids([1, 2]), pats([1], [2]), EOS)


# ---------------------------------------------------------------------------------------------------
# Component semantics
# ---------------------------------------------------------------------------------------------------


def test_exact_match_semantics():
    batch = ids([7, EOS, 3, 3], [7, 7, EOS, 3], [3, 7, EOS, 3], [7, 3, EOS, EOS], [EOS, 7, 7, 7], [7, 3, 1, 2])
    answers = [[T([7])], [T([7])], [T([7])], [T([7]), T([7, 3])], [T([7])], [T([7, 3, 1, 2])]]
    assert exact_match_reward(batch, answers, EOS).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    # an empty answer never matches, even an empty response
    assert exact_match_reward(ids([EOS, 1]), [[T([])]], EOS).tolist() == [0.0]


MARK, C1, C2 = 9, 1, 2  # marker token; continuation tokens


def test_marker_last_occurrence_wins():
    # answer 4 after the first marker, 5 after the last: only the last counts
    batch = ids([MARK, 4, MARK, 5, EOS], [MARK, 5, MARK, 4, EOS], [MARK, 4, EOS, MARK, 5])
    out = answer_after_marker_reward(batch, pats([5], [5], [4]), EOS, T([MARK]), T([C1, C2]))
    assert out.tolist() == [1.0, 0.0, 1.0]  # row 3: the marker after EOS is ignored


def test_marker_answer_not_matched_inside_longer_number():
    batch = ids([MARK, 4, C2, EOS, 7], [MARK, 4, C2, C1, EOS], [MARK, 4, C2, 7, 7], [3, 3, MARK, 4, C2])
    out = answer_after_marker_reward(batch, pats([4, C2], [4, C2], [4, C2], [4, C2]), EOS, T([MARK]), T([C1, C2]))
    assert out.tolist() == [1.0, 0.0, 1.0, 1.0]  # followed by EOS / non-digit / end of row is fine


def test_marker_absent_or_answer_not_adjacent():
    batch = ids([4, 4, EOS, 0], [MARK, 3, 4, EOS], [MARK, EOS, 4, 4])
    out = answer_after_marker_reward(batch, pats([4], [4], [4]), EOS, T([MARK]), T([C1, C2]))
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_marker_alternatives_latest_ending_wins_and_whitespace():
    SP, M2a, M2b = 8, 6, 7  # whitespace token; a two-token marker tokenisation
    batch = ids([MARK, 4, M2a, M2b, 5, EOS], [M2a, M2b, 5, MARK, 4, EOS], [MARK, SP, SP, 4, EOS, 0])
    markers = [T([MARK]), T([M2a, M2b])]
    out = answer_after_marker_reward(batch, pats([5], [4], [4]), EOS, markers, T([C1]), whitespace_ids=T([SP]))
    assert out.tolist() == [1.0, 1.0, 1.0]
    out = answer_after_marker_reward(batch, pats([5], [4], [4]), EOS, markers, T([C1]))
    assert out.tolist() == [1.0, 1.0, 0.0]  # without whitespace ids the space must be in the pattern
    assert answer_after_marker_reward(batch, pats([5], [4], [4]), EOS, [], T([C1])).tolist() == [0.0] * 3
    # a pattern that itself starts with the whitespace token still matches right after the marker
    out = answer_after_marker_reward(batch[2:], pats([SP, SP, 4]), EOS, markers, T([C1]), whitespace_ids=T([SP]))
    assert out.tolist() == [1.0]


def test_format_ordering():
    A, B_, C = 3, 4, 5
    batch = ids([A, B_, 1, C, EOS], [C, A, B_, EOS, C], [A, B_, C, 1, 1], [A, B_, EOS, C, 1], [A, A, A, 1, 1])
    out = format_reward(batch, EOS, [T([A, B_]), T([C])])
    assert out.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    # non-overlapping: "A A" then "A A" needs four A's
    assert format_reward(ids([A, A, A, 1], [A, A, A, A]), EOS, [T([A, A]), T([A, A])]).tolist() == [0.0, 1.0]
    assert format_reward(batch, EOS, []).tolist() == [1.0] * 5


def test_length_penalty_by_hand():
    batch = ids(
        [1, EOS, 0, 0, 0, 0, 0, 0, 0, 0],  # len 2
        [1, 1, 1, 1, EOS, 0, 0, 0, 0, 0],  # len 5
        [1, 1, 1, 1, 1, 1, EOS, 0, 0, 0],  # len 7
        [1] * 10,
    )  # no EOS: len 10
    # target 4, L 10: 0, -(5-4)/6, -(7-4)/6, -(10-4)/6
    assert torch.allclose(length_penalty(batch, EOS, 4), T([0.0, -1 / 6, -3 / 6, -1.0]))
    assert length_penalty(batch, EOS, 10).tolist() == [0.0] * 4
    assert torch.allclose(length_penalty(batch, EOS, 4, max_length=16), T([0.0, -1 / 12, -3 / 12, -6 / 12]))
    assert length_penalty(batch, EOS, 9).tolist() == [0.0, 0.0, 0.0, -1.0]  # max(1, L - target) = 1


# ---------------------------------------------------------------------------------------------------
# Property tests against the references
# ---------------------------------------------------------------------------------------------------

VOCAB = 6
token = st.integers(0, VOCAB - 1)
pattern = st.lists(token, min_size=0, max_size=4)


@st.composite
def batches(draw, max_alts=3):
    B = draw(st.integers(0, 6))
    L = draw(st.integers(0, 10))
    rows = [draw(st.lists(token, min_size=L, max_size=L)) for _ in range(B)]
    alts = [draw(st.lists(pattern, min_size=1, max_size=max_alts)) for _ in range(B)]
    eos = draw(token)
    return rows, L, alts, eos


def to_ids(rows, L):
    return T(rows, dtype=torch.long) if rows else torch.zeros(0, L, dtype=torch.long)


def to_alts(alts):
    return [[T(p, dtype=torch.long) for p in a] for a in alts]


@HYP
@given(batches())
def test_contains_matches_reference(data):
    rows, L, alts, eos = data
    packed = pack_patterns(to_alts(alts))
    expected = [ref_contains(r, a, eos) for r, a in zip(rows, alts)]
    assert tensor_native_reward(to_ids(rows, L), packed, eos).tolist() == expected
    assert tensor_native_reward(to_ids(rows, L), to_alts(alts), eos).tolist() == expected


@HYP
@given(batches(max_alts=1))
def test_single_pattern_list_matches_reference(data):
    rows, L, alts, eos = data
    single = [T(a[0], dtype=torch.long) for a in alts]
    assert tensor_native_reward(to_ids(rows, L), single, eos).tolist() == [
        ref_contains(r, a, eos) for r, a in zip(rows, alts)
    ]


@HYP
@given(batches())
def test_exact_match_matches_reference(data):
    rows, L, alts, eos = data
    assert exact_match_reward(to_ids(rows, L), to_alts(alts), eos).tolist() == [
        ref_exact(r, a, eos) for r, a in zip(rows, alts)
    ]


@HYP
@given(
    batches(),
    st.lists(st.lists(token, min_size=1, max_size=2), min_size=1, max_size=2),
    st.lists(token, max_size=3, unique=True),
    st.one_of(st.none(), st.lists(token, max_size=2, unique=True)),
)
def test_answer_after_marker_matches_reference(data, markers, cont, ws):
    rows, L, alts, eos = data
    out = answer_after_marker_reward(
        to_ids(rows, L),
        to_alts(alts),
        eos,
        [T(m) for m in markers],
        T(cont, dtype=torch.long),
        None if ws is None else T(ws, dtype=torch.long),
    )
    assert out.tolist() == [ref_marker(r, a, eos, markers, cont, ws) for r, a in zip(rows, alts)]


@HYP
@given(batches(max_alts=1), st.lists(pattern, max_size=3))
def test_format_matches_reference(data, seqs):
    rows, L, _, eos = data
    out = format_reward(to_ids(rows, L), eos, [T(s, dtype=torch.long) for s in seqs])
    assert out.tolist() == [ref_format(r, eos, seqs) for r in rows]


@HYP
@given(batches(max_alts=1), st.integers(0, 12), st.one_of(st.none(), st.integers(0, 14)))
def test_length_penalty_matches_reference(data, target, max_length):
    rows, L, _, eos = data
    out = length_penalty(to_ids(rows, L), eos, target, max_length)
    expected = T([ref_length_penalty(r, eos, target, L if max_length is None else max_length) for r in rows])
    assert torch.allclose(out, expected) and bool((out <= 0).all()) and bool((out >= -1).all())


def test_large_batch_matches_reference():
    """B = 1024 rows in one call (no per-row Python loop could be hiding behind small examples)."""
    g = torch.Generator().manual_seed(1)
    B, L = 1024, 40
    batch = torch.randint(0, 5, (B, L), generator=g)
    rng = random.Random(1)
    alts = [
        [[rng.randrange(5) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 3))] for _ in range(B)
    ]
    packed = pack_patterns(to_alts(alts))
    rows = as_rows(batch)
    assert tensor_native_reward(batch, packed, EOS).tolist() == [ref_contains(r, a, EOS) for r, a in zip(rows, alts)]
    assert exact_match_reward(batch, packed, EOS).tolist() == [ref_exact(r, a, EOS) for r, a in zip(rows, alts)]
    big_continuation_set = torch.cat([T([2, 1]), torch.arange(100, 1100)])  # large sets: no torch.isin unique path
    out = answer_after_marker_reward(batch, packed, EOS, T([4]), big_continuation_set, whitespace_ids=T([3]))
    assert out.tolist() == [ref_marker(r, a, EOS, [[4]], [1, 2], [3]) for r, a in zip(rows, alts)]


def test_int32_and_negative_ids():
    batch = T([[5, 7, 8, EOS, -100], [-100, 7, 8, -100, -100], [7, -100, 8, EOS, EOS]], dtype=torch.int32)
    before = batch.clone()
    assert tensor_native_reward(batch, pats([7, 8], [7, 8], [7, 8]), EOS).tolist() == [1.0, 1.0, 0.0]
    assert exact_match_reward(batch, pats([5, 7, 8], [7], [7, -100, 8]), EOS).tolist() == [1.0, 0.0, 1.0]
    assert valid_lengths(batch, EOS).tolist() == [3, 5, 3]
    assert torch.equal(batch, before)  # the int32 fast path never writes into the caller's tensor


# ---------------------------------------------------------------------------------------------------
# No host round trip in the hot path
# ---------------------------------------------------------------------------------------------------


class ForbidHostSync(TorchFunctionMode):
    """Fails on the tensor operations that copy to the host or produce data-dependent shapes."""

    FORBIDDEN = {
        "item",
        "tolist",
        "cpu",
        "numpy",
        "nonzero",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "masked_select",
        "unique",
        "unique_consecutive",
        "argwhere",
        "nonzero_static",
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.FORBIDDEN:
            raise AssertionError(f"host round trip in the hot path: {name}")
        if name == "where" and len(args) == 1 and not kwargs:
            raise AssertionError("data-dependent torch.where(cond)")
        if name == "__getitem__" and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            raise AssertionError("boolean-mask indexing in the hot path")
        return func(*args, **(kwargs or {}))


def _hot_path_calls(device):
    g = torch.Generator().manual_seed(2)
    batch = torch.randint(0, 6, (64, 32), generator=g).to(device)
    packed = pack_patterns([[T([1, 2]), T([3])]] * 64, device=device)
    marker, cont, ws = T([4]).to(device), T([1, 2]).to(device), T([5]).to(device)
    seqs = [T([1]).to(device), T([2, 3]).to(device)]
    return [
        lambda: tensor_native_reward(batch, packed, EOS),
        lambda: tensor_native_reward(batch, (packed.tokens, packed.lengths), EOS),
        lambda: exact_match_reward(batch, packed, EOS),
        lambda: answer_after_marker_reward(batch, packed, EOS, marker, cont, ws),
        lambda: format_reward(batch, EOS, seqs),
        lambda: length_penalty(batch, EOS, 8, 32),
    ]


def test_hot_path_makes_no_host_round_trip():
    calls = _hot_path_calls("cpu")
    with ForbidHostSync():
        for call in calls:
            call()
    # and the guard does catch one
    with pytest.raises(AssertionError):
        with ForbidHostSync():
            T([1, 2]).sum().item()


def test_composed_reward_makes_no_host_round_trip(quirk_tokenizer):
    cfg = RewardConfig(components={name: 1.0 for name in REWARD_COMPONENTS}, format_sequences=["the answer is"])
    reward = build_reward_fn(cfg, quirk_tokenizer, quirk_tokenizer.eos_token_id, 16)
    batch = torch.randint(0, len(quirk_tokenizer.get_vocab()), (8, 16))
    patterns = patterns_from_texts(quirk_tokenizer, ["42"] * 8)
    reward(batch, patterns)  # first call caches the build-time constants on the device
    with ForbidHostSync():
        reward(batch, patterns)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hot_path_cuda_sync_debug_mode():
    calls = _hot_path_calls("cuda")
    for call in calls:  # warm up (allocator, lazy init)
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            out = call()
            assert out.device.type == "cuda"
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------------
# Tokenizer-facing pieces: answer variants and the configured composition
# ---------------------------------------------------------------------------------------------------

WORDS = ["####", "42", "421", "1", "000", "1000", "7", ",", ".", "0", "the", "answer", "is", "so", "x", "<", ">"]


@pytest.fixture(scope="module")
def quirk_tokenizer():
    """Byte-level pre-tokenizer + WordLevel: '42' and 'Ġ42' (' 42') are different tokens, as in GPT-2."""
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, "\u0120": 3, "\u010a": 4}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
        vocab.setdefault("\u0120" + w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]")


def encode_batch(tokenizer, texts, L):
    rows = []
    for text in texts:
        row = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(row + [tokenizer.pad_token_id] * (L - len(row)))
    return T(rows, dtype=torch.long)


def test_answer_variants_leading_space_quirk(quirk_tokenizer):
    v = quirk_tokenizer.get_vocab()
    variants = answer_variants(quirk_tokenizer, "42")
    assert variants == [[v["42"]], [v["\u012042"]]]
    # the model wrote "so 42": the answer token is 'Ġ42', found only thanks to the variant
    batch = encode_batch(quirk_tokenizer, ["so 42", "so 421", "42"], 6)
    assert batch[0, 1] == v["\u012042"]
    assert tensor_native_reward(batch, [T(variants[0])] * 3, quirk_tokenizer.eos_token_id).tolist() == [0.0, 0.0, 1.0]
    packed = patterns_from_texts(quirk_tokenizer, ["42", " 421 ", "421"])
    assert tensor_native_reward(batch, packed, quirk_tokenizer.eos_token_id).tolist() == [1.0, 1.0, 0.0]


def test_answer_variants_number_forms(quirk_tokenizer):
    assert number_forms("1,000") == ["1000", "1,000"]
    assert number_forms(" 42.0 ") == ["42"]
    assert number_forms("-0.50") == ["-0.5"]
    assert number_forms("007") == ["7"] and number_forms("+007") == []  # one grammar: an optional '-' only
    assert number_forms("-0") == ["0"]
    assert number_forms("$1,000.00.") == ["1000", "1,000"] and number_forms("$50") == ["50"]
    assert number_forms("x42") == [] and number_forms("1,00") == ["100"]  # commas dropped wherever they are
    v = quirk_tokenizer.get_vocab()
    variants = answer_variants(quirk_tokenizer, "1,000")
    assert [v["1000"]] in variants and [v["\u01201000"]] in variants
    assert [v["1"], v[","], v["000"]] in variants
    assert [v["7"]] in answer_variants(quirk_tokenizer, "7.0")
    assert all(variants) and len(set(map(tuple, variants))) == len(variants)
    assert answer_variants(quirk_tokenizer, "") == []


def test_vocab_token_sets(quirk_tokenizer):
    v = quirk_tokenizer.get_vocab()
    cont = set(continuation_token_ids(quirk_tokenizer, "0123456789.,").tolist())
    assert {v["1"], v["\u01201"], v["421"], v[","], v["."], v["\u0120000"]} <= cont
    assert not cont & {v["####"], v["the"], v["\u0120"], v["[EOS]"]}
    assert set(whitespace_token_ids(quirk_tokenizer).tolist()) == {v["\u0120"], v["\u010a"]}


def test_registry_and_config_validation():
    assert {"exact_match", "contains", "answer_after_marker", "format", "length_penalty"} <= set(REWARD_COMPONENTS)
    assert REWARD_COMPONENTS["contains"] is tensor_native_reward
    with pytest.raises(ConfigError, match="unknown reward component"):
        load_config(None, ["reward.components={nope: 1.0}"])


def test_composed_reward_weights(quirk_tokenizer):
    cfg = RewardConfig(
        components={
            "exact_match": 1.0,
            "contains": 0.5,
            "answer_after_marker": 2.0,
            "format": 0.25,
            "length_penalty": 0.1,
        },
        format_sequences=["the answer is"],
        length_target=4,
    )
    eos = quirk_tokenizer.eos_token_id
    reward = build_reward_fn(cfg, quirk_tokenizer, eos, max_new_tokens=12)
    texts = [
        "42",
        "the answer is #### 42",
        "the answer is ####  421",
        "#### 42 #### 7",
        "so 42 x x x x x x x x",
        "####  42",
    ]
    batch = encode_batch(quirk_tokenizer, texts, 12)
    patterns = patterns_from_texts(quirk_tokenizer, ["42"] * 4 + ["7", "42"])
    total, parts = reward(batch, patterns)
    assert set(parts) == set(cfg.components)
    assert parts["exact_match"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert parts["contains"].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    # row 4: its 42 follows a marker but not the last one; row 6: a separate space token is skipped
    assert parts["answer_after_marker"].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert parts["format"].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # lengths incl. EOS: 2, 6, 7, 5, 11, 4; target 4, scale max_new_tokens - target = 8
    assert torch.allclose(parts["length_penalty"], T([0.0, -2 / 8, -3 / 8, -1 / 8, -7 / 8, 0.0]))
    expected = sum(w * parts[n] for n, w in cfg.components.items())
    assert torch.allclose(total, expected)
    # patterns on another device than responses (here: same CPU, different form) are accepted
    total2, _ = reward(batch, (patterns.tokens, patterns.lengths))
    assert torch.equal(total, total2)


def test_composed_default_is_exact_match(quirk_tokenizer):
    reward = build_reward_fn(RewardConfig(), quirk_tokenizer, quirk_tokenizer.eos_token_id, max_new_tokens=4)
    batch = encode_batch(quirk_tokenizer, ["7", "7 7", "42"], 4)
    total, parts = reward(batch, patterns_from_texts(quirk_tokenizer, ["7", "7", "7"]))
    assert total.tolist() == [1.0, 0.0, 0.0] and list(parts) == ["exact_match"]


def test_build_rejects_untokenizable_format(quirk_tokenizer):
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        build_reward_fn(RewardConfig(components={"format": 1.0}, format_sequences=[""]), quirk_tokenizer, 1, 4)


def test_answer_variants_sentencepiece_style_dedupes():
    """Metaspace (SentencePiece-style) BPE: '42' and ' 42' both encode to '▁42', one variant only."""
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    corpus = ["the answer is 42", "so it is 7", "42 is the answer", "#### 42", "it is 421"] * 10
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["[PAD]", "[EOS]", "[UNK]"], show_progress=False)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]")
    variants = answer_variants(tokenizer, "42")
    assert variants == [tokenizer.encode(" 42", add_special_tokens=False)]
    batch = encode_batch(tokenizer, ["the answer is 42", "it is 421"], 8)
    assert tensor_native_reward(
        batch, patterns_from_texts(tokenizer, ["42", "42"]), tokenizer.eos_token_id
    ).tolist() == [1.0, 0.0]
