"""`async-grpo worker / status / stop` against a real `ray start --head` cluster."""

import os
import re
import subprocess
import time

import pytest
from _cli import CLI, REPO, cluster_command, free_port, run_command, wait_for_line

pytestmark = pytest.mark.integration


def test_a_worker_pinned_where_it_cannot_run_is_one_line_exit_2(ray_head, tiny_model_dir):
    """`--node` naming no live node, and a pool larger than the node's free cores: one line
    each (the nodes there are; the node, the resource, the need and what is free), exit 2,
    before any actor is asked for."""
    address, env = ray_head
    base = [*CLI, "worker", "--mode", "logprob", "--model", str(tiny_model_dir)]
    base += ["--address", address]
    lines = []
    for extra in (["--node", "ffffffff"], ["--num-workers", "1000"]):
        r = subprocess.run([*base, *extra], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
        lines.append(r.stderr.strip().splitlines()[-1])
    assert re.fullmatch(
        r"async-grpo: error: --node ffffffff: no live Ray node\(s\) match; the nodes:"
        r" \d+\.\d+\.\d+\.\d+ \([0-9a-f]{8}\)",
        lines[0],
    ), lines[0]
    assert re.fullmatch(
        r"async-grpo: error: node [0-9a-f]{8}: 1000 logprob worker\(s\) need (\d+) CPU"
        r" \(1000 x (\d+)\); \d+ free there",
        lines[1],
    ), lines[1]


def test_no_cluster_is_one_line_exit_2():
    r = subprocess.run(
        [*CLI, "status", "--address", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("async-grpo: error: no Ray cluster at")


def _status_rows(address, env, pool):
    r = cluster_command("status", address, env)
    assert r.returncode == 0, r.stderr[-2000:]
    return [row.split() for row in r.stdout.splitlines() if row.strip().startswith(pool)]


def _generation_worker(address, env, model_dir):
    return subprocess.Popen(
        [
            *CLI,
            "worker",
            "--mode",
            "generation",
            "--model",
            str(model_dir),
            "--address",
            address,
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            "generation.max_new_tokens=16",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_second_run_on_a_live_cluster_then_a_late_worker(ray_head, tiny_model_dir, tmp_path):
    """Two `async-grpo run --address` in a row on a cluster whose generation worker was
    started with `async-grpo worker`, then one more worker joins. Each run leaves the
    registry naming its final checkpoint after its trainer exited: the late worker loads
    it (workers used to die with OwnerDiedError on weights the trainer had owned), and no
    lease outlives a run."""
    address, env = ray_head
    workers = [_generation_worker(address, env, tiny_model_dir)]
    try:
        wait_for_line(workers[0], "1 generation worker(s) registered", 600)
        for name in ("first", "second"):
            t = time.monotonic()
            r = subprocess.run(
                [
                    *run_command(
                        "quickstart.yaml",
                        f"model={tiny_model_dir}",
                        f"output_dir={tmp_path / name}",
                        "trainer.max_steps=2",
                        "batcher.questions_per_step=1",
                        "batcher.samples_per_question=4",
                        "generation.max_new_tokens=16",
                    ),
                    "--address",
                    address,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert r.returncode == 0, f"{name} run: {(r.stdout + r.stderr)[-6000:]}"
            print(f"{name} run: {time.monotonic() - t:.0f}s")
            steps = (tmp_path / name / "training_metrics.jsonl").read_text().splitlines()
            assert len(steps) == 2
            # only the `async-grpo worker` one is left, idle, on the last pushed version;
            # the run's verifiers are gone from their registry too
            rows = _status_rows(address, env, "generation")
            assert [(row[2], row[3]) for row in rows] == [("0/64", "1")], rows
            assert _status_rows(address, env, "verifier") == []
        workers.append(_generation_worker(address, env, tiny_model_dir))
        wait_for_line(workers[1], "1 generation worker(s) registered", 600)
        rows = _status_rows(address, env, "generation")
        assert len({row[1] for row in rows}) == 2, rows  # two ids
        # the late one loaded the second run's final checkpoint (version 2, saved after its
        # last push), never a full-model object
        assert sorted((row[2], row[3]) for row in rows) == [("0/64", "1"), ("0/64", "2")], rows
        stop = cluster_command("stop", address, env)
        assert "asked 2 worker(s) to drain and stop" in stop.stdout, stop.stdout + stop.stderr
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()  # the worker command stops its workers on SIGTERM
            try:
                w.wait(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
