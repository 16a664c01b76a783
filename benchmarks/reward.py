"""Reward scoring throughput: tensor-native token matching vs. a per-row Python loop vs. decode + regex.

For each batch shape (B rows x L response tokens) it times, single-threaded on the CPU:
  tensor  rlhf_core.reward.tensor_native.tensor_native_reward on pre-packed patterns (PackedPatterns) — our hot path;
  loop    a plain Python loop over rows: per row, slice to the first EOS, unfold, compare;
  regex   what verl / TRL reward functions do: move ids to the host, tokenizer.batch_decode the rows up
          to EOS with a real Hugging Face fast tokenizer, then a regex search for the answer text per row.
Data: uniform random tokens over a ~500-word vocabulary, answer patterns of 3-5 tokens planted at a
random position in half the rows, EOS at a random position (some rows have none), padding after EOS.
All three must agree on every row (checked, reported). `exact_match_ms` times exact_match_reward (the
synthetic task's default reward) on the same batch, for reference.

    python benchmarks/reward.py            # table
    python benchmarks/reward.py --json     # one JSON object on stdout, nothing else
    python benchmarks/reward.py --quick    # fewer shapes and repeats
    python benchmarks/reward.py --text     # also: GSM8K answers matched as TEXT (byte-level BPE), see below
    python benchmarks/reward.py --text --device cuda   # the same with the responses on a GPU
    python benchmarks/reward.py --functions  # Python reward functions (reward.functions) per 1,000 samples

--text times, at B=256 L=1024 (and B=64 L=256), each text-mode component (`answer_after_marker`,
`exact_match`, `contains`, `format` with format_sequences ['####']) as training builds it (`build_reward_fn`,
reward.match='text': on the device, tokens -> bytes only in windows) against decode + regex doing the same
job (ids to host, trim at the first stop token, `decode(skip_special_tokens=True)` with the chat test model's
byte-level BPE tokenizer, then: the number after the last '####' by regex, '$' ',' and a trailing '.' / '.0'
removed, compared with the answer; the whole text as one such number; an answer spelling ('72', '1,000')
as a whole number / word; '####' in the text). Data: random tokens of that vocabulary, then '#### <answer>'
written in a random form ('72', '$72', '72.', '7.0', '1,000') and a random tokenization (the encoder's, byte
by byte, marker split '##' '##'), a wrong number in a quarter of the rows, then <|im_end|> and padding.
The packed answers are prepared once (`ComposedReward.prepare`, on the host), as the rollout worker prepares
each prompt batch; the scores with and without that step must be equal (checked).
Agreement with decode + regex is reported per component. Timing: the repeats of ours and of decode + regex
are interleaved in one process, each timed by wall clock and by the thread's CPU time (time.thread_time:
what a loaded, shared machine does not inflate as much); the ratio of the medians of each is reported.
`text_fresh_patterns_ms`: answer_after_marker with new PackedPatterns for every call, prepared in the call (as
training packs them per rollout batch, so the answers' text is not reused from the previous call).
`text_training_path_ms`: the rollout worker's path, fresh patterns of B / 8 prompts prepared on the host (which
makes their answers' text once per prompt), repeated for 8 samples each, then scored. `--stages`
also prints the CPU time of each stage (the one pass over the tokens, the host's prepare, the answers' text,
each component's own work) and its aten operator calls per call (torch.profiler, nested calls included).
`--device cuda`: the responses and the prepared answers on that GPU, ours timed until torch.cuda.synchronize
returns; decode + regex copies the ids to the host first, as verl / TRL do (`--stages` is CPU only).

--functions times the cost per 1,000 samples of scoring the --text GSM8K batch (B=256, L=256) with Python
reward functions as a rollout worker does (`PythonFunctionRewards.score`: trim at the first stop, decode,
the calls in the process pool of reward.function_workers processes, tensors back), next to the configured
tensor-native `answer_after_marker` reward on the same batch: the GSM8K check as a TRL function (one call
per chunk of rows), as a verl function (one call per row), and a TRL function that does nothing (decode and
pool overhead only), with 1 and 2 pool processes. All GSM8K scorers must agree on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_core.reward.components import exact_match_reward  # noqa: E402
from rlhf_core.reward.tensor_native import pack_patterns, tensor_native_reward, valid_lengths  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when imported
from machine import cpu_model  # noqa: E402

from rlhf_core.reward.text import gpt2_byte_decoder  # noqa: E402

TARGETS = {"shape": {"B": 256, "L": 1024}, "speedup_vs_regex": 20.0, "speedup_vs_loop": 2.0}
TEXT_TARGET = 15.0  # --text: each component at least this many times decode + regex at B=256 L=1024, 1 thread
PAD, EOS, UNK = 0, 1, 2


def build_tokenizer():
    """A real fast tokenizer, built locally: WordLevel over 100 numbers and 400 words, whitespace split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[EOS]", "[UNK]"] + [str(i) for i in range(100)] + [f"w{i}" for i in range(400)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def make_batch(B: int, L: int, vocab: int, seed: int):
    """Random responses with planted answers. Returns (ids [B, L], list of B answer patterns)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, L), generator=g)
    patterns = []
    for b in range(B):  # data generation, not timed
        q = int(torch.randint(3, 6, (1,), generator=g))
        pattern = torch.randint(3, vocab, (q,), generator=g)
        if b % 2 == 0 and L >= q:
            start = int(torch.randint(0, L - q + 1, (1,), generator=g))
            ids[b, start : start + q] = pattern
        eos_at = int(torch.randint(L // 8, L + L // 8, (1,), generator=g))  # >= L: no EOS in this row
        if eos_at < L:
            ids[b, eos_at] = EOS
            ids[b, eos_at + 1 :] = PAD
        patterns.append(pattern)
    return ids, patterns


def loop_reward(generated_ids, answer_patterns, eos_token_id):
    """The baseline: tensor_native_reward's "contains" rule written as a Python loop over rows."""
    B, L = generated_ids.shape
    device_obj = generated_ids.device
    rewards = torch.zeros(B, device=device_obj)
    eos_mask = generated_ids == eos_token_id
    first_eos = torch.where(
        eos_mask.any(dim=1), eos_mask.int().argmax(dim=1), torch.full((B,), L, device=device_obj, dtype=torch.long)
    )
    for i in range(B):
        seq = generated_ids[i, : first_eos[i]]
        pattern = answer_patterns[i]
        pat_len = pattern.shape[0]
        if pat_len == 0 or pat_len > seq.shape[0]:
            continue
        windows = seq.unfold(0, pat_len, 1)
        match = (windows == pattern).all(dim=1).any()
        rewards[i] = 1.0 if match else 0.0
    return rewards


def decode_regex_reward(generated_ids, answer_regexes, tokenizer, eos_token_id):
    """verl / TRL style: ids to host, decode each row up to its first EOS, regex-search the answer text."""
    rows = generated_ids.tolist()
    trimmed = [row[: row.index(eos_token_id)] if eos_token_id in row else row for row in rows]
    texts = tokenizer.batch_decode(trimmed, skip_special_tokens=True)
    return torch.tensor([1.0 if rx.search(text) else 0.0 for text, rx in zip(texts, answer_regexes)])


def timings_ms(fn, repeats: int, budget_s: float) -> list[float]:
    fn()  # warm up
    times = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return [t * 1e3 for t in times]


def median_ms(fn, repeats: int, budget_s: float) -> float:
    return statistics.median(timings_ms(fn, repeats, budget_s))


GSM8K_NUMBER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]*)?)")


def _gsm8k_canonical(s: str) -> str:
    s = s.replace(",", "").rstrip(".")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def decode_gsm8k_reward(response_ids, answers, tokenizer, stop_ids):
    """Decode + regex: ids to host, trim at the first stop, decode, the number after the LAST '####'."""
    out = []
    for text, answer in zip(_decode_rows(response_ids, tokenizer, stop_ids), answers):
        found = GSM8K_NUMBER.findall(text)
        out.append(1.0 if found and _gsm8k_canonical(found[-1]) == _gsm8k_canonical(answer) else 0.0)
    return torch.tensor(out)


def _decode_rows(response_ids, tokenizer, stop_ids) -> list[str]:
    """Ids to host, each row trimmed at its first stop and decoded (special tokens skipped)."""
    out = []
    for row in response_ids.tolist():
        cut = min([row.index(s) for s in stop_ids if s in row], default=len(row))
        out.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return out


_NUMBER_TEXT = re.compile(r"\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]*)?)\s*")
_WORD = r"[A-Za-z0-9]|[^\x00-\x7f]"


def decode_exact_reward(response_ids, answers, tokenizer, stop_ids):
    """Decode + regex exact_match: the whole text is one number (spaces, '$', a trailing period) equal to the answer."""
    out = []
    for text, answer in zip(_decode_rows(response_ids, tokenizer, stop_ids), answers):
        m = _NUMBER_TEXT.fullmatch(text)
        out.append(1.0 if m and _gsm8k_canonical(m.group(1)) == _gsm8k_canonical(answer) else 0.0)
    return torch.tensor(out)


def contains_regexes(answers):
    """Per answer: a regex for its spellings ('1000', '1,000') as a whole number / word (docs/rewards.md)."""
    from rlhf_core.reward.answer_forms import text_variants

    out = []
    for answer in answers:
        alts = "|".join(re.escape(v) for v in dict.fromkeys(t.strip() for t in text_variants(answer)) if v)
        before = rf"(?<!{_WORD})(?<!-)(?<![0-9][.,])"
        after = rf"(?:\.0+(?!{_WORD})|(?!{_WORD})(?![.,][0-9]))"
        out.append(re.compile(before + "(?:" + alts + ")" + after))
    return out


def decode_contains_reward(response_ids, regexes, tokenizer, stop_ids):
    texts = _decode_rows(response_ids, tokenizer, stop_ids)
    return torch.tensor([1.0 if rx.search(t) else 0.0 for t, rx in zip(texts, regexes)])


def decode_format_reward(response_ids, tokenizer, stop_ids, sequence="####"):
    return torch.tensor([1.0 if sequence in t else 0.0 for t in _decode_rows(response_ids, tokenizer, stop_ids)])


def make_gsm8k_batch(tokenizer, B: int, L: int, seed: int):
    """Random-token responses ending in '#### <answer>' in random forms and tokenizations; see --text."""
    import random

    rng = random.Random(seed)
    vocab = tokenizer.get_vocab()
    byte_char = {b: c for c, b in gpt2_byte_decoder().items()}
    specials = set(tokenizer.all_special_ids)
    normal = [i for i in range(len(tokenizer)) if i not in specials]
    im_end, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id or 0
    rows, answers = [], []
    for b in range(B):
        n = rng.randrange(1, 5000)
        answer = str(n)
        written = rng.choice([answer, "$" + answer, answer + ".", answer + ".0", f"{n:,}"])
        if b % 4 == 3:
            written = str(n + 1)
        text = " #### " + written
        form = rng.randrange(3)
        if form == 0:
            tail = tokenizer.encode(text, add_special_tokens=False)
        elif form == 1:
            tail = [vocab[byte_char[c]] for c in text.encode()]
        else:
            tail = [vocab[byte_char[32]], vocab["##"], vocab["##"]] + tokenizer.encode(
                text[5:], add_special_tokens=False
            )
        body = rng.randrange(L // 8, L - len(tail) - 1)
        row = [rng.choice(normal) for _ in range(body)] + tail + [im_end]
        rows.append(row + [pad] * (L - len(row)))
        answers.append(answer)
    return torch.tensor(rows, dtype=torch.long), answers


def interleaved(fns: dict, repeats: int, budget_s: float, sync=None) -> dict:
    """Runs every fn once per round (after one warm-up round), `repeats` rounds (at least 3; fewer past the
    budget); returns {name: {"wall": [ms], "cpu": [ms]}} (wall clock and the thread's CPU time). sync: called
    after each fn, inside its timing (torch.cuda.synchronize on a GPU: the time until the work is done)."""
    if sync is not None:
        fns = {name: (lambda f: lambda: (f(), sync()))(fn) for name, fn in fns.items()}
    for fn in fns.values():
        fn()
    out = {name: {"wall": [], "cpu": []} for name in fns}
    start = time.perf_counter()
    for r in range(repeats):
        if r >= 3 and time.perf_counter() - start > budget_s:
            break
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            c1, w1 = time.thread_time(), time.perf_counter()
            out[name]["wall"].append((w1 - w0) * 1e3)
            out[name]["cpu"].append((c1 - c0) * 1e3)
    return out


def stage_times(reward, ids, patterns, repeats: int) -> dict:
    """CPU time (median ms) of each stage of the text components, called one by one on the same batch."""
    from rlhf_core.reward.components import _packed_on
    from rlhf_core.reward.text import answer_text

    tm = reward.text
    p = _packed_on(patterns, ids.device)
    vb, _ = tm.on(ids.device)
    rows = tm.rows(ids, reward.stop_token_ids)
    ans = tm.answers(ids, p)
    hints = (p.text_hints or {}).get(tm.token)
    stages = {
        "scan (one pass: codes, first stop)": lambda: tm.rows(ids, reward.stop_token_ids),
        "prepare (host, per prompt batch)": lambda: reward.prepare(type(p)(p.tokens, p.lengths)),
        "prepare (host, 32 prompts)": lambda: reward.prepare(type(p)(p.tokens[:32], p.lengths[:32])),
        "answers' text (fresh patterns)": lambda: answer_text(vb, p.tokens, p.lengths, hints=hints),
        "answer_after_marker (after scan)": lambda: tm.answer_after_marker(rows, ans),
        "exact_match (after scan)": lambda: tm.exact_match(rows, ans),
        "contains (after scan)": lambda: tm.contains(rows, ans),
        "format (after scan)": lambda: tm.format(rows),
    }
    times = interleaved(stages, repeats, 30.0)
    return {name: statistics.median(t["cpu"]) for name, t in times.items()}, aten_calls(stages)


def aten_calls(stages: dict, calls: int = 10) -> dict:
    """Aten operator calls per call of each stage (torch.profiler, nested calls such as views included)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, fn in stages.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fn()
        out[name] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / calls
    return out


COMPONENTS = ("answer_after_marker", "exact_match", "contains", "format")
SAMPLES_PER_PROMPT = 8  # G of the rollout worker's path (--text)


def run_text(quick: bool, stages: bool = False, device: str = "cpu") -> list[dict]:
    import tempfile

    from rlhf_core.config import RewardConfig
    from rlhf_core.model.chat import build_chat_policy
    from rlhf_core.model.policy import load_policy
    from rlhf_core.reward.answers import patterns_from_texts
    from rlhf_core.reward.components import build_reward_fn

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tokenizer = load_policy(build_chat_policy(d, style="instruct", layers=1, hidden=32, heads=2), "float32", "cpu")[
            1
        ]
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    rewards = {
        name: build_reward_fn(RewardConfig(components={name: 1.0}, format_sequences=["####"]), tokenizer, stops, 1024)
        for name in COMPONENTS
    }
    repeats, budget = (5, 5.0) if quick else (15, 60.0)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    results = []
    for B, L in [(64, 256), (256, 1024)]:
        ids, answers = make_gsm8k_batch(tokenizer, B, L, seed=B + L)
        ids = ids.to(dev)  # generated there; decode + regex copies them to the host, as verl / TRL do
        packed = patterns_from_texts(tokenizer, answers)  # once per prompt batch, as the data layer does
        # and prepared on the host once per prompt batch, as the rollout worker does (ComposedReward.prepare)
        prepared = {name: rewards[name].prepare(packed).to(dev) for name in COMPONENTS}
        regexes = contains_regexes(answers)
        baselines = {
            "answer_after_marker": lambda: decode_gsm8k_reward(ids, answers, tokenizer, stops),
            "exact_match": lambda: decode_exact_reward(ids, answers, tokenizer, stops),
            "contains": lambda: decode_contains_reward(ids, regexes, tokenizer, stops),
            "format": lambda: decode_format_reward(ids, tokenizer, stops),
        }
        # training packs fresh patterns for every rollout batch: the answers' text is not cached across calls
        fresh = [type(packed)(packed.tokens.clone(), packed.lengths.clone()) for _ in range(repeats + 2)]
        fresh_iter = iter(fresh * 2)
        # the rollout worker's path: fresh patterns of B / G prompts prepared on the host, repeated for G samples
        # each (timing only: the rows' answers are those of each group's first row)
        per_prompt = patterns_from_texts(tokenizer, answers[::SAMPLES_PER_PROMPT])
        prompt_iter = iter(
            [type(packed)(per_prompt.tokens.clone(), per_prompt.lengths.clone()) for _ in range(2 * repeats + 4)]
        )
        aam = rewards["answer_after_marker"]
        fns = {}
        for name in COMPONENTS:
            fns[name] = (lambda f, p: lambda: f(ids, p))(rewards[name], prepared[name])
            fns[name + "_decode_regex"] = baselines[name]
        fns["answer_after_marker_fresh_patterns"] = lambda: aam(ids, aam.prepare(next(fresh_iter)).to(dev))
        fns["answer_after_marker_training_path"] = lambda: aam(
            ids, aam.prepare(next(prompt_iter)).to(dev).repeat_interleave(SAMPLES_PER_PROMPT)
        )
        times = interleaved(fns, repeats, budget, sync)
        med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
        row = {"B": B, "L": L, "vocab_size": len(tokenizer), "repeats": len(times["format"]["cpu"]), "components": {}}
        for name in COMPONENTS:
            ours = rewards[name](ids, prepared[name])[0]
            unprepared = rewards[name](ids, packed.to(dev))[0]  # the static window bounds: the same scores
            assert torch.equal(ours, unprepared), f"{name}: prepared and unprepared patterns disagree"
            base = baselines[name]().to(dev)
            row["components"][name] = {
                "match_rate": float(ours.mean()),
                "agree_decode_regex": float((ours == base).float().mean()),
                "ms": med[name]["wall"],
                "cpu_ms": med[name]["cpu"],
                "decode_regex_ms": med[name + "_decode_regex"]["wall"],
                "decode_regex_cpu_ms": med[name + "_decode_regex"]["cpu"],
                "speedup": med[name + "_decode_regex"]["wall"] / med[name]["wall"],
                "speedup_cpu": med[name + "_decode_regex"]["cpu"] / med[name]["cpu"],
            }
        row["text_fresh_patterns_ms"] = med["answer_after_marker_fresh_patterns"]["wall"]
        row["text_fresh_patterns_cpu_ms"] = med["answer_after_marker_fresh_patterns"]["cpu"]
        row["text_training_path_ms"] = med["answer_after_marker_training_path"]["wall"]
        row["text_training_path_cpu_ms"] = med["answer_after_marker_training_path"]["cpu"]
        if stages and dev.type == "cpu":
            row["stages_cpu_ms"], row["stages_aten_calls"] = stage_times(
                aam, ids, prepared["answer_after_marker"], repeats
            )
        results.append(row)
    return results


def run_functions(quick: bool) -> dict:
    import tempfile

    from rlhf_core.config import RewardConfig
    from rlhf_core.data import Prompt
    from rlhf_core.model.chat import build_chat_policy
    from rlhf_core.model.policy import load_policy
    from rlhf_core.reward.answers import patterns_from_texts
    from rlhf_core.reward.components import build_reward_fn
    from rlhf_core.reward.functions.external import PythonFunctionRewards
    from rlhf_core.types import RolloutBatch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tokenizer = load_policy(build_chat_policy(d, style="instruct", layers=1, hidden=32, heads=2), "float32", "cpu")[
            1
        ]
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    B, L = 256, 256
    ids, answers = make_gsm8k_batch(tokenizer, B, L, seed=B + L)
    mask = torch.ones_like(ids, dtype=torch.bool)
    zeros = torch.zeros(B, dtype=torch.long)
    batch = RolloutBatch(ids[:, :1], mask[:, :1], ids, mask, torch.zeros(B, L), zeros + L, zeros, zeros)
    prompts = [Prompt(uid=i, prompt_ids=[], answers=[], answer_text=a) for i, a in enumerate(answers)]
    reward = build_reward_fn(RewardConfig(components={"answer_after_marker": 1.0}), tokenizer, stops, L)
    patterns = patterns_from_texts(tokenizer, answers)
    repeats, budget = (5, 1.0) if quick else (15, 4.0)
    tensor_ms = median_ms(lambda: reward(ids, patterns), repeats, budget)
    expected = reward(ids, patterns)[0]
    fns = str(Path(__file__).resolve().with_name("reward_fns.py"))
    rows = [{"scorer": "tensor-native answer_after_marker", "workers": 0, "ms_per_1k": tensor_ms * 1000 / B}]
    for name in ("gsm8k_trl", "gsm8k_verl", "nothing_trl"):
        for workers in (1, 2):
            cfg = RewardConfig(functions=[{"path": fns, "name": name}], function_workers=workers)
            scorer = PythonFunctionRewards(cfg, tokenizer, stops)
            try:
                out = scorer.score(prompts, batch)[name]
                ms = median_ms(lambda: scorer.score(prompts, batch), repeats, budget)
            finally:
                scorer.close()
            row = {"scorer": name, "workers": workers, "ms_per_1k": ms * 1000 / B}
            if name != "nothing_trl":
                row["agree_tensor_native"] = float((out == expected).float().mean())
            rows.append(row)
    for row in rows:
        row["x_tensor_native"] = row["ms_per_1k"] / rows[0]["ms_per_1k"]
    return {
        "benchmark": "reward_functions",
        "date": date.today().isoformat(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "B": B,
        "L": L,
        "results": rows,
    }


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    vocab = len(tokenizer.get_vocab())
    shapes = [(64, 256), (256, 1024)] if quick else [(B, L) for L in (256, 1024) for B in (64, 256, 1024)]
    repeats, budget = (5, 0.5) if quick else (21, 2.0)
    results = []
    for B, L in shapes:
        ids, patterns = make_batch(B, L, vocab, seed=B * 10_000 + L)
        packed = pack_patterns(patterns)  # once per prompt batch, outside the scoring call
        answers = tokenizer.batch_decode([p.tolist() for p in patterns])
        regexes = [re.compile(r"(?<!\S)" + re.escape(a) + r"(?!\S)") for a in answers]

        ours = tensor_native_reward(ids, packed, EOS)
        loop = loop_reward(ids, patterns, EOS)
        regex = decode_regex_reward(ids, regexes, tokenizer, EOS)
        row = {
            "B": B,
            "L": L,
            "tokens_scored": int(valid_lengths(ids, EOS).sum()),
            "match_rate": float(ours.mean()),
            "agree_loop": float((ours == loop).float().mean()),
            "agree_regex": float((ours == regex).float().mean()),
            "tensor_ms": median_ms(lambda: tensor_native_reward(ids, packed, EOS), repeats, budget),
            "loop_ms": median_ms(lambda: loop_reward(ids, patterns, EOS), repeats, budget),
            "regex_ms": median_ms(lambda: decode_regex_reward(ids, regexes, tokenizer, EOS), repeats, budget),
            # for reference: the default reward of the synthetic task (whole response == answer)
            "exact_match_ms": median_ms(lambda: exact_match_reward(ids, packed, EOS), repeats, budget),
        }
        for name in ("tensor", "loop", "regex"):
            row[f"{name}_ns_per_token"] = row[f"{name}_ms"] * 1e6 / (B * L)
        row["speedup_vs_loop"] = row["loop_ms"] / row["tensor_ms"]
        row["speedup_vs_regex"] = row["regex_ms"] / row["tensor_ms"]
        results.append(row)

    target_row = next((r for r in results if (r["B"], r["L"]) == (256, 1024)), None)
    targets = dict(TARGETS)
    if target_row is not None:
        targets["met_vs_regex"] = target_row["speedup_vs_regex"] >= TARGETS["speedup_vs_regex"]
        targets["met_vs_loop"] = target_row["speedup_vs_loop"] >= TARGETS["speedup_vs_loop"]
    return {
        "benchmark": "reward",
        "date": date.today().isoformat(),
        "machine": {
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "quick": quick,
        "vocab_size": vocab,
        "results": results,
        "targets": targets,
    }


def print_table(report: dict) -> None:
    m = report["machine"]
    print(
        f"reward scoring, {m['cpu']}, {m['threads']} thread, torch {m['torch']}, vocab {report['vocab_size']}"
        f"{' (quick)' if report['quick'] else ''}"
    )
    head = (
        f"{'B':>5} {'L':>5} | {'tensor ms':>10} {'loop ms':>10} {'regex ms':>10} | "
        f"{'tensor ns/tok':>13} {'loop ns/tok':>11} {'regex ns/tok':>12} | {'x loop':>7} {'x regex':>8} | "
        f"{'agree':>9} | {'exact ms':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        print(
            f"{r['B']:>5} {r['L']:>5} | {r['tensor_ms']:>10.3f} {r['loop_ms']:>10.2f} {r['regex_ms']:>10.2f} | "
            f"{r['tensor_ns_per_token']:>13.2f} {r['loop_ns_per_token']:>11.1f} {r['regex_ns_per_token']:>12.1f} | "
            f"{r['speedup_vs_loop']:>7.1f} {r['speedup_vs_regex']:>8.1f} | "
            f"{r['agree_loop']:>4.0%}/{r['agree_regex']:<4.0%} | {r['exact_match_ms']:>8.3f}"
        )
    t = report["targets"]
    if "met_vs_regex" in t:
        print(
            f"targets at B=256, L=1024: >= {t['speedup_vs_regex']:.0f}x vs decode+regex: "
            f"{'met' if t['met_vs_regex'] else 'NOT met'}; >= {t['speedup_vs_loop']:.0f}x vs per-row loop: "
            f"{'met' if t['met_vs_loop'] else 'NOT met'}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object of all figures, nothing else")
    parser.add_argument("--quick", action="store_true", help="two shapes, few repeats")
    parser.add_argument("--text", action="store_true", help="only the GSM8K text-matching comparison")
    parser.add_argument("--stages", action="store_true", help="with --text: CPU time of each stage too")
    parser.add_argument("--functions", action="store_true", help="only Python reward functions vs tensor-native")
    parser.add_argument("--device", default="cpu", help="with --text: the device of the responses (e.g. cuda)")
    args = parser.parse_args(argv)
    if args.functions:
        report = run_functions(args.quick)
        if args.json:
            print(json.dumps(report))
        else:
            print(
                f"Python reward functions vs tensor-native, GSM8K batch B={report['B']} L={report['L']}, "
                f"{report['cpu']}, torch {report['torch']}"
            )
            print(f"{'scorer':<36} {'processes':>9} {'ms / 1,000':>11} {'x tensor':>9} {'agree':>6}")
            for r in report["results"]:
                agree = f"{r['agree_tensor_native']:.0%}" if "agree_tensor_native" in r else "-"
                print(
                    f"{r['scorer']:<36} {r['workers']:>9} {r['ms_per_1k']:>11.2f} {r['x_tensor_native']:>9.1f} "
                    f"{agree:>6}"
                )
        return
    if args.text:
        report = {
            "benchmark": "reward_text",
            "date": date.today().isoformat(),
            "cpu": cpu_model(),
            "torch": torch.__version__,
        }
        report["device"] = str(torch.device(args.device))
        if torch.device(args.device).type == "cuda":
            report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        report["results"] = run_text(args.quick, args.stages, args.device)
        report["target_speedup_vs_decode_regex"] = TEXT_TARGET
        report["load_average"] = list(os.getloadavg())
        if args.json:
            print(json.dumps(report))
        else:
            where = report.get("gpu", "CPU") + f" ({report['device']})"
            print(f"text components vs decode + regex, on {where}, {report['cpu']}, 1 thread, torch {report['torch']}")
            print(f"load average {report['load_average']} (ratios: medians of interleaved repeats)")
            for r in report["results"]:
                print(f"B={r['B']} L={r['L']} vocab {r['vocab_size']}, {r['repeats']} repeats")
                for name, c in r["components"].items():
                    met = "met" if c["speedup"] >= TEXT_TARGET else "NOT met"
                    print(
                        f"  {name:20s} ours {c['ms']:7.2f} ms (cpu {c['cpu_ms']:6.2f}), decode+regex "
                        f"{c['decode_regex_ms']:7.1f} ms (cpu {c['decode_regex_cpu_ms']:6.1f}): x{c['speedup']:.1f} "
                        f"(cpu x{c['speedup_cpu']:.1f}, {met}), agree {c['agree_decode_regex']:.1%}, "
                        f"match rate {c['match_rate']:.2f}"
                    )
                print(
                    f"  answer_after_marker with fresh patterns {r['text_fresh_patterns_ms']:.2f} ms "
                    f"(cpu {r['text_fresh_patterns_cpu_ms']:.2f})"
                )
                print(
                    f"  answer_after_marker, rollout worker's path ({r['B'] // SAMPLES_PER_PROMPT} prompts prepared, "
                    f"x{SAMPLES_PER_PROMPT} samples) {r['text_training_path_ms']:.2f} ms "
                    f"(cpu {r['text_training_path_cpu_ms']:.2f})"
                )
                calls = r.get("stages_aten_calls", {})
                for stage, ms in r.get("stages_cpu_ms", {}).items():
                    print(f"  stage {stage:40s} cpu {ms:7.2f} ms, {calls.get(stage, 0):5.0f} aten calls")
        return
    report = run(args.quick)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
