"""How fast MathAnswerMatch scores completions (goal: 10,000 in under 5 s on the reference CPU).

    python benchmarks/reward_speed.py            # 10,000 completions per set (2,000 math-verify only)
    python benchmarks/reward_speed.py --quick    # 1,000 per set (200 math-verify only; CI smoke)

Completions are generated (seeded) as a rollout produces them: groups of 8 samples per prompt,
each a few hundred characters of reasoning with numbers and equations followed by a final answer
in one of the formats the reward reads (boxed, ``####``, ``**Answer:**``, Minerva's "Final
Answer: ...", "The answer is ..."), about 60% right. Three sets:

* ``numbers`` (GSM8K / DAPO-Math style): integer references (``#### 72`` or bare), answers
  written as ``1,000``, ``$18``, ``18.00``, ``18 \\text{ dollars}``, ... (the fast number path);
* ``latex`` (MATH style): every reference is a LaTeX expression (roots, multiples of pi,
  intervals, polynomials, tuples); right answers are written either as the reference is or in
  an equivalent form (``\\sqrt{45}`` for ``3\\sqrt{5}``), decided by the numeric check
  (``minippo/data/_numeric.py``);
* ``math-verify only`` (the slow end): inequalities, vectors and ``x \\in (a, b)``, which only
  math-verify decides: its cost per distinct (reference, answer) pair (a fifth as many
  completions, the time per 10,000 extrapolated).

The math-verify child process is started (and timed) before the sets; each set is timed from the
first completion to the last, with the reward's caches as a run would have them (each prompt's
reference parsed once, repeated (reference, answer) pairs answered from the cache). The last set
runs twice, the second time on new prompts: math-verify's LaTeX parser (ANTLR, pure Python)
caches its parsing decisions, so a run scores faster after its first few thousand answers.
"""

from __future__ import annotations

import argparse
import random
import time

from _common import machine, markdown_table

from minippo.data import MathAnswerMatch, PromptExample
from minippo.data.rewards import shared_verifier

SAMPLES_PER_PROMPT = 8
GOAL_S = 5.0


def _filler(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 10)):
        a, b = rng.randint(1, 999), rng.randint(1, 99)
        lines.append(
            rng.choice(
                [
                    f"First we add {a} and {b}: {a} + {b} = {a + b}.",
                    f"Each box holds {b} items, so {a} boxes hold {a} * {b} = {a * b} items.",
                    f"Let $x = {a}$. Then $2x + {b} = {2 * a + b}$.",
                    f"Half of {2 * a} is $\\frac{{{2 * a}}}{{2}} = {a}$.",
                    "Let me double-check this step before moving on.",
                ]
            )
        )
    return "\n".join(lines)


FORMATS = [
    "\\boxed{{{a}}}",
    "So the final result is $\\boxed{{{a}}}$.",
    "#### {a}",
    "**Answer:** {a}",
    "**Final Answer:** {a}",
    "Final Answer: The final answer is ${a}$. I hope it is correct.",
    "The answer is {a}.",
]


def numbers_set(n: int, rng: random.Random) -> list[tuple[PromptExample, str]]:
    out = []
    for i in range(n // SAMPLES_PER_PROMPT):
        v = rng.randint(0, 5000)
        ref = rng.choice([f"Work <<{v}-1={v - 1}>>...\n#### {v}", str(v)])
        example = PromptExample(i, (1,), "q", ref)
        for _ in range(SAMPLES_PER_PROMPT):
            w = v if rng.random() < 0.6 else v + rng.choice([-10, -1, 1, 2, 100])
            a = rng.choice([str(w), f"{w:,}", f"{w}.00", f"\\${w}", f"{w} \\text{{ dollars}}"])
            out.append((example, _filler(rng) + "\n" + rng.choice(FORMATS).format(a=a)))
    return out


def _latex_answer(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(reference, equivalent forms, wrong forms) of one LaTeX answer."""
    a, c = rng.randint(2, 99), rng.randint(2, 99)
    b = rng.choice([2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19, 21, 22, 23])
    kind = rng.randrange(5)
    if kind == 0:
        return (
            f"{a}\\sqrt{{{b}}}",
            [f"\\sqrt{{{a * a * b}}}", f"\\sqrt{{{b}}} \\cdot {a}"],
            [f"{a + 1}\\sqrt{{{b}}}"],
        )
    if kind == 1:
        return (
            f"\\frac{{{a}\\pi}}{{{c}}}",
            [f"\\frac{{{a}}}{{{c}}}\\pi", f"{a}\\pi/{c}"],
            [f"\\frac{{{a + 1}\\pi}}{{{c}}}"],
        )
    if kind == 2:
        return (f"(-{a}, {c}]", [f"(-{a},{c}]", f"\\left(-{a}, {c}\\right]"], [f"[-{a}, {c}]"])
    if kind == 3:
        return (
            f"x^2 + {a}x + {c}",
            [f"{c} + {a}x + x^2", f"x^{{2}}+{a}x+{c}"],
            [f"x^2 + {a + 1}x + {c}"],
        )
    return (f"({a}, -{c})", [f"({a},-{c})", f"\\left({a}, -{c}\\right)"], [f"(-{c}, {a})"])


def _math_verify_answer(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(reference, equivalent forms, wrong forms) of an answer only math-verify decides."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    kind = rng.randrange(3)
    if kind == 0:
        return (f"x > {a}", [f"{a} < x", f"x>{a}"], [f"x > {a + 1}", f"x < {a}"])
    if kind == 1:
        vec = "\\begin{{pmatrix}} {} \\\\ {} \\end{{pmatrix}}"
        return (vec.format(a, b), [vec.format(a, b).replace(" ", "")], [vec.format(a, b + 1)])
    return (f"x \\in ({a}, {a + b})", [f"({a}, {a + b})", f"({a},{a + b})"], [f"({a}, {a + b}]"])


def _grouped_set(n: int, rng: random.Random, answer) -> list[tuple[PromptExample, str]]:
    out = []
    for i in range(n // SAMPLES_PER_PROMPT):
        ref, rights, wrongs = answer(rng)
        example = PromptExample(i, (1,), "q", rng.choice([ref, f"... so $\\boxed{{{ref}}}$."]))
        for _ in range(SAMPLES_PER_PROMPT):
            a = rng.choice([ref, *rights]) if rng.random() < 0.6 else rng.choice(wrongs)
            out.append((example, _filler(rng) + "\n" + rng.choice(FORMATS).format(a=a)))
    return out


def latex_set(n: int, rng: random.Random) -> list[tuple[PromptExample, str]]:
    return _grouped_set(n, rng, _latex_answer)


def math_verify_set(n: int, rng: random.Random) -> list[tuple[PromptExample, str]]:
    return _grouped_set(n, rng, _math_verify_answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,000 completions per set (200)")
    ap.add_argument("--n", type=int, default=None, help="completions per set")
    args = ap.parse_args()
    n = args.n or (1_000 if args.quick else 10_000)
    print(f"# machine: {machine()}")

    verifier = shared_verifier()
    t0 = time.perf_counter()
    verifier.verify("1", "1")  # starts the child (imports sympy + math_verify)
    start_s = time.perf_counter() - t0
    print(f"math-verify child start-up: {start_s:.2f} s (once per process)")

    reward = MathAnswerMatch()
    rows = []
    for name, build, size, seed in (
        ("numbers", numbers_set, n, 0),
        ("latex", latex_set, n, 0),
        ("math-verify only, first pass", math_verify_set, n // 5, 0),
        ("math-verify only, second pass (new prompts)", math_verify_set, n // 5, 1),
    ):
        samples = build(size, random.Random(seed))
        calls0 = verifier.calls
        t0 = time.perf_counter()
        scores = [reward(example, text) for example, text in samples]
        dt = time.perf_counter() - t0
        rows.append(
            [
                name,
                len(samples),
                round(dt, 2),
                round(len(samples) / dt),
                round(dt / len(samples) * 10_000, 2),
                verifier.calls - calls0,
                round(sum(scores) / len(scores), 3),
                f"< {GOAL_S:g} s",
            ]
        )
    print(
        markdown_table(
            [
                "set",
                "completions",
                "seconds",
                "completions/s",
                "s per 10,000",
                "math-verify calls",
                "mean reward",
                "goal per 10,000",
            ],
            rows,
        )
    )
    print(f"timeouts: {verifier.timeouts}, child restarts: {verifier.restarts}")


if __name__ == "__main__":
    main()
