"""Seeded, offline generators for the sample tasks: Countdown and small arithmetic.

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
