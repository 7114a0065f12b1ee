"""Typed containers passed between the steps of a training step.

Layout convention (the same everywhere in minippo): a batch of B sequences is stored as
``input_ids [B, P + R]`` where the prompt part ``[:, :P]`` is LEFT-padded and the response part
``[:, P:]`` is RIGHT-padded. Every per-token RL tensor (logprobs, values, advantages, versions,
masks) is response-aligned, shape ``[B, R]``: column j refers to the response token
``input_ids[:, P + j]``, whose logprob comes from the logits at position ``P + j - 1``.

Tokens not sampled by the policy (the one marker convention, also in the engine protocol): a
response position that the policy did not sample has ``response_mask == 0``, ``versions == -1``
and ``rollout_logprobs == 0``; the two kinds differ only in ``attention_mask``:

* padding (after the response): ``attention_mask`` False, no position of its own;
* an observation token of a multi-turn episode (written by an environment between model
  turns, ``minippo.env``): ``attention_mask`` True and a position of its own, so later tokens
  attend to it, exactly as the engine saw the context.

Every consumer masks with ``response_mask``, so observations are excluded from the policy loss,
KL, entropy, the token-mean denominators, advantage whitening, the correction's statistics and
keep-masks, and the staleness count (``versions >= 0``). GAE skips them: a masked position is not
a transition, so the value after a model turn's last token is the critic's value before the
next model turn's first token (the state that includes the observation), discounted once, as
AReaL and verl do; a reward sits on the episode's last model token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class RolloutBatch:
    """Rollouts of one training step, as the rollout queue hands them to the trainer.

    Fields (B sequences, P padded prompt length, R padded response length):
        input_ids:        int64 [B, P + R]  left-padded prompt | right-padded response
        attention_mask:   bool  [B, P + R]  True on real (non-pad) tokens
        position_ids:     int64 [B, P + R]  0-based positions of real tokens (pads: 0)
        response_mask:    float32 [B, R]    1.0 on generated tokens, 0.0 on padding and on
                                            observation tokens (module docstring)
        rollout_logprobs: float32 [B, R]    μ: the engine's logprob of each sampled token
                                            (log_softmax(logits / T) over the full vocab); 0 on pads
        versions:         int64 [B, R]      weight version that sampled each token; -1 on pads
                                            and observation tokens
        rewards:          float32 [B]       scalar reward of each sequence
        group_ids:        int64 [B]         index of the prompt a sample came from (GRPO groups)
        truncated:        bool  [B]         True when the response was cut by max_new_tokens
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    truncated: torch.Tensor

    @property
    def prompt_len(self) -> int:
        """P, the padded prompt length."""
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with every tensor on ``device``."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        """The sub-batch of the given rows (a minibatch), every field indexed alike."""
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def padded_to(self, prompt_len: int, response_len: int) -> RolloutBatch:
        """The same rows with prompts left-padded to ``prompt_len`` and responses right-padded to
        ``response_len`` (each at least the batch's own), so that rows of two batches can be
        stacked. New pads: token 0 (never attended to or scored), mask False, position 0,
        logprob 0, version -1."""
        P, R = self.prompt_len, self.response_mask.shape[1]
        if prompt_len < P or response_len < R:
            raise ValueError(
                f"padded_to({prompt_len}, {response_len}) is narrower than the batch ({P}, {R})"
            )
        left, right = prompt_len - P, response_len - R

        def seq(t: torch.Tensor) -> torch.Tensor:  # [B, P + R]
            return torch.nn.functional.pad(t, (left, right), value=0)

        def resp(t: torch.Tensor, value: float) -> torch.Tensor:  # [B, R]
            return torch.nn.functional.pad(t, (0, right), value=value)

        return replace(
            self,
            input_ids=seq(self.input_ids),
            attention_mask=seq(self.attention_mask),
            position_ids=seq(self.position_ids),
            response_mask=resp(self.response_mask, 0.0),
            rollout_logprobs=resp(self.rollout_logprobs, 0.0),
            versions=resp(self.versions, -1),
        )
