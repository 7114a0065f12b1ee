"""Prompt data: examples and datasets, loading with ``datasets`` + chat templates, toy tasks,
rewards.

* :class:`PromptExample`, :class:`PromptDataset`, :class:`PromptStream` (seeded epochs).
* :func:`load_prompt_dataset` (local json/jsonl/parquet/csv or hub names), :func:`format_prompt`.
* ``minippo.data.tasks``: toy tasks (``arithmetic_task``, ``digit_task``) for tiny models.
* ``minippo.data.rewards``: ``ExactMatch``, ``PerPositionMatch``, ``MathAnswerMatch`` (math answers,
  checked by math-verify with numeric fast paths).
* ``minippo.data.samples``: small data files (``SAMPLES_DIR``) for tests and smoke runs.
"""

from pathlib import Path

from minippo.data.loading import format_prompt, load_prompt_dataset, load_rows
from minippo.data.prompts import PromptDataset, PromptExample, PromptStream
from minippo.data.rewards import (
    ExactMatch,
    MathAnswerMatch,
    PerPositionMatch,
    answers_match,
    extract_answer,
    normalize_answer,
)

SAMPLES_DIR = Path(__file__).parent / "samples"

__all__ = [
    "SAMPLES_DIR",
    "ExactMatch",
    "MathAnswerMatch",
    "PerPositionMatch",
    "PromptDataset",
    "PromptExample",
    "PromptStream",
    "answers_match",
    "extract_answer",
    "format_prompt",
    "load_prompt_dataset",
    "load_rows",
    "normalize_answer",
]
