"""Bad input to `async-grpo run`, through the real command: each is refused before Ray
starts, with exit code 2 and one line naming what, where and what was expected. Where one
kind of refusal has several cases, one goes through the command and the others through the
command's own checks in this process (`_refused_here`)."""

import json
import shutil
import subprocess

import pytest
from _cli import CLI, REPO, free_port, run_command


def _run(tmp_path, *overrides):
    cmd = run_command("arithmetic.yaml", f"output_dir={tmp_path / 'out'}", *overrides)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _refused(r, *words):
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert "Ray head" not in r.stdout  # nothing started
    lines = [x for x in r.stderr.splitlines() if x.strip() and "Warning" not in x]
    assert len(lines) == 1, r.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def _refused_here(tmp_path, overrides, *words, resume=None):
    """What `_run` refuses, checked in this process: the same `load_config` and
    `checked_before_ray` as the command, whose door for the error (one line, exit 2) the
    case of the same kind through the real command checks. A command's start imports torch
    and transformers (about 5 s); here they are loaded already."""
    from async_grpo.errors import UserError
    from async_grpo.preflight import checked_before_ray
    from async_grpo.preflight.settings import load_config

    config = str(REPO / "configs" / "arithmetic.yaml")
    with pytest.raises(UserError) as refused:
        cfg = load_config(config, [f"output_dir={tmp_path / 'out'}", *overrides])
        checked_before_ray(cfg, "run", resume=resume)
    line = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in line, line
    for word in words:
        assert word in line, line


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.lr=nan", ("trainer.lr", "finite")),
        ("trainer.loss.kl_coef=inf", ("trainer.loss.kl_coef", "finite")),
        ("trainer.grad_clip=0", ("trainer.grad_clip", "> 0")),
        ("trainer.weight_decay=-0.1", ("trainer.weight_decay", ">= 0")),
        ("verifier.max_error_fraction=1.5", ("verifier.max_error_fraction", "(0, 1]")),
    ],
)
def test_numbers_out_of_range(tmp_path, override, words):
    _refused(_run(tmp_path, override), *words)


def test_a_refused_setting_costs_no_torch_import(tmp_path):
    """A setting is refused before anything heavy loads: building the command line and
    reading the config import neither torch nor transformers (2.5 s of every command)."""
    cmd = run_command("arithmetic.yaml", f"output_dir={tmp_path / 'out'}", "trainer.lr=nan")
    r = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-3000:]
    imported = {x.rsplit("|", 1)[-1].strip() for x in r.stderr.splitlines() if "|" in x}
    assert "async_grpo.config" in imported and not imported & {"torch", "transformers"}


@pytest.mark.parametrize(
    "reward, words",
    [
        ("no_such_reward", ("no_such_reward", "unknown")),
        ("nopkg.mod:fn", ("nopkg.mod", "cannot import")),
        ("json:no_such_function", ("json", "no_such_function")),
    ],
)
def test_rewards_are_looked_up_at_start(tmp_path, reward, words):
    if reward == "no_such_reward":  # through the command; the others in this process
        _refused(_run(tmp_path, f"verifier.rewards=[{reward}]"), *words)
    else:
        _refused_here(tmp_path, [f"verifier.rewards=[{reward}]"], *words)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["environment.rollout=nopkg.agent:rollout"], ("environment.rollout", "cannot import")),
        (["environment.tool_parser=nope"], ("environment.tool_parser", "hermes")),
    ],
)
def test_a_harness_that_cannot_run_is_refused(tmp_path, overrides, words):
    """Two through the real command; the rest of the class in test_harness.py, in process."""
    harness = ["environment.kind=openai", "batcher.share_prompts=false"]
    if not any("rollout=" in o for o in overrides):
        harness.append("environment.rollout=async_grpo.environments.calculator_harness:rollout")
    _refused(_run(tmp_path, *harness, *overrides), *words)


def test_a_verifiers_environment_that_does_not_load_is_refused(tmp_path):
    """Through the real command (the environment loads before Ray); the rest of the class
    in test_verifiers_env.py, in process."""
    env = ["environment.kind=verifiers", "environment.name=no_such_env", "data=environment"]
    env += ["batcher.share_prompts=false", "eval.data=null"]
    _refused(_run(tmp_path, *env), "environment.name=no_such_env", "cannot import")


def test_a_reward_model_that_is_not_a_classifier_is_refused(tmp_path, tiny_model_dir):
    """Through the real command (the folder is read before Ray); the rest of the class in
    unit/test_model_rewards.py, in process."""
    _refused(
        _run(tmp_path, f"verifier.reward_model.model={tiny_model_dir}"),
        "verifier.reward_model.model",
        "not a reward model",
        "ForSequenceClassification",
    )


def test_resume_without_a_checkpoint(tmp_path):
    cmd = [*run_command("arithmetic.yaml", f"output_dir={tmp_path / 'out'}"), "--resume"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    _refused(r, "--resume", "no checkpoint")


def test_a_model_no_library_can_load(tmp_path, tiny_model_dir):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "no_such_family"}))
    _refused(_run(tmp_path, f"model={folder}"), str(folder), "no_such_family")
    config["architectures"] = ["NoSuchForCausalLM"]  # transformers reads it; vLLM does not
    (folder / "config.json").write_text(json.dumps(config))
    _refused_here(tmp_path, [f"model={folder}"], "vLLM", "NoSuchForCausalLM")


def test_families_the_run_cannot_train_exactly_are_refused(tmp_path, smollm2_dir):
    """Before Ray: a family the engine computes otherwise (measured, by architecture),
    through the real command, and one the trainer's packed path gets wrong, found by the
    start-up check on a small random twin (Bloom's ALiBi), by its checks in this process."""
    from async_grpo.model_families import make_family_model

    neox = make_family_model("gpt_neox", tmp_path / "neox", smollm2_dir)
    _refused(_run(tmp_path, f"model={neox}"), "GPTNeoXForCausalLM", "Transformers backend")
    bloom = tmp_path / "bloom"
    shutil.copytree(neox, bloom)
    config = json.loads((bloom / "config.json").read_text())
    config |= {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "n_head": 2}
    (bloom / "config.json").write_text(json.dumps(config))
    _refused_here(tmp_path, [f"model={bloom}"], "'bloom'", "packed path")


def _without_chat_template(tmp_path, tiny_model_dir):
    """A copy of the tiny model whose tokenizer has no chat template (a base model)."""
    import shutil

    folder = tmp_path / "base"
    shutil.copytree(tiny_model_dir, folder)
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def test_chat_prompts_for_a_model_without_a_chat_template(tmp_path, tiny_model_dir):
    folder = _without_chat_template(tmp_path, tiny_model_dir)
    _refused(_run(tmp_path, f"model={folder}"), "no chat template", "prompt_format=plain")


def test_an_environment_on_a_model_without_a_chat_template(tmp_path, tiny_model_dir):
    """Plain prompts pass, but the episode's turns need the template: refused before Ray."""
    folder = _without_chat_template(tmp_path, tiny_model_dir)
    r = _run(
        tmp_path,
        f"model={folder}",
        "prompt_format=plain",
        "environment.name=calculator",
        "eval.data=null",
    )
    _refused(r, "environment.name=calculator", "no chat template")


def test_plain_prompts_are_the_text_as_it_is(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from async_grpo.data.jsonl import Prompt
    from async_grpo.data.tokenize import tokenize_prompts

    folder = _without_chat_template(tmp_path, tiny_model_dir)
    text = "Question: 2 + 3 = ? Answer:"
    (plain,) = tokenize_prompts([Prompt(input=text, answer="5")], folder, "plain")
    assert plain.input_token_ids == AutoTokenizer.from_pretrained(folder)(text).input_ids
    (chat,) = tokenize_prompts([Prompt(input=text, answer="5")], tiny_model_dir, "chat")
    assert len(chat.input_token_ids) > len(plain.input_token_ids)  # the template's turn


def test_the_registry_read_from_source_is_vllms_own():
    """preflight reads vLLM's architectures from the registry's source (an import costs
    about 4 s before every run); it must be exactly the set vLLM's registry reports."""
    from async_grpo.preflight.model import imported_vllm_architectures, vllm_architectures

    read = vllm_architectures()
    assert {"LlamaForCausalLM", "Gemma2ForCausalLM", "Qwen3MoeForCausalLM"} <= read
    assert read == imported_vllm_architectures()


def test_lora_targets_the_model_does_not_have(tmp_path):
    r = _run(tmp_path, "trainer.lora.rank=8", "trainer.lora.target_modules=[no_such_proj]")
    _refused(r, "trainer.lora.target_modules", "no_such_proj")


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.lora.rank=600", ("trainer.lora.rank", "1..512")),
        ("trainer.lora.alpha=0", ("trainer.lora.alpha", "> 0")),
        ("trainer.lora.dropout=1.0", ("trainer.lora.dropout", "[0, 1)")),
        ("trainer.lora.push=both", ("trainer.lora.push", "adapter")),
    ],
)
def test_lora_settings_out_of_range(tmp_path, override, words):
    rank = [] if "rank=" in override else ["trainer.lora.rank=8"]
    if "rank=" in override:  # through the command; the others in this process
        _refused(_run(tmp_path, *rank, override), *words)
    else:
        _refused_here(tmp_path, [*rank, override], *words)


# Text that is not UTF-8 (a byte 0xe9 on line 2) or not valid Unicode (a lone surrogate,
# valid JSON and YAML as the escape \ud800), in every file the CLI reads
NOT_UTF8 = b'{"input": "2 + 2", "answer": "4"}\n{"input": "caf\xe9", "answer": "1"}\n'
SURROGATE = b'{"input": "2 + 2", "answer": "4"}\n{"input": "x", "answer": "\\ud800"}\n'


@pytest.mark.parametrize(
    "key, content, words",
    [
        ("data", NOT_UTF8, (":2: not UTF-8: byte 0xe9 at column 15 (byte 48 of the file)",)),
        ("eval.data", SURROGATE, (":2: field 'answer': not valid Unicode",)),
    ],
)
def test_data_that_is_not_unicode(tmp_path, key, content, words):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    if key == "data":  # through the command; the held-out file in this process
        _refused(_run(tmp_path, f"{key}={path}"), str(path), *words)
    else:
        _refused_here(tmp_path, [f"{key}={path}"], str(path), *words)


@pytest.mark.parametrize(
    "content, words",
    [
        (b"model: smollm2-135m\n# caf\xe9\n", (":2: not UTF-8: byte 0xe9 at column 6",)),
        (b'model: smollm2-135m\nrun_name: "\\ud800"\n', (": run_name: not valid Unicode",)),
    ],
)
def test_a_config_that_is_not_unicode(tmp_path, content, words):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    cmd = [*run_command("arithmetic.yaml")[:-1], str(path)]
    _refused(subprocess.run(cmd, capture_output=True, text=True, timeout=120), str(path), *words)


def test_files_of_the_other_commands_that_are_not_utf8(tmp_path):
    """`data check`, `plot` and `timeline` read files a user names: the same one line."""
    import sys

    (tmp_path / "m.jsonl").write_bytes(b'{"step": 1, "loss": 1.0}\n{"step": 2, "x\xff": 1}\n')
    (tmp_path / "d.jsonl").write_bytes(NOT_UTF8)
    out = str(tmp_path / "out.png")
    for argv, where in [
        (["data", "check", str(tmp_path / "d.jsonl")], "d.jsonl:2: not UTF-8"),
        (["plot", str(tmp_path / "m.jsonl"), "-v", "loss", "-o", out], "m.jsonl:2: not UTF-8"),
        (["timeline", str(tmp_path / "m.jsonl"), "-o", out], "m.jsonl:2: not UTF-8"),
    ]:
        cmd = [sys.executable, "-m", "async_grpo.cli", *argv]
        _refused(subprocess.run(cmd, capture_output=True, text=True, timeout=60), where)


@pytest.mark.parametrize(
    "targets, named", [("lm_head", "lm_head"), ("embed_tokens", "model.embed_tokens")]
)
def test_lora_targets_outside_the_decoder_layers(tmp_path, targets, named):
    """An adapter on the LM head would never train (the trainer's chunked head multiplies
    by the base weight), one on the embedding failed to load after Ray had started. (The
    head through the command, the embedding in this process.)"""
    overrides = ["trainer.lora.rank=8", f"trainer.lora.target_modules=[{targets}]"]
    words = (f"trainer.lora.target_modules: {named} ", "only the decoder layers' linear")
    if targets == "lm_head":
        _refused(_run(tmp_path, *overrides), *words)
    else:
        _refused_here(tmp_path, overrides, *words)


def test_a_new_run_refuses_an_output_dir_with_checkpoints(tmp_path):
    """A new run writing into an earlier run's checkpoints would leave its step_N/adapter/
    beside this run's step_N/hf/ (or the reverse), which eval, export and late-joining
    workers took."""
    (tmp_path / "out" / "checkpoints" / "step_4" / "adapter").mkdir(parents=True)
    r = _run(tmp_path)
    _refused(r, str(tmp_path / "out"), "step_4", "pass --resume to continue or choose another")


QV = [f"model.layers.{i}.self_attn.{m}" for i in range(30) for m in ("q_proj", "v_proj")]
SAVED = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": QV}  # SmolLM2's 30 layers


@pytest.mark.parametrize(
    "saved, overrides, words",
    [
        (
            SAVED,
            [
                "trainer.lora.rank=8",
                "trainer.lora.alpha=32",
                "trainer.lora.target_modules=[q_proj]",
            ],
            ["alpha 16.0 -> 32.0", "target_modules [q_proj, v_proj] (60 modules) -> [q_proj] (30"],
        ),
        (None, ["trainer.lora.rank=8"], ["it trained every weight", "LoRA adapters (rank 8)"]),
        (SAVED, [], ["it trained LoRA adapters (rank 8); this run trains every weight"]),
    ],
    ids=["narrowed-and-rescaled", "full-as-lora", "lora-as-full"],
)
def test_a_resume_with_other_lora_settings(tmp_path, saved, overrides, words):
    """The checkpoint records its LoRA settings; a resume that would load it into another
    function (a rescaled or narrowed adapter, or the other kind of training) is refused."""
    step = tmp_path / "out" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 2, "lora": saved}))
    (step.parent / "latest").write_text("step_2")
    if saved is not None and overrides:  # through the command; the other kinds in this process
        cmd = run_command("arithmetic.yaml", f"output_dir={tmp_path / 'out'}", *overrides)
        r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=120)
        _refused(r, "--resume", str(step), *words)
    else:
        _refused_here(tmp_path, overrides, "--resume", str(step), *words, resume="latest")


# Bad rows in the forms the `datasets` library reads (docs/data.md): each a real file,
# refused before Ray in one line naming the file, the row and the column; the first through
# the real command, the others by the command's own checks in this process (`_refused_here`).
# A row the same check refuses in another form (a wrong type, no user turn, messages as
# plain text, a prompt too long, a hub name) is refused in process by
# unit/test_data_forms.py::test_each_row_is_checked: the one-line door is the same
def _parquet(path, rows):
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(path))


BAD_ROWS = [
    (
        "d.parquet",
        [{"question": "1 + 1", "answer": "2"}],
        [],
        ["d.parquet:1: column 'input': missing (dataset.prompt_key", "question"],
    ),
    ("d.csv", b"input,answer\n1 + 1,2\n  ,3\n", [], ["d.csv:2: column 'input': empty prompt"]),
    ("d.csv", b"input,answer\n1 + 1,2\ncaf\xe9,3\n", [], ["d.csv:3: not UTF-8: byte 0xe9"]),
    (
        "d.jsonl",
        b'{"input": "a", "answer": 1}\n{"input": {"text": "b"}, "answer": {"x": [1]}}\n',
        [],
        ["d.jsonl:2: column 'input': expected a string or a list of {role, content}", "dict"],
    ),
    (
        "d.parquet",
        [{"input": "1 + 1", "answer": "2"}, {"input": "2 + 2", "answer": "oops"}],
        ["dataset.map=bad_map:answer_as_int"],
        ["d.parquet:2: dataset.map bad_map:answer_as_int failed: ValueError"],
    ),
]


@pytest.mark.parametrize(
    "name, content, overrides, words",
    BAD_ROWS,
    ids=["missing-column", "empty-prompt", "csv-bad-bytes", "json-odd-types", "map-error"],
)
def test_bad_rows_in_any_form(tmp_path, monkeypatch, name, content, overrides, words):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        _parquet(path, content)
    (tmp_path / "bad_map.py").write_text(
        "def answer_as_int(row):\n    return {'prompt': row['input'], 'answer': int(row['answer'])}\n"
    )
    if name == "d.parquet" and not overrides:  # through the command; the others in this process
        cmd = run_command("arithmetic.yaml", f"output_dir={tmp_path / 'out'}", f"data={path}")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        _refused(r, str(tmp_path), *words)
    else:
        monkeypatch.syspath_prepend(str(tmp_path))  # bad_map
        _refused_here(tmp_path, [f"data={path}", *overrides], str(tmp_path), *words)


def test_the_train_command_refuses_what_run_refuses(tmp_path):
    """`async-grpo train` by hand (each torchrun rank) checks what `run` checks, before its
    process group and Ray: here outside torchrun, where the process group could not start,
    a bad row is still one line, exit 2."""
    path = tmp_path / "d.parquet"
    _parquet(path, [{"question": "1 + 1", "answer": "2"}])
    cmd = run_command("arithmetic.yaml", f"output_dir={tmp_path / 'out'}", f"data={path}")
    cmd[cmd.index("run")] = "train"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    _refused(r, f"{path}:1: column 'input': missing (dataset.prompt_key")


@pytest.mark.parametrize(
    "args, words",
    [
        (["worker", "--mode", "generation", "--model", "/no/such/model"], ("/no/such/model",)),
        (["worker", "--mode", "verifier", "verifier.rewards=[nopkg.mod:fn]"], ("nopkg.mod",)),
        (["worker", "--mode", "judge"], ("verifier.judge.model", "required for --mode judge")),
        (["eval", "/no/such/model", "--data", "d.jsonl"], ("/no/such/model",)),
        (["eval", "smollm2-135m", "--data", "d.jsonl", "--rewards", "json:nope"], ("'json:nope'",)),
    ],
    ids=["worker-model", "worker-reward", "worker-judge", "eval-model", "eval-reward"],
)
def test_every_command_refuses_before_ray_the_same_way(tmp_path, args, words):
    """`worker` and `eval` pass through the same door as `run` and `train`
    (`preflight.checked_before_ray`): bad input is one line, exit 2, before they reach a
    cluster (the address given has none: reaching for it would be another line)."""
    (tmp_path / "d.jsonl").write_text('{"input": "1 + 1", "answer": "2"}\n')
    where = ["--address", f"127.0.0.1:{free_port()}"]
    config = ["--config", str(REPO / "configs" / "arithmetic.yaml")]
    if args[0] == "worker":
        cmd = [*CLI, args[0], *args[1:3], *where, *config, *args[3:]]
    else:
        cmd = [*CLI, *args, *where, *config, "-o", str(tmp_path / "eval")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    _refused(r, *words)
