import json
import subprocess
import sys
from pathlib import Path

import pytest

from async_grpo.data import DataError, PromptSampler, load_prompts, write_jsonl
from async_grpo.data.generate import (
    arithmetic_rows,
    calculator_rows,
    countdown_rows,
    guess_rows,
    math_rows,
)

REPO = Path(__file__).resolve().parents[2]


def _rows(n):
    return [json.dumps({"input": f"q{i}", "answer": i}) for i in range(n)]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "async_grpo.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_json_on_line_7_is_one_line_exit_2(tmp_path):
    rows = _rows(10)
    rows[6] = '{"input": "q6", "answer": '
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    r = _cli("data", "check", str(path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"{path}:7: not valid JSON" in lines[0]


def test_missing_answer_on_line_9_is_one_line_exit_2(tmp_path):
    rows = _rows(10)
    rows[8] = json.dumps({"input": "q8"})
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    r = _cli("data", "check", str(path))
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == f"async-grpo: error: {path}:9: field 'answer': missing (required: input, answer)"
    )


@pytest.mark.parametrize(
    "row, message",
    [
        ({"input": "", "answer": 1}, "field 'input': expected a non-empty string"),
        ({"input": "q", "answer": 1, "input_token_ids": [1, -2]}, "field 'input_token_ids'"),
        ({"input": "q", "answer": 1, "input_token_ids": "12"}, "field 'input_token_ids'"),
        ({"input": "q", "answer": 1, "extra": 1}, "field 'extra': unknown"),
        ({"input": "q", "answer": 1, "prefill": 3}, "field 'prefill': expected a string"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_schema_errors(tmp_path, row, message):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"input": "ok", "answer": 0}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"x.jsonl:2: .*{message[:20]}"):
        load_prompts(path)


def test_shipped_sample_data_is_valid():
    for name in (
        "countdown.jsonl",
        "math.jsonl",
        "arithmetic.jsonl",
        "arithmetic-plain.jsonl",
        "arithmetic-plain-heldout.jsonl",
        "calculator.jsonl",
        "guess.jsonl",
    ):
        assert len(load_prompts(REPO / "sample-data" / name)) >= 100


def test_countdown_generator_is_seeded_and_solvable():
    a, b = countdown_rows(50, seed=3), countdown_rows(50, seed=3)
    assert a == b and a != countdown_rows(50, seed=4)
    for row in a:
        nums = row["answer"]["numbers"]
        assert 3 <= len(nums) <= 4 and 1 <= row["answer"]["target"] <= 100
        assert str(nums) in row["input"] and "<answer>" in row["input"]


def test_math_generator_is_seeded():
    assert math_rows(20, 1) == math_rows(20, 1)
    assert all("\\boxed{}" in r["input"] for r in math_rows(20, 1))


def test_arithmetic_generator_is_seeded_and_correct():
    import re

    rows = arithmetic_rows(300, seed=2, max_operand=9)
    assert rows == arithmetic_rows(300, seed=2) and rows != arithmetic_rows(300, seed=3)
    ops = set()
    for row in rows:
        a, op, b = re.search(r"compute (\d+) ([-+*]) (\d+) and", row["input"]).groups()
        a, b = int(a), int(b)
        assert 1 <= a <= 9 and 1 <= b <= 9
        assert int(row["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
        ops.add(op)
    assert ops == {"+", "-", "*"}


def test_plain_arithmetic_asks_the_same_questions_as_text_to_complete():
    chat, plain = arithmetic_rows(50, seed=2), arithmetic_rows(50, seed=2, plain=True)
    for c, p in zip(chat, plain, strict=True):
        a, op, b = c["input"].split("compute ")[1].split(" and")[0].split()
        assert p["input"].endswith(f"\n{a} {op} {b} =") and p["answer"] == c["answer"]
    # the shipped held-out set asks the chat set's held-out questions
    held = [
        r.input.rsplit("\n", 1)[1]
        for r in load_prompts(REPO / "sample-data/arithmetic-plain-heldout.jsonl")
    ]
    chat_held = [
        r.input.split("compute ")[1].split(" and")[0] + " ="
        for r in load_prompts(REPO / "sample-data/arithmetic-heldout.jsonl")
    ]
    assert sorted(held) == sorted(chat_held)


def test_multi_turn_generators_are_seeded_and_correct():
    import re

    rows = calculator_rows(100, seed=1, digits=(3, 2))
    assert rows == calculator_rows(100, seed=1) and rows != calculator_rows(100, seed=2)
    for row in rows:
        a, b = map(int, re.search(r"compute (\d+) \* (\d+)\.$", row["input"]).groups())
        assert 100 <= a <= 999 and 10 <= b <= 99 and row["answer"] == str(a * b)
        assert row["prefill"] == "<calc>"
    secrets = [r["answer"] for r in guess_rows(200, seed=0, high=20)]
    assert set(secrets) == set(range(1, 21))
    assert guess_rows(1, seed=0, high=20)[0]["metadata"] == {"low": 1, "high": 20}
    r = _cli("data", "calculator", "--digits", "0", "2", "-o", "/tmp/never.jsonl")
    assert r.returncode == 2 and "--digits: each must be >= 1" in r.stderr


def test_write_jsonl_is_atomic(tmp_path):
    path = tmp_path / "out.jsonl"
    write_jsonl(path, [{"a": 1}])

    def broken():
        yield {"a": 2}
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_jsonl(path, broken())
    assert path.read_text() == '{"a": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_sampler_resumes_exactly():
    s = PromptSampler(7, seed=1)
    first = s.take(10)
    assert sorted(first[:7]) == list(range(7))  # one full epoch, each prompt once
    state = s.state_dict()
    rest = s.take(12)
    t = PromptSampler(7, seed=1)
    t.load_state_dict(state)
    assert t.take(12) == rest
    with pytest.raises(ValueError, match="sampler state is for 7 prompts"):
        PromptSampler(8, seed=1).load_state_dict(state)


def test_tokenize_writes_chat_token_ids(tmp_path, smollm2_dir):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, countdown_rows(3, seed=0))
    out = tmp_path / "out.jsonl"
    r = _cli("data", "tokenize", str(src), "--model", str(smollm2_dir), "-o", str(out))
    assert r.returncode == 0, r.stderr
    prompts = load_prompts(out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.decode(prompts[0].input_token_ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert prompts[0].input in text
    # a prefill opens the model's turn: its tokens follow the template's
    write_jsonl(src, calculator_rows(2, seed=0))
    r = _cli("data", "tokenize", str(src), "--model", str(smollm2_dir), "-o", str(out))
    assert r.returncode == 0, r.stderr
    (first, _) = load_prompts(out)
    assert tok.decode(first.input_token_ids).endswith("<|im_start|>assistant\n<calc>")
    assert first.prefill == "<calc>"


def test_sampler_index_at_matches_the_sequence():
    s = PromptSampler(5, seed=2)
    seq = s.take(17)
    fresh = PromptSampler(5, seed=2)
    assert [fresh.index_at(k) for k in range(17)] == seq
