"""The text components' fused CPU kernel (rlhf_core/reward/kernel.py, text_kernel.c) computes exactly what the
tensor code computes: the same scores on fuzzed batches (texts in several tokenizations, special tokens, ids
outside the vocabulary, stops anywhere, rows longer than the windows, int32 / int64 ids, prepared and
unprepared patterns), and a run without a compiler falls back to the tensor code."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from test_reward_text import _byte_tokens, bpe_tok, word_tok  # noqa: F401 (fixtures)

from rlhf_core.config import RewardConfig
from rlhf_core.reward import build_reward_fn, kernel, patterns_from_texts

COMPONENTS = ("answer_after_marker", "exact_match", "contains", "format")
ANSWERS = ["72", "1,000", "1000", "-5", "0.50", "7", "Paris", "x y", "007", "3.14159", "1234567890123456789012"]
WORDS = ["so", "the", "is", "Paris", "Parisian", "apples", "$", ".", ",", "-", "=", "\n", "x", "y", "72", "720",
         "7.2", "0.72", "7,200", "1,000", "1000.", "72.000000", "-72", "7 2", "#", "##", "###", "####", "# #",
         "$72", "72abc", "1234567890123456789012", "0.5", "007", "3.14159", ".0", "<tag>", "</answer>"]  # fmt: skip


@pytest.fixture(scope="module")
def lib():
    lib = kernel.load()
    if lib is None:
        pytest.skip("no C compiler here: the kernel is not built (the tensor code runs instead)")
    return lib


def _pair(tokenizer, stops, fmt):
    """(kernel reward, tensor-code reward): one matcher (same tables, same hints token), kernel on / off."""
    cfg = RewardConfig(components={c: 1.0 for c in COMPONENTS}, format_sequences=fmt)
    reward = build_reward_fn(cfg, tokenizer, stops, 64)
    assert reward.text.kernel
    return reward, dataclasses.replace(reward, text=dataclasses.replace(reward.text, kernel=False))


def _tokenize(tokenizer, text: str, how: str) -> list[int]:
    """The text in one of three tokenizations (the encoder's, byte by byte, each space-separated piece encoded
    alone), cheaper than test_reward_text.tokenizations' greedy ones on long rows."""
    if how == "canonical":
        return list(tokenizer.encode(text, add_special_tokens=False))
    if how == "bytes":
        vocab = tokenizer.get_vocab()
        return [vocab[c] for c in _byte_tokens(text)]
    words = text.split(" ")
    return [t for i, w in enumerate(words) for t in tokenizer.encode((" " if i else "") + w, add_special_tokens=False)]


def _fuzz_batch(tokenizer, g, N: int, L: int, stops: list[int]):
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
            ids.insert(
                at,
                pick(specials + [V + 3, -1, -7, 10**6] + ([pick(stops)] if torch.rand(1, generator=g) < 0.3 else [])),
            )
        ids = ids[:L] + [pick(stops)] * (L - len(ids[:L]))
        if torch.rand(1, generator=g) < 0.2:  # no stop at all in some rows
            ids = [i if i not in stops else pick(specials) for i in ids]
        rows.append(ids)
        answers.append(answer)
    return torch.tensor(rows), answers


def _both(pair, ids, patterns):
    kern, ref = pair
    got = {k: v.clone() for k, v in kern(ids, patterns)[1].items()}  # kernel rows: this thread's buffers
    want = ref(ids, patterns)[1]
    return got, want


@pytest.mark.parametrize("fmt", [["####"], ["##", "</answer>"], ["a", "e", "####"]], ids=["one", "two", "every_token"])
def test_kernel_equals_the_tensor_code_on_fuzzed_batches(lib, bpe_tok, word_tok, fmt):  # noqa: F811
    """Every component, both format paths (windows: rare last bytes; every token: common ones), several row
    lengths (shorter than a block, not a multiple of it, longer than every window), both tokenizers."""
    g = torch.Generator().manual_seed(len(fmt))
    for tokenizer in (bpe_tok, word_tok):
        stops = [tokenizer.eos_token_id] + (
            [tokenizer.convert_tokens_to_ids("<|endoftext|>")] if tokenizer is bpe_tok else []
        )
        pair = _pair(tokenizer, stops, fmt)
        assert pair[0].text.format_windowed == (fmt != ["a", "e", "####"])
        hits = dict.fromkeys(COMPONENTS, 0.0)
        for L in (1, 5, 17, 45, 160):
            ids, answers = _fuzz_batch(tokenizer, g, 48, L, stops)
            packed = patterns_from_texts(tokenizer, answers)
            # unprepared patterns with int64 ids, prepared ones (hints, the answers' text) with int32 ids
            for patterns, dtype in ((packed, torch.int64), (pair[0].prepare(packed), torch.int32)):
                got, want = _both(pair, ids.to(dtype), patterns)
                for name in COMPONENTS:
                    assert got[name].tolist() == want[name].tolist(), (name, L, dtype, tokenizer.name_or_path)
                    hits[name] += float(want[name].sum())
        assert all(v > 0 for v in hits.values()), hits  # the batches are not all misses


def test_kernel_equals_the_tensor_code_where_the_windows_bite(lib, bpe_tok):  # noqa: F811
    """Rows built to hit every window limit: markers followed by many '#' blocks, answers followed by many
    candidates, format texts after stray '#' blocks, answers cut at a window's end: the kernel misses and finds
    exactly what the tensor code misses and finds."""
    g = torch.Generator().manual_seed(7)
    pair = _pair(bpe_tok, [bpe_tok.eos_token_id], ["####"])
    texts, answers = [], []
    for i in range(96):
        answer = ["72", "7", "1000", "Paris"][i % 4]
        n_hash = int(torch.randint(0, 9, (1,), generator=g))
        n_num = int(torch.randint(0, 9, (1,), generator=g))
        filler = " ".join(["# heading words here"] * n_hash + [f"7{j} and P{j}" for j in range(n_num)])
        head = "so " * int(torch.randint(0, 30, (1,), generator=g))
        if i % 3 == 0:
            texts.append(f"{head}#### {answer} {filler}")
        elif i % 3 == 1:
            texts.append(f"{filler} {head} it is {answer} " + "7 " * int(torch.randint(0, 9, (1,), generator=g)))
        else:
            texts.append(
                f"#### {' ' * int(torch.randint(0, 24, (1,), generator=g))}{answer}{'0' * (i % 5)}.0000 {filler}"
            )
        answers.append(answer)
    encoded = [bpe_tok.encode(t, add_special_tokens=False) for t in texts]
    L = max(len(r) for r in encoded) + 1
    ids = torch.tensor([r + [bpe_tok.eos_token_id] * (L - len(r)) for r in encoded])
    packed = patterns_from_texts(bpe_tok, answers)
    for patterns in (packed, pair[0].prepare(packed)):
        got, want = _both(pair, ids, patterns)
        for name in COMPONENTS:
            assert got[name].tolist() == want[name].tolist(), name
        # the windows bite: of the rows '#### <answer>' then filler, the ones with many '#' blocks after it miss
        marked = want["answer_after_marker"][::3]
        assert 0 < marked.sum() < len(marked)
        assert 0 < want["contains"].sum() < len(texts)


def test_kernel_rows_equal_the_tensor_scan(lib, bpe_tok):  # noqa: F811
    """The kernel's one pass gives the tensor scan's index, codes and first stops, and never writes the ids."""
    reward, ref = _pair(bpe_tok, [bpe_tok.eos_token_id], ["####"])
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(-3, len(bpe_tok) + 5, (9, 37), generator=g)
    ids[::2, 11] = bpe_tok.eos_token_id
    before = ids.clone()
    got = reward.text.rows(ids, [bpe_tok.eos_token_id])
    want = ref.text.rows(ids, [bpe_tok.eos_token_id])
    assert torch.equal(ids, before)
    assert torch.equal(got.index, want.index)
    assert torch.equal(got.n_valid, want.n_valid)
    assert torch.equal(got.codes[:, :37], want.codes[:, :37]) and not got.codes[:, 37:].any()


def test_without_a_compiler_the_tensor_code_runs(bpe_tok, monkeypatch, tmp_path, caplog):  # noqa: F811
    """No compiler: load() logs why once and returns None, and the components score with the tensor code."""
    monkeypatch.setattr(kernel, "_state", {})
    monkeypatch.setenv("CC", "no-such-compiler-atrlhf")
    monkeypatch.setenv("ATRLHF_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=kernel.__name__):
        assert kernel.load() is None
        assert kernel.load() is None
    assert [r.getMessage() for r in caplog.records if "kernel is unavailable" in r.getMessage()] == [
        "text reward: the CPU kernel is unavailable, using the tensor code (slower on CPU): "
        "no C compiler found ($CC, cc, gcc or clang)"
    ]
    reward = build_reward_fn(RewardConfig(components={"answer_after_marker": 1.0}), bpe_tok, [bpe_tok.eos_token_id], 8)
    ids = torch.tensor([bpe_tok.encode("#### 72", add_special_tokens=False) + [bpe_tok.eos_token_id]])
    assert reward(ids, patterns_from_texts(bpe_tok, ["72"]))[0].tolist() == [1.0]
    monkeypatch.setenv("ATRLHF_TEXT_KERNEL", "0")
    monkeypatch.setattr(kernel, "_state", {})
    monkeypatch.delenv("CC")
    assert kernel.load() is None and "lib" not in kernel._state  # off: not even built


def test_a_failed_build_names_the_command_and_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ATRLHF_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"false .*failed \(1\)"):
        kernel.build(cc="false")
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_the_build_is_cached_by_source_and_compiler(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("ATRLHF_KERNEL_CACHE", str(tmp_path))
    first = kernel.build()
    mtime = first.stat().st_mtime_ns
    assert kernel.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert first.parent == tmp_path and first.name.startswith("text_kernel-")


@pytest.mark.parametrize("kernel_on", [True, False], ids=["kernel", "tensor_code"])
def test_cpu_buffers_are_kept_for_the_last_few_batch_shapes_only(bpe_tok, kernel_on):  # noqa: F811
    """Batches of ever new lengths do not pile up scan buffers: the last BUFFER_SHAPES shapes' are kept, and a
    shape asked for again reuses its buffers."""
    from rlhf_core.reward.text import BUFFER_SHAPES, TextMatcher

    tm = dataclasses.replace(TextMatcher.build(bpe_tok, "####"), kernel=kernel_on)
    eos = bpe_tok.eos_token_id
    first = tm.rows(torch.full((3, 16), eos), [eos]).index
    for L in range(17, 17 + BUFFER_SHAPES - 1):
        tm.rows(torch.full((3, L), eos), [eos])
    assert tm.rows(torch.full((3, 16), eos), [eos]).index.data_ptr() == first.data_ptr()  # kept: reused
    for L in range(40, 40 + 2 * BUFFER_SHAPES):
        tm.rows(torch.full((3, L), eos), [eos])
    kept = [v for k, v in tm._on_device.items() if isinstance(k, tuple) and k[0] == "buffers"]
    assert kept and all(len(shapes) == BUFFER_SHAPES for shapes in kept)
