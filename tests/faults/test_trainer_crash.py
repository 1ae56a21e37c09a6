"""A trainer rank killed mid-step (after its forward/backward, before the optimizer
step): `async-grpo run` ends with one line saying how to resume and leaves no process;
`async-grpo run ... --resume` continues from the last checkpoint and trains the same
next-step batch (generated before the crash, kept in the checkpoint), and the books of
every step balance."""

import pytest
from _faults import assert_all_gone, assert_books, finish, fired, rows, start, tiny_run

pytestmark = pytest.mark.faults


def test_a_killed_trainer_resumes_from_its_checkpoint(tiny_model_dir, tmp_path):
    cmd = tiny_run(
        tiny_model_dir,
        tmp_path,
        "trainer.max_steps=4",
        "batcher.max_off_policy_steps=1",
        "verifier.rewards=[rewards_for_tests:vowel_share]",  # rewards that differ: trained
    )
    proc, tag = start(cmd, tmp_path, "trainer.step@3")  # step 3's forward/backward
    out = finish(proc, tmp_path)
    assert fired(tmp_path) == ["trainer.step"]
    assert proc.returncode not in (0, 2), out[-4000:]
    assert "the trainer died (exit code" in out and "--resume" in out, out[-4000:]
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]
    assert_all_gone(tag)

    proc, tag = start([*cmd, "--resume"], tmp_path)
    out = finish(proc, tmp_path)
    assert proc.returncode == 0, out[-4000:]
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[2]["samples/replayed"] == 4  # step 3: the batch generated before the crash
    assert steps[3]["samples/replayed"] == 0
    assert_books(steps)
    assert_all_gone(tag)
