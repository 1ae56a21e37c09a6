"""An environment that misbehaves in every way, in a real `async-grpo run` with two real
environment workers: its step raises, hangs past the step timeout, returns garbage,
returns a NaN reward and ends its worker's process; its reset refuses a data row. Each
episode ends with reward 0 and its counted reason, the refused row's group is dropped as a
group error after its tries, the dead worker is replaced, the books balance, the run
exits 0 and no process or weight file of it is left. The hung steps leave threads
stuck, so their worker retires and is replaced too."""

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
        "environment.step_timeout_s=2",
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
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("env-*.log"))
    assert logs.count("this worker retires") == 2
    gone = assert_all_gone(tag)
    print(f"every process gone {gone:.1f}s after the run")
