"""The one helper that turns an environment's observation text into token ids.

The model's sampled ids are never re-tokenized: an observation is appended to the context as
ids, and only the observation text itself is encoded. With a chat template (an HF tokenizer
folder that has one), the ids are what the template renders for a ``role`` message (default
"tool") after an assistant turn, plus the next assistant turn's generation prompt, so that the
context reads exactly as the template would render the whole conversation:

* the template must append: rendering the conversation with the message must start with the
  rendering without it (text), and encoding the two pieces separately must give the same ids as
  encoding them together (no token merge across the junction); otherwise a ValueError names the
  template and the role;
* what the template writes after an assistant turn's end-of-turn token (Qwen: the ``"\\n"`` after
  ``<|im_end|>``) belongs to the observation, since the model's turn ends at that token;
* a turn that did not end with the end-of-turn token (cut by a stop tag or a length cap) gets
  that token first, as a non-sampled observation token.

Without a chat template (``TinyTokenizer``, an HF folder without one) the observation text is
encoded as it is: the environment writes its own separators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# a fixed probe conversation: only what the template appends after it is used
_PROBE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]

ObservationEncoder = Callable[[str, int | None], list[int]]


def observation_encoder(tokenizer: Any, role: str = "tool") -> ObservationEncoder:
    """``encode(text, last_token_id) -> ids``: the observation ids to append after a model turn
    whose last sampled id is ``last_token_id`` (None: the turn is empty)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return lambda text, last_token_id=None: [int(t) for t in tokenizer.encode(text)]
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    eot = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
    base = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=False)
    cut = base.rfind(eot) + len(eot) if eot and eot in base else len(base)
    head, gap = base[:cut], base[cut:]  # gap: what follows the end-of-turn token
    eot_ids = [int(t) for t in tokenizer.encode(eot)] if eot and eot in base else []

    def encode(text: str, last_token_id: int | None = None) -> list[int]:
        msgs = [*_PROBE, {"role": role, "content": text}]
        full = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError(
                f"the chat template of {name} is not append-only for a {role!r} message: the "
                f"conversation rendered with it does not start with the rendering without it; "
                "return observation ids from the environment instead, or use another template"
            )
        piece = gap + full[len(base) :]
        ids = [int(t) for t in tokenizer.encode(piece)]
        if [int(t) for t in tokenizer.encode(head)] + ids != [
            int(t) for t in tokenizer.encode(head + piece)
        ]:
            raise ValueError(
                f"the chat template of {name}: the {role!r} message's tokens merge with the "
                "assistant turn's end when encoded together, so appending ids would drift from "
                "the rendered text; return observation ids from the environment instead"
            )
        ended_turn = last_token_id is not None and [last_token_id] == eot_ids
        return (eot_ids if eot_ids and not ended_turn else []) + ids

    return encode
