"""The Arrow screen before a run (data/screen.py) against the exact check it stands in for.

Real parquet files read by the real `datasets` reader, the real SmolLM2 and Gemma 3
tokenizers and chat templates. The claim under test: a row the exact check (rows.py)
refuses is always a suspect, or its token bound reaches the context; a row that is not a
suspect has at most `bound` prompt tokens."""

import dataclasses
import math
import random

import pytest
from test_data_forms import with_template

from async_grpo.config import DatasetConfig
from async_grpo.data import DataError
from async_grpo.data.forms import open_rows
from async_grpo.data.rows import encode, source_rows
from async_grpo.data.screen import screen
from async_grpo.data.table import prepare_table, row_spec

MSG = [{"role": "user", "content": "What is 2 + 2?"}]
NAN, INF = math.nan, math.inf
# each case: rows of one parquet file (one Arrow type per column), the dataset settings
CASES = {
    "text": (
        [
            {"input": x, "answer": "1"}
            for x in ["ok", "", "   ", "\u3000\u2003", "\x1c\x1f", None, "\ufeff", " a ", "日本"]
        ],
        {},
    ),
    "messages": (
        [
            {"m": m, "answer": "1"}
            for m in [
                MSG,
                [],
                None,
                [{"role": "system", "content": "be brief"}],
                [{"role": "user", "content": " \n\t"}],
                [{"role": "robot", "content": "x"}],
                [{"role": "user", "content": None}],
                [{"role": None, "content": "x"}],
                [None],
                [{"role": "user", "content": ""}, {"role": "user", "content": "x"}],
                [{"role": "assistant", "content": "hi"}, *MSG],
                [{"role": "system", "content": "s"}, *MSG, {"role": "assistant", "content": "4"}, *MSG],
                [*MSG, {"role": "tool", "content": "{}"}],
            ]
        ],
        {"prompt_key": "m"},
    ),
    "float-answers": ([{"input": "q", "answer": a} for a in [1.0, NAN, INF, None, -0.0]], {}),
    "nested": (
        [
            {"input": "q", "answer": a, "metadata": md}
            for a, md in [
                ([1, 2], {"d": 0.5, "tags": [1.0]}),
                ([3], {"d": NAN, "tags": [2.0]}),
                (None, {"d": 1.0, "tags": [INF]}),
                ([4, None], None),
                ([], {"d": None, "tags": None}),
            ]
        ],
        {},
    ),
    "token-ids": (
        [{"input": "q", "answer": "1", "input_token_ids": t} for t in [[1, 2], [], None, [-1, 3], [7]]],
        {},
    ),
    "prefill": ([{"input": "q", "answer": "1", "prefill": p} for p in ["<c>", None, "", " x"]], {}),
    "bytes-answer": ([{"input": "q", "answer": b} for b in [b"\x00", b"ok"]], {}),
    "messages-plain": ([{"m": MSG, "answer": "1"}], {"prompt_key": "m", "format": "plain"}),
    "plain-text": ([{"input": x, "answer": "1"} for x in ["2+2", " ", "x" * 40]], {"format": "plain"}),
    "system-prompt": ([{"input": x, "answer": "1"} for x in ["2+2", "3+3"]], {"system_prompt": "Be brief."}),
}  # fmt: skip


def _write(tmp_path, rows, name="d"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _exact(source, spec, tokenizer, i):
    """The exact check on row i alone: its token count, or the error it raises."""
    spec = dataclasses.replace(spec, max_model_len=0)  # counted here, compared in _holds
    try:
        rows = source_rows(source[i : i + 1], [i], spec)
        return len(encode(rows, tokenizer, spec)["input_token_ids"][0])
    except (DataError, UnicodeDecodeError) as e:
        return e


def _screened(path, model, settings, max_model_len=4096):
    from async_grpo.models import load_tokenizer

    settings = dict(settings)
    fmt = settings.pop("format", "chat")
    spec = row_spec(path, DatasetConfig(**settings), fmt, max_model_len)
    source = open_rows(path)
    tokenizer = load_tokenizer(model)
    suspect, bound = screen(source.data.table, spec, tokenizer)
    exact = [_exact(source, spec, tokenizer, i) for i in range(len(source))]
    return suspect, bound, exact


def _holds(suspect, bound, exact, max_model_len):
    for i, got in enumerate(exact):
        if isinstance(got, Exception) or got >= max_model_len:
            assert suspect[i] or bound[i] >= max_model_len, (i, got)
        if not suspect[i]:
            assert isinstance(got, int) and got <= bound[i], (i, got, bound[i])


@pytest.mark.parametrize("case", list(CASES))
def test_every_row_the_exact_check_refuses_is_a_suspect(tmp_path, tiny_model_dir, case):
    rows, settings = CASES[case]
    suspect, bound, exact = _screened(_write(tmp_path, rows), tiny_model_dir, settings)
    _holds(suspect, bound, exact, 4096)
    refused = [isinstance(e, Exception) for e in exact]
    assert any(not r for r in refused) or case in ("messages-plain", "bytes-answer")
    if case in ("text", "messages", "float-answers", "nested", "token-ids"):
        assert any(refused) and sum(suspect) <= sum(refused) + 1  # few clean rows suspected


def _strings(seed, n):
    """Text no tokenizer is kind to: scripts, emoji, combining marks, space runs, digits,
    characters that expand under Unicode normalisation."""
    rng = random.Random(seed)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0x1F300, 0x1FAFF), (0x300, 0x36F), (0xFB00, 0xFB4F), (0xFDF0, 0xFDFF)]  # fmt: skip
    out = ["½﷽ﬁ㎏…", "x" + " " * 50 + "\n" * 20 + "\t" * 10, "0123456789" * 20, "\u0301" * 40]
    for _ in range(n):
        lo, hi = rng.choice(blocks)
        out.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 200))))
    return out


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_token_bound_holds_on_hostile_text(tmp_path, tiny_model_dir, gemma3_dir, model):
    """No tokenizer the project ships makes more tokens than the rendered text has bytes
    (the screen's bound); every row near the context is checked exactly, so a prompt that
    does not fit is always refused."""
    from async_grpo.models import load_tokenizer

    folder = tiny_model_dir if model == "smollm2" else gemma3_dir
    tokenizer = load_tokenizer(folder)
    texts = _strings(seed=7, n=150)
    for text in texts:
        assert len(tokenizer(text, add_special_tokens=False).input_ids) <= len(text.encode())
    rows = [{"input": t, "answer": "1"} for t in texts]
    path = _write(tmp_path, rows)
    for fmt in ("chat", "plain") if tokenizer.chat_template else ("plain",):
        suspect, bound, exact = _screened(path, folder, {"format": fmt}, max_model_len=64)
        _holds(suspect, bound, exact, 64)
        assert not suspect.any()
        with pytest.raises(DataError, match=r"d.parquet:\d+: column 'input': \d+ prompt tokens"):
            prepare_table(path, folder, 64, fmt)
        prepare_table(path, folder, 1024, fmt)  # every row fits: refused by none


def test_a_conversation_the_template_refuses_is_one_line(tmp_path, tiny_model_dir):
    """A chat template's own `raise_exception` (roles that must alternate, as Gemma's and
    Mistral's do) is the row's one-line error before the run, not a traceback when drawn."""
    model = with_template(
        tiny_model_dir,
        tmp_path / "alternating",
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n",
    )
    two = [*MSG, *MSG]
    rows = [{"m": m, "answer": "1"} for m in [MSG, MSG, two, MSG]]
    path = _write(tmp_path, rows)
    with pytest.raises(
        DataError,
        match=r"^\S+d.parquet:3: column 'm': the model's chat template refuses these messages:"
        r" roles must alternate user/assistant$",
    ):
        prepare_table(path, model, 512, "chat", DatasetConfig(prompt_key="m"))
    del rows[2]
    table = prepare_table(
        _write(tmp_path, rows, "ok"), model, 512, "chat", DatasetConfig(prompt_key="m")
    )
    assert len(table) == 3 and table[2].input == MSG[0]["content"]


def test_a_million_rows_are_not_read_into_python(tmp_path, tiny_model_dir, monkeypatch):
    """The exact check runs on the suspects alone: 20,000 clean rows and one bad one at the
    end read one row into Python, and that row is the one named."""
    import async_grpo.data.rows as rows_module

    rows = [{"input": f"what is {i} + 1?", "answer": str(i + 1)} for i in range(20_000)]
    rows.append({"input": " ", "answer": "0"})
    path = _write(tmp_path, rows)
    seen = []
    original = rows_module.source_rows

    def counted(batch, indices, spec):
        seen.extend(indices)
        return original(batch, indices, spec)

    monkeypatch.setattr(rows_module, "source_rows", counted)
    with pytest.raises(DataError, match=r"d.parquet:20001: column 'input': empty prompt"):
        prepare_table(path, tiny_model_dir, 512, "chat")
    assert seen == [20_000]
