"""Countdown reward: reach `target` using each of `numbers` exactly once with + - * / ( ).

The equation is model output, so it is never `eval`-ed: a small tokenizer and a
recursive-descent parser evaluate it with exact `fractions.Fraction` arithmetic, under
caps on length, literal size and nesting depth. `**` (or anything else) is refused.

Scores: `format_reward` (0.1) for one well-placed `<answer>...</answer>`, plus
`answer_reward` (1.0) when the equation is valid and equals the target.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from async_grpo.rewards.registry import RewardInput, RewardOutput, reward

FORMAT_SCORE = 0.1
ANSWER_SCORE = 1.0
MAX_EQUATION_CHARS = 200
MAX_LITERAL_DIGITS = 6
MAX_DEPTH = 50
MAX_COMPLETION_CHARS = 100_000

_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class EquationError(ValueError):
    """The equation is not a valid countdown expression; the message says why."""


@dataclass
class ParsedEquation:
    """A parsed equation: its exact value and the integer literals it used."""

    value: Fraction
    literals: list[int]


def extract_answer(completion: str) -> tuple[str | None, bool, str]:
    """Return (answer text or None, format ok, reason).

    Format is ok when there is exactly one `<answer>...</answer>`, at most one `<think>`
    / `</think>` with `</think>` before the answer, and only whitespace after it.
    The prompt may end in `<think>`, so a bare `</think>` is accepted.
    """
    if len(completion) > MAX_COMPLETION_CHARS:
        return None, False, f"completion longer than {MAX_COMPLETION_CHARS} chars"
    if completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return None, False, "expected exactly one <answer>...</answer>"
    match = _ANSWER.search(completion)
    if match is None:
        return None, False, "</answer> before <answer>"
    text = match.group(1)
    before, after = completion[: match.start()], completion[match.end() :]
    think_ok = before.count("<think>") <= 1 and before.count("</think>") <= 1
    think_ok = think_ok and "<think>" not in after and "</think>" not in after
    if "<think>" in before and "</think>" in before:
        think_ok = think_ok and before.index("<think>") < before.index("</think>")
    if "<think>" in before and "</think>" not in before:
        think_ok = False
    if not think_ok:
        return text, False, "misplaced <think> block"
    if after.strip():
        return text, False, "text after </answer>"
    return text, True, ""


def evaluate(equation: str) -> ParsedEquation:
    """Parse and evaluate `equation` exactly; raise EquationError when it is not valid."""
    if len(equation) > MAX_EQUATION_CHARS:
        raise EquationError(f"equation longer than {MAX_EQUATION_CHARS} chars")
    return _Parser(_tokenize(equation)).parse()


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    pos, end = 0, len(text.rstrip())
    while pos < end:
        match = _TOKEN.match(text, pos)
        if match is None:
            raise EquationError(f"unexpected character {text[pos:].lstrip()[:1]!r}")
        tokens.append(match.group(1) or match.group(2))
        pos = match.end()
    if any(a == b == "*" for a, b in zip(tokens, tokens[1:], strict=False)):
        raise EquationError("'**' is not allowed")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*;
    unary := '-' unary | atom; atom := INT | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.literals: list[int] = []

    def parse(self) -> ParsedEquation:
        if not self.tokens:
            raise EquationError("empty equation")
        value = self.expr()
        if self.pos != len(self.tokens):
            raise EquationError(f"unexpected {self.tokens[self.pos]!r}")
        return ParsedEquation(value, self.literals)

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise EquationError("equation ends too early")
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value = value * self.unary()
            else:
                divisor = self.unary()
                if divisor == 0:
                    raise EquationError("division by zero")
                value = value / divisor
        return value

    def unary(self) -> Fraction:
        if self.peek() == "-":
            self.take()
            with self.nested():
                return -self.unary()
        return self.atom()

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            with self.nested():
                value = self.expr()
            if self.take() != ")":
                raise EquationError("unbalanced parentheses")
            return value
        if not token.isdigit():
            raise EquationError(f"expected a number or '(', got {token!r}")
        if len(token) > MAX_LITERAL_DIGITS:
            raise EquationError(f"number longer than {MAX_LITERAL_DIGITS} digits")
        self.literals.append(int(token))
        return Fraction(int(token))

    def nested(self) -> _Nesting:
        return _Nesting(self)


class _Nesting:
    """Counts nesting depth (parentheses and unary minus) and refuses past MAX_DEPTH."""

    def __init__(self, parser: _Parser) -> None:
        self.parser = parser

    def __enter__(self) -> None:
        self.parser.depth += 1
        if self.parser.depth > MAX_DEPTH:
            raise EquationError(f"nesting deeper than {MAX_DEPTH}")

    def __exit__(self, *exc: object) -> None:
        self.parser.depth -= 1


def check_equation(equation: str, target: int, numbers: list[int]) -> tuple[bool, str]:
    """(correct, reason): valid syntax, each number used exactly once, equals target."""
    lhs, eq, rhs = equation.partition("=")
    try:
        parsed = evaluate(lhs)
        if eq and evaluate(rhs).value != parsed.value:
            return False, "the two sides of '=' differ"
    except EquationError as e:
        return False, f"invalid equation: {e}"
    if Counter(parsed.literals) != Counter(numbers):
        return False, f"uses {sorted(parsed.literals)}, expected each of {sorted(numbers)} once"
    if parsed.value != target:
        return False, f"evaluates to {parsed.value}, expected {target}"
    return True, ""


@reward("countdown")
def countdown_reward(sample: RewardInput) -> RewardOutput:
    """Score a countdown completion; `sample.answer` is {"target": int, "numbers": [int]}."""
    target, numbers = _ground_truth(sample.answer)
    text, format_ok, reason = extract_answer(sample.completion)
    correct = False
    if text is not None:
        correct, answer_reason = check_equation(text.strip(), target, numbers)
        reason = reason or answer_reason
    components = {
        "format_reward": FORMAT_SCORE if format_ok else 0.0,
        "answer_reward": ANSWER_SCORE if correct else 0.0,
    }
    return RewardOutput(sum(components.values()), components, reason)


def _ground_truth(answer: Any) -> tuple[int, list[int]]:
    if not isinstance(answer, dict) or "target" not in answer or "numbers" not in answer:
        raise ValueError(f"countdown: answer must be {{'target', 'numbers'}}, got {answer!r}")
    return int(answer["target"]), [int(n) for n in answer["numbers"]]
