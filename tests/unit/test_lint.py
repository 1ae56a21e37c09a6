import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (REPO / ".venv/bin/ruff").exists(),
    reason="ruff is in the dev extra",
)
def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(REPO / ".venv/bin/ruff")
    r = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:]
