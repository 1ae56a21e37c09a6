"""The calculator tool: the model may write `<calc>EXPRESSION</calc>` in a turn; the
environment answers with the value as the next user turn. A turn without a tool call is
the final answer: reward 1.0 when its last number equals the task's answer.

The expression is model output: it is parsed and evaluated exactly by Countdown's safe
evaluator (integers, + - * / and parentheses, capped in length and depth), never `eval`-ed.
"""

from __future__ import annotations

from fractions import Fraction

from async_grpo.environments.base import Environment, StepResult, Task
from async_grpo.environments.registry import environment
from async_grpo.rewards.countdown import EquationError, evaluate
from async_grpo.rewards.number import last_number

MAX_ACTION_CHARS = 10_000


def show(value: Fraction) -> str:
    """An exact value as the model reads it: an integer, or a decimal to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0")


def tool_call(action: str) -> str | None:
    """The expression of the turn's first call: the text before the first </calc>, after the
    last <calc> before it (or from the start: a prompt may open the turn with "<calc>")."""
    end = action.find("</calc>")
    if end < 0:
        return None
    head = action[:end]
    start = head.rfind("<calc>")
    return head[start + len("<calc>") :] if start >= 0 else head


@environment("calculator")
class Calculator(Environment):
    """Answer `task.answer` (a number); `<calc>` calls are answered with their value."""

    max_turns = 3
    max_episode_tokens = 160

    def reset(self, task: Task) -> None:
        self.truth = last_number(str(task.answer))
        if self.truth is None:
            raise ValueError(f"calculator: answer {task.answer!r} holds no number")

    def step(self, action: str) -> StepResult:
        action = action[:MAX_ACTION_CHARS]
        call = tool_call(action)
        if call is None:  # the final answer
            correct = last_number(action) == self.truth
            return StepResult("", float(correct), True, {"tool_calls": 0.0})
        try:
            reply = show(evaluate(call.strip()).value)
        except (EquationError, ZeroDivisionError) as e:
            reply = f"error: {e}"
        return StepResult(reply, 0.0, False, {"tool_calls": 1.0})
