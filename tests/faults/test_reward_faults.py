"""A reward function that hangs on every sample: each sample is scored 0 with the cause
(the verifier's timeout), and since every sample of step 1 failed, the run stops with one
line that gives the count and the first reasons, exit 2, within a bound, instead of
training on zero rewards; no process is left. Each other way a reward fails (it raises,
crashes its process, asks for 10 GB) is scored 0 with its own reason by a verifier actor in
tests/integration/test_verifier_pool.py; the stop is the same whatever the reason."""

import time

import pytest
from _faults import assert_all_gone, assert_books, finish, rows, start, tiny_run

pytestmark = pytest.mark.faults


def test_a_broken_reward_stops_the_run_with_its_reason(tiny_model_dir, tmp_path):
    cmd = tiny_run(
        tiny_model_dir,
        tmp_path,
        "trainer.max_steps=3",
        "generation.max_new_tokens=8",
        "verifier.rewards=[rewards_for_tests:hangs]",
        "verifier.timeout_s=3",
    )
    t = time.monotonic()
    proc, tag = start(cmd, tmp_path)
    out = finish(proc, tmp_path, timeout_s=600)
    took = time.monotonic() - t
    assert proc.returncode == 2, out[-4000:]
    assert "verifier: 4/4 samples failed to score in step 1: timeout" in out, out[-4000:]
    assert "stopping instead of training on zero rewards" in out
    (step,) = rows(tmp_path)
    assert step["verifier/step_failures"] == 4
    assert_books([step])  # scored 0, trained: failing to score drops nothing
    gone = assert_all_gone(tag)
    print(f"run stopped after {took:.0f}s, every process gone {gone:.1f}s later")
