"""Pool workers die (SIGKILL, as the OOM killer sends) at the worst moments: a generation
worker during a weight push and again holding a request, a verifier and a log-prob
worker holding theirs. `async-grpo run` replaces each one, the requests they held are
sent again exactly once, the run finishes every step, the books balance and no process of
the run is left."""

import pytest
from _faults import assert_all_gone, assert_books, finish, fired, rows, start, tiny_run

pytestmark = pytest.mark.faults

FAULTS = {
    "generation.load_chunk": 1,  # the first push: the worker dies before loading a chunk
    "generation.generate": 3,  # its replacement dies holding a request
    "verifier.score": 2,
    "logprob.logprobs": 2,
}


def test_dead_workers_are_replaced_and_every_sample_accounted_for(tiny_model_dir, tmp_path):
    cmd = tiny_run(
        tiny_model_dir,
        tmp_path,
        "trainer.max_steps=5",
        "trainer.loss.kl_coef=0.01",
        "max_worker_restarts=4",
    )
    proc, tag = start(cmd, tmp_path, ",".join(f"{p}@{k}" for p, k in FAULTS.items()))
    out = finish(proc, tmp_path)
    assert proc.returncode == 0, out[-4000:]
    assert fired(tmp_path) == sorted(FAULTS)
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    last = steps[-1]
    assert last["pool/generation/restarts"] == 2
    assert last["pool/verifier/restarts"] == 1 and last["pool/logprob/restarts"] == 1
    assert max(r.get("weight_push_lost_workers", 0) for r in steps) == 1
    assert out.count("a worker died; started a new one") == 4
    assert_books(steps)
    # the three requests held by a dying worker were each sent again once: 4 samples each
    assert sum(r["samples/reissued"] for r in steps) == 12
    assert sum(r["samples/trained"] + r["samples/skipped"] for r in steps) == 5 * 4
    assert sum(r["samples/missing"] for r in steps) == 0
    gone = assert_all_gone(tag)
    times = ", ".join(f"{r['step']}: {r['time/step']:.1f}s" for r in steps)
    print(f"step times (the deaths in steps 1-3): {times}; every process gone in {gone:.1f}s")


def test_a_broadcast_member_dying_mid_push_makes_the_push_start_over(tiny_model_dir, tmp_path):
    """Two generation workers on the broadcast group; one dies before loading the first
    chunk of the first push. The group is formed again without it, the survivor (paused
    all along) starts its reload over and gets the whole push; the run finishes."""
    cmd = tiny_run(
        tiny_model_dir,
        tmp_path,
        "trainer.max_steps=3",
        "generation.num_workers=2",
        "generation.kv_cache_gib=0.25",
        "trainer.weight_transport=broadcast",
    )
    proc, tag = start(cmd, tmp_path, "generation.load_chunk@1")
    out = finish(proc, tmp_path)
    assert proc.returncode == 0, out[-4000:]
    assert fired(tmp_path) == ["generation.load_chunk"]
    assert "forming the group again, resending" in out, out[-4000:]
    steps = rows(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0]["weight_push_lost_workers"] == 1
    assert steps[0]["worker_version/min"] == 1  # the survivor serves the resent version
    assert_books(steps)
    assert_all_gone(tag)
