"""Two Ray nodes on one machine (raylets on 127.0.0.1 and 127.0.0.2), driven by the commands
docs/cluster.md gives: a generation worker pinned to node B, one more with two verifiers
and a log-prob worker on the head, `status` by node, the trainer as two torchrun launchers
(`--nnodes 2`, one rank each, gloo), node B lost mid-run, then `stop`."""

import contextlib
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
from _cli import CLI, REPO, TINY_KV, cluster_command, free_port, wait_for_line

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
    """The node lost at once: every process of its raylet's tree (its workers too, which
    Ray starts in sessions of their own), then its process group."""
    import psutil

    tree = []
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = psutil.Process(proc.pid).children(recursive=True)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)
    return [p.pid for p in tree]


def _alive(pids):
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_a_worker_on_node_b_takes_the_cross_node_push_then_b_is_lost(
    two_nodes, tiny_model_dir, tmp_path
):
    """A generation worker on B (`--node`) and one on the head; `status` lists each under
    its node; the trainer's two launchers push to B over the broadcast group (rank 0 is on
    the head: the transport is chosen, not forced) and to the head's by shared memory.
    Then B's raylet is killed mid-run: its worker is dropped, the run trains on with the
    head's worker to its last step, and the command that started B's worker ends with one
    line naming the node. `stop` then leaves nothing, in processes or in /dev/shm."""
    address, env, node_b = two_nodes
    tag = uuid.uuid4().hex
    env = {**env, RUN_ID_ENV: tag}
    common = [f"model={tiny_model_dir}", "generation.max_new_tokens=16", TINY_KV]
    worker = [*CLI, "worker", "--config", CONFIG, "--address", address]
    model = ["--model", str(tiny_model_dir)]
    modes = {
        "gen_b": ["generation", *model, "--node", NODE_B, *common],
        "gen_a": ["generation", *model, *common],
        # two verifiers, not two log-prob workers: the same `--num-workers` and node
        # headers, without a second process that loads torch and the model (about 4 CPU s)
        "verifier": ["verifier", "--num-workers", "2"],
        "logprob": ["logprob", *model],
    }
    cmds = {
        name: subprocess.Popen(
            [*worker, "--mode", *mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, mode in modes.items()
    }
    ranks, node_b_pids = [], []
    try:
        for name, line in [
            ("gen_b", "1 generation worker(s) registered"),
            ("gen_a", "1 generation worker(s) registered"),
            ("verifier", "2 verifier worker(s) registered"),
            ("logprob", "1 logprob worker(s) registered"),
        ]:
            wait_for_line(cmds[name], line, 600)
        _status_by_node(address, env)
        out, port = tmp_path / "out", free_port()
        for rank in range(2):  # as docs/cluster.md starts the trainer on each of its nodes
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            cmd += ["--nproc-per-node", "1", "--node-rank", str(rank)]
            cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
            cmd += ["-m", "async_grpo.cli", "train", CONFIG, *common, f"output_dir={out}"]
            cmd += ["trainer.num_ranks=2", "trainer.threads=1", "trainer.max_steps=6"]
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
        metrics_file, deadline = out / "training_metrics.jsonl", time.monotonic() + 600
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and ranks[0].poll() is None, "no step 2"
            time.sleep(0.2)
        node_b_pids = _kill_group(node_b)  # node B lost mid-run
        assert node_b_pids, "node B had no processes to lose"
        for rank, proc in enumerate(ranks):
            code = proc.wait(timeout=600)
            assert code == 0, (tmp_path / f"rank{rank}.txt").read_text()[-6000:]
        metrics = [json.loads(x) for x in metrics_file.read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
        pushed = [
            (m["weight_transport/broadcast"], m["weight_transport/shm"])
            for m in metrics
            if "weight_transport/broadcast" in m  # the last step pushes nothing
        ]
        assert pushed[0] == (1.0, 1.0) and pushed[-1] == (0.0, 1.0), metrics
        params = json.loads((out / "training_params.json").read_text())
        assert params["world_size"] == 2
        assert sorted(params["resolved"]["weight_transports"].values()) == ["broadcast", "shm"]
        gen_b = cmds["gen_b"]
        assert gen_b.wait(timeout=180) == 1
        said = gen_b.stdout.read()
        assert re.search(
            rf"^node {NODE_B} \([0-9a-f]{{8}}\) is gone: no generation worker can start there$",
            said,
            re.M,
        ), said[-3000:]
        stop = cluster_command("stop", address, env)
        assert "asked 4 worker(s) to drain and stop" in stop.stdout, stop.stdout + stop.stderr
        assert all(cmds[name].wait(timeout=120) == 0 for name in ("gen_a", "verifier", "logprob"))
        after = cluster_command("status", address, env)
        assert after.stdout.strip() == "no workers registered", after.stdout
    finally:
        for p in [*cmds.values(), *ranks]:
            if p.poll() is None:
                p.kill()
    assert not _alive(node_b_pids), "a process of node B outlived its raylet"
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
    assert any(h.endswith(": 4 worker(s) of generation, logprob, verifier") for h in headers)
    logprob = [x for x in lines if x.startswith("logprob")]
    assert len(logprob) == 1 and " 0/256 " in logprob[0], lines
    assert len([x for x in lines if x.startswith("verifier")]) == 2, lines
    status = cluster_command("status", address, env, "--json")
    rows = [json.loads(x) for x in status.stdout.splitlines()]
    pools = sorted(r["pool"] for r in rows)
    assert pools == ["generation", "generation", "logprob", "verifier", "verifier"], rows
    assert all(re.fullmatch(node, r["node"]) for r in rows), rows
    on_b = [r["pool"] for r in rows if r["node"].startswith(f"{NODE_B} ")]
    assert on_b == ["generation"], rows
