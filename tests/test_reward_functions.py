"""Python reward functions (reward.functions): the process pool, config checks, the rollout worker's sum.

Real spawned processes run real functions written to a temporary file; nothing is mocked.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError, RewardConfig, load_config
from rlhf_core.reward.functions import pool as pool_module
from rlhf_core.reward.functions.pool import Call, FunctionLoadError, FunctionPool

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "rewards"

FUNCTIONS = '''
import asyncio
import os
import signal
import sys
import time


def trl_len(prompts, completions, completion_ids, answer, **columns):
    """len(completion) + the row's 'bonus' column; None where the answer is 'skip'."""
    return [None if a == "skip" else float(len(c)) + b for c, a, b in zip(completions, answer, columns["bonus"])]


async def trl_async(prompts, completions, completion_ids, **columns):
    await asyncio.sleep(0.01)
    return [float(ids[0]) if ids else 0.0 for ids in completion_ids]


def trl_no_kwargs(completions, prompts):  # takes no **columns: it is given only what it names
    return [1.0] * len(completions)


def verl_float(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.startswith(ground_truth) else 0.0


def verl_dict(data_source, solution_str, ground_truth):  # no extra_info parameter
    return {"score": 0.5, "length": len(solution_str), "source_is_d": data_source == "d"}


def raises(prompts, completions, **columns):
    raise ZeroDivisionError("the function broke")


def raises_on_b(data_source, solution_str, ground_truth, extra_info=None):
    if "b" in (solution_str, ground_truth):
        raise KeyError("b")
    return 1.0


def sleeps(prompts, completions, **columns):
    time.sleep(60)
    return [1.0] * len(completions)


def wrong_length(prompts, completions, **columns):
    return [1.0]


def deaf_sleeper(prompts, completions, **columns):  # ignores the timer: only killing the process stops it
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(60)


def hangs_once(data_source, solution_str, ground_truth, extra_info=None):
    """1.0, except the first call of all (the one that creates extra_info['flag']), which hangs as a call stuck in
    C code does: no signal reaches Python (the timer's and SIGTERM blocked), only SIGKILL ends it."""
    try:
        os.close(os.open(extra_info["flag"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return 1.0
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
    time.sleep(60)
    return 1.0


def trl_nan(prompts, completions, **columns):
    return [float("nan"), 2.0][: len(completions)]


def verl_nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan") if solution_str == "nan" else {"score": float("inf")} if solution_str == "inf" else 1.0


def heavy_modules(prompts, completions, **columns):
    return [float(m in sys.modules) for m in ("torch", "transformers")][: len(completions)]
'''
NAMES = [
    "trl_len",
    "trl_async",
    "trl_no_kwargs",
    "verl_float",
    "verl_dict",
    "raises",
    "raises_on_b",
    "sleeps",
    "wrong_length",
    "deaf_sleeper",
    "hangs_once",
    "trl_nan",
    "verl_nan",
    "heavy_modules",
]


@pytest.fixture(scope="module")
def functions_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward_functions") / "fns.py"
    path.write_text(FUNCTIONS)
    return path


@pytest.fixture(scope="module")
def pool(functions_file):
    p = FunctionPool([(str(functions_file), n, f"reward.functions[{i}]") for i, n in enumerate(NAMES)], 2, 0.5)
    yield p
    p.close()


def trl_call(name: str, completions: list[str], answer=None) -> Call:
    n = len(completions)
    kwargs = {
        "prompts": ["p"] * n,
        "completions": completions,
        "completion_ids": [[i + 1] for i in range(n)],
        "answer": answer or ["a"] * n,
        "bonus": [10.0 * i for i in range(n)],
    }
    return Call(NAMES.index(name), "trl", kwargs, n)


def verl_call(name: str, solutions: list[str], truth: str = "a") -> Call:
    rows = [{"data_source": "d", "solution_str": s, "ground_truth": truth, "extra_info": {"i": 1}} for s in solutions]
    return Call(NAMES.index(name), "verl", rows, len(rows))


def test_pool_tells_the_signatures_apart(pool):
    assert pool.kinds == ["trl", "trl", "trl", "verl", "verl", "trl", "verl", "trl", "trl", "trl"] + [
        "verl",
        "trl",
        "verl",
        "trl",
    ]


def test_pool_runs_trl_sync_async_and_verl_float_dict(pool):
    out = pool.run(
        [
            trl_call("trl_len", ["xy", "xyz", "q"], answer=["a", "skip", "a"]),
            trl_call("trl_async", ["u", "v"]),
            trl_call("trl_no_kwargs", ["u", "v"]),
            verl_call("verl_float", ["a b", "b a"]),
            verl_call("verl_dict", ["abc"]),
        ]
    )
    assert out[0] == [(2.0, {}, None), (None, {}, None), (21.0, {}, None)]  # None: "does not apply"
    assert out[1] == [(1.0, {}, None), (2.0, {}, None)]
    assert out[2] == [(1.0, {}, None), (1.0, {}, None)]
    assert out[3] == [(1.0, {}, None), (0.0, {}, None)]
    assert out[4] == [(0.5, {"length": 3.0, "source_is_d": 1.0}, None)]


def test_pool_reports_a_raising_function_per_row_and_keeps_serving(pool):
    out = pool.run([trl_call("raises", ["a", "b"]), verl_call("raises_on_b", ["a", "b", "c"])])
    assert [v for v, _, _ in out[0]] == [None, None]
    assert all("ZeroDivisionError: the function broke" in e and "fns.py" in e for _, _, e in out[0])
    assert [(v, e is None) for v, _, e in out[1]] == [(1.0, True), (None, False), (1.0, True)]
    assert "KeyError" in out[1][1][2]
    out = pool.run([trl_call("wrong_length", ["a", "b"])])
    assert "not a list of 2 floats" in out[0][0][2]
    assert pool.run([verl_call("verl_float", ["a"])]) == [[(1.0, {}, None)]]


def test_pool_times_out_a_sleeping_function_without_replacing_the_process(pool):
    replaced = pool.replaced
    start = time.monotonic()
    out = pool.run([trl_call("sleeps", ["a", "b"]), trl_call("trl_no_kwargs", ["a"])])
    assert time.monotonic() - start < 5
    assert all(v is None and "timed out after 0.5 s (reward.function_timeout_s)" in e for v, _, e in out[0])
    assert out[1] == [(1.0, {}, None)]
    assert pool.replaced == replaced  # the timer interrupted it: the process lives on


def test_pool_kills_and_replaces_a_process_that_ignores_the_timer(pool, monkeypatch):
    monkeypatch.setattr(pool_module, "KILL_GRACE_S", 0.5)
    replaced = pool.replaced
    start = time.monotonic()
    out = pool.run([trl_call("deaf_sleeper", ["a"]), trl_call("trl_no_kwargs", ["a"])])
    assert time.monotonic() - start < 10
    assert out[0][0][0] is None and "killed and replaced" in out[0][0][2]
    assert out[1] == [(1.0, {}, None)]
    assert pool.replaced == replaced + 1
    assert pool.run([verl_call("verl_float", ["a"])] * 3) == [[(1.0, {}, None)]] * 3  # the replacement serves


def test_one_hung_row_fails_alone_and_the_others_score(functions_file, tmp_path):
    """The review's scenario, scaled down: 6 verl rows, function_timeout_s 1 s, one process; one row hangs where
    no timer can interrupt it. That row alone fails (its process killed and replaced); the 5 others score, those
    before it and those after it."""
    p = FunctionPool([(str(functions_file), n, f"reward.functions[{i}]") for i, n in enumerate(NAMES)], 1, 1.0)
    try:
        flag = str(tmp_path / "hung")
        rows = [{"data_source": "d", "solution_str": "s", "ground_truth": "g", "extra_info": {"flag": flag}}] * 6
        (out,) = p.run([Call(NAMES.index("hangs_once"), "verl", rows, 6)])
        failed = [r for r in out if r[2] is not None]
        assert len(failed) == 1 and failed[0][0] is None and "killed and replaced" in failed[0][2]
        assert [r for r in out if r[2] is None] == [(1.0, {}, None)] * 5
        assert p.replaced == 1
    finally:
        p.close()


def test_nan_means_does_not_apply_and_infinity_is_an_error(pool):
    out = pool.run([trl_call("trl_nan", ["a", "b"]), verl_call("verl_nan", ["nan", "inf", "x"])])
    assert out[0] == [(None, {}, None), (2.0, {}, None)]  # NaN as None: not applicable, not a failure (as TRL)
    assert out[1][0] == (None, {}, None) and out[1][2] == (1.0, {}, None)
    assert out[1][1][0] is None and "not a finite number" in out[1][1][2]


def test_pool_processes_import_no_torch(pool):
    assert pool.run([trl_call("heavy_modules", ["a", "b"])]) == [[(0.0, {}, None), (0.0, {}, None)]]


def test_pool_names_the_function_that_cannot_be_imported(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_anywhere\n\ndef f(prompts, completions, **kw):\n    return []\n")
    with pytest.raises(FunctionLoadError, match=r"reward\.functions\[3\].*no_such_module_anywhere"):
        FunctionPool([(str(bad), "f", "reward.functions[3]")], 1, 1.0)


# ------------------------------------------------------------------------------------------ config checks
def functions_cfg(*entries, **extra) -> list[str]:
    items = ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}" for e in entries)
    return [f"reward.functions=[{items}]", *(f"reward.{k}={v}" for k, v in extra.items())]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"path": "no/such/file.py", "name": "f"}, r"reward\.functions\[0\]: 'no/such/file.py' is neither"),
        ({"path": "{file}", "name": "missing"}, r"reward\.functions\[0\]: .* defines no function named 'missing'"),
        ({"path": "{file}", "name": "raises_on_b"}, None),
        ({"name": "not_builtin"}, r"reward\.functions\[0\]: path is empty and 'not_builtin' is not a built-in"),
        ({"path": "{file}", "name": "verl_float", "metrics": "[failed]"}, r"not 'failed'"),
        ({"path": "{file}", "name": "trl_len", "metrics": "[x]"}, r"keys of a verl function's dict"),
        ({"path": "{file}", "name": "trl_len", "label": "exact_match"}, r"give this function a unique `label`"),
    ],
)
def test_config_checks_each_function(functions_file, entry, message):
    entry = {k: str(v).replace("{file}", str(functions_file)) for k, v in entry.items()}
    if message is None:
        assert load_config(None, functions_cfg(entry)).reward.functions[0].name == entry["name"]
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, functions_cfg(entry))


def test_config_refuses_a_signature_that_is_neither(tmp_path):
    (tmp_path / "odd.py").write_text("def score(text, answer):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"reward\.functions\[1\]: score\(text, answer\) .* is not TRL's"):
        load_config(None, functions_cfg({"name": "math_verify"}, {"path": tmp_path / "odd.py", "name": "score"}))


def test_config_resolves_relative_paths_and_lists_the_columns(monkeypatch):
    monkeypatch.chdir(EXAMPLES.parents[1])
    cfg = load_config(
        None,
        functions_cfg(
            {"path": "examples/rewards/trl_style.py", "name": "last_number_matches"},
            {"path": "examples/rewards/verl_style.py", "name": "compute_score", "label": "verl", "metrics": "[length]"},
        ),
    )
    assert cfg.reward.functions[0].path == str(EXAMPLES / "trl_style.py")
    assert cfg.reward.column_names() == [
        "exact_match",
        "last_number_matches",
        "last_number_matches/failed",
        "verl",
        "verl/failed",
        "verl/length",
    ]


def test_config_with_functions_imports_neither_torch_nor_the_functions(functions_file):
    code = (
        "import sys; from rlhf_core.config import load_config; "
        f"load_config(None, ['reward.functions=[{{path: {functions_file}, name: trl_len}}]']); "
        "print(sorted(m for m in ('torch', 'transformers', 'fns') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------ the worker's sum
@pytest.fixture
def worker_factory(tiny_model, tiny_tokenizer):
    from rlhf_core.reward.components import build_reward_fn
    from rlhf_core.rollout import HFEngine, RolloutWorker, SamplingParams
    from rlhf_core.run import build

    made = []

    def make(reward_cfg: RewardConfig, max_failures: int = 20):
        tok = tiny_tokenizer
        stop = [tok.eos_token_id]
        cfg = load_config(None, [f"supervision.max_consecutive_failures={max_failures}"])
        cfg.reward = reward_cfg
        worker = RolloutWorker(
            HFEngine(tiny_model, stop, tok.pad_token_id, seed=0),
            build_reward_fn(reward_cfg, tok, stop, 4),
            SamplingParams(max_new_tokens=4),
            4,
            tok.pad_token_id,
            component_names=reward_cfg.column_names(),
            external=build.build_external_rewards(cfg, tok, stop),
        )
        made.append(worker)
        return worker

    yield make
    for w in made:
        w.close()


def reward_cfg(functions_file, *entries, **extra) -> RewardConfig:
    return RewardConfig(
        components={"exact_match": 1.0},
        functions=[{"path": str(functions_file), **e} for e in entries],
        **{"function_workers": 2, **extra},
    )


def test_worker_adds_functions_by_weight_and_logs_their_columns(
    worker_factory, functions_file, max3_prompts, tiny_tokenizer
):
    from rlhf_core.reward.functions.external import completion_ids
    from rlhf_core.trainer import Trainer

    cfg = reward_cfg(
        functions_file,
        {"name": "trl_async", "weight": 0.5},
        {"name": "verl_dict", "weight": 2.0, "metrics": ["length"]},
    )
    worker = worker_factory(cfg)
    prompts = max3_prompts[0][:3]
    batch, components = worker.rollout(prompts)
    names = cfg.column_names()
    assert names == [
        "exact_match",
        "trl_async",
        "trl_async/failed",
        "verl_dict",
        "verl_dict/failed",
        "verl_dict/length",
    ]
    assert batch.reward_components.shape == (12, 6)
    comps = dict(zip(names, batch.reward_components.T))
    ids = completion_ids(batch.response_ids, batch.response_mask, [tiny_tokenizer.eos_token_id])
    # trl_async scores the first generated token id; verl_dict 0.5 with the decoded text's length
    torch.testing.assert_close(comps["trl_async"], torch.tensor([float(r[0]) if r else 0.0 for r in ids]))
    texts = tiny_tokenizer.batch_decode(ids, skip_special_tokens=True)
    torch.testing.assert_close(comps["verl_dict/length"], torch.tensor([float(len(t)) for t in texts]))
    torch.testing.assert_close(
        batch.rewards, comps["exact_match"] + 0.5 * comps["trl_async"] + 2.0 * torch.full((12,), 0.5)
    )
    assert float(comps["trl_async/failed"].sum()) == 0 and float(comps["verl_dict/failed"].sum()) == 0
    assert set(components) >= set(names)
    train_cfg = load_config(None, [])
    trainer = Trainer(worker.engine.model, train_cfg, tiny_tokenizer.pad_token_id)
    assert trainer.reward_component_means(batch) == {}  # a config without the functions has fewer columns
    train_cfg.reward = cfg
    metrics = trainer.reward_component_means(batch)
    assert metrics["reward/verl_dict"] == pytest.approx(0.5)
    assert metrics["reward/trl_async"] == pytest.approx(float(comps["trl_async"].mean()))


def test_none_rows_add_zero_and_leave_the_mean(worker_factory, functions_file, max3_prompts):
    from rlhf_core.trainer import Trainer

    cfg = reward_cfg(functions_file, {"name": "trl_len", "weight": 1.0})
    worker = worker_factory(cfg)
    first, second = max3_prompts[0][:2]
    prompts = [
        type(p)(**{**p.__dict__, "answer_text": a, "meta": {**p.meta, "bonus": 0.0}})
        for p, a in [(first, "skip"), (second, second.answer_text)]
    ]
    batch, _ = worker.rollout(prompts)
    column = batch.reward_components[:, 1]
    assert column[:4].isnan().all() and not column[4:].isnan().any()  # the first prompt's 4 rows: None
    torch.testing.assert_close(batch.rewards[:4], batch.reward_components[:4, 0])  # None adds 0 to the total
    torch.testing.assert_close(batch.rewards[4:], batch.reward_components[4:, 0] + column[4:])
    train_cfg = load_config(None, [])
    train_cfg.reward = cfg
    metrics = Trainer(worker.engine.model, train_cfg, 0).reward_component_means(batch)
    assert metrics["reward/trl_len"] == pytest.approx(float(column[4:].mean()))  # mean over the rows it applies to


def test_failures_score_zero_warn_and_then_stop_the_run(worker_factory, functions_file, max3_prompts, caplog):
    from rlhf_core.reward.functions.external import RewardFunctionError

    cfg = reward_cfg(
        functions_file,
        {"name": "raises", "weight": 1.0},
        {"name": "sleeps", "weight": 1.0},
        function_timeout_s=0.3,
    )
    worker = worker_factory(cfg, max_failures=6)
    with caplog.at_level(logging.WARNING, logger="rlhf_core.reward"):
        batch, _ = worker.rollout(max3_prompts[0][:2])  # 2 chunks each: 2 failed calls per function
    comps = dict(zip(cfg.column_names(), batch.reward_components.T))
    assert float(comps["raises"].abs().sum()) == 0 and float(comps["raises/failed"].mean()) == 1.0
    assert float(comps["sleeps/failed"].mean()) == 1.0
    torch.testing.assert_close(batch.rewards, comps["exact_match"])
    text = caplog.text
    assert "reward function raises: 2 failed call(s) in this batch, scored 0 (2 of 2 calls" in text
    assert "ZeroDivisionError: the function broke" in text and "timed out after 0.3 s" in text
    assert worker.external[0].stats()["sleeps"]["failures"] == 2
    worker.rollout(max3_prompts[0][2:4])  # 4 in a row
    with pytest.raises(RewardFunctionError, match=r"raises \(reward\.functions\[0\].*failed 6 calls in a row.*ZeroDiv"):
        worker.rollout(max3_prompts[0][4:6])


def test_a_hung_row_is_one_failed_call_and_the_run_goes_on(worker_factory, functions_file, max3_prompts, tmp_path):
    """With one process and supervision.max_consecutive_failures=2, a row stuck past its deadline fails that row
    only and counts once: the batch's other rows score and the run does not stop."""
    cfg = reward_cfg(
        functions_file,
        {"name": "hangs_once", "weight": 1.0},
        function_workers=1,
        function_timeout_s=1.0,
    )
    worker = worker_factory(cfg, max_failures=2)
    flag = {"flag": str(tmp_path / "hung")}
    prompts = [type(p)(**{**p.__dict__, "meta": {**p.meta, "extra_info": flag}}) for p in max3_prompts[0][:2]]
    batch, _ = worker.rollout(prompts)
    comps = dict(zip(cfg.column_names(), batch.reward_components.T))
    assert float(comps["hangs_once/failed"].sum()) == 1.0
    assert float(comps["hangs_once"].sum()) == len(batch) - 1
    stats = worker.external[0].stats()["hangs_once"]
    assert (stats["calls"], stats["failures"]) == (len(batch), 1)
    assert "killed and replaced" in stats["first_error"]


def test_a_success_resets_the_consecutive_count(worker_factory, functions_file, max3_prompts):
    from rlhf_core.reward.functions.external import RewardFunctionError

    cfg = reward_cfg(functions_file, {"name": "raises_on_b"})
    worker = worker_factory(cfg, max_failures=5)
    p, q = max3_prompts[0][:2]
    b = type(p)(**{**p.__dict__, "answer_text": "b"})  # verl's ground truth: this row's calls raise
    worker.rollout([b, q, b])  # rows: 4 failures, 4 successes, 4 failures: never 5 in a row
    assert worker.external[0].stats()["raises_on_b"]["failures"] == 8
    with pytest.raises(RewardFunctionError, match=r"failed 5 calls in a row .*KeyError: 'b'"):
        worker.rollout([b, b])


# ----------------------------------------------------------------------------------------- math_verify
def test_math_verify_builtin_scores_latex_and_boxed_answers():
    pytest.importorskip("math_verify")
    from rlhf_core.reward.functions.math_verify import math_verify

    out = math_verify(
        None,
        [r"so \boxed{\frac{1}{2}}", "the answer is 0.5", "I think 3", "x", [{"role": "assistant", "content": "= 4"}]],
        answer=["0.5", r"\frac{1}{2}", "4", "", "4"],
    )
    assert out == [1.0, 1.0, 0.0, None, 1.0]


def test_math_verify_runs_in_the_pool_with_verl_ground_truth():
    pytest.importorskip("math_verify")
    p = FunctionPool([("", "math_verify", "reward.functions[0]")], 1, 10.0)
    try:
        kwargs = {
            "prompts": ["q", "q"],
            "completions": [r"\boxed{2\sqrt{2}}", r"\boxed{3}"],
            "completion_ids": [[1], [2]],
            "answer": ["", ""],
            "reward_model": [{"ground_truth": r"\sqrt{8}"}, {"ground_truth": "3"}],
        }
        assert p.run([Call(0, "trl", kwargs, 2)]) == [[(1.0, {}, None), (1.0, {}, None)]]
    finally:
        p.close()


def test_examples_follow_their_signatures():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import trl_style
        import verl_style
    finally:
        sys.path.remove(str(EXAMPLES))
    assert trl_style.last_number_matches(None, ["it is 7", [{"content": "8 or 9"}], "x"], None, ["7", "8", "y"]) == [
        1.0,
        0.0,
        None,
    ]
    assert verl_style.compute_score("max3", "7 then", "7") == {"score": 1.0, "length": 2.0}
    assert math.isclose(verl_style.compute_score("max3", "then 7", "7")["score"], 0.1)


def test_a_user_file_imported_from_several_threads_at_once_is_whole_in_each(tmp_path):
    """Environments open many episodes in one process on threads, each loading its tools: every thread gets the
    module after its code ran (a thread once found it registered but not yet executed: "defines no 'add'")."""
    import threading

    from rlhf_core.usercode import import_path

    path = tmp_path / "slow_tools.py"
    path.write_text("import time\ntime.sleep(0.3)\n\ndef add(a, b):\n    return a + b\n")
    found, start = [], threading.Barrier(6)

    def load():
        start.wait()
        found.append(getattr(import_path(str(path), "env.tools[0]"), "add", None))

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 6 and all(fn is not None and fn(2, 3) == 5 for fn in found)
