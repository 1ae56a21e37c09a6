"""Shared fixtures: the real SmolLM2 folder and a tiny random model with its tokenizer.

Every test process runs offline, single-threaded by default, with a passive OpenMP wait
policy (2-thread runs were sometimes 10x slower without it on the 2-core machines).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from _cli import CLI, free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a Hugging Face folder (converted once, cached)."""
    from async_grpo.models import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random llama with the SmolLM2 tokenizer (loads in vLLM: head dim 64)."""
    from async_grpo.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer_from=smollm2_dir)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ray_head():
    """A private head node: `ray start --block` in the foreground, so that ending it ends
    exactly this cluster (`ray stop` would end every Ray process of the user)."""
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    temp = tempfile.mkdtemp(prefix="rg", dir="/tmp")  # short: Unix socket paths are limited
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--include-dashboard=false",
            "--num-cpus=4",
            f"--object-store-memory={256 << 20}",
            f"--temp-dir={temp}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while (
        subprocess.run(
            [*CLI, "status", "--address", address], env=env, capture_output=True, timeout=120
        ).returncode
        != 0
    ):
        assert head.poll() is None and time.monotonic() < deadline, "ray head did not start"
        time.sleep(2)
    yield address, env
    head.terminate()
    head.wait(timeout=60)
    shutil.rmtree(temp, ignore_errors=True)
