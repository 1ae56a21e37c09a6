"""Seeded, offline generators for the sample tasks: Countdown, LaTeX arithmetic, one-step
integer arithmetic (the CPU learning-curve task), and the two multi-turn tasks: products
for the calculator tool and the number-guessing game.

Countdown rows have the shape of the public Countdown-Tasks-3to4 set (3 to 4 numbers and
a target reachable with + - * /), with `answer = {"target": T, "numbers": [...]}`.
Every generated target is reachable: it is the value of a random expression over the numbers.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

COUNTDOWN_PROMPT = (
    "Use the numbers {numbers} to write an equation whose value is {target}. "
    "Use each number exactly once, with only + - * / and parentheses. "
    "Think briefly inside <think> </think>, then give only the equation inside "
    "<answer> </answer>, for example <answer>(3 + 5) * 2</answer>."
)

MATH_PROMPT = "{question} Give the final answer inside \\boxed{{}}."

# One worked example, then the question: the prompt under which SmolLM2-135M (Q4_1) ends
# with the right number in ~19% of samples at T=1 (probed against five other phrasings,
# 3-14%), so GRPO groups of 8 usually hold a reward to learn from.
ARITHMETIC_PROMPT = "Example: 3 + 4 = 7.\nNow compute {a} {op} {b} and reply with the result only."
# For a base model, as plain text: three worked lines, then the question to complete. A base
# model goes on writing after its answer, so its reward is `first_number`. Step 0 of Gemma
# 3 270M (96 samples at temperature 1): the first number is right in 55%, the last in 8%.
ARITHMETIC_PLAIN_PROMPT = "3 + 4 = 7\n9 - 2 = 7\n5 * 3 = 15\n{a} {op} {b} ="


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction]:
    """Combine the numbers in random order with random operators; return text and value."""
    items = [(str(n), Fraction(n)) for n in numbers]
    rng.shuffle(items)
    while len(items) > 1:
        (ta, a), (tb, b) = items.pop(), items.pop()
        op = rng.choice("+-*/" if b != 0 else "+-*")
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
        items.append((f"({ta} {op} {tb})", value))
    return items[0]


def countdown_rows(
    n: int,
    seed: int,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    max_target: int = 100,
) -> list[dict[str, Any]]:
    """`n` solvable Countdown problems; the same seed always gives the same rows."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        _, value = _random_expression(rng, numbers)
        if value.denominator != 1 or not 1 <= value <= max_target:
            continue
        target = int(value)
        rows.append(
            {
                "input": COUNTDOWN_PROMPT.format(numbers=numbers, target=target),
                "answer": {"target": target, "numbers": numbers},
            }
        )
    return rows


def _fraction_latex(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


def math_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` arithmetic questions (integers and fractions) with exact answers as LaTeX."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        kind = rng.choice(["add", "sub", "mul", "frac"])
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        if kind == "frac":
            x, y = Fraction(1, rng.randint(2, 9)), Fraction(1, rng.randint(2, 9))
            question = f"What is ${_fraction_latex(x)} + {_fraction_latex(y)}$?"
            answer = _fraction_latex(x + y)
        else:
            sym, value = {"add": ("+", a + b), "sub": ("-", a - b), "mul": ("\\times", a * b)}[kind]
            question, answer = f"What is ${a} {sym} {b}$?", str(value)
        rows.append({"input": MATH_PROMPT.format(question=question), "answer": answer})
    return rows


def arithmetic_rows(
    n: int, seed: int, max_operand: int = 9, plain: bool = False
) -> list[dict[str, Any]]:
    """`n` one-step questions `a + b`, `a - b` (never negative) or `a * b` with operands in
    1..max_operand; `answer` is the integer result as a string (for the `last_number`
    reward; `first_number` for the `plain` prompts, written for base models)."""
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        op = rng.choice("+-*")
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt = ARITHMETIC_PLAIN_PROMPT if plain else ARITHMETIC_PROMPT
        rows.append({"input": prompt.format(a=a, op=op, b=b), "answer": str(value)})
    return rows


# The calculator task's prompt: how to call the tool, with one worked exchange; the model's
# turn is opened with "<calc>" (`prefill`). Step 0 of SmolLM2-135M (bench/env_step0.py, 128
# episodes): 6% solved, 87% call the tool, 44% of groups mixed. Without the prefill, 0.8% /
# 7% / 6%; three other wordings did no better (docs/environments.md).
CALCULATOR_PREFILL = "<calc>"
CALCULATOR_PROMPT = (
    "You have a calculator. To use it, reply with only <calc>expression</calc>; the result"
    " comes back as the next message. Example: for 12 * 34 you reply <calc>12 * 34</calc>,"
    " get 408, and then reply 408.\nNow compute {a} * {b}."
)
GUESS_PROMPT = (
    "I picked a secret whole number from {low} to {high}. Guess it: reply with one number."
    " After each wrong guess I say higher or lower."
)


def calculator_rows(n: int, seed: int, digits: tuple[int, int] = (3, 2)) -> list[dict[str, Any]]:
    """`n` products of a `digits[0]`-digit and a `digits[1]`-digit number, too long for a
    small model to multiply in its head; `answer` is the product as a string."""
    if min(digits) < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    rng = random.Random(seed)
    lo_hi = [(10 ** (d - 1), 10**d - 1) for d in digits]
    rows = []
    for _ in range(n):
        a, b = (rng.randint(lo, hi) for lo, hi in lo_hi)
        rows.append(
            {
                "input": CALCULATOR_PROMPT.format(a=a, b=b),
                "answer": str(a * b),
                "prefill": CALCULATOR_PREFILL,
            }
        )
    return rows


def guess_rows(n: int, seed: int, high: int = 10) -> list[dict[str, Any]]:
    """`n` secrets in 1..high for the `guess_number` environment (bounds in `metadata`)."""
    if high < 2:
        raise ValueError(f"high must be >= 2, got {high}")
    rng = random.Random(seed)
    return [
        {
            "input": GUESS_PROMPT.format(low=1, high=high),
            "answer": rng.randint(1, high),
            "metadata": {"low": 1, "high": high},
        }
        for _ in range(n)
    ]
