"""The :class:`MultiTurn` settings of a run from its config (``env`` and ``multi_turn``)."""

from __future__ import annotations

from typing import Any

from minippo.env.base import MultiTurn
from minippo.env.observation import observation_encoder


def build_multi_turn(cfg: Any, tokenizer: Any, vocab_size: int, budget: int) -> MultiTurn | None:
    """None when ``env`` is null (single-turn samples); else the instantiated environment with
    its stop ids (``env.stop_tokens``, each one token of ``tokenizer``), the observation encoder
    and the ``multi_turn`` budgets and fault settings (their defaults: ``ASYNC_PPO_SCHEMA``);
    ``budget``: the whole response's tokens (the per-turn cap when ``max_turn_tokens`` is null)."""
    from minippo.config import instantiate
    from minippo.training import preflight

    if preflight.setting(cfg, "env") is None:
        return None
    env = instantiate(cfg.env)
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise TypeError(
                f"env._component_ {cfg.env._component_} has no {method}() method; an environment "
                "needs reset(prompt, seed) and step(state, turn) (minippo.env.Environment)"
            )
    stop_tokens = list(getattr(env, "stop_tokens", ()) or ())
    key = f"{type(env).__name__}.stop_tokens"
    stops = preflight.stop_ids(tokenizer, stop_tokens or None, stop_at_eos=False, key=key)

    def setting(name: str) -> Any:
        return preflight.setting(cfg, f"multi_turn.{name}")

    cap = setting("max_turn_tokens")
    return MultiTurn(
        env,
        encode_observation=observation_encoder(tokenizer, setting("observation_role")),
        vocab_size=int(vocab_size),
        max_turns=int(setting("max_turns")),
        max_turn_tokens=int(cap if cap is not None else budget),
        stop_token_ids=stops,
        step_timeout_s=float(setting("step_timeout_s")),
        on_error=str(setting("on_error")),
        workers=int(setting("workers")),
    )
