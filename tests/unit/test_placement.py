"""CPU placement (async_grpo/placement.py): core lists parsed and refused before Ray, and a
real process bound thread by thread, the threads it had already started included."""

import json
import os
import subprocess
import sys

import pytest
from _cli import run_command

from async_grpo.placement import PlacementError, compact, parse_cpus

CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "text, cores",
    [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("3,0-1", (0, 1, 3)), (" 2 , 2-2", (2,)), (5, (5,))],
)
def test_core_lists(text, cores):
    assert parse_cpus(text, "x.cpus") == cores
    assert parse_cpus(compact(cores), "x.cpus") == cores


def test_compact():
    assert compact({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "0;1", "1.5"])
def test_bad_core_lists(text):
    with pytest.raises(PlacementError, match=r"^x\.cpus: "):
        parse_cpus(text, "x.cpus")


def _refused(tmp_path, *overrides):
    cmd = run_command("arithmetic.yaml", f"output_dir={tmp_path / 'out'}", *overrides)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert "Ray head" not in r.stdout  # nothing started
    lines = [x for x in r.stderr.splitlines() if x.strip() and "Warning" not in x]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["generation.cpus=9999"], ["generation.cpus", "[9999]", "do not exist"]),
        (["trainer.cpus=0-x"], ["trainer.cpus", "'0-x'", "not a core list"]),
        (["trainer.cpus=0", "trainer.threads=2"], ["trainer.cpus", "1 core(s)", "2 threads"]),
        (  # two pools on one core of this node
            ["generation.cpus=0", "trainer.cpus=0", "trainer.threads=1"],
            ["trainer.cpus", "[0]", "generation.cpus"],
        ),
    ],
)
def test_placements_refused_before_ray(tmp_path, overrides, words):
    line = _refused(tmp_path, *overrides)
    for word in words:
        assert word in line, line


def test_a_core_number_from_yaml_is_a_core_list():
    from async_grpo.preflight.settings import load_config

    cfg = load_config("configs/arithmetic.yaml", [f"generation.cpus={CORES[0]}"])
    assert cfg.generation.cpus == str(CORES[0])


BOUND = """
import json, os, sys, threading, time
from async_grpo.placement import bind_process, process_cpus
stop = threading.Event()
early = threading.Thread(target=stop.wait)  # started before the binding
early.start()
bind_process((int(sys.argv[1]),), "test.cpus")
late = threading.Thread(target=stop.wait)  # started after it
late.start()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(json.dumps({"threads": len(tids), "each": [sorted(os.sched_getaffinity(t)) for t in tids],
                  "process": sorted(process_cpus())}), flush=True)
time.sleep(float(sys.argv[2]))
stop.set()
"""


def test_a_process_is_bound_thread_by_thread():
    """A real child process binds itself to the last core: every one of its threads (one
    started before the binding, one after) runs there, as another process reads it too."""
    from async_grpo.placement import process_cpus

    core = CORES[-1]
    proc = subprocess.Popen(
        [sys.executable, "-c", BOUND, str(core), "5"], stdout=subprocess.PIPE, text=True
    )
    try:
        seen = json.loads(proc.stdout.readline())
        assert seen["threads"] >= 3
        assert seen["each"] == [[core]] * seen["threads"] and seen["process"] == [core]
        assert process_cpus(proc.pid) == {core}  # read from outside, /proc/<pid>/task
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_binding_to_a_core_this_node_lacks_is_one_line():
    from async_grpo.placement import bind_process

    with pytest.raises(
        PlacementError, match=r"^generation\.cpus: cannot bind to cores 9999 on node "
    ):
        bind_process((9999,), "generation.cpus")


def test_a_run_joining_a_cluster_leaves_core_existence_to_each_node():
    """With `ray_address` the workers run on other nodes: cores this machine lacks are
    accepted here (each process refuses them as it binds, naming its node); the parse and
    the thread count are still checked here."""
    from async_grpo.preflight.settings import load_config

    cluster = ["ray_address=127.0.0.1:6379", "generation.cpus=9990-9997"]
    assert load_config("configs/arithmetic.yaml", cluster).generation.cpus == "9990-9997"
    with pytest.raises(PlacementError, match="do not exist here"):
        load_config("configs/arithmetic.yaml", cluster[1:])
    with pytest.raises(PlacementError, match="1 core.s. .* for 2 threads"):
        load_config(
            "configs/arithmetic.yaml", [*cluster[:1], "trainer.cpus=9999", "trainer.threads=2"]
        )
