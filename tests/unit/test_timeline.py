"""The run's timeline: spans kept by each part, the file rank 0 writes, the figure."""

import argparse
import json

import pytest

from async_grpo.errors import UserError
from async_grpo.plot_cli import add_timeline_parser
from async_grpo.timeline import (
    TIMELINE_FILE,
    SpanLog,
    TimelineWriter,
    busy_shares,
    read_timeline,
    select_steps,
)


def _span(step, lane, what, start, end, **kw):
    return {"step": step, "lane": lane, "what": what, "start": start, "end": end} | kw


SPANS = [
    _span(1, "trainer", "wait", 100.0, 104.0),
    _span(1, "trainer", "train", 104.0, 106.0),
    _span(1, "trainer", "push", 106.0, 107.0),
    _span(1, "gen-a-0", "generate", 100.0, 103.0, version=0),
    _span(1, "gen-a-0", "generate", 102.0, 105.0, version=0),  # overlaps: counted once
    _span(1, "verifier", "score", 103.0, 103.5),
    _span(2, "trainer", "train", 107.0, 110.0),
    _span(2, "gen-a-0", "generate", 107.0, 108.0, version=1),
]


def test_span_log_keeps_real_spans_until_taken(monkeypatch):
    import itertools

    import async_grpo.timeline as timeline

    # a clock that moves 0.2 ms a reading: each span below is under a millisecond, however
    # busy the machine that runs the test
    ticks = itertools.count()
    monkeypatch.setattr(timeline.time, "time", lambda: 100.0 + 0.0002 * next(ticks))
    log = SpanLog("trainer")
    with log.span("push"):
        pass  # under a millisecond: not kept
    log.add("train", 10.0, 12.5)
    with pytest.raises(RuntimeError), log.span("save", version=3):
        raise RuntimeError("a failed save still ends its span")
    taken = log.take()
    assert [s["what"] for s in taken] == ["train"]  # the failed save took no time either
    assert taken[0] == {"lane": "trainer", "what": "train", "start": 10.0, "end": 12.5}
    assert log.take() == []


def test_writer_appends_and_a_resumed_run_drops_the_steps_after_its_checkpoint(tmp_path):
    w = TimelineWriter(tmp_path, 0)
    w.write(1, [SPANS[1]])
    w.write(2, [SPANS[6]])
    w.write(3, [SPANS[6]])
    assert [s["step"] for s in read_timeline(tmp_path)] == [1, 2, 3]
    TimelineWriter(tmp_path, 2).write(3, [SPANS[1]])  # resumed from step 2's checkpoint
    rows = read_timeline(tmp_path / TIMELINE_FILE)
    assert [(s["step"], s["what"]) for s in rows] == [(1, "train"), (2, "train"), (3, "train")]


def test_busy_shares_count_overlaps_once_and_not_the_trainers_waits():
    shares = busy_shares(SPANS)  # the window: 100 .. 110
    assert shares["trainer"] == pytest.approx(0.6)  # 2 + 1 + 3 of 10
    assert shares["gen-a-0"] == pytest.approx(0.6)  # 100..105 and 107..108
    assert shares["verifier"] == pytest.approx(0.05)


def test_a_bad_line_is_one_clear_error_but_a_cut_last_line_is_skipped(tmp_path):
    path = tmp_path / TIMELINE_FILE
    good = json.dumps(SPANS[0])
    path.write_text(f"{good}\n{good[:20]}")  # killed mid-write
    assert len(read_timeline(tmp_path)) == 1
    path.write_text(f'{good}\n{{"lane": "trainer"}}\n{good}\n')
    with pytest.raises(UserError, match=f"{TIMELINE_FILE}:2: not a span"):
        read_timeline(tmp_path)
    with pytest.raises(UserError, match="no such file"):
        read_timeline(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"steps 1\.\.2"):
        select_steps(SPANS, 5, 6)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="async-grpo")
    add_timeline_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_draws_png_and_svg_and_prints_the_busy_shares(tmp_path, capsys):
    (tmp_path / TIMELINE_FILE).write_text("".join(json.dumps(s) + "\n" for s in SPANS))
    assert _cli(["timeline", str(tmp_path), "-o", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert "trainer: busy 60.0%" in out and "gen-a-0: busy 60.0%" in out
    assert _cli(["timeline", str(tmp_path), "--steps", "2:2", "-o", str(tmp_path / "t.svg")]) == 0
    assert "trainer: busy 100.0%" in capsys.readouterr().out  # step 2 alone: 107 .. 110
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(UserError, match="expected A:B"):
        _cli(["timeline", str(tmp_path), "--steps", "x", "-o", str(tmp_path / "t.png")])
    with pytest.raises(UserError, match=".png or .svg"):
        _cli(["timeline", str(tmp_path), "-o", str(tmp_path / "t.pdf")])
