"""torchrun for `async-grpo run`: the same launcher (`torch.distributed.run`), without its
failure report on the console.

When a rank fails, torchrun prints a block of about 30 lines (its own traceback and a
`ChildFailedError` summary) after the rank's traceback. Under `async-grpo run` the failing
rank has already written its cause as one line and its traceback to a file
(`cli._train`), so here a failed child ends this process with exit code 1 and one log
line, and torch's elastic agent logs warnings and errors only to the worker log. Run
directly (`torchrun ... async_grpo.cli train`) nothing changes."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from async_grpo.errors import EXIT_FILE_ENV


def cause_file() -> Path | None:
    """Where the run's first trainer failure is said in one line (beside the exit file
    `async-grpo run` gives its ranks); None outside `async-grpo run`."""
    exit_file = os.environ.get(EXIT_FILE_ENV)
    return Path(exit_file + ".cause") if exit_file else None


def write_cause(line: str) -> bool:
    """Record `line` as the run's trainer failure unless one is recorded; True if it was."""
    path = cause_file()
    if path is None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(line.strip().replace("\n", " ") + "\n")
    return True


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"exit code {failure.exitcode}"
        if failure.exitcode < 0:
            how = f"signal {signal.Signals(-failure.exitcode).name}"
        write_cause(f"trainer rank {rank} ended by {how}")  # unless the rank said why
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
