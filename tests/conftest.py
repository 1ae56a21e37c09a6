"""Shared fixtures: the real SmolLM2 folder, a tiny random model with its tokenizer, and
one Ray cluster for the whole test session (`ray_cluster`; tests/integration/conftest.py
gives each module a clean set of pools on it).

Every test process runs offline, single-threaded by default, with a passive OpenMP wait
policy (2-thread runs were sometimes 10x slower without it on the 2-core machines).
"""

import gc
import logging
import os
import subprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from _cli import PLUGINS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Modules whose engines hold the real SmolLM2 (a few GB each): run one at a time, so two
# pytest workers (-n 2) never hold all of them at once on a 24 GB machine.
SMOLLM2_ENGINES = {
    "test_environment_pool.py",
    "test_inference_pools.py",
    "test_weight_transports.py",
}
# The longest files and groups (docs/testing.md), handed out first: a long one started last
# would leave one worker alone at the end. pytest-xdist hands groups out in this order only
# with `--no-loadscope-reorder` (pyproject.toml); by default it sorts them by their number of
# tests, which put the files of one or two whole runs last.
LONGEST_FIRST = [
    "smollm2-engines",
    "test_training_loop.py",
    "test_pool_faults.py",
    "test_trainer_crash.py",
    "test_environment_faults.py",
    "test_lora_run.py",
    "test_eval_in_run.py",
    "test_two_nodes.py",
    "test_bad_input.py",
    "test_model_families_engine.py",
    "test_model_families.py",
    "test_signals.py",
    "test_lora_serving.py",
    "test_engine_death.py",
    "test_registry_ray.py",
    "test_reward_faults.py",
]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a Hugging Face folder (converted once, cached)."""
    from async_grpo.models import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """SmolLM2's tokenizer and chat template (a module may define its own `tokenizer`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """The real Gemma 3 270M base model as a Hugging Face folder (converted once, cached)."""
    from async_grpo.models import GEMMA3_NAME, prepare_model

    return prepare_model(GEMMA3_NAME)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random llama with the SmolLM2 tokenizer (loads in vLLM: head dim 64)."""
    from async_grpo.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer_from=smollm2_dir)


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer random one-label Llama classifier (a reward model) with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    folder = tmp_path_factory.mktemp("rm") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _group(item) -> str:
    name = item.path.name
    return "smollm2-engines" if name in SMOLLM2_ENGINES else name


def pytest_itemcollected(item):
    """Each test file is one group of pytest-xdist's `--dist loadgroup` (its module fixtures
    are built once), the files in SMOLLM2_ENGINES one group together. Marked as each item is
    collected: pytest-xdist reads the groups before any conftest's modifyitems runs."""
    item.add_marker(pytest.mark.xdist_group(_group(item)))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped where torch sees no CUDA device; the longest groups first."""
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(_group(it), len(rank)), order[id(it)]))


FILE_SECONDS: dict[str, float] = {}
FILE_RUNS: dict[str, int] = {}  # whole runs per file (`count_whole_runs`)


def pytest_runtest_logreport(report):
    """Seconds of test time per file (set-up, call and tear-down), and the whole runs its
    tests made, summed where the reports arrive: the controller under pytest-xdist."""
    path = report.nodeid.split("::")[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration
    if report.when == "teardown":  # each phase's report carries the test's whole list
        runs = sum(n for key, n in report.user_properties if key == "whole_runs")
        FILE_RUNS[path] = FILE_RUNS.get(path, 0) + runs


STARTED: list = []  # this process's `async-grpo run` and `eval` processes, not yet counted
_popen_init = subprocess.Popen.__init__


def _recording_init(self, args, *rest, **kwargs):
    _popen_init(self, args, *rest, **kwargs)
    argv = [str(a) for a in args] if isinstance(args, list | tuple) else []
    if "async_grpo.cli" in argv[:-1] and argv[argv.index("async_grpo.cli") + 1] in ("run", "eval"):
        STARTED.append((self, argv))


subprocess.Popen.__init__ = _recording_init  # every test's commands, however started


def _whole_run(proc, argv) -> bool:
    """A command that got past its start-up checks (started Ray): any exit but 2, or a run
    that wrote metrics before it stopped with 2 (a step that failed to score)."""
    if proc.returncode != 2:
        return True
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("output_dir=")), None)
    return out is not None and (Path(out) / "training_metrics.jsonl").is_file()


@pytest.fixture(autouse=True)
def count_whole_runs(request):
    """The whole runs that ended during this test (or its module's fixtures before it),
    reported with it (`pytest_terminal_summary`): the suite's costliest unit."""
    yield
    ended = [(p, a) for p, a in STARTED if p.poll() is not None]
    for item in ended:
        STARTED.remove(item)
    runs = sum(_whole_run(p, a) for p, a in ended)
    if runs:
        request.node.user_properties.append(("whole_runs", runs))


def pytest_terminal_summary(terminalreporter):
    """The 15 files that took the most test time, after `--durations`' slowest tests, with
    the whole runs each made: where the suite's time goes (docs/testing.md). Then any task
    error nobody saw that the session's last collections found."""
    for line in UNSEEN_AT_END:
        terminalreporter.write_line(f"FAILED (session end) {_UNSEEN}: {line}", red=True)
    if not FILE_SECONDS:
        return
    top = sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    total = sum(FILE_SECONDS.values())
    tiers: dict[str, float] = {}
    for path, seconds in FILE_SECONDS.items():
        tier = path.split("/")[1] if path.count("/") > 1 else path
        tiers[tier] = tiers.get(tier, 0.0) + seconds
    by_tier = ", ".join(f"{t} {s:.0f} s" for t, s in sorted(tiers.items(), key=lambda kv: -kv[1]))
    runs = sum(FILE_RUNS.values())
    terminalreporter.write_sep(
        "=",
        f"slowest files ({total:.0f} s of test time: {by_tier}; whole runs: {runs}, `run`"
        " or `eval` commands past their start-up checks)",
    )
    for path, seconds in top:
        n = FILE_RUNS.get(path, 0)
        terminalreporter.write_line(
            f"{seconds:8.1f}s  {path}" + (f"  (whole runs: {n})" if n else "")
        )


class _UnseenTaskErrors(logging.Handler):
    """asyncio's "Task exception was never retrieved" for a task of our package: an error
    nobody saw (async_grpo/background.py). asyncio logs it whenever the collector frees the
    task: in the test running then (which fails, naming the task's code), or at the end of
    the session, after a last collection (which fails the session, listing them)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []
        self.package = str(REPO / "async_grpo")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()  # the task's repr: its coroutine and where it is defined
        if "never retrieved" in message and self.package in message:
            self.seen.append(f"{message} ({record.exc_info[1]!r})" if record.exc_info else message)

    def take(self) -> list[str]:
        seen, self.seen = self.seen, []
        return seen


UNSEEN = _UnseenTaskErrors()
logging.getLogger("asyncio").addHandler(UNSEEN)
UNSEEN_AT_END: list[str] = []  # from every process of the session, once collected
_UNSEEN = "a task of async_grpo ended by an error nobody saw"


@pytest.fixture(autouse=True)
def no_unseen_task_errors():
    yield
    if seen := UNSEEN.take():
        pytest.fail(f"{_UNSEEN}:\n" + "\n".join(seen))


def pytest_testnodedown(node, error):
    """A pytest-xdist worker ended: what its last collection found (its `workeroutput`)."""
    UNSEEN_AT_END.extend(getattr(node, "workeroutput", {}).get("unseen_task_errors", []))


def pytest_sessionfinish(session):
    gc.collect()  # ~1 s once per process, not per module or test
    seen = UNSEEN.take()
    if hasattr(session.config, "workeroutput"):  # a worker: its controller reports them
        session.config.workeroutput["unseen_task_errors"] = seen
        return
    UNSEEN_AT_END.extend(seen)
    if UNSEEN_AT_END:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def ray_head():
    """A private head node (`ray start --block` in a session of its own, as `async-grpo run`
    starts one): killing its process group ends exactly this cluster, at once (`ray stop`
    would end every Ray process of the user; a SIGTERM to the head takes ~30 s)."""
    from async_grpo.local_head import LocalHead

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    head = LocalHead(num_cpus=4, object_store_bytes=256 << 20)
    try:
        yield head.address, env
    finally:
        head.stop()


@pytest.fixture(scope="session")
def ray_cluster():
    """One private local Ray instance for every in-process test of the session: its start
    (~5-10 s) is paid once. Its workers can import the test plugins (rewards, environments,
    hooks). Modules must not shut it down; they stop what they started."""
    import ray

    from async_grpo.ray_utils import connect

    assert not ray.is_initialized(), "a test left Ray connected before the session cluster"
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{PLUGINS}{os.pathsep}{path}" if path else str(PLUGINS)
    connect(None, num_cpus=8, object_store_bytes=1 << 30)
    yield
    ray.shutdown()
