"""The calculator task as an agent harness (`environment.kind: openai`): the same task and
reward as the `calculator` environment, written as a user writes a harness, against the
`openai` SDK (configs/calculator-harness.yaml).

The model may reply `<calc>EXPRESSION</calc>`; the harness sends the value back as the
next user message. A reply without a call is the answer: reward 1.0 when its last number
is the task's. Two model turns at most, as the environment's config gives it. The data's
prefill (`<calc>`) opens the first turn, as it does the environment's: sent as a final
assistant message to continue, as a vLLM server takes it.
"""

from __future__ import annotations

from typing import Any

from async_grpo.environments.calculator import MAX_ACTION_CHARS, show, tool_call
from async_grpo.rewards.countdown import EquationError, evaluate
from async_grpo.rewards.number import last_number

MAX_TURNS = 2


async def rollout(client: Any, row: dict[str, Any]) -> float:
    """1.0 when the answer's last number is the task's, else 0.0."""
    messages = list(row["prompt"])
    truth = last_number(str(row["answer"]))
    prefill = row["prefill"]
    for _ in range(MAX_TURNS):
        opened, extra = messages, None
        if prefill:  # the turn starts with it: continued, not a turn of its own
            opened = [*messages, {"role": "assistant", "content": prefill}]
            extra = {"continue_final_message": True, "add_generation_prompt": False}
        reply = await client.chat.completions.create(
            model=row["model"], messages=opened, extra_body=extra
        )
        text = (prefill + (reply.choices[0].message.content or ""))[:MAX_ACTION_CHARS]
        prefill = ""
        call = tool_call(text)
        if call is None:  # the answer
            return float(last_number(text) == truth)
        try:
            value = show(evaluate(call.strip()).value)
        except (EquationError, ZeroDivisionError) as e:
            value = f"error: {e}"
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": value}]
    return 0.0
