"""Why a run stopped, in one line: the first cause recorded wins over later symptoms.

A run that stops because a pool cannot work says so in one line naming the pool, what it
runs (the environment, the reward functions, the model) and what that did, e.g.
`pool 'environment' (environment 'sandbox'): reset hung past environment.step_timeout_s
(30 s) on 4 workers in a row; ...`. Whoever decides to stop records its line here: a
pool's supervisor that gives up (inference/supervisor.py, in `async-grpo run`), a trainer
rank that stops on a user error (samples that never arrived, rewards that failed: the
line leads with what the pool's failures said). Moments later other processes fail on
the consequences (a rank's broken wait, a worker cut off by the stop); their lines come
second and are not printed. `async-grpo run` gives its ranks the file (CAUSE_FILE_ENV)
and prints the line it holds once the run has stopped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

CAUSE_FILE_ENV = "ASYNC_GRPO_CAUSE_FILE"


def record(line: str, path: str | Path | None = None) -> bool:
    """Keep `line` (made one line) as the run's cause, unless a cause is kept already;
    whether it was kept. `path`: the run's cause file (this process's CAUSE_FILE_ENV if
    None; outside a run there is none and nothing is kept)."""
    path = path or os.environ.get(CAUSE_FILE_ENV)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(" ".join(line.split()) + "\n")
    return True


def recorded(path: str | Path) -> str | None:
    """The run's cause, if one was recorded."""
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None


def subject(kind: str, names: Sequence[str]) -> str:
    """What a pool runs, for a cause line: `environment 'calc'`, `reward functions 'a',
    'b'`, `model 'smollm2-135m'`."""
    plural = "s" if len(names) > 1 else ""
    return f"{kind}{plural} " + ", ".join(repr(str(n)) for n in names)
