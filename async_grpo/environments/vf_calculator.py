"""The calculator task as a `verifiers` environment (`environment.kind: verifiers`,
`environment.name: async_grpo.environments.vf_calculator`; configs/calculator-verifiers.yaml):
the task, the tool and the reward of the built-in `calculator` environment, written as a
`verifiers` author writes one (a `vf.MultiTurnEnv`, its dataset, its rubric).

The model may reply `<calc>EXPRESSION</calc>`; the environment evaluates it with the
project's own parser (never `eval`) and sends the value back as the next user message. A
reply without a call is the answer: `correct` is 1.0 when its last number is the task's
(`calls`, weight 0, counts the calculator's uses). The first turn opens with `<calc>`,
as the built-in task's data prefills it: the environment continues a final assistant
message there (`continue_final_message`, as a vLLM server takes it).
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

from async_grpo.data.generate import calculator_rows
from async_grpo.environments.calculator import MAX_ACTION_CHARS, show, tool_call
from async_grpo.rewards.countdown import EquationError, evaluate
from async_grpo.rewards.number import last_number

PREFILL = "<calc>"
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else ""


def _replies(completion: Any) -> list[str]:
    return [_text(m) for m in completion or [] if _role(m) == "assistant"]


def _role(message: Any) -> str:
    return message.get("role") if isinstance(message, dict) else message.role


class CalculatorEnv(vf.MultiTurnEnv):
    """Two model turns at most: a call, then the answer."""

    async def get_model_response(self, state, prompt, client=None, model=None, **kwargs):
        if state["trajectory"] or not PREFILL:
            return await super().get_model_response(state, prompt, client, model, **kwargs)
        opened = [*prompt, vf.AssistantMessage(content=PREFILL)]
        sampling = {**(state["sampling_args"] or {}), "extra_body": CONTINUE}
        response = await super().get_model_response(
            state, opened, client, model, sampling_args=sampling, **kwargs
        )
        # the turn is the prefill and what followed it, as the model's context holds it
        response.message.content = PREFILL + (_text(response.message) or "")
        return response

    @vf.stop
    async def answered(self, state) -> bool:
        """The last reply made no call: it is the answer."""
        replies = _replies(state["trajectory"][-1]["completion"]) if state["trajectory"] else []
        return bool(replies) and tool_call(replies[-1][:MAX_ACTION_CHARS]) is None

    async def env_response(self, messages, state, **kwargs):
        call = tool_call(_text(messages[-1])[:MAX_ACTION_CHARS]) or ""
        try:
            value = show(evaluate(call.strip()).value)
        except (EquationError, ZeroDivisionError) as e:
            value = f"error: {e}"
        return [vf.UserMessage(content=value)]


def correct(completion, answer, **kwargs) -> float:
    """1.0 when the last reply's last number is the task's."""
    replies = _replies(completion)
    return float(bool(replies) and last_number(replies[-1]) == last_number(str(answer)))


def calls(completion, **kwargs) -> float:
    """The calculator's uses in the rollout."""
    return float(sum(tool_call(r[:MAX_ACTION_CHARS]) is not None for r in _replies(completion)))


def load_environment(n: int = 1000, seed: int = 0, eval_n: int = 64) -> vf.Environment:
    """`n` training tasks and `eval_n` held-out ones (another seed), as
    `async-grpo data calculator` writes them."""

    def rows(count: int, s: int) -> Dataset:
        return Dataset.from_list(
            [{"question": r["input"], "answer": r["answer"]} for r in calculator_rows(count, s)]
        )

    rubric = vf.Rubric(funcs=[correct, calls], weights=[1.0, 0.0])
    return CalculatorEnv(
        dataset=rows(n, seed),
        eval_dataset=rows(eval_n, seed + 1),
        rubric=rubric,
        max_turns=2,
    )
