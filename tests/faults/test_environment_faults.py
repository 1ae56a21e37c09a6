"""An environment that misbehaves in every way, in a real `async-grpo run` with two real
environment workers: its step raises, hangs past the step timeout, returns garbage,
returns a NaN reward and ends its worker's process; its reset refuses a data row. Each
episode ends with reward 0 and its counted reason, the refused row's group is dropped as a
group error after its tries, the dead worker is replaced, the books balance, the run
exits 0 and no process or weight file of it is left. The hung steps leave threads
stuck, so their worker retires, saying why, and is replaced too; Ray's own lines about
the deaths stay in the run's logs, off the console.

An environment whose every reset hangs cannot work at all: the run stops with one line
naming it and what it did."""

import json

import pytest
from _faults import assert_all_gone, assert_books, finish, rows, start, tiny_run

pytestmark = pytest.mark.faults

WAYS = ("raise", "hang", "garbage", "nan", "exit", "refuse", "ok")


def test_every_way_an_environment_fails_ends_its_episode_and_the_run_goes_on(
    tiny_model_dir, tmp_path
):
    data = tmp_path / "ways.jsonl"
    data.write_text("".join(json.dumps({"input": f"{w} now", "answer": w}) + "\n" for w in WAYS))
    cmd = tiny_run(
        tiny_model_dir,
        tmp_path,
        f"data={data}",
        "environment.name=envs_for_tests:Hostile",
        "environment.num_workers=2",
        "environment.capacity=4",  # one group per worker at a time: a death ends only its own
        "environment.step_timeout_s=4",  # the ok steps have 4 s on a loaded machine
        f"batcher.questions_per_step={len(WAYS)}",
        "trainer.max_steps=2",
        "trainer.save_every=0",
        "generation.max_new_tokens=8",
        "max_worker_restarts=4",
    )
    proc, tag = start(cmd, tmp_path)
    out = finish(proc, tmp_path, timeout_s=600)
    assert proc.returncode == 0, out[-4000:]
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == [1, 2]
    assert_books(steps)
    for r in steps:  # one group per way: 4 episodes each
        assert r["env/errors/error"] == r["env/errors/timeout"] == r["env/errors/died"] == 4, r
        assert r["env/errors/bad_output"] == 8, r  # garbage and NaN
        assert r["env/errors"] == 20, r
        assert r["dropped/group_error"] == 12, r  # the refused row: 3 tries of 4
        assert r["samples/scored"] == 24 and r["reward/max_in_group_mean"] == 1 / 6, r
    # each step ends two workers: the one whose step exited, and the one whose 4 hung steps
    # left 4 threads stuck (pool.STUCK_LIMIT), which retires once its group is released.
    # Step 1's are replaced while step 2 runs; step 2's may be after the run's last row.
    assert steps[-1]["pool/environment/restarts"] >= 1, steps[-1]
    assert out.count("a worker died; started a new one") >= 2, out[-4000:]
    assert "it said: step hung past environment.step_timeout_s (4 s))" in out, out[-4000:]
    assert "(raylet)" not in out, out[-4000:]
    assert "A worker died or was killed" in (tmp_path / "logs" / "ray.log").read_text()
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("env-*.log"))
    assert logs.count("this worker retires") == 2
    gone = assert_all_gone(tag)
    print(f"every process gone {gone:.1f}s after the run")


def test_an_environment_whose_every_reset_hangs_stops_the_run_naming_it(tiny_model_dir, tmp_path):
    """Each worker's resets time out, its stuck threads retire it (leaving the pool before
    its caller tries again) and it is replaced; the group's three attempts fail on three
    workers, so step 1's samples never arrive. The run stops (exit 2) with one cause line
    naming the environment and what it did, then where the logs are; the supervisor's
    lines say what each retired worker said; Ray's lines about the deaths stay off the
    console."""
    cmd = tiny_run(
        tiny_model_dir,
        tmp_path,
        "environment.name=envs_for_tests:HangingReset",
        "environment.step_timeout_s=1",
        "trainer.max_steps=1",
        "trainer.save_every=0",
        "generation.max_new_tokens=8",
    )
    proc, tag = start(cmd, tmp_path)
    out = finish(proc, tmp_path, timeout_s=600)
    assert proc.returncode == 2, out[-4000:]
    lines = [x for x in out.replace("\r", "\n").splitlines() if x.strip() and "steps:" not in x]
    hung = "reset hung past environment.step_timeout_s (1 s)"
    cause = f"async-grpo: error: environment 'envs_for_tests:HangingReset': {hung} on 3 workers;"
    assert lines[-2].startswith(f"{cause} 4/4 samples of step 1 never arrived"), lines
    assert lines[-1].startswith("the run failed; the workers' logs are in"), lines
    assert out.count(f"it said: {hung})") >= 2, out  # the third may come after the stop
    assert "(raylet)" not in out and "Traceback" not in out, out
    assert_all_gone(tag)
