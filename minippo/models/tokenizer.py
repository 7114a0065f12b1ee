"""Tokenizers: HF ``tokenizer.json`` folders (through the ``tokenizers`` library) and a tiny built-in
character tokenizer for toy tasks. Both satisfy the :class:`Tokenizer` protocol."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["HFTokenizer", "TinyTokenizer", "Tokenizer", "load_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of minippo needs from a tokenizer.

    eos_ids holds every id that ends a generation (``eos_id`` is its first element); pad_id is used
    for padding only (never scored); bos_id is None when the model has no BOS token.
    """

    eos_id: int
    eos_ids: tuple[int, ...]
    pad_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


# ----------------------------------------------------------------------------------------------
# TinyTokenizer

_TINY_SPECIALS = ("<pad>", "<bos>", "<eos>")
_TINY_CHARS = "0123456789" + " +-*=()" + "abcdefghijklmnopqrstuvwxyz" + "?.,:\n"


class TinyTokenizer:
    r"""Character-level tokenizer for toy tasks (arithmetic, short words); fits ``qwen3_tiny()``.

    Vocabulary (51 ids, plus ``extra_tokens``, plus reserved ids up to ``vocab_size``):
        0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``,
        3-12 digits ``0``-``9``, 13-19 `` +-*=()`` (space first),
        20-45 lowercase ``a``-``z``, 46-50 ``?`` ``.`` ``,`` ``:`` and newline,
        51... ``extra_tokens`` in their order.
    ``encode`` maps each character to one id (no BOS/EOS added) and rejects any other character;
    an extra token of several characters (``"\boxed{"``) is one id, like a BPE merge, taken
    wherever it matches (the longest extra token first).
    Chat template: the message contents joined by newlines; with ``add_generation_prompt`` a final
    newline is appended (the answer follows it).

    Args:
        extra_tokens: tokens appended after id 50: new characters (``"}"``) or strings of several
            characters (``"\boxed{"``, so that a randomly initialised model can sample the answer
            format of math rewards as one token). The 51 ids above never change; ``vocab_size``
            grows by ``len(extra_tokens)``.
        vocab_size: None (the ids above only), or a larger total: the ids past the tokens are
            reserved ids that no text encodes to and that decode to nothing, as an HF tokenizer
            decodes an id it has no token for (Qwen3's embedding has 151,936 rows for 151,669
            tokens). For a randomly initialised model of a real vocabulary size on a toy task
            (``vocab_size: 151936``): its lm_head, logits and publishes have their real sizes.
    """

    def __init__(self, extra_tokens: Sequence[str] = (), vocab_size: int | None = None) -> None:
        if isinstance(extra_tokens, str):
            raise ValueError(
                f"tokenizer.extra_tokens must be a list of strings, got the string {extra_tokens!r}; "
                f"e.g. extra_tokens=['\\boxed{{', '}}']"
            )
        extra = [str(t) for t in extra_tokens]
        base = {*_TINY_SPECIALS, *_TINY_CHARS}
        for t in extra:
            if not t or t in base or extra.count(t) > 1:
                raise ValueError(
                    f"tokenizer.extra_tokens must be distinct non-empty strings that are not "
                    f"already in the vocabulary, got {t!r} in {extra!r}"
                )
        self.extra_tokens: tuple[str, ...] = tuple(extra)
        self.itos: list[str] = [*_TINY_SPECIALS, *_TINY_CHARS, *extra]
        self.stoi: dict[str, int] = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = (self.eos_id,)
        self.vocab_size = len(self.itos)
        if vocab_size is not None:
            integer = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
            if not integer or vocab_size < len(self.itos):
                raise ValueError(
                    f"tokenizer.vocab_size must be null or an integer >= {len(self.itos)} (the "
                    f"tokens: 51 + {len(extra)} extra_tokens), got {vocab_size!r}"
                )
            self.vocab_size = vocab_size  # ids past len(itos): reserved, decode to nothing
        self._merges = sorted((t for t in extra if len(t) > 1), key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        """text -> one id per character (one per multi-character extra token)."""
        ids = []
        pos = 0
        while pos < len(text):
            merged = next((t for t in self._merges if text.startswith(t, pos)), None)
            if merged is not None:
                ids.append(self.stoi[merged])
                pos += len(merged)
                continue
            ch = text[pos]
            if ch not in self.stoi:
                allowed = _TINY_CHARS + "".join(t for t in self.extra_tokens if len(t) == 1)
                raise ValueError(
                    f"TinyTokenizer cannot encode character {ch!r} at position {pos} of {text!r}; "
                    f"allowed characters: {allowed!r}"
                    + (f", extra tokens: {list(self._merges)!r}" if self._merges else "")
                )
            ids.append(self.stoi[ch])
            pos += 1
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside TinyTokenizer's vocab [0, {self.vocab_size})"
                )
            if (skip_special_tokens and i < len(_TINY_SPECIALS)) or i >= len(self.itos):
                continue  # a reserved id (past the tokens) has no text
            out.append(self.itos[i])
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        text = "\n".join(m["content"] for m in messages)
        return text + "\n" if add_generation_prompt else text


# ----------------------------------------------------------------------------------------------
# HF tokenizer folders


def _token_content(tok: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if tok is None:
        return None
    return tok["content"] if isinstance(tok, dict) else str(tok)


class HFTokenizer:
    """A ``tokenizer.json`` tokenizer with the special ids and chat template of its HF folder.

    Built by :func:`load_tokenizer`. ``encode`` adds no special tokens by default (chat templates
    write BOS themselves); ``encode(text, add_special_tokens=True)`` applies the tokenizer's
    post-processor, like ``transformers``' default.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        bos_id: int | None,
        chat_template: str | None,
        special_tokens: dict[str, str],
    ) -> None:
        self._tok = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.eos_id = self.eos_ids[0]
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self._compiled = None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the folder's jinja2 chat template (extra kwargs, such as
        ``enable_thinking``, are passed to the template)."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (no 'chat_template' key in tokenizer_config.json "
                "and no chat_template.jinja); format prompts yourself or add a template"
            )
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )


def _compile_template(source: str):
    """A sandboxed jinja2 template with the helpers HF chat templates use."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


# every file of an HF folder that ``load_tokenizer`` reads (an export copies all of them)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """Load the tokenizer of an HF folder: ``tokenizer.json`` (required), special tokens from
    ``tokenizer_config.json`` and ``generation_config.json``, the chat template from
    ``tokenizer_config.json["chat_template"]`` or ``chat_template.jinja``.

    eos_ids: generation_config ``eos_token_id`` (int or list) followed by tokenizer_config
    ``eos_token`` if not already there. pad_id: ``pad_token`` of tokenizer_config, else
    generation_config ``pad_token_id``, else the first eos id (padding is masked, never scored).
    bos_id: ``bos_token`` of tokenizer_config (an explicit null means none), else generation_config
    ``bos_token_id``. vocab_size counts the tokenizer's ids (a model's embedding may be larger).
    """
    from tokenizers import Tokenizer as _RawTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        raise FileNotFoundError(
            f"{str(tj)!r} not found: only fast tokenizers (tokenizer.json) are supported; "
            "convert with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(...)"
        )
    tok = _RawTokenizer.from_file(str(tj))
    cfg = _read_json(folder / "tokenizer_config.json")
    gen = _read_json(folder / "generation_config.json")

    def tid(name: str) -> int | None:
        content = _token_content(cfg.get(name))
        if content is None:
            return None
        i = tok.token_to_id(content)
        if i is None:
            raise ValueError(
                f"tokenizer_config.json {name} {content!r} is not in the vocabulary of {str(tj)!r}"
            )
        return i

    eos_ids: list[int] = []
    gen_eos = gen.get("eos_token_id")
    if gen_eos is not None:
        eos_ids.extend([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
    cfg_eos = tid("eos_token")
    if cfg_eos is not None and cfg_eos not in eos_ids:
        eos_ids.append(cfg_eos)
    if not eos_ids:
        raise ValueError(
            f"no eos token in {str(folder)!r}: set eos_token in tokenizer_config.json "
            "or eos_token_id in generation_config.json"
        )
    pad_id = tid("pad_token")
    if pad_id is None:
        pad_id = gen.get("pad_token_id")
    if pad_id is None:
        pad_id = eos_ids[0]
    bos_id = tid("bos_token")
    if (
        bos_id is None
        and gen.get("bos_token_id") is not None
        and cfg.get("bos_token", 0) is not None
    ):
        bos_id = gen["bos_token_id"]

    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()

    special = {
        name: _token_content(cfg.get(name)) or ""
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    return HFTokenizer(
        tok,
        eos_ids=eos_ids,
        pad_id=pad_id,
        bos_id=bos_id,
        chat_template=template,
        special_tokens=special,
    )
