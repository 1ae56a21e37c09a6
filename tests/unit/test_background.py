"""A background task's error is said at once, in one line naming the task, and never left
for asyncio to log when the collector frees it (which, on Python 3.11, breaks whatever
`ast.parse` the collector interrupted)."""

import ast
import asyncio
import gc
import logging
from pathlib import Path

from async_grpo import background

SOURCE = (Path(__file__).resolve().parents[2] / "async_grpo" / "batcher" / "batcher.py").read_text()


async def _fails() -> None:
    await asyncio.sleep(0)
    raise ValueError("the queue is gone")


async def _forever() -> None:
    await asyncio.Event().wait()


def test_an_error_is_one_line_naming_the_task_and_ends_what_it_serves(capsys):
    ended: list[str] = []

    async def main() -> asyncio.Task:
        task = background.start(_fails(), "worker-1: serving loop", end=ended.append)
        await asyncio.wait({task})
        await asyncio.sleep(0)  # the done callback runs in the next turn
        return task

    asyncio.run(main())
    assert ended == ["worker-1: serving loop failed: ValueError: the queue is gone"]
    err = capsys.readouterr().err
    assert err.startswith(ended[0] + "\n") and "Traceback" in err and "_fails" in err


def test_a_cancel_or_a_return_is_quiet(capsys):
    ended: list[str] = []

    async def main() -> None:
        quiet = background.start(asyncio.sleep(0), "returns", end=ended.append)
        cancelled = background.start(_forever(), "cancelled", end=ended.append)
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.wait({quiet, cancelled})
        await asyncio.sleep(0)

    asyncio.run(main())
    assert ended == [] and capsys.readouterr().err == ""


def _leak(make) -> None:
    """A task that failed, left in a reference cycle (only the collector frees it)."""
    loop = asyncio.new_event_loop()
    task = loop.run_until_complete(make())
    task.cycle = task
    loop.close()


def _parses_while_collecting(make) -> tuple[int, list[str]]:
    """`ast.parse` with the collector running at every allocation, over tasks `make` left."""
    records: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("asyncio").addHandler(handler)
    thresholds = gc.get_threshold()
    errors = 0
    try:
        gc.collect()
        gc.disable()
        for _ in range(20):
            _leak(make)
        gc.set_threshold(1)
        gc.enable()
        for _ in range(20):
            try:
                ast.parse(SOURCE)
            except SystemError:  # "AST constructor recursion depth mismatch"
                errors += 1
        gc.collect()
    finally:
        gc.set_threshold(*thresholds)
        gc.enable()
        logging.getLogger("asyncio").removeHandler(handler)
    return errors, [r for r in records if "never retrieved" in r]


def test_a_failed_background_task_leaves_nothing_for_the_collector(capsys):
    async def started() -> asyncio.Task:
        task = background.start(_fails(), "leaked")
        await asyncio.wait({task})
        await asyncio.sleep(0)
        return task

    errors, unseen = _parses_while_collecting(started)
    assert (errors, unseen) == (0, [])
    assert capsys.readouterr().err.count("leaked failed: ValueError") == 20


def test_a_plain_task_that_fails_unseen_is_left_for_the_collector():
    """Why `background.start`: the same leak through a plain task is logged only when the
    collector frees it, from inside whatever it interrupted (on 3.11 the log's traceback,
    whose carets come from `ast.parse`, can break the parse it interrupted)."""

    async def started() -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(_fails())
        await asyncio.wait({task})
        return task

    _, unseen = _parses_while_collecting(started)
    assert len(unseen) == 20
