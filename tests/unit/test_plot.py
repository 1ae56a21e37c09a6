"""Plotting: smoothing by hand, panels and lines per run, errors, files written, the CLI."""

import argparse

import pytest

from async_grpo.errors import UserError
from async_grpo.metrics import METRICS_FILE, MetricsWriter
from async_grpo.plot import build_figure, list_keys, load_runs, moving_average, plot
from async_grpo.plot_cli import add_plot_parser


@pytest.fixture
def two_runs(tmp_path):
    """runA has reward/mean, loss and kl on steps 1..4; runB lacks kl; one NaN loss."""
    paths = []
    for name, offset in (("runA", 0.0), ("runB", 1.0)):
        with MetricsWriter(tmp_path / name) as w:
            for step, reward in enumerate([0.0, 0.0, 3.0, 3.0], start=1):
                metrics = {"reward/mean": reward + offset, "loss": 1.0 / step}
                if name == "runA":
                    metrics["kl"] = 0.01 * step
                elif step == 2:
                    metrics["loss"] = float("nan")
                w.log(step, metrics)
        paths.append(tmp_path / name / METRICS_FILE)
    return paths


def test_moving_average_by_hand():
    # window 2: [0], [0, 0], [0, 3], [3, 3] -> 0, 0, 1.5, 3
    assert moving_average([0, 0, 3, 3], 2) == [0, 0, 1.5, 3]
    # window 3: [3], [3, 6], [3, 6, 9], [6, 9, 12] -> 3, 4.5, 6, 9
    assert moving_average([3, 6, 9, 12], 3) == [3, 4.5, 6, 9]
    assert moving_average([1, 5, 2], 1) == [1, 5, 2]
    with pytest.raises(UserError, match="at least 1"):
        moving_average([1], 0)


def test_one_panel_per_key_one_line_per_run(two_runs):
    fig = build_figure(load_runs(two_runs), ["reward/mean", "loss"])
    assert len(fig.axes) == 2
    assert [len(ax.lines) for ax in fig.axes] == [2, 2]
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward/mean", "loss"]
    assert fig.axes[-1].get_xlabel() == "step"
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["runA", "runB"]
    # runB's NaN loss at step 2 was written as null and is left out of its curve
    assert list(fig.axes[1].lines[1].get_xdata()) == [1, 3, 4]


def test_smoothing_draws_raw_faint_and_average_bold(two_runs):
    fig = build_figure(load_runs(two_runs), ["reward/mean"], smooth=2)
    raw, smoothed = fig.axes[0].lines[:2]  # runA
    assert list(raw.get_ydata()) == [0, 0, 3, 3]
    assert list(smoothed.get_ydata()) == [0, 0, 1.5, 3]
    assert raw.get_alpha() < 1 and smoothed.get_linewidth() > raw.get_linewidth()
    assert len(fig.axes[0].lines) == 4
    assert "moving average over 2 points" in fig.get_suptitle()


def test_run_missing_a_key_is_left_out_of_that_panel(two_runs, capsys):
    fig = build_figure(load_runs(two_runs), ["kl", "loss"])
    assert [len(ax.lines) for ax in fig.axes] == [1, 2]
    assert "runB" in capsys.readouterr().err


def test_unknown_key_lists_the_available_ones(two_runs):
    with pytest.raises(UserError, match=r"'reward' is in none.*available: kl, loss, reward/mean"):
        build_figure(load_runs(two_runs), ["reward"])
    with pytest.raises(UserError, match=r"'time' \(x axis\)"):
        build_figure(load_runs(two_runs), ["loss"], x_key="time")


def test_list_keys_is_the_sorted_numeric_union(two_runs, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text('{"step": 1, "note": "text", "flag": true, "time/step": 2.5}\n')
    assert list_keys([*two_runs, other]) == ["kl", "loss", "reward/mean", "step", "time/step"]


def test_labels_fall_back_to_stem_and_disambiguate(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "m.jsonl").write_text('{"step": 1}\n')
    runs = load_runs([tmp_path / "a" / "m.jsonl", tmp_path / "b" / "m.jsonl"])
    assert [r.label for r in runs] == [str(tmp_path / "a" / "m"), str(tmp_path / "b" / "m")]
    assert load_runs([tmp_path / "a" / "m.jsonl"])[0].label == "m"


def test_plot_writes_png_and_svg(two_runs, tmp_path):
    png = plot(two_runs, ["reward/mean", "loss"], smooth=2, out=tmp_path / "out" / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = plot(two_runs, ["loss"], out=tmp_path / "r.svg")
    assert "<svg" in svg.read_text()[:1000]
    with pytest.raises(UserError, match=r"\.png or \.svg, got '\.pdf'"):
        plot(two_runs, ["loss"], out=tmp_path / "r.pdf")
    assert not (tmp_path / "r.pdf").exists()


def _cli(argv):
    parser = argparse.ArgumentParser(prog="async-grpo")
    add_plot_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_list_and_plot(two_runs, tmp_path, capsys):
    files = [str(p) for p in two_runs]
    assert _cli(["plot", "--list", *files]) == 0
    assert capsys.readouterr().out.splitlines() == ["kl", "loss", "reward/mean", "step"]
    out = tmp_path / "cli.png"
    argv = ["plot", *files, "-v", "reward/mean", "-v", "loss", "--smooth", "3", "-o", str(out)]
    assert _cli(argv) == 0
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out


def test_cli_errors_are_user_errors(two_runs, tmp_path):
    with pytest.raises(UserError, match="-v KEY"):
        _cli(["plot", str(two_runs[0]), "-o", str(tmp_path / "x.png")])
    with pytest.raises(UserError, match="-o out.png"):
        _cli(["plot", str(two_runs[0]), "-v", "loss"])
    with pytest.raises(UserError, match="'nope' is in none"):
        _cli(["plot", str(two_runs[0]), "-v", "nope", "-o", str(tmp_path / "x.png")])
