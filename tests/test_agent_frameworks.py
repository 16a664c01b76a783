"""The agent frameworks users write agents in, unchanged, against the endpoint and through `agent:`: the examples
of examples/agents/ (the OpenAI Agents SDK, smolagents' ToolCallingAgent, LangChain, LiteLLM, DSPy's ReAct) each
run episodes through the rollout worker over the small chat model (taught the reveal tool's format, 8,192
positions: a framework's own system prompt fits) and the HF engine. Each episode's requests are recorded; the
batch they make trains on policy (the trainer's log-probs equal the engine's); an agent the framework made raise
(a parse error on the model's output, a turn limit) is scored agent.error_reward, its error kept. The table in
docs/agents.md is these tests' findings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rlhf_core.config import validate_config
from rlhf_core.data.prompts import Prompt
from rlhf_core.reward.components import build_reward_fn
from rlhf_core.rollout import HFEngine, RolloutWorker, SamplingParams
from rlhf_core.trainer.trainer import sequence_logprobs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
FRAMEWORKS = {  # example -> what its episodes show on this model (beyond being recorded and trainable)
    "agents_sdk_agent.py": "tool_round_trip",  # through the Responses API
    "smolagents_agent.py": "forced_tool_choice",
    "langchain_agent.py": "tool_round_trip",
    "litellm_agent.py": "tool_round_trip",
    "dspy_agent.py": "parse_error_scored",
}
# and again streamed (agent.kwargs stream: true): LangChain's .astream, LiteLLM's stream=True, the Agents SDK's
# Runner.run_streamed read server-sent events; the episodes must be the same
CASES = [(e, False) for e in FRAMEWORKS] + [
    (e, True) for e in ("agents_sdk_agent.py", "langchain_agent.py", "litellm_agent.py")
]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM (and DSPy through it): no download at import


def rows(n: int) -> list[Prompt]:
    return [Prompt(i, [1, 2, 3], [], f"max of {i + 1}, {i + 7}, 2?", str(i + 7), {}) for i in range(n)]


@pytest.mark.parametrize("example, stream", CASES, ids=[e + (" streamed" if s else "") for e, s in CASES])
def test_a_framework_agent_with_its_defaults_trains_through_agent(example, stream, tool_policy):
    model, tok, stops = tool_policy
    kwargs = {"stream": True} if stream else {}
    cfg = validate_config(
        {
            "agent": {
                "path": str(EXAMPLES / example),
                "name": "run",
                "error_reward": 0.0,
                "timeout_s": 120,
                "kwargs": kwargs,
            }
        }
    )
    from rlhf_core.agent.runner import AgentRunner

    runner = AgentRunner(cfg.agent, tok, stops, max_failures=50)
    sampling = SamplingParams(max_new_tokens=32, temperature=0.0)  # greedy: the taught call, where the prompt is

    reward = build_reward_fn(cfg.reward, tok, stops, sampling.max_new_tokens)
    names = cfg.reward.column_names() + cfg.env.column_names() + cfg.agent.column_names()
    engine = HFEngine(model, stops, tok.pad_token_id, seed=0)
    worker = RolloutWorker(engine, reward, sampling, 2, tok.pad_token_id, component_names=names, agent=runner)
    try:
        batch, components = worker.rollout(rows(2))
        served, streamed = runner.server.requests, runner.server.streamed
    finally:
        worker.close()
    episodes = runner.last_episodes
    assert len(episodes) == 4 and all(e.requests >= 1 for e in episodes), [e.error for e in episodes]
    for e in episodes:  # ended, or raised in the framework and scored agent.error_reward
        assert e.error is None or e.reward == 0.0, e.error
    assert len(batch) >= 4 and served >= 4 and torch.isfinite(batch.rewards).all()
    assert streamed == (served if stream else 0), (streamed, served)  # every request of a streamed run streamed
    assert batch.loss_mask.any(-1).any()
    calls = [c for e in episodes for c in e.calls]
    if FRAMEWORKS[example] == "forced_tool_choice":  # its steps force a call: the turn opens with <tool_call>
        opening = tok("<tool_call>\n", add_special_tokens=False)["input_ids"]
        assert all(e.calls[0].prompt_ids[-len(opening) :] == opening for e in episodes)
        assert len(tok.decode(calls[0].prompt_ids)) > 2000  # its own system prompt (tools, rules, examples)
    if FRAMEWORKS[example] == "tool_round_trip":  # the model calls reveal, the framework runs it and asks again:
        for e in episodes:  # two requests, one segment (the second extends the first by the call and the result)
            assert e.requests == 2 and e.error is None, (e.metrics, e.error, e.raised)
            # the model's answer after the tool's output runs past max_tokens (this model was taught turn 1
            # only): the Agents SDK raises on an incomplete response, as against OpenAI (scored error_reward)
            assert e.metrics.get("tool_calls") == 1.0 or "incomplete" in (e.raised or ""), (e.metrics, e.raised)
            assert len(e.segments) == 1 and e.prefix_breaks == 0
            assert e.calls[0].replies[0]["tool_calls"][0]["function"]["name"] == "reveal"
    if FRAMEWORKS[example] == "parse_error_scored":  # DSPy cannot parse the model's text into its fields
        assert all("AdapterParseError" in (e.raised or "") and e.error is None for e in episodes)
        assert runner.errors_rewarded == 4
    with torch.no_grad():
        logps, _ = sequence_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, sampling=sampling
        )
    ratio = torch.exp(logps[batch.loss_mask] - batch.behavior_logprobs[batch.loss_mask])
    assert float((ratio - 1).abs().max()) <= 1e-4
