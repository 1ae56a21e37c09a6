"""`verifiers` environments written as their authors write them, against the real
package (`environment.kind: verifiers`, `environment.name: verifiers_envs_for_tests`,
`environment.args: {kind: ...}`)."""

import math

import verifiers as vf
from datasets import Dataset


def exact(completion, answer, **kwargs) -> float:
    """1.0 when the reply is the answer."""
    return float(completion[-1].content.strip() == str(answer))


def short(completion, **kwargs) -> float:
    return float(len(completion[-1].content or "") < 20)


def not_a_number(completion, **kwargs) -> float:
    return math.nan


def shortest(completions, **kwargs) -> list[float]:
    """A group reward function: 1.0 for the group's shortest replies."""
    lengths = [len(c[-1].content or "") for c in completions]
    return [float(n == min(lengths)) for n in lengths]


def group_breaks(completions, **kwargs) -> list[float]:
    """No score for anyone: `verifiers` itself fails the group's scoring (a function
    that raises it scores 0 itself)."""
    return []


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


class Broken(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise KeyError("the environment broke")


def _xml(data) -> vf.Environment:
    """A parser's answer field and its format reward (weight 0.2)."""
    parser = vf.XMLParser(["think", "answer"], answer_field="answer")

    def correct(completion, answer, **kwargs) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    funcs = [correct, parser.get_format_reward_func()]
    rubric = vf.Rubric(funcs=funcs, weights=[1.0, 0.2], parser=parser)
    return vf.SingleTurnEnv(dataset=data, parser=parser, rubric=rubric)


def _group(data) -> vf.Environment:
    """Two environments behind one, a row routed by its info's env_id."""

    def one(completion, **kwargs) -> float:
        return 1.0

    def half(completion, **kwargs) -> float:
        return 0.5

    a = vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[one]))
    b = vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[half]))
    return vf.EnvGroup([a, b], env_names=["a", "b"])


def load_environment(kind: str = "single", n: int = 8) -> vf.Environment:
    data = Dataset.from_list(
        [{"question": f"What is {12 + i} * 34?", "answer": str((12 + i) * 34)} for i in range(n)]
    )
    if kind == "single":
        rubric = vf.Rubric(funcs=[exact, short], weights=[1.0, 0.5])
        return vf.SingleTurnEnv(dataset=data, rubric=rubric, system_prompt="Reply with a number.")
    if kind == "tool":
        return vf.ToolEnv(tools=[add], dataset=data, rubric=vf.Rubric(funcs=[exact]), max_turns=3)
    if kind == "broken":
        return Broken(dataset=data, rubric=vf.Rubric(funcs=[exact]), max_turns=3)
    if kind == "nan":
        return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[not_a_number]))
    if kind == "group":
        return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[exact, shortest]))
    if kind == "group_breaks":
        return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[group_breaks]))
    if kind == "xml":
        return _xml(data)
    if kind == "group_of_envs":
        return _group(data)
    if kind == "fails":
        raise RuntimeError("cannot reach the task server")
    raise ValueError(f"unknown kind {kind}")
