"""minippo against TRL's ``GRPOTrainer`` on the same problem: the same initial weights (a seeded
minippo model exported as an HF folder), the same token ids, prompts, reward function, group size,
batch, max new tokens, temperature, optimizer, lr schedule and GRPO loss settings.

Three settings run one after another, interleaved (A/B/C/A/B/C, so that a busy machine slows all
alike), each in its own process tree:

    sync   minippo, rollout.max_staleness=0 (generate, then train)
    async  minippo, rollout.max_staleness=1 (the engine process generates batch k+1 while the
           trainer trains on batch k)
    trlN   trl.GRPOTrainer with transformers ``generate()`` (its default generation path) and N
           torch threads (``--trl-threads``, default 1)

Both minippo settings use ``ppo.minibatches=1``, ``ppo.whiten_advantages=false``: one optimizer
step per batch, as TRL with ``steps_per_generation`` = gradient accumulation steps. sync uses the
correction ``rollout_logprobs`` (the PPO ratio against the engine's logprobs, no extra scoring
forward: on-policy, like TRL's ratio of 1); async uses ``--async-correction`` (default ``tis``:
the ratio against the weights at the start of the step, with the truncated importance weight to
the sampling version; with one optimizer step per batch those are the training forward's own
weights, so no scoring forward is added; ``rollout_logprobs`` anchors the clip at the previous
version, which on ``long`` clips a quarter of the tokens and learns less per step). minippo's
policy loss is its fused lm_head + loss pass (``models.fused_policy_loss``, the recipe's only path).

Three workloads (the third runs only when named):

    copy   tiny_cpu's copy task ("3012=" -> "3012", PerPositionMatch) with GRPO: the 0.1M
           qwen3_tiny model, 4 new tokens at most, stop at EOS; time to a reward threshold.
    long   a Qwen3-shaped model of ~19M parameters (qk-norm, GQA, SwiGLU, tied embeddings)
           writes 128 tokens (no stop) after a 6-token prompt, scored by ``RepeatMatch`` (the
           prompt's string repeated): generation-heavy; speed at equal learning per step.
    long10m  the same as long on a ~10.6M-parameter model (hidden 384, 6 heads of 64, 3 KV
           heads, SwiGLU 1152): the narrow end of the 10-30M range.

Per run: seconds per step (median over the steps after the first ``warm``), generated tokens/s
(tokens / time over the same steps), the first step whose 3-step mean reward reaches the
threshold and the training time up to it (start-up excluded), the wall time of the whole process,
and the peak PSS of its process tree (trainer and engine processes; /proc/*/smaps_rollup sampled
every 0.25 s). Where a step goes, medians: "gen s/step", the generation (minippo: the engine's
``rollout/gen_time_s``, hidden behind the update when async; TRL: its calls of the model's
``generate``), and "update s/step", the rest of the step (minippo: ``perf/train_s``, the PPO update
alone; TRL: step − generation). Needs ``trl`` (``pip install -e .[bench]``).

    python benchmarks/vs_trl.py --quick          # 3 steps of each setting on copy, in parallel
    python benchmarks/vs_trl.py                  # the table of docs/benchmarks.md
    python benchmarks/vs_trl.py --workloads long --repeats 3
    python benchmarks/vs_trl.py --workloads long10m --seeds 0 1 2 3 4 --repeats 1   # learning
                                                  # per step over 5 seeds, paired against TRL
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

try:  # run as a script: benchmarks/ is on sys.path
    from _common import DEFAULT_OUT, REPO, ci95, load_average, machine, markdown_table, run_recipe
except ImportError:  # imported as benchmarks.vs_trl (the recipe instantiates RepeatMatch)
    from benchmarks._common import (
        DEFAULT_OUT,
        REPO,
        ci95,
        load_average,
        machine,
        markdown_table,
        run_recipe,
    )

from minippo import models
from minippo.data.tasks import digit_task
from minippo.models import TinyTokenizer

THRESHOLD_WINDOW = 3  # steps in the moving mean that must reach the threshold


class RepeatMatch:
    """The fraction of ``length`` positions where the completion repeats the answer:
    reward = Σ_{i<length} [c_i == a_{i mod len(a)}] / length (c = completion, a = answer).

    A reward for long responses from a short prompt: ``"3012="`` asks for ``"301230123012..."``.
    Missing characters count as wrong; characters past ``length`` are ignored.
    """

    max_value = 1.0

    def __init__(self, length: int = 128) -> None:
        if length < 1:
            raise ValueError(f"RepeatMatch length must be >= 1, got {length}")
        self.length = length

    def __call__(self, example: Any, completion: str) -> float:
        a = example.answer
        hits = sum(c == a[i % len(a)] for i, c in enumerate(completion[: self.length]))
        return hits / self.length


@dataclass
class Workload:
    """One problem, as both trainers see it."""

    name: str
    model: dict  # ModelArgs fields over qwen3_tiny's (vocab = TinyTokenizer's 51)
    steps: int
    warm: int  # steps left out of s/step and tokens/s (start-up, first publish)
    groups: int  # prompts per step
    samples: int  # responses per prompt (GRPO group size)
    max_new_tokens: int
    stop_at_eos: bool
    micro: int  # rows per forward/backward (gradient accumulation over rows / micro)
    lr: float
    reward: dict  # the minippo reward component
    threshold: float | None  # reward for "time to threshold" (None: not reported)
    length: int = 4  # copy-task string length
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.groups * self.samples


REWARD_PER_POSITION = {"_component_": "minippo.data.rewards.PerPositionMatch"}
WORKLOADS = {
    "copy": Workload(
        name="copy",
        model={},
        steps=60,
        warm=3,
        groups=32,
        samples=4,
        max_new_tokens=4,
        stop_at_eos=True,
        micro=16,
        lr=3e-3,
        reward=REWARD_PER_POSITION,
        threshold=0.3,
    ),
    "long": Workload(
        name="long",
        model=dict(
            dim=512, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, intermediate_size=1536
        ),
        steps=8,
        warm=2,
        groups=4,
        samples=4,
        max_new_tokens=128,
        stop_at_eos=False,
        micro=8,
        lr=3e-4,
        reward={"_component_": "benchmarks.vs_trl.RepeatMatch", "length": 128},
        threshold=None,
    ),
}
# The same problem on a narrower model at the bottom of the 10-30M range (hidden 384, 6 layers:
# 10.6M parameters): the update costs about half of long's, generation per token about as much
WORKLOADS["long10m"] = Workload(
    **{
        **WORKLOADS["long"].__dict__,
        "name": "long10m",
        "model": dict(
            dim=384, n_layers=6, n_heads=6, n_kv_heads=3, head_dim=64, intermediate_size=1152
        ),
    }
)


def quick_workload(w: Workload) -> Workload:
    """The same problem, 3 steps, a smaller batch: checks that every code path runs."""
    return Workload(**{**w.__dict__, "steps": 3, "warm": 1, "groups": 8, "micro": 8})


# ----------------------------------------------------------------------------------------------
# The shared problem: weights, tokenizer, prompts, reward


def model_args(w: Workload) -> models.ModelArgs:
    args = models.qwen3_tiny(vocab_size=TinyTokenizer().vocab_size)
    return models.ModelArgs(**{**args.__dict__, **w.model})


def export_problem(w: Workload, folder: Path) -> int:
    """Write the seeded initial model as an HF folder and a ``tokenizer.json`` with TinyTokenizer's
    ids into ``folder``; returns the parameter count."""
    torch.manual_seed(w.seed)
    model = models.init_weights(models.Transformer(model_args(w)), seed=w.seed)
    models.save_pretrained(model, folder)
    save_hf_tokenizer(folder, stop_at_eos=w.stop_at_eos)
    return sum(p.numel() for p in model.parameters())


def save_hf_tokenizer(folder: Path, *, stop_at_eos: bool) -> None:
    """TinyTokenizer as a transformers fast tokenizer: one id per character, the same ids, decode
    joins the characters and drops the special tokens. Without ``stop_at_eos`` the tokenizer's
    EOS is an extra token the 51-id model can never sample (TRL then generates to the length
    limit, like minippo's ``rollout.stop_at_eos=false``); ``<eos>`` stays a skipped special."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    tiny = TinyTokenizer()
    vocab = {s: i for i, s in enumerate(tiny.itos)}
    eos = "<eos>"
    if not stop_at_eos:
        eos = "<never>"
        vocab[eos] = len(vocab)
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    specials = ["<pad>", "<bos>", "<eos>", *([eos] if not stop_at_eos else [])]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token=eos,
        additional_special_tokens=[s for s in specials if s not in ("<pad>", "<bos>", eos)],
        padding_side="left",
    )
    fast.save_pretrained(folder)


def problem_dataset(w: Workload):
    """The prompts of both trainers: tiny_cpu's copy-task set (minippo's ``digit_task``)."""
    return digit_task(
        TinyTokenizer(), op="copy", length=w.length, alphabet="0123", num_prompts=4096, seed=w.seed
    )


def build_reward(spec: dict):
    """The minippo reward component ``spec`` (``{"_component_": path, **kwargs}``)."""
    from minippo.config import instantiate

    return instantiate(dict(spec))


# ----------------------------------------------------------------------------------------------
# Measuring: peak PSS of a process tree


class PssPeaks:
    """Peak PSS (bytes) of the process trees of this process's children, sampled every
    ``interval`` s from /proc/<pid>/smaps_rollup; a child is named by the first ``keys`` string
    its command line contains (its output folder)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.keys: list[str] = []
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PssPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry.name))
        return kids

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def sample(self) -> None:
        kids = self._children()
        for root in kids.get(os.getpid(), []):
            try:
                cmd = Path(f"/proc/{root}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            key = next((k for k in self.keys if k in cmd), None)
            if key is None:
                continue
            total, todo = 0, [root]
            while todo:
                pid = todo.pop()
                total += self._pss(pid)
                todo += kids.get(pid, [])
            self.peak[key] = max(self.peak.get(key, 0), total)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


# ----------------------------------------------------------------------------------------------
# One run of each setting


@dataclass
class Run:
    """One finished run: per-step times (s), generated tokens and mean rewards."""

    setting: str
    step_s: list[float]
    tokens: list[float]
    rewards: list[float]
    wall_s: float
    gen_s: list[float] = field(default_factory=list)  # per step: generation
    update_s: list[float] = field(default_factory=list)  # per step: the optimizer update
    pss_mib: float = 0.0
    extra: dict = field(default_factory=dict)

    def figures(self, w: Workload) -> dict[str, float]:
        times, toks = self.step_s[w.warm :], self.tokens[w.warm :]
        out = {
            "s_per_step": statistics.median(times),
            "tokens_per_s": sum(toks) / sum(times),
            "final_reward": statistics.fmean(self.rewards[-5:]),
            "gen_s": statistics.median(self.gen_s[w.warm :]) if self.gen_s else math.nan,
            "update_s": statistics.median(self.update_s[w.warm :]) if self.update_s else math.nan,
            "wall_s": self.wall_s,
            "pss_mib": self.pss_mib,
            "threshold_step": math.nan,
            "threshold_s": math.nan,
        }
        if w.threshold is not None:
            k = THRESHOLD_WINDOW
            for i in range(k - 1, len(self.rewards)):
                if statistics.fmean(self.rewards[i - k + 1 : i + 1]) >= w.threshold:
                    out["threshold_step"] = float(i)
                    out["threshold_s"] = sum(self.step_s[: i + 1])
                    break
        return out


CORRECTIONS = {"rollout_logprobs": "RolloutLogprobs", "tis": "TIS"}


def minippo_overrides(
    w: Workload,
    folder: Path,
    setting: str,
    *,
    async_correction: str = "tis",
    extra: tuple[str, ...] = (),
) -> list[str]:
    reward = [f"reward.{k}={v}" for k, v in w.reward.items() if k != "_component_"]
    staleness = {"sync": 0, "async": 1}[setting]
    correction = "rollout_logprobs" if setting == "sync" else async_correction
    return [
        f"seed={w.seed}",
        f"total_steps={w.steps}",
        f"checkpoint_path={folder}",
        f"dataset.length={w.length}",
        f"reward._component_={w.reward['_component_']}",
        *(f"+{r}" for r in reward),
        "advantage_estimator=grpo",
        "grpo.normalize_std=true",
        "ppo.whiten_advantages=false",  # TRL uses the group-normalised advantages as they are
        "ppo.epochs=1",
        "ppo.minibatches=1",  # one optimizer step per batch, as TRL's default
        f"ppo.micro_batch_size={w.micro}",
        "ppo.loss_agg_mode=token-mean",
        "ppo.clip_low=0.2",
        "ppo.clip_high=0.2",
        "ppo.max_grad_norm=1.0",
        "kl.coef=0.0",
        f"optimizer.lr={w.lr}",
        "optimizer.betas=[0.9,0.99]",  # TRL's adam_beta2 below (tiny_cpu itself uses 0.95)
        "ppo.max_update_kl=null",  # TRL has no update bound (tiny_cpu bounds each actor step)
        "lr_scheduler.min_lr_ratio=0.1",
        f"lr_scheduler.total_steps={w.steps}",  # TRL's cosine spans the run (tiny_cpu's ends at 40)
        "lr_scheduler.warmup_steps=0",  # as TRL's run (tiny_cpu itself warms up)
        f"rollout.groups_per_batch={w.groups}",
        f"rollout.samples_per_prompt={w.samples}",
        f"rollout.max_new_tokens={w.max_new_tokens}",
        f"rollout.stop_at_eos={str(w.stop_at_eos).lower()}",
        "rollout.temperature=1.0",
        f"rollout.max_staleness={staleness}",
        # sync: the PPO ratio's denominator is the engine's logprobs, no extra scoring forward,
        # like TRL with one generation per optimizer step (its ratio is 1 by construction)
        "~correction",
        f"+correction._component_=minippo.rl.correction.{CORRECTIONS[correction]}",
        *extra,
    ]


def run_minippo(
    w: Workload, folder: Path, setting: str, out: Path, threads: int, **options: Any
) -> Run:
    r = run_recipe(minippo_overrides(w, folder, setting, **options), out, threads=threads)
    if r.returncode != 0 or len(r.metrics) < w.steps:
        raise RuntimeError(f"minippo {setting} run failed ({out}):\n{r.log_tail}")
    step_s = r.series("perf/step_s")
    tokens = r.series("rollout/tokens")
    rewards = r.series("rollout/reward_mean")
    gen_s, update_s = r.series("rollout/gen_time_s"), r.series("perf/train_s")
    return Run(setting, step_s, tokens, rewards, r.wall_s, gen_s=gen_s, update_s=update_s)


def run_trl(w: Workload, folder: Path, out: Path, threads: int) -> Run:
    """This script's ``--trl-worker`` in a subprocess with ``threads`` torch threads (this checkout
    first on its path, so that the reward component resolves to this file)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"workload": w.__dict__, "folder": str(folder), "out": str(out)}))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["TRL_WORKER_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    with open(out / "run.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, __file__, "--trl-worker", str(spec)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    wall = time.perf_counter() - t0
    steps_file = out / "steps.jsonl"
    recs = (
        [json.loads(x) for x in steps_file.read_text().splitlines()] if steps_file.is_file() else []
    )
    if proc.returncode != 0 or len(recs) < w.steps:
        tail = "\n".join((out / "run.log").read_text().splitlines()[-25:])
        raise RuntimeError(f"TRL run failed ({out}):\n{tail}")
    return Run(
        f"trl{threads}",
        [r["step_s"] for r in recs],
        [r["tokens"] for r in recs],
        [r["reward"] for r in recs],
        wall,
        gen_s=[r["gen_s"] for r in recs],
        update_s=[r["step_s"] - r["gen_s"] for r in recs],
        extra={"lr": [r["lr"] for r in recs]},
    )


def trl_worker(spec_path: str) -> None:
    """Train with trl.GRPOTrainer on the problem of ``spec_path``; one JSON line per step into
    ``<out>/steps.jsonl`` (step time, generated tokens, mean reward, lr)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    w = Workload(**spec["workload"])
    folder, out = Path(spec["folder"]), Path(spec["out"])
    torch.set_num_threads(int(os.environ.get("TRL_WORKER_THREADS", "1")))

    tok = AutoTokenizer.from_pretrained(folder)
    prompts = problem_dataset(w)
    rows = [{"prompt": "<bos>" + ex.prompt, "answer": ex.answer} for ex in prompts]
    for ex, row in list(zip(prompts, rows))[:64]:  # the same token ids as minippo's prompts
        ids = tok(row["prompt"])["input_ids"]
        if tuple(ids) != ex.prompt_ids:
            raise RuntimeError(
                f"tokenizer mismatch: {ids} vs {ex.prompt_ids} for {row['prompt']!r}"
            )
    reward_obj = build_reward(w.reward)

    class _Example:
        __slots__ = ("answer", "prompt")

        def __init__(self, prompt: str, answer: str) -> None:
            self.prompt, self.answer = prompt, answer

    def reward(prompts, completions, answer, **_):
        return [
            float(reward_obj(_Example(p, a), c))
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]

    reward.__name__ = "reward"

    class StepLog(TrainerCallback):
        """Times each optimizer step (= one generation) and writes it with the step's logs (the
        Trainer logs a step after ``on_step_end``)."""

        def __init__(self) -> None:
            self.t: float | None = None
            self.step_s = math.nan
            self.f = open(out / "steps.jsonl", "w")  # noqa: SIM115

        def on_step_begin(self, args, state, control, **kw):
            if self.t is None:
                self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.step_s, self.t = now - self.t, now
            self.gen_s, gen_time[0] = gen_time[0], 0.0

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            rec = {
                "step_s": self.step_s,
                "gen_s": self.gen_s,
                "reward": logs["reward"],
                "tokens": logs["completions/mean_length"] * w.rows,
                "lr": logs.get("learning_rate", math.nan),
            }
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()

    log = StepLog()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the tokenizer's EOS is the only stop
    # the generation seconds of each step: GRPOTrainer samples with this model's ``generate``
    gen_time, generate = [0.0], model.generate

    def timed_generate(*args, **kwargs):
        t = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            gen_time[0] += time.perf_counter() - t

    model.generate = timed_generate
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=w.seed,
        max_steps=w.steps,
        per_device_train_batch_size=w.micro,
        gradient_accumulation_steps=w.rows // w.micro,  # one generation per optimizer step
        num_generations=w.samples,
        max_completion_length=w.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=w.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",  # token mean over the accumulated batch = minippo's token-mean
        scale_rewards="group",
        mask_truncated_completions=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[log],
    )

    trainer.train()
    log.f.close()


# ----------------------------------------------------------------------------------------------
# Driver


def setting_name(setting: str) -> str:
    if setting.startswith("trl"):
        n = int(setting[3:])
        return f"TRL GRPOTrainer, {n} thread{'s' if n > 1 else ''}"
    return f"minippo {setting}"


def run_workload(
    w: Workload,
    out: Path,
    settings: list[str],
    repeats: int,
    threads: int,
    parallel: bool,
    **options: Any,
) -> dict[str, list[Run]]:
    folder = out / f"{w.name}_s{w.seed}_init"
    n_params = export_problem(w, folder)
    print(
        f"\n## workload {w.name} (seed {w.seed}): {n_params / 1e6:.2f}M parameters, {w.groups} prompts x "
        f"{w.samples} samples, {w.max_new_tokens} new tokens "
        f"({'stop at EOS' if w.stop_at_eos else 'no stop'}), {w.steps} steps, first {w.warm} "
        f"left out of s/step, {repeats} run(s) per setting interleaved",
        flush=True,
    )
    runs: dict[str, list[Run]] = {s: [] for s in settings}
    with PssPeaks() as pss:

        def one(rep: int, setting: str) -> Run:
            d = out / f"{w.name}_{setting}_s{w.seed}_r{rep}"
            pss.keys.append(str(d))
            if setting.startswith("trl"):
                run = run_trl(w, folder, d, int(setting[3:]))
            else:
                run = run_minippo(w, folder, setting, d, threads, **options)
            pss.sample()
            run.pss_mib = pss.peak.get(str(d), 0) / 2**20
            f = run.figures(w)
            print(
                f"  {setting} run {rep}: {f['s_per_step']:.3f} s/step, {run.wall_s:.1f} s wall, "
                f"load average {load_average():.2f}",
                flush=True,
            )
            return run

        for rep in range(repeats):
            if parallel:  # quick mode: the figures only show that the code runs
                with ThreadPoolExecutor(max_workers=len(settings)) as pool:
                    done = list(pool.map(one, [rep] * len(settings), settings))
            else:
                done = [one(rep, s) for s in settings]
            for run in done:
                runs[run.setting].append(run)
    return runs


def report(w: Workload, runs: dict[str, list[Run]]) -> str:
    """The markdown table: medians over the runs of each setting; the ratio is against the
    fastest TRL setting."""
    settings = list(runs)
    figs = {s: [r.figures(w) for r in runs[s]] for s in settings}
    med = {s: {k: statistics.median(f[k] for f in figs[s]) for k in figs[s][0]} for s in settings}
    trl_steps = [med[s]["s_per_step"] for s in settings if s.startswith("trl")]
    best_trl = min(trl_steps) if trl_steps else math.nan  # no TRL setting run: no ratio
    heads = [
        "setting",
        "s/step",
        "steps/s",
        "steps/s vs best TRL",
        "gen tokens/s",
        "gen s/step",
        "update s/step",
        "final reward",
        "step to threshold",
        "train s to threshold",
        "wall s",
        "peak PSS MiB",
    ]
    rows = []
    for s in settings:
        m = med[s]
        rows.append(
            [
                setting_name(s),
                m["s_per_step"],
                1 / m["s_per_step"],
                best_trl / m["s_per_step"],
                m["tokens_per_s"],
                m["gen_s"],
                m["update_s"],
                m["final_reward"],
                "-" if math.isnan(m["threshold_step"]) else f"{m['threshold_step']:.0f}",
                "-" if math.isnan(m["threshold_s"]) else f"{m['threshold_s']:.1f}",
                m["wall_s"],
                m["pss_mib"],
            ]
        )
    table = markdown_table(heads, rows)
    if w.threshold is not None:
        table += (
            f"\nthreshold: mean reward of {THRESHOLD_WINDOW} consecutive steps >= {w.threshold}; "
            "train s = the step times up to it (start-up excluded)"
        )
    return table


def learning_report(w: Workload, by_seed: dict[int, dict[str, list[Run]]]) -> str:
    """Learning per step over workload seeds: each setting's final reward (mean over seeds of
    its runs' mean), and each minippo setting minus TRL, paired by seed (the same initial
    weights and prompt set), with 95% Student-t intervals over the seeds."""
    seeds = sorted(by_seed)
    settings = list(by_seed[seeds[0]])
    final = {
        s: [statistics.fmean(r.figures(w)["final_reward"] for r in by_seed[k][s]) for k in seeds]
        for s in settings
    }

    def mean_ci(xs: list[float]) -> str:
        return f"{statistics.fmean(xs):+.3f} ± {ci95(xs):.3f}"

    trl = next((s for s in settings if s.startswith("trl")), None)
    rows = []
    for s in settings:
        diff = "—"
        if trl is not None and s != trl:
            diff = mean_ci([a - b for a, b in zip(final[s], final[trl])])
        rows.append(
            [
                setting_name(s),
                mean_ci(final[s]).lstrip("+"),
                diff,
                " ".join(f"{x:.3f}" for x in final[s]),
            ]
        )
    heads = ["setting", "final reward (mean ± 95%)", "minus TRL, paired by seed", "per seed"]
    return f"learning over seeds {seeds} (final reward: mean of the last 5 steps)\n" + (
        markdown_table(heads, rows)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 steps of each setting on copy")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["copy", "long"])
    p.add_argument("--repeats", type=int, default=2, help="runs per setting (interleaved)")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="workload seeds (initial weights, prompt set, sampling), each run --repeats times; "
        "with 2 or more the report adds the learning over seeds, paired against TRL",
    )
    p.add_argument("--threads", type=int, default=1, help="minippo trainer threads")
    p.add_argument(
        "--trl-threads",
        type=int,
        nargs="+",
        default=[1],
        help="TRL torch thread counts, one setting each (minippo: 1 trainer thread + its engine "
        "process); 2 threads on 2 shared cores oversubscribe them (docs/benchmarks.md)",
    )
    p.add_argument(
        "--async-correction",
        choices=sorted(CORRECTIONS),
        default="tis",
        help="the correction of the async setting (sync: rollout_logprobs)",
    )
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="more config overrides for both minippo settings, e.g. compile=true",
    )
    p.add_argument(
        "--settings",
        nargs="+",
        choices=["sync", "async", "trl"],
        default=["sync", "async", "trl"],
        help="which settings to run (default all three)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT / "vs_trl")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_worker:
        trl_worker(a.trl_worker)
        return
    try:
        import trl
    except ImportError:
        sys.exit("vs_trl.py needs TRL: pip install -e .[bench]")
    names = ["copy"] if a.quick else a.workloads
    repeats = 1 if a.quick else a.repeats
    trl_threads = [1] if a.quick else a.trl_threads
    settings = [s for s in ("sync", "async") if s in a.settings]
    settings += [f"trl{n}" for n in trl_threads] if "trl" in a.settings else []
    print(f"machine: {machine()}")
    print(f"trl {trl.__version__}; minippo trainer {a.threads} thread(s) + its engine process")
    print(
        f"minippo: sync correction rollout_logprobs, async correction {a.async_correction}"
        + "".join(f" {x}" for x in a.set)
    )
    seeds = [0] if a.quick else a.seeds
    if len(set(seeds)) != len(seeds):
        sys.exit(f"--seeds: give each seed once, got {seeds}")
    for name in names:
        base = quick_workload(WORKLOADS[name]) if a.quick else WORKLOADS[name]
        by_seed: dict[int, dict[str, list[Run]]] = {}
        for seed in seeds:
            by_seed[seed] = run_workload(
                replace(base, seed=seed),
                a.out,
                settings,
                repeats,
                a.threads,
                parallel=a.quick,
                async_correction=a.async_correction,
                extra=tuple(a.set),
            )
        w = replace(base, seed=seeds[0])
        runs = {s: [r for k in seeds for r in by_seed[k][s]] for s in settings}
        print(report(w, runs))
        if len(seeds) > 1:
            print(learning_report(w, by_seed))
        if "trl" in a.settings:
            lr_trl = runs[settings[-1]][0].extra["lr"]
            print(f"TRL lr per step: {', '.join(f'{x:.3g}' for x in lr_trl[:4])} ...", flush=True)
    print(f"load average at the end: {load_average():.2f}")


if __name__ == "__main__":
    main()
