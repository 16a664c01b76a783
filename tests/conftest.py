"""Shared fixtures: offline environment, a tiny policy built once per session, its tokenizer and prompts."""

from __future__ import annotations

import os

# Set before transformers / ray / prefect are imported anywhere in the test session.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_ignore_collect(collection_path, config):
    """With `-m "not slow"` (`make test-fast`), do not even import a module marked slow as a whole: those
    import Prefect, MLflow and Ray at the top (seconds of collection) for tests that would all be deselected."""
    if (
        "not slow" in (config.getoption("markexpr") or "")
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and "\npytestmark = pytest.mark.slow" in collection_path.read_text(encoding="utf-8")
    ):
        return True
    return None


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A 1-layer, hidden-32 tiny Llama policy and its tokenizer, saved once for the session (read-only use)."""
    from rlhf_core.models import build_tiny_policy

    return build_tiny_policy("max3", tmp_path_factory.mktemp("tiny_policy"), layers=1, hidden=32, heads=2, seed=0)


@pytest.fixture(scope="session")
def chat_policy_dir(tmp_path_factory):
    """A user's real model in miniature: Qwen2 architecture, byte-level BPE tokenizer trained locally, ChatML
    chat template, generation_config.json listing <|im_end|> and <|endoftext|>; tokenizer EOS <|im_end|>."""
    from rlhf_core.chat_model import build_chat_policy

    return build_chat_policy(tmp_path_factory.mktemp("chat_policy"), style="instruct", layers=1, hidden=32, heads=2)


@pytest.fixture(scope="session")
def base_chat_policy_dir(tmp_path_factory):
    """The same chat model with a base-style tokenizer: its EOS is <|endoftext|>, not the turn end <|im_end|>."""
    from rlhf_core.chat_model import build_chat_policy

    return build_chat_policy(tmp_path_factory.mktemp("base_chat_policy"), style="base", layers=1, hidden=32, heads=2)


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_policy_dir, tmp_path_factory):
    """A sequence-classification reward model (LlamaForSequenceClassification, one label, random weights) with
    the tiny policy's architecture and word-level tokenizer: it shares the tiny policy's tokenizer."""
    from rlhf_core.reward.model import build_tiny_reward_model

    return build_tiny_reward_model(tiny_policy_dir, tmp_path_factory.mktemp("tiny_reward_model"), seed=1)


@pytest.fixture(scope="session")
def chat_reward_model_dir(chat_policy_dir, tmp_path_factory):
    """A Qwen2ForSequenceClassification reward model with the chat fixture's byte-level BPE tokenizer and ChatML
    template: for the tiny (word-level) policy it has its own tokenizer."""
    from rlhf_core.reward.model import build_tiny_reward_model

    return build_tiny_reward_model(chat_policy_dir, tmp_path_factory.mktemp("chat_reward_model"), seed=2)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_policy_dir):
    from rlhf_core.models import load_policy

    _, tok = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    return tok


@pytest.fixture
def tiny_model(tiny_policy_dir):
    """A fresh copy of the tiny policy (tests may train or overwrite it)."""
    from rlhf_core.models import load_policy

    model, _ = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    return model


@pytest.fixture(scope="session")
def max3_prompts(tiny_tokenizer):
    """(train, heldout) prompts of the max3 task, heldout capped at 50."""
    from rlhf_core.data import build_synthetic_task

    return build_synthetic_task("max3", tiny_tokenizer, heldout_frac=0.2, seed=0, eval_size=50)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global torch RNG state (and leaves threads as it found them)."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray (2 CPUs) per test module; a runtime joins it and kills only its own actors."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
