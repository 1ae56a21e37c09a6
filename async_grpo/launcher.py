"""torchrun for `async-grpo run`: the same launcher (`torch.distributed.run`), without its
failure report on the console, and the one line that says why the trainer failed.

When a rank fails, torchrun prints a block of about 30 lines (its own traceback and a
`ChildFailedError` summary) after the rank's traceback. Under `async-grpo run` a rank that
raises writes its cause as one line, with the time, and its traceback to a file
(`cli._train`); here a failed child ends this process with exit code 1 and torch's elastic
agent logs nothing on the console. Run directly (`torchrun ... async_grpo.cli train`)
nothing changes.

Which failure is the cause: when one rank dies, the others fail moments later on their
broken connections ("Connection reset by peer") and torchrun stops the rest with SIGTERM.
So a rank killed by any other signal (the OOM killer's SIGKILL, a crash) is the cause;
failing that, the rank that raised first; failing that, the first failure torchrun saw.

When the run stops the trainer (Ctrl-C, SIGTERM, a failed pool), this process gets SIGTERM,
which torchrun raises as `SignalException` after stopping the ranks; it ends with exit
code 128 + the signal and no traceback: the run says why it stopped."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from async_grpo.errors import EXIT_FILE_ENV

STOPPED = {-signal.SIGTERM, -signal.SIGINT}  # how torchrun stops the ranks left


def cause_path(exit_file: str | Path) -> Path:
    """Where the run's trainer failure is said in one line: beside the exit file
    `async-grpo run` gives its ranks."""
    return Path(f"{exit_file}.cause")


def cause_file() -> Path | None:
    """This process's `cause_path`; None outside `async-grpo run`."""
    exit_file = os.environ.get(EXIT_FILE_ENV)
    return cause_path(exit_file) if exit_file else None


def write_rank_cause(rank: str, line: str) -> None:
    """A rank's own failure: `line` (one line), with the time it failed."""
    path = cause_file()
    if path is not None:
        one = line.strip().replace("\n", " ")
        path.with_name(f"{path.name}.rank{rank}").write_text(f"{time.time()}\t{one}\n")


def first_rank_cause(path: Path) -> str | None:
    """The line of the rank that raised first, if any did (`path`: the run's cause file)."""
    found = []
    for f in path.parent.glob(f"{path.name}.rank*"):
        stamp, _, line = f.read_text().strip().partition("\t")
        found.append((float(stamp), line))
    return min(found)[1] if found else None


def failure_cause(failures: dict[int, object], path: Path) -> str:
    """The one line for torchrun's `failures` (global rank -> ProcessFailure); `path`: the
    run's cause file, beside which the ranks wrote theirs."""
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and f.exitcode not in STOPPED}
    if killed:
        return _ended(killed)
    return first_rank_cause(path) or _ended(failures)


def _ended(failures: dict[int, object]) -> str:
    """How the first of `failures` ended, by the launcher's clock."""
    rank = min(failures, key=lambda r: (failures[r].timestamp, r))
    code = failures[rank].exitcode
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"trainer rank {rank} ended by {how}"


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):  # each sets its own level (WARNING):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # "Received 15 death signal"
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        path = cause_file()
        if path is not None:
            path.write_text(failure_cause(e.failures, path) + "\n")
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
