"""Prompt examples, datasets of them, and the deterministic stream the rollout queue reads.

A dataset builder (a toy task in ``minippo.data.tasks`` or :func:`minippo.data.load_prompt_dataset`)
turns raw rows into :class:`PromptExample` s (prompt token ids + the reference answer the reward
compares against). :class:`PromptStream` walks a dataset epoch after epoch in a seeded order;
iterating it twice gives the same sequence, which is what makes a run reproducible and resumable
(the rollout queue skips the prompts a checkpoint already consumed).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptExample:
    """One prompt and what its reward needs.

    Fields:
        index:      position in the dataset (stable; ties a sample back to its row).
        prompt_ids: the token ids the engine is given (template applied, no padding).
        prompt:     the prompt text those ids encode (after the chat template).
        answer:     the reference answer the reward compares the completion with.
    """

    index: int
    prompt_ids: tuple[int, ...]
    prompt: str
    answer: str


class PromptDataset(Sequence[PromptExample]):
    """An in-memory list of prompt examples (toy tasks and loaded datasets alike).

    Args:
        examples: the examples; their ``index`` fields must be 0..n-1 in order.
        name: a short description used in messages.
    """

    def __init__(self, examples: Sequence[PromptExample], name: str = "prompts") -> None:
        if len(examples) == 0:
            raise ValueError(f"prompt dataset {name!r} is empty")
        for i, ex in enumerate(examples):
            if ex.index != i:
                raise ValueError(
                    f"{name}: example {i} has index {ex.index}; indices must be 0..n-1"
                )
            if len(ex.prompt_ids) == 0:
                raise ValueError(f"{name}: example {i} has an empty prompt")
        self.examples = list(examples)
        self.name = name

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):  # type: ignore[override]
        return self.examples[i]

    def max_prompt_len(self) -> int:
        """The longest prompt, in tokens."""
        return max(len(ex.prompt_ids) for ex in self.examples)

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, {len(self)} examples)"


class PromptStream:
    """An endless, re-iterable, seeded walk over a dataset: epoch after epoch.

    Epoch ``e`` visits every example once, in the order ``torch.randperm(n)`` drawn from a
    generator seeded with ``seed + e`` (or in dataset order when ``shuffle`` is False). Two
    iterations over the same stream give the same sequence.

    Data parallel: with ``world_size`` W the global sequence is dealt out round-robin, rank r
    yields items r, r + W, r + 2W, ... of it, so W ranks that each take G/W prompts per step
    together consume the same G prompts per step as a single process taking G.

    Args:
        dataset: the examples.
        seed: base seed of the shuffles.
        shuffle: shuffle each epoch.
        max_epochs: stop after this many epochs (None: never stop).
        rank / world_size: this rank's share of the global sequence.
    """

    def __init__(
        self,
        dataset: Sequence[PromptExample],
        *,
        seed: int = 0,
        shuffle: bool = True,
        max_epochs: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1 or None, got {max_epochs}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank ({rank}) < world_size ({world_size})")
        self.rank = rank
        self.world_size = world_size
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = shuffle
        self.max_epochs = max_epochs

    def epoch_order(self, epoch: int) -> list[int]:
        """The example indices of epoch ``epoch``, in visiting order."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[PromptExample]:
        epochs = itertools.count() if self.max_epochs is None else range(self.max_epochs)
        every = (i for epoch in epochs for i in self.epoch_order(epoch))
        for i in itertools.islice(every, self.rank, None, self.world_size):
            yield self.dataset[i]
