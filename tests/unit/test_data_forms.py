"""Prompts from every form the `datasets` library reads (data/forms.py, rows.py, table.py):
real files written here, read by the real reader, tokenized with the real SmolLM2
tokenizer and chat template (the tiny model carries them)."""

import json
import pickle
import shutil
import subprocess
import sys

import pytest

from async_grpo.config import DatasetConfig
from async_grpo.data import DataError, PromptSampler
from async_grpo.data.tokenize import chat_token_ids, prepare_prompts

QUESTIONS = ["What is 2 + 3?", "Name a prime above 10.", "Say hi.", "What is 7 * 6?"]
ANSWERS = ["5", "11", "hi", "42"]


def _prepare(path, model, **dataset):
    fmt = dataset.pop("format", "chat")
    max_len = dataset.pop("max_model_len", 512)
    return prepare_prompts(path, model, max_len, fmt, DatasetConfig(**dataset))


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def with_template(model_dir, out, template):
    """A copy of the model folder whose chat template is `template` (a .jinja file)."""
    shutil.copytree(model_dir, out)
    (out / "chat_template.jinja").write_text(template)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


def _rows(prompt_key="question", answer_key="solution"):
    return [
        {prompt_key: q, answer_key: a, "source": "unit", "level": i}
        for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS, strict=True))
    ]


def _write(form, folder, rows):
    """`rows` written in `form`; the path `data` names."""
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(rows)
    if form == "jsonl":
        path = folder / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif form == "json":  # one JSON array, not lines
        path = folder / "d.json"
        path.write_text(json.dumps(rows))
    elif form == "parquet":
        path = folder / "d.parquet"
        ds.to_parquet(str(path))
    elif form == "csv":
        path = folder / "d.csv"
        ds.to_csv(str(path), index=False)
    elif form == "parquet-shards":  # the hub's layout: data/train-0000N-of-00002.parquet
        path = folder / "shards"
        (path / "data").mkdir(parents=True)
        for k in range(2):
            ds.shard(2, k, contiguous=True).to_parquet(
                str(path / "data" / f"train-{k:05d}-of-00002.parquet")
            )
    elif form == "saved":
        path = folder / "saved"
        ds.save_to_disk(str(path))
    else:  # a saved DatasetDict of one split
        path = folder / "saved-dict"
        DatasetDict({"train": ds}).save_to_disk(str(path))
    return path


FORMS = ["jsonl", "json", "parquet", "csv", "parquet-shards", "saved", "saved-dict"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_gives_the_prompts_the_jsonl_path_gave(tmp_path, tiny_model_dir, form):
    """Any column names, any form: the same prompts, token ids exactly those of the chat
    path every earlier run used (one user turn, the assistant's turn opened)."""
    path = _write(form, tmp_path, _rows())
    table = _prepare(path, tiny_model_dir, prompt_key="question", answer_key="solution")
    tok = _tokenizer(tiny_model_dir)
    assert len(table) == 4
    got = list(table)
    assert [p.input for p in got] == QUESTIONS
    assert [p.answer for p in got] == ANSWERS
    assert [p.line for p in got] == [1, 2, 3, 4]
    assert [p.input_token_ids for p in got] == [chat_token_ids(tok, q) for q in QUESTIONS]


def test_the_shipped_jsonl_reads_as_before(tmp_path, tiny_model_dir):
    """The default keys (`input`, `answer`), structured answers, metadata and a prefill."""
    from async_grpo.data import load_prompts
    from async_grpo.data.generate import calculator_rows, countdown_rows, guess_rows
    from async_grpo.data.tokenize import tokenize_prompts

    for rows in (countdown_rows(5, 0), guess_rows(5, 0), calculator_rows(3, 0)):
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        old = tokenize_prompts(load_prompts(path), tiny_model_dir, "chat")
        new = list(_prepare(path, tiny_model_dir))
        assert [p.to_json() for p in new] == [p.to_json() for p in old]


def test_a_split_is_picked(tmp_path, tiny_model_dir):
    from datasets import Dataset, DatasetDict

    rows = _rows("input", "answer")
    splits = {"train": Dataset.from_list(rows[:3]), "test": Dataset.from_list(rows[3:])}
    DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    assert len(_prepare(tmp_path / "dd", tiny_model_dir)) == 3  # train when there are several
    test = _prepare(tmp_path / "dd", tiny_model_dir, split="test")
    assert [p.input for p in test] == QUESTIONS[3:]
    with pytest.raises(DataError, match=r"dataset.split=dev: no such split \(has: train, test\)"):
        _prepare(tmp_path / "dd", tiny_model_dir, split="dev")
    DatasetDict({"a": splits["train"], "b": splits["test"]}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataError, match=r"several splits \(a, b\): set dataset.split"):
        _prepare(tmp_path / "ab", tiny_model_dir)
    # parquet shards named by split, as the hub ships them
    (tmp_path / "hub" / "data").mkdir(parents=True)
    splits["train"].to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    splits["test"].to_parquet(str(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet"))
    assert [p.input for p in _prepare(tmp_path / "hub", tiny_model_dir, split="test")] == [
        QUESTIONS[3]
    ]


MAP_MODULE = """
def to_prompt(row):
    if row["level"] == 2:
        raise ValueError("level 2 is not for training")
    return {
        "prompt": "Q: " + row["question"]["text"],
        "answer": {"value": row["solution"], "source": row["source"]},
        "metadata": {"level": row["level"]},
    }


def not_a_dict(row):
    return [row["solution"]]
"""


def test_a_map_function_shapes_each_row(tmp_path, tiny_model_dir, monkeypatch):
    (tmp_path / "unit_map.py").write_text(MAP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{**r, "question": {"text": r["question"]}} for r in _rows()]
    path = _write("parquet", tmp_path, rows)
    with pytest.raises(
        DataError,
        match=r"d.parquet:3: dataset.map unit_map:to_prompt failed: ValueError: level 2 is not",
    ):
        _prepare(path, tiny_model_dir, map="unit_map:to_prompt")
    path = _write("parquet", tmp_path, [r for r in rows if r["level"] != 2])
    got = list(_prepare(path, tiny_model_dir, map="unit_map:to_prompt"))
    assert got[0].input == "Q: " + QUESTIONS[0]
    assert got[1].answer == {"value": "11", "source": "unit"}
    assert [p.metadata for p in got] == [{"level": 0}, {"level": 1}, {"level": 3}]
    with pytest.raises(DataError, match=r"d.parquet:1: dataset.map unit_map:not_a_dict: expected"):
        _prepare(path, tiny_model_dir, map="unit_map:not_a_dict")
    with pytest.raises(DataError, match=r"dataset.map: unit_map has no function 'nope'"):
        _prepare(path, tiny_model_dir, map="unit_map:nope")


CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "1 + 1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And 2 + 2?"},
]


def test_messages_are_rendered_with_the_models_chat_template(tmp_path, tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    rows = [{"messages": CHAT, "answer": "4"}, {"messages": CHAT[1:2], "answer": "2"}]
    table = _prepare(_write("parquet", tmp_path, rows), tiny_model_dir, prompt_key="messages")
    for p, row in zip(table, rows, strict=True):
        want = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert p.input_token_ids == list(want)
    assert [p.input for p in table] == ["And 2 + 2?", "1 + 1?"]  # the last user turn
    text = tok.decode(table[0].input_token_ids)
    assert "You add numbers." in text and text.endswith("<|im_start|>assistant\n")


def test_system_prompt_and_template_kwargs_reach_the_template(tmp_path, tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    path = _write("parquet", tmp_path, _rows("input", "answer"))
    (p, *_) = _prepare(path, tiny_model_dir, system_prompt="Answer with a number only.")
    text = tok.decode(p.input_token_ids)
    assert text.startswith("<|im_start|>system\nAnswer with a number only.<|im_end|>")
    assert "SmolLM" not in text  # the template's default system turn is replaced
    # a template that reads a keyword, as Qwen3's reads enable_thinking
    model = with_template(
        tiny_model_dir,
        tmp_path / "model",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}",
    )
    think = _tokenizer(model).decode(_prepare(path, model)[0].input_token_ids)
    off = _prepare(path, model, chat_template_kwargs={"enable_thinking": False})
    assert not think.endswith("</think>\n")
    assert _tokenizer(model).decode(off[0].input_token_ids).endswith("<think>\n\n</think>\n")


@pytest.mark.parametrize(
    "rows, settings, message",
    [
        ([{"q": "a", "answer": "1"}], {}, r"d.parquet:1: column 'input': missing \(dataset.prompt_key"),
        ([{"input": "a", "answer": "1"}, {"input": "", "answer": "2"}], {}, r":2: column 'input': empty prompt"),
        ([{"input": 3, "answer": "1"}], {}, r":1: column 'input': expected a string or a list"),
        ([{"input": "a", "answer": None}, {"input": "b", "answer": None}], {}, r":1: column 'answer': missing \(null\)"),
        ([{"m": [{"role": "system", "content": "x"}], "answer": "1"}], {"prompt_key": "m"}, r":1: column 'm': no user turn"),
        ([{"m": [{"role": "robot", "content": "x"}], "answer": "1"}], {"prompt_key": "m"}, r"column 'm': message 0: role 'robot'"),
        ([{"m": [{"role": "user", "content": "x"}], "answer": "1"}], {"prompt_key": "m", "format": "plain"}, r"column 'm': a list of messages needs prompt_format: chat"),
        ([{"input": "word " * 300, "answer": "1"}], {"max_model_len": 256}, r":1: column 'input': \d+ prompt tokens leave no room"),
    ],
    ids=["missing-column", "empty", "wrong-type", "null-answer", "no-user-turn", "bad-role", "messages-plain", "too-long"],
)  # fmt: skip
def test_each_row_is_checked(tmp_path, tiny_model_dir, rows, settings, message):
    path = _write("parquet", tmp_path, rows)
    with pytest.raises(DataError, match=message):
        _prepare(path, tiny_model_dir, **settings)


def test_a_name_with_no_local_copy_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"^openai/gsm8k: no such file or folder; .*no hub access"):
        _prepare("openai/gsm8k", tiny_model_dir)


def test_the_table_is_lazy_and_pickles_as_its_path(tmp_path, tiny_model_dir):
    """What the batcher and the evaluator actors receive: a path and the tokenizer, not the
    rows (3,000 rows pickle within a kB of 30); the sampler addresses it by index as it
    did a list."""
    rows = [{"input": f"question {i}", "answer": str(i)} for i in range(3000)]
    table = _prepare(_write("parquet", tmp_path, rows), tiny_model_dir)
    (tmp_path / "small").mkdir()
    small = _prepare(_write("parquet", tmp_path / "small", rows[:30]), tiny_model_dir)
    blob = pickle.dumps(table)
    assert abs(len(blob) - len(pickle.dumps(small))) < 1000
    again = pickle.loads(blob)
    sampler = PromptSampler(len(again), seed=3)
    for i in sampler.take(20):
        assert again[i].input == f"question {i}" and again[i].answer == str(i)
    head = table[:5]
    assert len(head) == 5 and [p.input for p in head][-1] == "question 4"
    assert len(pickle.loads(pickle.dumps(head))) == 5
    with pytest.raises(IndexError):
        table[3000]


def test_an_unpickled_table_tokenizes_as_before_without_autotokenizer(tmp_path, tiny_model_dir):
    """The process that receives the table (the batcher) reads each prompt with the
    tokenizer that came with it: the same token ids, and transformers' model classes
    (which `AutoTokenizer`'s import brings, ~4 s) never imported there."""
    rows = [{"input": f"question {i}", "answer": str(i)} for i in range(10)]
    table = _prepare(_write("parquet", tmp_path, rows), tiny_model_dir)
    (tmp_path / "table.pkl").write_bytes(pickle.dumps(table))
    code = (
        "import pickle, sys\n"
        "t = pickle.load(open(sys.argv[1], 'rb'))\n"
        "print(','.join(map(str, t[3].input_token_ids)))\n"
        "print('transformers.models.auto.modeling_auto' in sys.modules)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "table.pkl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    ids, imported = r.stdout.split()
    assert ids == ",".join(map(str, table[3].input_token_ids))
    assert imported == "False"


def test_a_second_start_reads_the_prepared_file(tmp_path, tiny_model_dir, monkeypatch):
    """Rows shaped by `dataset.map` are prepared once per source, model and settings; rows
    read by column name are the source itself, so an edited file reads as edited."""
    (tmp_path / "unit_map.py").write_text(MAP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{**r, "question": {"text": r["question"]}} for r in _rows() if r["level"] != 2]
    path = _write("parquet", tmp_path, rows)
    first = _prepare(path, tiny_model_dir, map="unit_map:to_prompt")
    assert _prepare(path, tiny_model_dir, map="unit_map:to_prompt").path == first.path
    other = _prepare(path, tiny_model_dir, map="unit_map:to_prompt", system_prompt="x")
    assert other.path != first.path
    rows = _rows("input", "answer")
    _write("parquet", tmp_path, rows)
    assert _prepare(path, tiny_model_dir)[0].input == QUESTIONS[0]
    rows[0]["input"] = "What is 3 + 3?"
    _write("parquet", tmp_path, rows)
    assert _prepare(path, tiny_model_dir)[0].input == "What is 3 + 3?"


def test_the_data_command_writes_parquet_with_messages(tmp_path, tiny_model_dir):
    out = tmp_path / "arith.parquet"
    cmd = [sys.executable, "-m", "async_grpo.cli", "data", "arithmetic", "-n", "6"]
    r = subprocess.run([*cmd, "--messages", "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*cmd, "-o", str(tmp_path / "a.jsonl")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    chat = _prepare(out, tiny_model_dir, prompt_key="messages")
    text = _prepare(tmp_path / "a.jsonl", tiny_model_dir)
    assert [p.to_json() for p in chat] == [p.to_json() for p in text]


@pytest.mark.parametrize("curriculum", [False, True])
def test_the_batcher_draws_from_a_table_as_from_a_list(tmp_path, tiny_model_dir, curriculum):
    """The same step from a parquet table as from the list of the same prompts: the
    sampler's and the curriculum's indices address both alike."""
    import asyncio

    from test_batcher import (
        ScriptedGeneration,
        ScriptedVerifier,
        _cfg,
        _drain,
        _prompts,
        sent_samples,
    )

    from async_grpo.batcher.batcher import ExperienceBatcher

    prompts = _prompts()
    rows = [
        {"input": p.input, "answer": p.answer, "input_token_ids": p.input_token_ids}
        for p in prompts
    ]
    table = _prepare(_write("parquet", tmp_path, rows), tiny_model_dir)
    assert [p.to_json() for p in table] == [p.to_json() for p in prompts]
    cfg = _cfg(curriculum=curriculum)

    async def first_step(source):
        b = ExperienceBatcher(cfg, source, num_ranks=2, clients={})
        b._clients = {"generation": ScriptedGeneration(b), "verifier": ScriptedVerifier()}
        await b.start(0)
        await b.set_version(0)
        per_rank = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.stop()
        return sent_samples(per_rank)

    def run(source):
        return asyncio.run(asyncio.wait_for(first_step(source), 60))

    from_list = run(prompts)
    assert len(from_list) == 16 and run(table) == from_list


def test_the_check_command_reads_any_form_as_a_run_does(tmp_path, tiny_model_dir):
    """`async-grpo data check FILE --set ...`: every row through the run's own reader and
    checks (a parquet file with other column names); a missing column is one line, exit 2."""
    path = _write("parquet", tmp_path, _rows("question", "solution"))
    cmd = [sys.executable, "-m", "async_grpo.cli", "data", "check", str(path)]
    cmd += ["--set", f"model={tiny_model_dir}"]
    keys = ["--set", "dataset.prompt_key=question", "--set", "dataset.answer_key=solution"]
    r = subprocess.run([*cmd, *keys], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"{path}: {len(QUESTIONS)} prompts, all valid" in r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"async-grpo: error: {path}:1: column 'input': missing (dataset.prompt_key; the columns:"
        " question,"
        " solution, source, level)"
    ]
