"""Two Ray nodes on one machine (raylets on 127.0.0.1 and 127.0.0.2), driven by the commands
docs/cluster.md gives: a generation worker pinned to node B, a verifier and two log-prob
workers on the head, `status` by node, the trainer as two torchrun launchers (`--nnodes 2`,
one rank each, gloo), then `stop`."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _cli import CLI, REPO, cluster_command, free_port, wait_for_line

from async_grpo.shm_files import RUN_ID_ENV

pytestmark = pytest.mark.integration

NODE_B = "127.0.0.2"
CONFIG = str(REPO / "configs" / "quickstart.yaml")


@pytest.fixture
def two_nodes(ray_head):
    """The head, and a second raylet on NODE_B joined to it (its own process group)."""
    address, env = ray_head
    ray_bin = str(Path(sys.executable).with_name("ray"))
    node = subprocess.Popen(
        [ray_bin, "start", "--block", f"--address={address}", f"--node-ip-address={NODE_B}"]
        + ["--num-cpus=2", f"--object-store-memory={128 << 20}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_nodes(address, env, 2)
        yield address, env, node
    finally:
        _kill_group(node)


def _wait_nodes(address, env, n):
    code = (
        "import ray, sys, time\n"
        f"ray.init(address={address!r}, logging_level='ERROR')\n"
        "deadline = time.monotonic() + 120\n"
        f"while sum(x['Alive'] for x in ray.nodes()) < {n}:\n"
        "    if time.monotonic() > deadline: sys.exit(f'nodes: {ray.nodes()}')\n"
        "    time.sleep(0.5)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=180)
    assert r.returncode == 0, f"node B did not join in 120 s: {r.stderr[-2000:]}"


def _kill_group(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_worker_on_node_b_takes_the_cross_node_push(two_nodes, tiny_model_dir, tmp_path):
    """The generation worker runs on B (`--node`), `status` lists it under B, the trainer's
    two launchers train with it and push over the broadcast group (rank 0 is on the head:
    the transport is chosen, not forced), and `stop` then the end of both raylets leave
    no process and no /dev/shm file of this cluster."""
    address, env, node_b = two_nodes
    tag = uuid.uuid4().hex
    env = {**env, RUN_ID_ENV: tag}
    common = [f"model={tiny_model_dir}", "generation.max_new_tokens=16"]
    worker = [*CLI, "worker", "--config", CONFIG, "--address", address]
    gen = subprocess.Popen(
        [*worker, "--mode", "generation", "--model", str(tiny_model_dir), "--node", NODE_B]
        + common,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ver, logprob = (
        subprocess.Popen(
            [*worker, "--mode", *mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for mode in (
            ["verifier"],
            ["logprob", "--model", str(tiny_model_dir), "--num-workers", "2"],
        )
    )
    ranks = []
    try:
        wait_for_line(gen, "1 generation worker(s) registered", 600)
        wait_for_line(ver, "1 verifier worker(s) registered")
        wait_for_line(logprob, "2 logprob worker(s) registered")
        _status_by_node(address, env)
        out, port = tmp_path / "out", free_port()
        for rank in range(2):  # as docs/cluster.md starts the trainer on each of its nodes
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            cmd += ["--nproc-per-node", "1", "--node-rank", str(rank)]
            cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
            cmd += ["-m", "async_grpo.cli", "train", CONFIG, *common, f"output_dir={out}"]
            cmd += ["trainer.num_ranks=2", "trainer.threads=1", "trainer.max_steps=2"]
            cmd += ["batcher.questions_per_step=1", "batcher.samples_per_question=4"]
            log = (tmp_path / f"rank{rank}.txt").open("w")
            ranks.append(
                subprocess.Popen(
                    [*cmd, "--address", address],
                    env=env,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        for rank, proc in enumerate(ranks):
            code = proc.wait(timeout=600)
            assert code == 0, (tmp_path / f"rank{rank}.txt").read_text()[-6000:]
        metrics = [json.loads(x) for x in (out / "training_metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        pushed = [m for m in metrics if "weight_transport/broadcast" in m]  # the last: none
        assert [(m["weight_transport/broadcast"], m["weight_transport/shm"]) for m in pushed] == [
            (1.0, 0.0)
        ], metrics
        params = json.loads((out / "training_params.json").read_text())
        assert params["world_size"] == 2
        assert list(params["resolved"]["weight_transports"].values()) == ["broadcast"]
        stop = cluster_command("stop", address, env)
        assert "asked 4 worker(s) to drain and stop" in stop.stdout, stop.stdout + stop.stderr
        assert gen.wait(timeout=120) == 0
        assert ver.wait(timeout=60) == 0 and logprob.wait(timeout=60) == 0
        after = cluster_command("status", address, env)
        assert after.stdout.strip() == "no workers registered", after.stdout
    finally:
        for p in [gen, ver, logprob, *ranks]:
            if p.poll() is None:
                p.kill()
    _kill_group(node_b)
    deadline = time.monotonic() + 30
    while _group_alive(node_b.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_alive(node_b.pid), "a process of node B outlived its raylet"
    assert not list(Path("/dev/shm").glob(f"*{tag}*"))


def _status_by_node(address, env):
    """`status`: a header per node (IP, id, host), then its workers with their load;
    `--json`: one object per worker, its node as the header names it."""
    status = cluster_command("status", address, env)
    assert status.returncode == 0, status.stderr
    lines = [r.strip() for r in status.stdout.splitlines()]
    node = r"\d+\.\d+\.\d+\.\d+ node [0-9a-f]{8} \(.+\)"
    headers = [x for x in lines if re.fullmatch(rf"{node}: \d worker\(s\) of .+", x)]
    assert len(headers) == 2, lines
    assert any(
        h.startswith(f"{NODE_B} ") and h.endswith(": 1 worker(s) of generation") for h in headers
    )
    assert any(h.endswith(": 3 worker(s) of logprob, verifier") for h in headers), headers
    logprob = [x for x in lines if x.startswith("logprob")]
    assert len(logprob) == 2 and all(" 0/256 " in x for x in logprob), lines
    status = cluster_command("status", address, env, "--json")
    rows = [json.loads(x) for x in status.stdout.splitlines()]
    assert sorted(r["pool"] for r in rows) == ["generation", "logprob", "logprob", "verifier"]
    assert all(re.fullmatch(node, r["node"]) for r in rows), rows
    on_b = [r["pool"] for r in rows if r["node"].startswith(f"{NODE_B} ")]
    assert on_b == ["generation"], rows
