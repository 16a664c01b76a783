"""Rewards matched as TEXT (rlhf_core.reward.text): any tokenization of the same text scores the same.

A table of cases (the text a grader sees, the answer, the expected score) is scored in several
tokenizations (canonical, byte by byte, greedy longest-match, marker split, digits split / merged) with a
word-level tokenizer and with the real byte-level BPE tokenizer of the chat test model.
"""

from __future__ import annotations

import pytest
import torch
from test_reward import ForbidHostSync
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf_core.config import RewardConfig
from rlhf_core.reward.answers import patterns_from_texts
from rlhf_core.reward.components import build_reward_fn
from rlhf_core.reward.text import gpt2_byte_decoder, token_bytes

BYTE_TO_CHAR = {b: c for c, b in gpt2_byte_decoder().items()}
ALL = {"answer_after_marker": 1.0, "exact_match": 1.0, "contains": 1.0, "format": 1.0}

# (text a grader sees, answer, expected answer_after_marker score)
MARKER_CASES = [
    ("#### 72", "72", 1.0),
    ("#### 72.", "72", 1.0),  # sentence period
    ("#### $72", "72", 1.0),
    ("#### $ 72", "72", 1.0),
    ("#### 7.0", "7", 1.0),
    ("#### 7.", "7", 1.0),
    ("#### 72.00", "72", 1.0),
    ("####72", "72", 1.0),
    ("####   72 apples", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("#### $1,000.00.", "1000", 1.0),
    ("#### -7", "-7", 1.0),
    ("First 3 + 4 = 7.\n#### 7", "7", 1.0),
    ("#### 8 then #### 72", "72", 1.0),  # the LAST marker counts
    ("#### 72 then #### 8", "72", 0.0),
    ("#### 720", "72", 0.0),
    ("#### 7.2", "72", 0.0),
    ("#### 7", "72", 0.0),
    ("#### 72", "7", 0.0),
    ("#### -7", "7", 0.0),
    ("#### 7", "-7", 0.0),
    ("#### 7.5", "7", 0.0),
    ("the answer is 72", "72", 0.0),  # no marker
    ("### 72", "72", 0.0),  # not the marker
    ("#### 7 5", "75", 0.0),  # the number right after the marker is 7, in every tokenization
    ("#### 7 5", "7", 1.0),
]

EXACT_CASES = [
    ("72", "72", 1.0),
    (" 72 ", "72", 1.0),
    ("$72.", "72", 1.0),
    ("72.0", "72", 1.0),
    ("1,000", "1000", 1.0),
    ("720", "72", 0.0),
    ("7.2", "72", 0.0),
    ("-72", "72", 0.0),
    ("72 72", "72", 0.0),
    ("so 72", "72", 0.0),
    ("$1,000.00.", "1000", 1.0),
    ("-7", "-7", 1.0),
    ("7", "-7", 0.0),
    ("72.5", "72", 0.0),
    ("72 apples", "72", 0.0),
    ("1000", "1,000", 1.0),
]

CONTAINS_CASES = [
    ("so it is 72 apples", "72", 1.0),
    ("it costs $72.", "72", 1.0),
    ("it is 72.0 now", "72", 1.0),
    ("about 1,000 of them", "1000", 1.0),
    ("it is 720 apples", "72", 0.0),
    ("it is 7.2 apples", "72", 0.0),
    ("it is -72", "72", 0.0),
    ("it is 172", "72", 0.0),
    ("72", "72", 1.0),  # the whole response
    ("so 72, then 8", "72", 1.0),  # a comma after, not before a digit
    ("it is 72.00 now", "72", 1.0),
    ("costs $ 72 today", "72", 1.0),
    ("first 7 then 72", "72", 1.0),  # an earlier candidate that does not match
    ("it is 1000 now", "1,000", 1.0),
    ("it is 72.5", "72", 0.0),
    ("it is 72,5", "72", 0.0),  # reads 725
    ("it is 72abc", "72", 0.0),
    ("it is 7,200", "72", 0.0),
    ("it is 0.72", "72", 0.0),
    ("it is x72", "72", 0.0),
    ("it is 7 2", "72", 0.0),
]


def _byte_tokens(text: str) -> list[str]:
    return [BYTE_TO_CHAR[b] for b in text.encode("utf-8")]


def _greedy(text: str, vocab: dict) -> list[str]:
    """Longest-match segmentation of the byte-level string over the vocabulary (another valid tokenization)."""
    s, out = "".join(_byte_tokens(text)), []
    while s:
        n = max(k for k in range(1, len(s) + 1) if s[:k] in vocab)
        out.append(s[:n])
        s = s[n:]
    return out


def tokenizations(tokenizer, text: str) -> dict[str, list[int]]:
    """Several token sequences of the same text: the encoder's, byte by byte, greedy longest match, the marker
    split into '##' '##', and the encoder's on each space-separated piece (digits merged / split differently)."""
    vocab = tokenizer.get_vocab()
    ids = lambda toks: [vocab[t] for t in toks]  # noqa: E731
    out = {
        "canonical": tokenizer.encode(text, add_special_tokens=False),
        "bytes": ids(_byte_tokens(text)),
        "greedy": ids(_greedy(text, vocab)),
    }
    if "####" in text:
        pieces = text.split("####")
        split = []
        for i, piece in enumerate(pieces):
            if i:
                split += ids(["##", "##"]) if "##" in vocab else ids(_byte_tokens("####"))
            split += ids(_greedy(piece, vocab)) if piece else []
        out["marker_split"] = split
    words = text.split(" ")
    out["pieces"] = [t for i, w in enumerate(words) for t in ids(_greedy((" " if i else "") + w, vocab))]
    digits = []
    for ch in _greedy(text, vocab):  # every multi-digit token split into single digits
        digits += ids(list(ch)) if ch.isdigit() and len(ch) > 1 else [vocab[ch]]
    out["digits_split"] = digits
    for name, seq in out.items():
        assert tokenizer.decode(seq) == text, (name, text, tokenizer.convert_ids_to_tokens(seq))
    return out


def score(reward, tokenizer, rows: list[list[int]], answers: list[str], stop: int) -> dict:
    """The components' scores, with the answers prepared on the host (as the rollout worker does); they must
    equal the scores of the unprepared patterns (the static window bounds)."""
    L = max(len(r) for r in rows) + 1
    batch = torch.tensor([r + [stop] + [tokenizer.pad_token_id] * (L - len(r) - 1) for r in rows])
    packed = patterns_from_texts(tokenizer, answers)
    parts = reward(batch, reward.prepare(packed))[1]
    unprepared = reward(batch, packed)[1]
    assert {k: v.tolist() for k, v in parts.items()} == {k: v.tolist() for k, v in unprepared.items()}
    return parts


def word_level_tokenizer():
    """WordLevel over byte-level pre-tokenized words: every byte, the marker and its pieces, digits and some
    merged numbers with and without the leading 'Ġ' (space)."""
    words = ["####", "###", "##", "72", "720", "1000", "000", "00", "75", "then", "apples", "answer", "the", "is"]
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2}
    for c in BYTE_TO_CHAR.values():
        vocab.setdefault(c, len(vocab))
    for w in words:
        vocab.setdefault(w, len(vocab))
        vocab.setdefault("\u0120" + w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]")


class _Greedy:
    """Encodes by greedy longest match (the WordLevel model has no merges to split unknown words)."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, add_special_tokens=False):
        v = self.tok.get_vocab()
        return [v[t] for t in _greedy(text, v)]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}

    def __len__(self):
        return len(self.tok)


@pytest.fixture(scope="module")
def word_tok():
    return _Greedy(word_level_tokenizer())


@pytest.fixture(scope="module")
def bpe_tok(chat_policy_dir):
    from rlhf_core.model.policy import load_policy

    return load_policy(chat_policy_dir, dtype="float32", device="cpu")[1]


@pytest.fixture(scope="module", params=["word_level", "byte_level_bpe"])
def any_tok(request, word_tok, bpe_tok):
    return word_tok if request.param == "word_level" else bpe_tok


def _check_table(tokenizer, component, cases):
    stop = tokenizer.eos_token_id
    reward = build_reward_fn(RewardConfig(components={component: 1.0}), tokenizer, [stop], 64)
    rows, answers, expected, labels = [], [], [], []
    for text, answer, want in cases:
        for name, seq in tokenizations(tokenizer, text).items():
            rows.append(seq)
            answers.append(answer)
            expected.append(want)
            labels.append((text, answer, name))
    got = score(reward, tokenizer, rows, answers, stop)[component].tolist()
    wrong = [(label, g, e) for label, g, e in zip(labels, got, expected) if g != e]
    assert not wrong, wrong


def test_table_answer_after_marker(any_tok):
    _check_table(any_tok, "answer_after_marker", MARKER_CASES)


def test_table_exact_match(any_tok):
    _check_table(any_tok, "exact_match", EXACT_CASES)


def test_table_contains(any_tok):
    _check_table(any_tok, "contains", CONTAINS_CASES)


# Bytes are classified in ASCII (docs/rewards.md, common rules): where a Unicode-aware Python grader decides
# otherwise, the documented behaviour (a no-break space is not whitespace; a byte from 0x80 continues a word)
ASCII_CLASS_CASES = {
    "answer_after_marker": [("####\u00a072", "72", 0.0), ("#### 72 \u20ac", "72", 1.0), ("#### 72\u20ac", "72", 1.0)],
    "exact_match": [("72\u00a0", "72", 0.0), ("72 ", "72", 1.0)],
    "contains": [("it costs 72\u20ac", "72", 0.0), ("it costs 72 \u20ac", "72", 1.0)],
}


def test_bytes_are_classified_in_ascii_as_documented(bpe_tok):
    for component, cases in ASCII_CLASS_CASES.items():
        _check_table(bpe_tok, component, cases)


def test_byte_table_decodes_like_the_tokenizer(bpe_tok):
    table = token_bytes(bpe_tok)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(3, len(bpe_tok), (30,), generator=g).tolist()
        assert b"".join(table[i] for i in ids).decode("utf-8", "replace") == bpe_tok.decode(ids)
    assert all(table[i] == b"" for i in bpe_tok.all_special_ids)


# One test per false negative / false positive reported with the real tokenizer.
@pytest.mark.parametrize(
    "tokens, answer, want",
    [
        (["##", "##", "\u0120", "7", "2", "."], "72", 1.0),  # '#### 72.' sentence period
        (["##", "##", "\u0120$", "7", "2"], "72", 1.0),  # '#### $72'
        (["##", "##", "\u0120", "7", ".", "0"], "7", 1.0),  # '#### 7.0'
        (["#", "#", "#", "#", "\u0120", "7", "2"], "72", 1.0),  # marker byte by byte
        (["##", "##", "\u0120", "7", "2", "0"], "72", 0.0),  # 720
        (["##", "##", "\u0120", "7", ".", "2"], "72", 0.0),  # 7.2
        (["##", "##", "\u0120", "7"], "72", 0.0),  # 7
        (["##", "##", "\u0120", "-", "7"], "7", 0.0),  # -7
    ],
)
def test_reported_cases_bpe(bpe_tok, tokens, answer, want):
    vocab = bpe_tok.get_vocab()
    row = [vocab[t] for t in tokens]
    reward = build_reward_fn(RewardConfig(components={"answer_after_marker": 1.0}), bpe_tok, [bpe_tok.eos_token_id], 16)
    assert score(reward, bpe_tok, [row], [answer], bpe_tok.eos_token_id)["answer_after_marker"].tolist() == [want]


def test_two_tokenizers_agree_on_the_same_text(word_tok, bpe_tok):
    """'#### 7 5' used to score differently under two tokenizers; as text it is the number 7 after the marker."""
    for tok in (word_tok, bpe_tok):
        reward = build_reward_fn(RewardConfig(components={"answer_after_marker": 1.0}), tok, [tok.eos_token_id], 16)
        rows = list(tokenizations(tok, "#### 7 5").values())
        got = score(reward, tok, rows * 2, ["7"] * len(rows) + ["75"] * len(rows), tok.eos_token_id)
        assert got["answer_after_marker"].tolist() == [1.0] * len(rows) + [0.0] * len(rows)


def test_row_is_read_up_to_its_first_stop(base_chat_policy_dir):
    """Tokenizer EOS <|endoftext|>, the turn ends at <|im_end|>: text after the first stop is never read."""
    from rlhf_core.model.policy import load_policy

    tok = load_policy(base_chat_policy_dir, dtype="float32", device="cpu")[1]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id != im_end
    reward = build_reward_fn(
        RewardConfig(components=ALL, format_sequences=["####"]), tok, [tok.eos_token_id, im_end], 32
    )
    texts = ["#### 8<|im_end|>#### 7", "#### 7<|im_end|>#### 8", "#### 8<|endoftext|>#### 7", "8<|im_end|>7"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    parts = score(reward, tok, rows, ["7"] * 4, tok.eos_token_id)
    assert parts["answer_after_marker"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert parts["contains"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert parts["exact_match"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert parts["format"].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_format_in_any_tokenization(bpe_tok):
    reward = build_reward_fn(
        RewardConfig(components={"format": 1.0}, format_sequences=["answer", "####"]),
        bpe_tok,
        [bpe_tok.eos_token_id],
        32,
    )
    good = list(tokenizations(bpe_tok, "the answer is #### 7").values())
    bad = list(tokenizations(bpe_tok, "#### 7 is the answer").values())
    got = score(reward, bpe_tok, good + bad, ["7"] * (len(good) + len(bad)), bpe_tok.eos_token_id)["format"]
    assert got.tolist() == [1.0] * len(good) + [0.0] * len(bad)


def test_out_of_vocabulary_and_negative_ids_read_as_nothing(bpe_tok):
    reward = build_reward_fn(RewardConfig(components=ALL), bpe_tok, [bpe_tok.eos_token_id], 16)
    row = bpe_tok.encode("#### 7", add_special_tokens=False)
    batch = torch.tensor([row + [len(bpe_tok) + 5, -100, bpe_tok.eos_token_id]])
    _, parts = reward(batch, patterns_from_texts(bpe_tok, ["7"]))
    assert parts["answer_after_marker"].tolist() == [1.0]


def test_text_reward_makes_no_host_round_trip(bpe_tok):
    cfg = RewardConfig(components={**ALL, "length_penalty": 0.1}, format_sequences=["####"])
    reward = build_reward_fn(cfg, bpe_tok, [bpe_tok.eos_token_id, 0], 64)
    batch = torch.randint(0, len(bpe_tok), (16, 64))
    patterns = patterns_from_texts(bpe_tok, ["72"] * 16)
    reward(batch, patterns)  # caches the tables on the device
    fresh = patterns_from_texts(bpe_tok, ["1,000", "Paris", "-7", "7.5"] * 4)  # answers' text not cached yet
    with ForbidHostSync():
        reward(batch, patterns)
        reward(batch, fresh)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_text_reward_on_cuda_equals_cpu_without_a_sync(bpe_tok):
    """On a GPU (scripts/gpu_checks.sh) every text component scores the case tables as on the CPU, prepared and
    unprepared answers (their text made on the device), under set_sync_debug_mode('error')."""
    eos = bpe_tok.eos_token_id
    cfg = RewardConfig(components={**ALL, "length_penalty": 0.1}, format_sequences=["####"])
    reward = build_reward_fn(cfg, bpe_tok, [eos, 0], 64)
    rows, answers = [], []
    for text, answer, _ in MARKER_CASES + EXACT_CASES + CONTAINS_CASES:
        for seq in tokenizations(bpe_tok, text).values():
            rows.append(seq)
            answers.append(answer)
    L = max(len(r) for r in rows) + 1
    batch = torch.tensor([r + [eos] * (L - len(r)) for r in rows])
    packed = patterns_from_texts(bpe_tok, answers)
    want = {k: v.tolist() for k, v in reward(batch, reward.prepare(packed))[1].items()}
    on_gpu = batch.cuda()
    reward(on_gpu, packed.to("cuda"))  # caches the tables on the device
    patterns = [reward.prepare(packed).to("cuda"), packed.to("cuda")]  # copied before the check: copies sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [reward(on_gpu, p)[1] for p in patterns]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for parts in got:
        assert {k: v.cpu().tolist() for k, v in parts.items()} == want


def test_prepared_patterns_carry_the_answers_width_on_the_host(bpe_tok):
    """prepare reads, on the host, the byte width of the longest alternative, whether any is a number / a text
    and the most distinct texts of a row; to() and repeat_interleave keep it; another reward's hints are not
    used; scoring stays sync-free."""
    from rlhf_core.reward.text import ANSWER_MAX_BYTES

    cfg = RewardConfig(components=ALL, format_sequences=["####"])
    reward = build_reward_fn(cfg, bpe_tok, [bpe_tok.eos_token_id], 64)
    other = build_reward_fn(cfg, bpe_tok, [bpe_tok.eos_token_id], 64)
    numbers = reward.prepare(patterns_from_texts(bpe_tok, ["72", "1,000"]))
    hints = numbers.text_hints[reward.text.token]
    assert (hints.width, hints.any_num, hints.any_text) == (len(" 1,000"), True, False)
    assert hints.alternatives == 2  # '1,000' and '1000' ('72' / ' 72' and ' 1,000' are texts already counted)
    mixed = reward.prepare(patterns_from_texts(bpe_tok, ["Paris", "x" * (ANSWER_MAX_BYTES + 5)]))
    hints = mixed.text_hints[reward.text.token]
    assert (hints.width, hints.any_num, hints.any_text, hints.alternatives) == (ANSWER_MAX_BYTES, False, True, 1)
    moved = numbers.to("cpu").repeat_interleave(3)
    token = reward.text.token
    assert moved.text_hints[token] == numbers.text_hints[token] and moved.tokens.shape[0] == 6
    texts = ["so #### 72", "72", "#### 71", "#### 1000.", "1,000", "the 100 apples"]  # answers 72 x 3, 1,000 x 3
    encoded = [bpe_tok.encode(t, add_special_tokens=False) for t in texts]
    batch = torch.tensor([r + [bpe_tok.eos_token_id] * (12 - len(r)) for r in encoded])
    with ForbidHostSync():
        _, parts = reward(batch, moved)
        _, unprepared = other(batch, moved)  # hints of another reward: the static bounds
    assert other.text.answers(batch, moved).width > reward.text.answers(batch, moved).width == len(" 1,000")
    assert reward.text.answers(batch, moved).lit_len.shape == (6, 2) != other.text.answers(batch, moved).lit_len.shape
    assert {k: v.tolist() for k, v in parts.items()} == {k: v.tolist() for k, v in unprepared.items()}
    assert parts["answer_after_marker"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert parts["exact_match"].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert parts["contains"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_prepare_makes_the_answers_text_once_per_prompt_and_it_follows_the_rows(bpe_tok):
    """prepare makes the answers' text on the host for the prompt rows; to() and repeat_interleave move and repeat
    it with the patterns, and the reward reads it instead of making it again: equal, field by field, to what the
    reward makes from the repeated patterns' hints. Patterns of another shape carrying it (a slice) do not use it."""
    from dataclasses import fields

    from rlhf_core.reward.text import PreparedText

    cfg = RewardConfig(components=ALL, format_sequences=["####"])
    reward = build_reward_fn(cfg, bpe_tok, [bpe_tok.eos_token_id], 64)
    token = reward.text.token
    prepared = reward.prepare(patterns_from_texts(bpe_tok, ["72", "1,000", "Paris"]))
    text = prepared.text_hints[token + ":text"]
    assert isinstance(text, PreparedText) and text.text.lit.shape[0] == 3
    moved = prepared.to("cpu").repeat_interleave(4)
    batch = torch.tensor([bpe_tok.encode("#### 72", add_special_tokens=False) + [bpe_tok.eos_token_id]] * 12)
    used = reward.text.answers(batch, moved)
    assert used is moved.text_hints[token + ":text"].text  # read, not made again
    made = reward.text.answers(batch, type(moved)(moved.tokens, moved.lengths, {token: moved.text_hints[token]}))
    for f in fields(made):
        a, b = getattr(used, f.name), getattr(made, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
    assert used.lit.shape[0] == 12 and torch.equal(used.lit_len[:4], used.lit_len[:1].expand(4, -1))
    sliced = type(moved)(moved.tokens[:5], moved.lengths[:5], moved.text_hints)
    assert reward.text.answers(batch[:5], sliced).lit.shape[0] == 5
    assert reward(batch, moved)[1]["answer_after_marker"].tolist() == [1.0] * 4 + [0.0] * 8


def test_prepared_text_is_used_only_with_the_tensors_it_belongs_to(bpe_tok):
    """Rows rebuilt with the same shape, tensors changed in place after prepare, and a pickled copy never score
    against the prepared text of other rows: the text is made again from the tensors at hand."""
    import pickle

    reward = build_reward_fn(RewardConfig(components=ALL), bpe_tok, [bpe_tok.eos_token_id], 64)
    rows = [bpe_tok.encode(t, add_special_tokens=False) for t in ("#### 5", "#### 72")]
    batch = torch.tensor([r + [bpe_tok.eos_token_id] * (6 - len(r)) for r in rows])
    prepared = reward.prepare(patterns_from_texts(bpe_tok, ["72", "5"]))  # both rows wrong
    assert reward(batch, prepared)[1]["answer_after_marker"].tolist() == [0.0, 0.0]
    swapped = type(prepared)(prepared.tokens.flip(0), prepared.lengths.flip(0), prepared.text_hints)
    assert reward(batch, swapped)[1]["answer_after_marker"].tolist() == [1.0, 1.0]
    copied = pickle.loads(pickle.dumps(swapped))
    assert reward(batch, copied)[1]["answer_after_marker"].tolist() == [1.0, 1.0]
    prepared.tokens.copy_(prepared.tokens.flip(0))  # in place: the prepared text is stale
    prepared.lengths.copy_(prepared.lengths.flip(0))
    assert reward(batch, prepared)[1]["answer_after_marker"].tolist() == [1.0, 1.0]


def test_prepared_and_unprepared_patterns_agree_on_random_rows(bpe_tok):
    """Random texts with numbers, markers and text answers in several spellings: every component scores the same
    with prepared patterns (narrow windows, distinct texts only, skipped number / text paths) as without."""
    g = torch.Generator().manual_seed(3)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    answers_pool = ["72", "1,234", "1234", "-5", "0.50", "Paris", "7", "1000000", "x y"]
    words = ["so", "the", "####", "$", "is", "Paris", ".", ",", "-", "72", "1,234", "5", "0.5", "7.0", "##", "\n"]
    texts, answers = [], []
    for _ in range(96):
        answer = pick(answers_pool)
        parts = [pick(words) for _ in range(int(torch.randint(0, 12, (1,), generator=g)))]
        if torch.rand(1, generator=g) < 0.6:
            parts += ["####", pick([answer, "$" + answer, answer + ".", pick(answers_pool)])]
        texts.append(" ".join(parts) if torch.rand(1, generator=g) < 0.8 else answer)
        answers.append(answer)
    encoded = [bpe_tok.encode(t, add_special_tokens=False) for t in texts]
    L = max(len(r) for r in encoded) + 1
    batch = torch.tensor([r + [bpe_tok.eos_token_id] * (L - len(r)) for r in encoded])
    reward = build_reward_fn(
        RewardConfig(components=ALL, format_sequences=["####"]), bpe_tok, [bpe_tok.eos_token_id], 64
    )
    packed = patterns_from_texts(bpe_tok, answers)
    prepared = reward(batch, reward.prepare(packed))[1]
    unprepared = reward(batch, packed)[1]
    for name in ALL:
        assert prepared[name].tolist() == unprepared[name].tolist(), name
        assert 0 < prepared[name].sum() < len(texts), name  # the rows are neither all hits nor all misses


def test_token_mode_keeps_the_old_semantics(bpe_tok):
    cfg = RewardConfig(components={"answer_after_marker": 1.0}, match="tokens")
    reward = build_reward_fn(cfg, bpe_tok, [bpe_tok.eos_token_id], 16)
    assert reward.text is None


def test_special_token_answers_are_seen_in_token_mode_only(bpe_tok):
    """Why `reward.match: tokens` stays (docs/rewards.md): a special token has no bytes, so an answer that is one
    (a label or action token) is never found as text, and is found by its id."""
    eos = bpe_tok.eos_token_id
    special = "<|im_start|>"
    ids = torch.tensor([bpe_tok.encode(f"so {special}", add_special_tokens=False) + [eos]])
    patterns = patterns_from_texts(bpe_tok, [special])
    for match, want in (("tokens", 1.0), ("text", 0.0)):
        reward = build_reward_fn(RewardConfig(components={"contains": 1.0}, match=match), bpe_tok, [eos], 8)
        assert reward(ids, patterns)[1]["contains"].tolist() == [want], match


def test_long_numbers_compare_exactly(bpe_tok):
    """Numbers are compared as int64 chunks of 18 digits: exact beyond 2**63, '-0' is '0'."""
    big = "123456789012345678901234567890"
    cases = [
        (f"#### {big}", big, 1.0),
        (f"#### {big}.000", big, 1.0),
        (f"#### 9{big[1:]}", big, 0.0),
        (f"#### {big}1", big, 0.0),
        (f"#### 0.{big}", f"0.{big}0", 1.0),
        (f"#### 0.{big}", f"0.{big}1", 0.0),
        ("#### -0.0", "0", 1.0),
        ("#### -1000000000000000000", "1000000000000000000", 0.0),
    ]
    _check_table(bpe_tok, "answer_after_marker", cases)


def test_format_order_and_repeated_occurrences(bpe_tok):
    reward = build_reward_fn(
        RewardConfig(components={"format": 1.0}, format_sequences=["##", "####"]), bpe_tok, [bpe_tok.eos_token_id], 32
    )
    texts = ["######", "## x ####", "#### x ##", "####", "## ##"]
    rows = [bpe_tok.encode(t, add_special_tokens=False) for t in texts]
    got = score(reward, bpe_tok, rows, ["7"] * len(rows), bpe_tok.eos_token_id)["format"].tolist()
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_answer_text_cache_follows_the_pattern_tensors(bpe_tok):
    reward = build_reward_fn(RewardConfig(components={"answer_after_marker": 1.0}), bpe_tok, [bpe_tok.eos_token_id], 16)
    batch = torch.tensor([bpe_tok.encode("#### 7", add_special_tokens=False) + [bpe_tok.eos_token_id]])
    patterns = patterns_from_texts(bpe_tok, ["7"])
    assert reward(batch, patterns)[0].tolist() == [1.0]
    eight = patterns_from_texts(bpe_tok, ["8"])
    patterns.tokens.copy_(eight.tokens)  # same tensors, new contents: the cached answer text is not reused
    patterns.lengths.copy_(eight.lengths)
    assert reward(batch, patterns)[0].tolist() == [0.0]


def test_contains_finds_an_early_answer_among_later_numbers(bpe_tok):
    """contains reads windows around the last candidates: an answer followed by other numbers is still found
    while fewer than CONTAINS_WINDOWS candidates follow it; text without the answer never matches."""
    from rlhf_core.reward.text import CONTAINS_WINDOWS

    tail = " and ".join(str(n) for n in range(80, 80 + CONTAINS_WINDOWS - 2))  # other numbers, other first digits
    texts = [f"so 72 then {tail}", f"so 720 then {tail}", "no numbers here at all"]
    _check_table(bpe_tok, "contains", [(texts[0], "72", 1.0), (texts[1], "72", 0.0), (texts[2], "72", 0.0)])


def test_format_windows_agree_with_reading_every_token(bpe_tok):
    """The windowed format search (rare-ending texts) equals the full automaton pass on rows with a few stray
    '#' tokens, and both equal a search of the decoded text."""
    from rlhf_core.reward.text import TextMatcher, format_tokens, format_windows, token_bytes

    tm = TextMatcher.build(bpe_tok, "####", ["##", "####"])
    assert tm.format_windowed
    g = torch.Generator().manual_seed(0)
    vocab = bpe_tok.get_vocab()
    hashes = torch.tensor([i for t, i in vocab.items() if "#" in t])
    normal = torch.tensor([i for t, i in vocab.items() if "#" not in t and i not in bpe_tok.all_special_ids])
    ids = normal[torch.randint(len(normal), (32, 96), generator=g)]
    stray = torch.rand(ids.shape, generator=g) < 0.01
    ids = torch.where(stray, hashes[torch.randint(len(hashes), ids.shape, generator=g)], ids)
    rows = tm.rows(ids, [bpe_tok.eos_token_id])
    vb, automata = tm.on(ids.device)
    windowed = format_windows(vb, rows.index, rows.codes, rows.n_valid, automata)
    full = format_tokens(vb, rows.index, rows.n_valid, automata)
    table = token_bytes(bpe_tok)
    want = []
    for row in ids.tolist():
        text = b"".join(table[i] for i in row)
        first = text.find(b"##")
        want.append(float(first >= 0 and text.find(b"####", first + 2) >= 0))
    assert full.tolist() == want
    assert windowed.tolist() == want


def test_contains_windows_equal_the_whole_row_search(bpe_tok):
    """On rows with few numbers, contains in windows equals the search over whole rows converted to bytes."""
    from rlhf_core.reward.components import _packed_on
    from rlhf_core.reward.text import TextMatcher, contains_text

    g = torch.Generator().manual_seed(1)
    words = ["so", "the", "answer", "is", "apples", "then", "$", "it", "costs", "-", ".", ",", "x"]
    numbers = ["72", "720", "7.2", "172", "72.0", "1,000", "1000", "7", "-72", "72.5"]
    texts, answers = [], []
    for _ in range(48):
        parts = [words[int(i)] for i in torch.randint(len(words), (12,), generator=g)]
        for _ in range(3):  # three numbers at random places
            parts.insert(
                int(torch.randint(len(parts) + 1, (1,), generator=g)),
                numbers[int(torch.randint(10, (1,), generator=g))],
            )
        texts.append(" ".join(parts))
        answers.append(["72", "1000", "7"][len(texts) % 3])
    rows_ids = [bpe_tok.encode(t, add_special_tokens=False) for t in texts]
    L = max(len(r) for r in rows_ids) + 1
    ids = torch.tensor([r + [bpe_tok.eos_token_id] * (L - len(r)) for r in rows_ids])
    tm = TextMatcher.build(bpe_tok, "####")
    rows = tm.rows(ids, [bpe_tok.eos_token_id])
    ans = tm.answers(ids, _packed_on(patterns_from_texts(bpe_tok, answers), ids.device))
    whole = contains_text(*tm.text(rows), ans).float()
    assert tm.contains(rows, ans).tolist() == whole.tolist()
    assert 0 < whole.sum() < len(texts)


def test_empty_batch_and_rows_shorter_than_a_block(bpe_tok):
    """N = 0 gives empty scores; rows of 1..17 tokens (not a multiple of the 16-token block) score as text."""
    from rlhf_core.reward.text import MARKER_BLOCK_TOKENS

    cfg = RewardConfig(components=ALL, format_sequences=["####"])
    reward = build_reward_fn(cfg, bpe_tok, [bpe_tok.eos_token_id], 16)
    _, parts = reward(torch.zeros(0, 8, dtype=torch.long), patterns_from_texts(bpe_tok, []))
    assert all(v.shape == (0,) for v in parts.values())
    row = bpe_tok.encode("#### 72", add_special_tokens=False)
    for L in (len(row), MARKER_BLOCK_TOKENS + 1):
        batch = torch.tensor([row + [bpe_tok.eos_token_id] * (L - len(row))])
        _, parts = reward(batch, patterns_from_texts(bpe_tok, ["72"]))
        assert {k: v.tolist() for k, v in parts.items()} == {
            "answer_after_marker": [1.0],
            "exact_match": [0.0],
            "contains": [1.0],
            "format": [1.0],
        }


def test_pick_blocks_takes_the_first_or_last_true_columns_in_order():
    from rlhf_core.reward.text import pick_blocks

    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        n, nb = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        has = torch.rand(n, nb, generator=g) < float(torch.rand(1, generator=g))
        for k in (1, 4, 6, 50):
            for last in (True, False):
                want = []
                for row in has.tolist():
                    cols = [j for j, h in enumerate(row) if h]
                    kk = min(k, nb)
                    picked = cols[-kk:] if last else cols[:kk]
                    pad = [-1] * (kk - len(picked))
                    want.append(pad + picked if last else picked + pad)
                assert pick_blocks(has, k, last).tolist() == want


def test_text_a_window_cuts_never_matches(bpe_tok):
    """A number or word that goes on past the window (more bytes than it holds, or byte-less tokens that took
    the place of the text's tokens) is not taken as ended: '0.30000000000000004' is not 0.3, '720' after many
    spaces is not 72, '72' + byte-less tokens + '0' (the text '720') is not 72. Prepared or not. (Many byte-less
    tokens after an answer, before the stop, hide it: the window cannot tell them from text; docs/rewards.md.)"""
    eos = bpe_tok.eos_token_id
    reward = build_reward_fn(RewardConfig(components=ALL, format_sequences=["####"]), bpe_tok, [eos], 64)
    enc = lambda t: bpe_tok.encode(t, add_special_tokens=False)  # noqa: E731
    filler = [-100] * 20
    cases = [  # (tokens, answer, component, expected)
        (enc("#### 0.30000000000000004"), "0.3", "answer_after_marker", 0.0),
        (enc("#### 7.00000000000000001"), "7", "answer_after_marker", 0.0),
        (enc("####" + " " * 16 + "720"), "72", "answer_after_marker", 0.0),
        (enc("####" + " " * 17 + "Parisian"), "Paris", "answer_after_marker", 0.0),
        (enc("#### 72") + filler + enc("0"), "72", "answer_after_marker", 0.0),
        (enc("it is 72") + filler + enc("0 apples"), "72", "contains", 0.0),
        (enc("#### 72") + [-100] * 3, "72", "answer_after_marker", 1.0),  # a few byte-less tokens, then the stop
        (enc("it is 72") + [-100] * 3, "72", "contains", 1.0),
        (enc("#### 0.3 and more words after it"), "0.3", "answer_after_marker", 1.0),
    ]
    for tokens, answer, component, want in cases:
        batch = torch.tensor([tokens + [eos]])
        packed = patterns_from_texts(bpe_tok, [answer])
        for patterns in (packed, reward.prepare(packed)):
            got = reward(batch, patterns)[1][component].tolist()
            assert got == [want], (bpe_tok.decode([t for t in tokens if t >= 0]), answer, component, got)


def test_one_row_with_a_long_text_answer(bpe_tok):
    """A single row whose answer is longer than 24 bytes (int64 words of a [1, 1, w] slice), prepared or not."""
    eos = bpe_tok.eos_token_id
    reward = build_reward_fn(RewardConfig(components=ALL, format_sequences=["####"]), bpe_tok, [eos], 64)
    answer = "The Eiffel Tower in Paris"
    batch = torch.tensor([bpe_tok.encode("#### " + answer, add_special_tokens=False) + [eos]])
    packed = patterns_from_texts(bpe_tok, [answer])
    for patterns in (packed, reward.prepare(packed)):
        parts = reward(batch, patterns)[1]
        assert parts["answer_after_marker"].tolist() == [1.0] and parts["exact_match"].tolist() == [0.0]


def test_scan_never_writes_the_callers_ids(bpe_tok):
    """Without the CPU buffers (the device path), int32 ids are converted into a new tensor, not in place."""
    from rlhf_core.reward.text import TextMatcher, scan

    tm = TextMatcher.build(bpe_tok, "####")
    ids = torch.tensor(
        [bpe_tok.encode("#### 72", add_special_tokens=False) + [bpe_tok.eos_token_id]], dtype=torch.int32
    )
    before = ids.clone()
    codes, n_valid, index = scan(tm.codes_table(ids.device, (bpe_tok.eos_token_id,)), ids)
    assert torch.equal(ids, before) and torch.equal(index, before + 1)
    assert n_valid.tolist() == [ids.shape[1] - 1]
