"""A run that stops says why in one line, the first cause recorded: what a pool's
supervisor says when it gives up, and what a rank says when it stops on a user error.
(Through the real command: faults/test_environment_faults.py, faults/test_pool_faults.py.)"""

from async_grpo.cause import CAUSE_FILE_ENV, record, recorded, subject
from async_grpo.config import RunConfig
from async_grpo.errors import EXIT_FILE_ENV
from async_grpo.inference.supervisor import PoolSupervisor, pool_subject


def test_the_first_cause_recorded_wins(tmp_path, monkeypatch):
    path = tmp_path / "cause"
    assert recorded(path) is None
    assert record("pool 'environment' (environment 'x'): reset hung\n past it", path)
    assert not record("generation: 4/4 samples of step 1 never arrived", path)  # a symptom
    assert recorded(path) == "pool 'environment' (environment 'x'): reset hung past it"
    monkeypatch.delenv(CAUSE_FILE_ENV, raising=False)
    assert not record("outside a run: nowhere to keep it")


def test_a_supervisor_names_the_pool_what_it_runs_and_what_its_workers_did():
    """Deaths that ended the same way in a row are counted; a worker that said nothing
    (killed, out of memory) is 'a worker died'."""
    s = PoolSupervisor(3)
    s.watch("environment", [], list, subject("environment", ["sandbox"]))
    hung = "reset hung past environment.step_timeout_s (30 s)"
    s._count("environment", hung)
    assert s.cause("environment") == f"pool 'environment' (environment 'sandbox'): {hung}"
    s._count("environment", hung)
    s._count("environment", hung)
    assert s.cause("environment").endswith(f"{hung} on 3 workers in a row")
    s._count("environment", None)  # a different end starts a new streak
    assert s.cause("environment") == "pool 'environment' (environment 'sandbox'): a worker died"
    s._count("environment", None)
    assert s.cause("environment").endswith("): 2 workers in a row died")


def test_each_pool_is_named_by_what_it_runs():
    cfg = RunConfig()
    cfg.verifier.rewards = ["countdown", "mod:fmt"]
    assert pool_subject(cfg, "verifier") == "reward functions 'countdown', 'mod:fmt'"
    assert pool_subject(cfg, "generation") == f"model {cfg.model!r}"
    assert pool_subject(cfg, "logprob", "/models/m") == "model '/models/m'"
    cfg.environment.name = "calculator"
    assert pool_subject(cfg, "environment") == "environment 'calculator'"


def test_a_rank_of_run_records_its_user_error_for_run_to_print(tmp_path, monkeypatch, capsys):
    """Under `async-grpo run` a rank's one line is the run's cause (unless one came first),
    which `run` prints once the run has stopped; run by hand it is printed at once."""
    from async_grpo.cli import main

    bad = ["plot", str(tmp_path / "none.jsonl"), "-v", "loss", "-o", str(tmp_path / "a.png")]
    assert main(bad) == 2
    assert "metrics file not found" in capsys.readouterr().err
    monkeypatch.setenv(CAUSE_FILE_ENV, str(tmp_path / "cause"))
    monkeypatch.setenv(EXIT_FILE_ENV, str(tmp_path / "exit"))
    assert main(bad) == 2
    assert capsys.readouterr().err == ""
    assert recorded(tmp_path / "cause").startswith("async-grpo: error: ")
    assert "metrics file not found" in recorded(tmp_path / "cause")
    assert (tmp_path / "exit").read_text() == "2\n"
