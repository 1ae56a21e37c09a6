"""Reward registry: lookup by name, entry point and module path; `combine`."""

import textwrap

import pytest

from async_grpo.errors import UserError
from async_grpo.rewards import (
    CombinedReward,
    RewardInput,
    RewardOutput,
    combine,
    get_reward,
    known_rewards,
    reward,
)
from async_grpo.rewards.registry import as_output

SAMPLE = RewardInput("prompt", "<answer>1+2</answer>", {"target": 3, "numbers": [1, 2]}, {})


@reward("test_registry_length")
def length_reward(sample: RewardInput) -> float:
    return len(sample.completion) / 100


def test_builtins_and_decorated_rewards_are_found():
    assert {"countdown", "math", "exact", "test_registry_length"} <= set(known_rewards())
    assert get_reward("test_registry_length") is length_reward
    assert get_reward("countdown")(SAMPLE).reward == pytest.approx(1.1)


def test_unknown_name_lists_known_ones():
    with pytest.raises(UserError, match=r"'nope': unknown; known rewards: .*countdown.*exact"):
        get_reward("nope")


def test_same_name_for_another_function_is_refused():
    with pytest.raises(UserError, match="already registered"):
        reward("countdown")(length_reward)
    assert reward("test_registry_length")(length_reward) is length_reward  # re-import is fine


def test_module_path_spec():
    assert get_reward("test_rewards_registry:length_reward") is length_reward
    with pytest.raises(UserError, match="cannot import module"):
        get_reward("no_such_module_xyz:f")
    with pytest.raises(UserError, match="has no 'missing'"):
        get_reward("test_rewards_registry:missing")
    with pytest.raises(UserError, match="not callable"):
        get_reward("test_rewards_registry:SAMPLE")


def test_entry_point_from_an_installed_distribution(tmp_path, monkeypatch):
    # A real (if minimal) installed distribution: importlib.metadata reads its dist-info.
    (tmp_path / "my_rewards_pkg.py").write_text("def always_one(sample):\n    return 1.0\n")
    info = tmp_path / "my_rewards_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rewards-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""\
            [async_grpo.rewards]
            always_one = my_rewards_pkg:always_one
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "always_one" in known_rewards()
    assert get_reward("always_one")(SAMPLE) == 1.0


def test_as_output_normalises_and_refuses_bad_values():
    assert as_output(1) == RewardOutput(1.0, {}, "")
    with pytest.raises(ValueError, match="finite"):
        as_output(float("nan"))
    with pytest.raises(TypeError, match="got str"):
        as_output("1.0")
    with pytest.raises(TypeError, match="got bool"):
        as_output(True)


OUTPUTS = {
    "countdown": RewardOutput(1.1, {"format_reward": 0.1, "answer_reward": 1.0}),
    "length": RewardOutput(0.5, {}, "too long"),
}


def test_combine_sum_max_weighted_by_hand():
    total = combine(OUTPUTS, "sum")
    assert total.reward == pytest.approx(1.6)  # 1.1 + 0.5
    assert total.components == {
        "countdown": 1.1,
        "countdown/format_reward": 0.1,
        "countdown/answer_reward": 1.0,
        "length": 0.5,
    }
    assert total.reason == "length: too long"
    assert combine(OUTPUTS, "max").reward == pytest.approx(1.1)
    weighted = combine(OUTPUTS, "weighted", {"countdown": 2.0, "length": -1.0})
    assert weighted.reward == pytest.approx(1.7)  # 2 * 1.1 - 1 * 0.5


def test_combine_errors():
    with pytest.raises(UserError, match="no weight for reward 'length'"):
        combine(OUTPUTS, "weighted", {"countdown": 1.0})
    with pytest.raises(UserError, match="expected sum, max or weighted"):
        combine(OUTPUTS, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no reward outputs"):
        combine({}, "sum")


def test_combined_reward_runs_every_reward_and_validates():
    scorer = CombinedReward({"countdown": get_reward("countdown"), "len": length_reward})
    out = scorer(SAMPLE)
    assert out.reward == pytest.approx(1.1 + 0.2)  # 20 chars / 100
    assert out.components["len"] == pytest.approx(0.2)
    with pytest.raises(UserError, match="no weight"):
        CombinedReward({"len": length_reward}, "weighted", {})
    with pytest.raises(UserError, match="at least one"):
        CombinedReward({})
