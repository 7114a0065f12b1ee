"""Prompt + response budget against the engine's context, before anything is built
(``preflight.context_problems``: ``minippo validate``, the launcher and the recipe's setup)."""

from minippo.config import load_config
from minippo.training import preflight


def test_every_budget_is_checked_against_the_context_the_config_gives():
    cfg = load_config("tiny_math_cpu", ["eval.max_new_tokens=600"])  # qwen3_tiny: 512 tokens
    assert preflight.context_problems(cfg) == [
        "eval.max_new_tokens=600 plus a prompt of at least 1 token exceeds the engine's context "
        "of 512 tokens (model.max_seq_len); set eval.max_new_tokens to at most 511"
    ]
    # eval's budget null: it takes rollout's, which fits
    assert preflight.context_problems(load_config("tiny_math_cpu")) == []
    # engine.context_length, when the config sets it, is the engine's context
    cfg = load_config("tiny_cpu", ["rollout.max_new_tokens=64", "+engine.context_length=64"])
    assert preflight.context_problems(cfg) == [
        "rollout.max_new_tokens=64 plus a prompt of at least 1 token exceeds the engine's "
        "context of 64 tokens (engine.context_length); set rollout.max_new_tokens to at most 63"
    ]


def test_the_built_datasets_longest_prompt_and_max_prompt_tokens_count():
    cfg = load_config("tiny_cpu", ["rollout.max_new_tokens=500"])
    assert preflight.context_problems(cfg) == []  # 1 + 500 <= 512
    problems = preflight.context_problems(cfg, prompt_tokens={"dataset": 13})
    assert problems == [
        "rollout.max_new_tokens=500 plus the longest prompt of dataset 13 tokens exceeds the "
        "engine's context of 512 tokens (model.max_seq_len); set rollout.max_new_tokens to at "
        "most 499"
    ]
    assert preflight.context_problems(cfg, prompt_tokens={"dataset": 12}) == []  # 512 exactly
    cfg = load_config("tiny_cpu", ["rollout.max_new_tokens=500", "+dataset.max_prompt_tokens=20"])
    assert "dataset.max_prompt_tokens 20 tokens" in preflight.context_problems(cfg)[0]
