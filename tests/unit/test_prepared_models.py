"""Prepared models: the GGUF's own BOS/EOS flags reach the tokenizer made from it, and an
unknown name is refused in one line through the real command."""

import subprocess
import sys

import pytest


def _gguf(path, **flags):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for key, value in flags.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "flags",
    [
        {"add_bos_token": True, "add_eos_token": False},
        {"add_bos_token": False},
        {},
    ],
)
def test_special_token_flags_are_the_files_own(tmp_path, flags):
    from async_grpo.models import special_token_flags

    assert special_token_flags(_gguf(tmp_path / "m.gguf", **flags)) == flags


def test_unknown_model_name_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "async_grpo.cli", "prepare-model", "no-such-model"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "no-such-model" in lines[0] and "gemma3-270m" in lines[0]


def test_a_folders_tokenizer_loads_once_until_its_files_change(tmp_path, tiny_model_dir):
    """`load_tokenizer` keeps one tokenizer per folder in a process; a folder whose
    tokenizer files changed (another chat template written into it) is read again."""
    import json
    import shutil

    from async_grpo.models import load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    first = load_tokenizer(folder)
    assert load_tokenizer(str(folder)) is first and load_tokenizer(folder / ".") is first
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config.write_text(json.dumps(settings))
    again = load_tokenizer(folder)
    assert again is not first and again.chat_template == settings["chat_template"]
    assert load_tokenizer(folder) is again
