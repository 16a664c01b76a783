"""ToolEnv: tool schemas through the chat template, <tool_call> parsing, tool results as `tool` messages,
tool errors and timeouts, refusal of a template without a tool format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.config import validate_config
from rlhf_core.data.prompts import Prompt
from rlhf_core.env.chat import ChatFormatError
from rlhf_core.env.tools import parse_tool_calls, tool_schemas
from rlhf_core.model.policy import load_policy, stop_token_ids
from rlhf_core.rollout import SamplingParams
from rlhf_core.rollout.multiturn import EnvRunner
from rlhf_core.rollout.multiturn_batch import trajectory_batch
from rlhf_core.types import RolloutBatch

REPO = Path(__file__).resolve().parents[1]
CALCULATOR = str(REPO / "examples" / "envs" / "calculator.py")
FIXTURES = str(Path(__file__).parent / "env_fixtures.py")


def prompts_for(tok, n: int) -> list[Prompt]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"what is 2 + {i + 3}?"}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(Prompt(i, tok(text, add_special_tokens=False)["input_ids"], [], text, str(i + 5), {}, messages))
    return out


def test_parse_tool_calls():
    text = 'ok <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call> and '
    text += '<tool_call>{"name": "m"}</tool_call>'
    calls, errors = parse_tool_calls(text)
    assert calls == [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "m", "arguments": {}}] and not errors
    calls, errors = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls == [{"name": "f", "arguments": {"x": 1}}]
    calls, errors = parse_tool_calls("<tool_call>{nope</tool_call><tool_call>[1]</tool_call>")
    assert not calls and len(errors) == 2 and "is not JSON" in errors[0] and "has no string 'name'" in errors[1]
    assert parse_tool_calls("The answer is 5") == ([], [])
    # a <tool_call> never closed is a malformed call, not an answer
    calls, errors = parse_tool_calls('so <tool_call>{"name": "add", "arguments": {"a": 2}}')
    assert not calls and errors == [
        'the tool call \'{"name": "add", "arguments": {"a": 2}}\' is not closed with </tool_call>'
    ]


def test_tool_schemas_from_signature_and_docstring():
    (schema,) = tool_schemas([(CALCULATOR, "add")])
    assert schema["function"]["name"] == "add" and schema["function"]["description"] == "Add two numbers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "number", "description": "The first number."}
    with pytest.raises(ValueError, match=r"env.tools\[0\]: no JSON schema for undocumented"):
        tool_schemas([(FIXTURES, "undocumented")])


class ScriptedEngine:
    """Emits the tokens of a fixed turn per step of the conversation, as a model that learned the tool format
    would: a tool call while the context has no tool response yet, then an answer quoting the result."""

    def __init__(self, tok, stops, first: str, then: str):
        self.tok, self.stop, self.first, self.then = tok, stops[0], first, then
        self.version, self.device = 3, torch.device("cpu")
        self.generated: list[list[int]] = []

    def generate(self, prompts, samples_per_prompt, sampling) -> RolloutBatch:
        rows = []
        for ids, mask in zip(prompts.prompt_ids, prompts.prompt_mask):
            context = self.tok.decode(ids[mask].tolist())
            text = self.then if "<tool_response>" in context else self.first
            if "<tool_response>" in context:
                text = text.format(result=context.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0])
            rows.append(self.tok(text, add_special_tokens=False)["input_ids"] + [self.stop])
        self.generated += rows
        L = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.tok.pad_token_id] * (L - len(r)) for r in rows])
        mask = torch.tensor([[True] * len(r) + [False] * (L - len(r)) for r in rows])
        n = len(rows)
        return RolloutBatch(
            prompt_ids=prompts.prompt_ids,
            prompt_mask=prompts.prompt_mask,
            response_ids=ids,
            response_mask=mask,
            behavior_logprobs=torch.where(mask, -0.5, 0.0),
            response_lengths=mask.sum(-1),
            group_ids=torch.arange(n),
            policy_version=torch.full((n,), self.version),
        )


def tool_runner(tok, stops, tools, **env):
    cfg = validate_config(
        {
            "env": {"tools": [{"path": p, "name": n} for p, n in tools], **env},
        }
    )
    cfg.env.max_total_tokens = 4096  # the scripted engine has no context limit
    return EnvRunner(cfg.env, tok, stops, 1)


def test_a_tool_call_runs_and_its_result_comes_back_as_a_tool_message(chat_policy_dir):
    _, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    stops = stop_token_ids(chat_policy_dir, tok)
    runner = tool_runner(tok, stops, [(CALCULATOR, "add"), (CALCULATOR, "multiply")], max_turns=3)
    engine = ScriptedEngine(
        tok, stops, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', "It is {result}."
    )
    prompts = prompts_for(tok, 1)
    prompts[0].answer_text = "5"
    try:
        (t,) = runner.run(engine, prompts, 1, SamplingParams(max_new_tokens=256))
    finally:
        runner.close()
    assert t.error is None and t.done and t.turns == 2 and t.tool_calls == 1
    assert t.success is True  # the final answer "It is 5." contains the row's answer
    prompt_text = tok.decode(t.prompt_ids)
    assert '"name": "add"' in prompt_text and '"name": "multiply"' in prompt_text and "<tools>" in prompt_text
    assert [turn.role for turn in t.transcript] == ["user", "assistant", "tool", "assistant"]
    assert t.transcript[2].text == "5"
    # the ids: the two generated turns exactly, with the tool message between them masked out
    batch = trajectory_batch([t], tok.pad_token_id, engine.version)
    ids, loss = batch.response_ids[0].tolist(), batch.loss_mask[0].tolist()
    first, second = engine.generated
    obs = runner.chat.observation_ids([{"role": "tool", "content": "5"}], first[-1])
    assert ids == first + obs + second
    assert loss == [True] * len(first) + [False] * len(obs) + [True] * len(second)
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(obs)


@pytest.mark.parametrize(
    "answer, first, then, success, turns",
    [
        ("5", "I think it is 15.", "", False, 1),  # a substring test took this for 5
        ("5", "It is 5.", "", True, 1),
        ("1000", "It is 1,000 now.", "", True, 1),  # number forms
        ("Paris", "Parisian, I guess", "", False, 1),  # a word stands alone
        ("5", '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}', "So 5.", True, 2),  # unclosed: a call
    ],
)
def test_tool_env_success_is_the_answer_matchers_on_the_final_answer(
    chat_policy_dir, answer, first, then, success, turns
):
    """ToolEnv's info["success"]: the project's answer matcher (the contains component) on the final answer, a
    turn with no <tool_call>; an unclosed <tool_call> gets its error back as a tool message, the episode goes on."""
    _, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    stops = stop_token_ids(chat_policy_dir, tok)
    runner = tool_runner(tok, stops, [(CALCULATOR, "add")], max_turns=3)
    prompts = prompts_for(tok, 1)
    prompts[0].answer_text = answer
    try:
        (t,) = runner.run(ScriptedEngine(tok, stops, first, then), prompts, 1, SamplingParams(max_new_tokens=256))
    finally:
        runner.close()
    assert t.error is None and t.done and t.turns == turns
    assert t.success is success and "check_answer" not in t.info
    if turns == 2:
        assert "is not closed with </tool_call>" in t.transcript[2].text and t.transcript[2].role == "tool"


def test_tool_errors_are_the_models_to_read_and_a_slow_tool_fails_the_step(chat_policy_dir):
    _, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    stops = stop_token_ids(chat_policy_dir, tok)
    runner = tool_runner(tok, stops, [(FIXTURES, "divide"), (FIXTURES, "slow")], max_turns=2, step_timeout_s=1)
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
    try:
        for name, args, expect in [
            ("divide", '{"a": 1, "b": 0}', "error: ZeroDivisionError: division by zero"),
            ("nope", "{}", "error: no tool named 'nope' (tools: divide, slow)"),
        ]:
            engine = ScriptedEngine(tok, stops, call.format(name, args), "done")
            (t,) = runner.run(engine, prompts_for(tok, 1), 1, SamplingParams(max_new_tokens=256))
            assert t.error is None and t.transcript[2].text == expect
        # 3 s: past the 1 s timeout by a margin, and short enough that close() (which waits for the overrun call
        # to end, up to STOP_GRACE_S past the timeout) returns as soon as the sleep does
        engine = ScriptedEngine(tok, stops, call.format("slow", '{"seconds": 3}'), "done")
        (t,) = runner.run(engine, prompts_for(tok, 1), 1, SamplingParams(max_new_tokens=256))
        assert "timed out after 1 s (env.step_timeout_s)" in t.error
    finally:
        runner.close()


def test_a_template_without_a_tool_format_is_refused_at_start(chat_policy_dir):
    _, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(ChatFormatError, match="env.tools: the chat template of model has no tool format"):
        tool_runner(tok, stop_token_ids(chat_policy_dir, tok), [(CALCULATOR, "add")])


@pytest.mark.slow
def test_a_calculator_run_completes_on_the_small_chat_model(tmp_path):
    """The single-process loop with ToolEnv and the calculator's add on the small chat model: the tools are
    shown through its template, the run trains and evaluates (learning the calls is not required)."""
    from rlhf_core.config import load_config
    from rlhf_core.loop import build_run, run_sync

    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "model.preset=micro-chat",
            "data.task=max3_chat",
            "data.eval_size=2",
            "reward.components={answer_after_marker: 1.0}",
            "rollout.max_new_tokens=48",
            "env.max_total_tokens=512",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_batch=2",
            "env.workers=1",
            "eval.every=0",
            "checkpoint.every=0",
            f"env.tools=[{{path: {CALCULATOR}, name: add}}]",
            "env.max_turns=2",
        ],
    )
    parts = build_run(cfg)
    seen = []
    try:
        result = run_sync(cfg, parts=parts, on_step=seen.append)
    finally:
        parts.worker.close()
    assert result["steps"] == 2 and len(seen) == 2
    assert all(1 <= m["env/turns_mean"] <= 2 and m["env/errors"] == 0 for m in seen), [
        {k: v for k, v in m.items() if k.startswith("env/")} for m in seen
    ]
    assert "eval/accuracy" in result and len(result["eval/trajectories"]) == 2
    assert '"name": "add"' in parts.tokenizer.decode(parts.worker.last_trajectories[0].prompt_ids)
