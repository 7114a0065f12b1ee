"""Packed passes vs padded ones: one PPO update (actor and critic) on long-tailed lengths.

The minibatch is a rollout batch as the trainer gets it (``collate_completions``: prompts
left-padded to the longest, responses right-padded to the longest), prompts of 8 to 24 tokens
(``long_tail.prompt_ids``) and response lengths drawn as in ``benchmarks/long_tail.py``:
lognormal, p99 / p50 = 9, capped at 24 medians. One update is what ``_ppo_updates`` does for one
minibatch: per micro-batch the actor's fused policy loss (``models.fused_policy_loss``) and the
critic's clipped value loss, backward, then one AdamW step of each model.

    padded          ``ppo.pack: false``: micro-batches of ``--micro-rows`` rows of the padded
                    batch (the ``[rows, 1, S, S]`` mask, B·S positions in all)
    packed, rows    ``ppo.pack: true``, the same micro-batches of rows: real tokens only
    packed, budget  ``ppo.pack: true`` with ``ppo.max_tokens_per_micro_batch`` = micro-rows × S
                    (the same bound on a forward's tokens as the padded micro-batch, so the same
                    worst-case memory): fewer forwards, balanced by
                    ``minippo.training.micro_batches``

Reported: the tokens the forwards compute on (every linear layer's rows) and real / processed;
the attention's score entries (the padded batch's B·S²/2 causal entries, or the packed buckets'
right-padded ones) against those of the sequences alone; the update's wall time (median of
``--repeats`` interleaved runs: padded, packed, packed, padded, ...) and its peak of live tensor
bytes (``TensorMemoryTracker``, parameters and optimizer states included), and that peak above the
state that stays after the update (parameters and optimizer states): the update's working memory.
The same model, weights and batch for every variant.

Then the ranks' balance (``ppo.balance_ranks``, no model run): the real tokens of each rank's
batch as its engine sampled it and after whole groups moved (``rank_balance.assign_groups``),
as the heaviest rank's over the mean (FSDP's forwards wait for the heaviest rank), for the 8-GPU
config's shape: 8 ranks x 16 groups x 8 samples, responses long-tailed with median 1000 tokens
(p99 / p50 = 9, capped at 4096), over 200 seeded draws.

    python benchmarks/packing.py              # 32 rows, median 32 tokens, 5 repeats (~3 min)
    python benchmarks/packing.py --quick      # 8 rows, the tiny model, 1 repeat (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch

from minippo import models, rl
from minippo.engine.protocol import Completion
from minippo.models import ModelArgs, Transformer, ValueModel, init_weights, pack, qwen3_tiny
from minippo.training.micro_batches import split_rows
from minippo.training.rank_balance import assign_groups
from minippo.training.rollout_queue import collate_completions

try:
    from _common import TensorMemoryTracker, machine, markdown_table
    from long_tail import TAIL_RATIO, LengthTable, prompt_ids
except ImportError:  # imported from the repository root (tests)
    from benchmarks._common import TensorMemoryTracker, machine, markdown_table
    from benchmarks.long_tail import TAIL_RATIO, LengthTable, prompt_ids


def small_model() -> ModelArgs:
    """A 4-layer Qwen3 of ~1.5M parameters: large enough that the matmuls, not the per-op
    overhead, dominate a forward at a few thousand tokens."""
    return replace(
        qwen3_tiny(vocab_size=1024), dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16,
        intermediate_size=384,
    )  # fmt: skip


def rollout_batch(args: ModelArgs, rows: int, median: float, seed: int):
    """The minibatch: ``rows`` completions with prompts of 8-24 tokens and long-tailed response
    lengths (``LengthTable``), collated as the rollout queue collates them."""
    lengths = LengthTable(median, cap=int(24 * median), seed=seed)
    g = torch.Generator().manual_seed(seed)
    completions = []
    for i in range(rows):
        n = lengths(i, 0, 0)
        completions.append(
            Completion(
                request_id=f"r{i}",
                prompt_ids=prompt_ids(i, args.vocab_size),
                token_ids=torch.randint(1, args.vocab_size, (n,), generator=g).tolist(),
                logprobs=[-1.0] * n,
                versions=[0] * n,
                finish_reason="length",
            )
        )
    return collate_completions(completions, list(range(rows)))


def micro_batches(batch, rows: int, budget: bool) -> list[torch.Tensor]:
    """The forwards of one minibatch: rows of ``rows``, or a token budget of rows × S."""
    B, S = batch.input_ids.shape
    tokens = rows * S if budget else None
    lengths = batch.attention_mask.sum(1)
    (micros,) = split_rows(
        [torch.arange(B)], lengths, max_tokens=tokens, max_rows=rows, device="cpu"
    )
    return micros


def rank_loads(draws: int, ranks: int = 8, groups: int = 16, samples: int = 8) -> dict:
    """Heaviest rank's real tokens over the mean, as sampled and balanced, per draw."""
    out: dict[str, list[float]] = {"sampled": [], "balanced": []}
    for seed in range(draws):
        lengths = LengthTable(1000, cap=4096, seed=seed)
        tokens = [
            sum(len(prompt_ids(g, 1024)) + lengths(g, j, 0) for j in range(samples))
            for g in range(ranks * groups)
        ]
        sampled = [sum(tokens[r * groups : (r + 1) * groups]) for r in range(ranks)]
        balanced = [sum(tokens[g] for g in gs) for gs in assign_groups(tokens, [groups] * ranks)]
        for name, loads in (("sampled", sampled), ("balanced", balanced)):
            out[name].append(max(loads) * ranks / sum(loads))
    return out


def update(actor, critic, opts, batch, inputs, micros, packed: bool) -> None:
    """One minibatch of ``_ppo_updates``: actor fused policy loss + critic value loss per
    micro-batch (shares of the minibatch's global token count), backward, one step each."""
    m = batch.response_mask
    counts = rl.global_counts(m)
    P = batch.prompt_len
    for rows in micros:
        mb = batch.select(rows)
        layout = pack(mb.attention_mask, start=P) if packed else None
        kw = dict(position_ids=mb.position_ids, start=P, packed=layout)
        if not packed:
            kw["attention_mask"] = mb.attention_mask
        spec = models.FusedLossSpec(
            anchor_logprobs=inputs["anchor"][rows],
            advantages=inputs["adv"][rows],
            response_mask=mb.response_mask,
            global_tokens=counts.tokens,
            global_seqs=counts.seqs,
        )
        models.fused_policy_loss(actor, mb.input_ids, spec, **kw).loss.backward()
        values = critic(
            mb.input_ids,
            position_ids=mb.position_ids,
            attention_mask=None if packed else mb.attention_mask,
            packed=layout,
        )
        v, _ = rl.split_critic_values(values.float(), mb.response_mask)
        vloss, _ = rl.value_loss(
            v,
            inputs["old_values"][rows],
            inputs["returns"][rows],
            mb.response_mask,
            global_tokens=counts.tokens,
            global_seqs=counts.seqs,
        )
        vloss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def attention_entries(batch, micros, packed: bool) -> int:
    """Causal score entries the attention computes: L(L+1)/2 per (padded) sequence or bucket."""
    total = 0
    for rows in micros:
        mask = batch.attention_mask[rows]
        if not packed:
            S = mask.shape[1]
            total += len(rows) * S * (S + 1) // 2
        else:
            total += sum(b.count * b.length * (b.length + 1) // 2 for b in pack(mask).buckets)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="sequences in the minibatch")
    ap.add_argument("--median", type=float, default=32, help="median response length")
    ap.add_argument("--micro-rows", type=int, default=4, help="rows per padded micro-batch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 rows, the tiny model, 1 repeat")
    a = ap.parse_args()
    if a.quick:
        a.rows, a.median, a.micro_rows, a.repeats = 8, 8, 2, 1
    torch.set_num_threads(a.threads)
    args = qwen3_tiny(vocab_size=64) if a.quick else small_model()
    batch = rollout_batch(args, a.rows, a.median, a.seed)
    B, S = batch.input_ids.shape
    lengths = batch.attention_mask.sum(1).float()
    resp = batch.response_mask.sum(1)
    g = torch.Generator().manual_seed(a.seed)
    m = batch.response_mask
    inputs = {
        "anchor": -torch.rand(m.shape, generator=g) * 5 * m,
        "adv": torch.randn(m.shape, generator=g) * m,
        "old_values": torch.randn(m.shape, generator=g) * m,
        "returns": torch.randn(m.shape, generator=g) * m,
    }
    actor0 = init_weights(Transformer(args), seed=1)
    critic0 = init_weights(ValueModel(args), seed=2)
    print(machine())
    print(
        f"model: D={args.dim}, {args.n_layers} layers, V={args.vocab_size}; minibatch {B} rows "
        f"padded to S={S} (prompts 8-24, responses: median {resp.median():.0f}, "
        f"p99/p50 target {TAIL_RATIO:g}, longest {resp.max():.0f}); padded micro-batches of "
        f"{a.micro_rows} rows, packed budget {a.micro_rows * S} tokens; {a.threads} thread(s)"
    )
    real = int(lengths.sum())
    runs: dict[str, dict] = {}
    variants = (
        ("padded", False, False),
        ("packed, rows", True, False),
        ("packed, budget", True, True),
    )
    for name, packed, budget in variants:
        micros = micro_batches(batch, a.micro_rows, budget)
        processed = B * S if not packed else real
        runs[name] = dict(packed=packed, micros=micros, processed=processed, times=[], peak=0)
    order = list(runs)
    for r in range(a.repeats):  # interleaved, the order reversed every other repeat
        for name in order if r % 2 == 0 else order[::-1]:
            run = runs[name]
            actor = init_weights(Transformer(args), seed=1)
            actor.load_state_dict(actor0.state_dict())
            critic = init_weights(ValueModel(args), seed=2)
            critic.load_state_dict(critic0.state_dict())
            opts = [torch.optim.AdamW(x.parameters(), lr=1e-4) for x in (actor, critic)]
            tracker = TensorMemoryTracker()
            tracker.track(actor, critic, batch.input_ids)
            t0 = time.perf_counter()
            with tracker:
                update(actor, critic, opts, batch, inputs, run["micros"], run["packed"])
            run["times"].append(time.perf_counter() - t0)
            run["peak"] = max(run["peak"], sum(tracker.peak.values()))
            # what stays after the update: parameters and optimizer states (gradients freed)
            run["state"] = sum(tracker.current.values())
    table = []
    for name, run in runs.items():
        exact = int((lengths * (lengths + 1) / 2).sum())
        entries = attention_entries(batch, run["micros"], run["packed"])
        table.append(
            [
                name,
                run["processed"],
                real / run["processed"],
                exact / entries,
                len(run["micros"]),
                statistics.median(run["times"]),
                run["peak"] / 2**20,
                (run["peak"] - run["state"]) / 2**20,
            ]
        )
    print()
    print(
        markdown_table(
            [
                "pass",
                "tokens processed",
                "real / processed",
                "attention: real / computed entries",
                "forwards",
                "update s (median)",
                "peak MiB",
                "peak above the state MiB",
            ],
            table,
        )
    )
    pad, rows, pk = runs["padded"], runs["packed, rows"], runs["packed, budget"]
    speedup = statistics.median(pad["times"]) / statistics.median(pk["times"])
    print()
    print(f"real/processed: {real / pk['processed']:.3f} (padded: {real / pad['processed']:.3f})")
    print(f"speedup: {speedup:.2f} (packed with the token budget vs padded; same rows: "
          f"{statistics.median(pad['times']) / statistics.median(rows['times']):.2f})")  # fmt: skip

    def above(run: dict) -> float:
        return run["peak"] - run["state"]

    print(
        f"peak memory / padded: packed, same rows {rows['peak'] / pad['peak']:.2f}; packed, "
        f"same token bound {pk['peak'] / pad['peak']:.2f} (above the state: "
        f"{above(rows) / above(pad):.2f}, {above(pk) / above(pad):.2f})"
    )
    loads = rank_loads(20 if a.quick else 200)
    print(
        "rank tokens max/mean: "
        + ", ".join(
            f"{name} {statistics.median(v):.3f} (worst {max(v):.3f})" for name, v in loads.items()
        )
        + f" (8 ranks x 16 groups x 8 samples, median of {len(loads['sampled'])} draws)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
