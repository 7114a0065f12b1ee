"""Prompt datasets from local files or the HF hub, formatted with the tokenizer's chat template.

``load_prompt_dataset`` reads rows with ``datasets.load_dataset``:

* local files: ``source: json`` (also .jsonl), ``parquet`` or ``csv`` with ``data_files: <path or
  list>``, or ``source: <path to one .parquet/.jsonl/.json/.csv file>``; this is what the tests
  use (``minippo/data/samples/``).
* the hub: ``source: openai/gsm8k`` (``name: main``) or ``BytedTsinghua-SIA/DAPO-Math-17k``; this
  needs network access on first use (then the HF cache), or download first with
  ``huggingface-cli download --repo-type dataset <name> --local-dir <dir>`` and point
  ``source: parquet`` + ``data_files`` at the files.

Each row gives a prompt (``prompt_key``: a string, or a list of ``{"role", "content"}`` messages
as in DAPO-Math) and a reference answer (``answer_key``); keys may be dotted paths into nested
fields (``reward_model.ground_truth``). Both keys are checked on the first row: a missing one is
a ValueError naming it and listing the fields the rows have. Prompts go through
:func:`format_prompt`. The keys of GSM8K, MATH and DAPO-Math are in docs/data.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from minippo.data.prompts import PromptDataset, PromptExample

log = logging.getLogger(__name__)

_FILE_FORMATS = ("json", "jsonl", "parquet", "csv", "text", "arrow")
# a source that is one file: its format from the suffix
_SUFFIX_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_SUFFIX_FORMATS |= {".arrow": "arrow", ".txt": "text"}


def format_prompt(
    tokenizer: Any,
    prompt: str | Sequence[Mapping[str, str]],
    *,
    template: str = "chat",
    system_prompt: str | None = None,
    prompt_suffix: str = "",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text the model is given for one prompt.

    Args:
        tokenizer: with ``apply_chat_template(messages, add_generation_prompt=True, **kw)`` for
            ``template="chat"``.
        prompt: the user's text, or a list of chat messages (then ``prompt_suffix`` is appended to
            the last user message and ``system_prompt`` is prepended if given).
        template: ``"chat"`` (the tokenizer's chat template, generation prompt added), ``"plain"``
            (the text as is), or a format string with a ``{prompt}`` field, e.g.
            ``"Question: {prompt}\\nAnswer:"``.
        system_prompt: an optional system message (chat) or prefix line (plain / format).
        prompt_suffix: appended to the user text, e.g. an instruction on the answer format.
        chat_template_kwargs: extra template variables (Qwen3: ``{enable_thinking: false}``).
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt + prompt_suffix}]
    else:
        messages = [dict(m) for m in prompt]
        if not messages or any("role" not in m or "content" not in m for m in messages):
            raise ValueError(
                f"a message-list prompt needs 'role' and 'content' in every message, got {prompt!r}"
            )
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if prompt_suffix and users:
            messages[users[-1]]["content"] += prompt_suffix
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})

    if template == "chat":
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **dict(chat_template_kwargs or {})
        )
    text = "\n".join(m["content"] for m in messages if m["role"] != "system")
    prefix = (system_prompt + "\n") if system_prompt else ""
    if template == "plain":
        return prefix + text
    if "{prompt}" not in template:
        raise ValueError(
            f"template must be 'chat', 'plain' or a format string containing '{{prompt}}', "
            f"got {template!r}"
        )
    return prefix + template.format(prompt=text)


def _get(row: Mapping[str, Any], key: str, what: str, source: str = "the rows") -> Any:
    """``row[key]`` where ``key`` may be a dotted path ``a.b.c``; a ValueError naming ``what``
    (``prompt_key`` / ``answer_key``) and listing the fields there are when one is missing."""
    value: Any = row
    path: list[str] = []
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            where = f"in {'.'.join(path)!r} " if path else ""
            if isinstance(value, Mapping):
                have = f"its fields: {', '.join(map(str, value))}"
            else:
                have = f"{'.'.join(path)!r} is a {type(value).__name__}, not a record"
            raise ValueError(
                f"{what}={key!r}: {source} have no field {part!r} {where}({have}); set {what} "
                f"to one of them"
            )
        path.append(part)
        value = value[part]
    return value


def load_rows(
    source: str,
    *,
    data_files: str | Sequence[str] | None = None,
    name: str | None = None,
    split: str = "train",
) -> Any:
    """A ``datasets.Dataset``: ``load_dataset(source, name, data_files=..., split=...)``.

    ``source`` is a file format (``json``/``jsonl``/``parquet``/``csv``) with ``data_files``, the
    path of one such file (format from its suffix), a local folder, or a hub dataset name.
    """
    import datasets

    suffix = Path(source).suffix.lower()
    if data_files is None and suffix in _SUFFIX_FORMATS:
        if not Path(source).is_file():
            raise FileNotFoundError(f"source={source!r}: no such file")
        source, data_files = _SUFFIX_FORMATS[suffix], source
    if source in _FILE_FORMATS and data_files is None:
        raise ValueError(
            f"source={source!r} reads local files: set data_files to a path (or a list of paths)"
        )
    fmt = "json" if source == "jsonl" else source
    files = (
        list(data_files)
        if isinstance(data_files, Sequence) and not isinstance(data_files, str)
        else data_files
    )
    what = f"dataset {source!r}" + (f" (data_files={data_files})" if data_files else "")
    try:
        rows = datasets.load_dataset(fmt, name, data_files=files, split=split)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what}: {e}; check dataset.data_files or dataset.source") from e
    except StopIteration:  # what `datasets` raises for an empty file
        raise ValueError(f"{what} has no rows (an empty file?)") from None
    except Exception as e:  # parse errors arrive wrapped: the cause says what is wrong
        inner = e.__cause__ or e
        raise ValueError(
            f"cannot read {what} as {fmt}: {type(inner).__name__}: {inner}; is the file "
            f"corrupt, truncated or not {fmt}?"
        ) from e
    if len(rows) == 0:
        raise ValueError(f"{what} has no rows (split {split!r})")
    return rows


def load_prompt_dataset(
    tokenizer: Any,
    *,
    source: str,
    data_files: str | Sequence[str] | None = None,
    name: str | None = None,
    split: str = "train",
    prompt_key: str = "question",
    answer_key: str = "answer",
    template: str = "chat",
    system_prompt: str | None = None,
    prompt_suffix: str = "",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_prompt_tokens: int | None = None,
    num_examples: int | None = None,
) -> PromptDataset:
    """Load rows (see :func:`load_rows`), format and tokenize them into a PromptDataset.

    Args:
        tokenizer: ``encode(str) -> list[int]`` (no special tokens added: the chat template
            writes them) and ``apply_chat_template`` for ``template="chat"``.
        source, data_files, name, split: what to load (see the module docstring).
        prompt_key / answer_key: fields (dotted paths allowed) of the prompt and the answer.
        template, system_prompt, prompt_suffix, chat_template_kwargs: see :func:`format_prompt`.
        max_prompt_tokens: drop prompts longer than this (the count is logged); None keeps all.
        num_examples: keep only the first n rows (after the length filter).
    """
    if num_examples is not None and num_examples < 1:
        raise ValueError(f"num_examples must be >= 1 or null, got {num_examples}")
    rows = load_rows(source, data_files=data_files, name=name, split=split)
    what = f"the rows of {data_files if data_files is not None else source} ({split!r})"
    if len(rows) == 0:
        raise ValueError(f"{what} are empty: check source, data_files and split")
    for key, role in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        _get(rows[0], key, role, what)  # a missing key fails here, before any tokenizing
    examples: list[PromptExample] = []
    dropped = 0
    for row in rows:
        text = format_prompt(
            tokenizer,
            _get(row, prompt_key, "prompt_key", what),
            template=template,
            system_prompt=system_prompt,
            prompt_suffix=prompt_suffix,
            chat_template_kwargs=chat_template_kwargs,
        )
        ids = tokenizer.encode(text)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        answer = str(_get(row, answer_key, "answer_key", what))
        examples.append(PromptExample(len(examples), tuple(ids), text, answer))
        if num_examples is not None and len(examples) >= num_examples:
            break
    if dropped:
        log.warning(
            "dropped %d prompts longer than max_prompt_tokens=%s", dropped, max_prompt_tokens
        )
    if not examples:
        raise ValueError(
            f"no prompts left from {source!r} (split {split!r}): all {dropped} rows are longer "
            f"than max_prompt_tokens={max_prompt_tokens}; raise it"
        )
    return PromptDataset(examples, name=f"{source}:{split}")
