"""docs/configuration.md is generated from async_grpo/config.py and must not drift from it."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from async_grpo.config import RunConfig

REPO = Path(__file__).resolve().parents[2]


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            keys += _leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_config_doc_is_up_to_date():
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts/gen_config_docs.py"), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_every_leaf_key_is_documented():
    text = (REPO / "docs/configuration.md").read_text()
    keys = _leaf_keys(RunConfig)
    assert "trainer.loss.kl_coef" in keys and len(keys) > 40
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, f"keys without a row in docs/configuration.md: {missing}"
