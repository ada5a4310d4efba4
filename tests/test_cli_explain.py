"""`python -m layouts explain`, run as a subprocess from the repository root.

A user error is exit status 2 with exactly one line on stderr (no traceback, no
usage dump); integers are integers (``8`` yes, ``1.5`` no); choices are
case-insensitive; huge topologies are refused at once instead of running for
minutes; ``--help`` shows the defaults.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.demo_cli import assert_usage_error

ROOT = Path(__file__).resolve().parents[1]


def explain(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "layouts", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


BAD_INPUTS = [
    (["--tp", "0"], ["--tp", "[1, 1024]"]),
    (["--tp", "-4"], ["--tp"]),
    (["--tp", "1.5"], ["--tp", "'1.5'"]),
    (["--tp", "100000"], ["--tp", "100000"]),  # used to run for more than a minute
    (["--dcp", "0"], ["--dcp"]),
    (["--pcp", "0"], ["--pcp"]),
    (["--pcp", "2.0"], ["--pcp"]),
    (["--total-kv-heads", "0"], ["--total-kv-heads"]),
    (["--head-size", "0"], ["--head-size"]),
    (["--block-size", "-16"], ["--block-size"]),
    (["--interleave", "0"], ["--interleave"]),
    (["--heads-per-rank", "0"], ["--heads-per-rank"]),
    (["--width", "0"], ["--width"]),
    (["--width", "-3"], ["--width"]),
    (["--width", "1e9"], ["--width"]),
    (["--page-id", "-1"], ["--page-id"]),
    (["--dtype", "float13"], ["--dtype", "float13"]),
    (["--order", "NDH"], ["--order", "NDH"]),
    (["--packing", "interleaved"], ["--packing"]),
    (["--attention", "sliding"], ["--attention"]),
    (["--attention", "mla", "--total-kv-heads", "8"], ["--total-kv-heads", "MLA"]),
    (["--tp", "64", "--pcp", "32"], ["2048 ranks"]),
    (
        ["--attention", "mla", "--tp", "64", "--dcp", "8", "--pcp", "16", "--block-size", "1024"],
        ["fragments"],
    ),
    (["--no-such-flag"], ["--no-such-flag"]),
]


@pytest.mark.parametrize(("args", "words"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(args, words):
    start = time.monotonic()
    assert_usage_error(explain("explain", *args), *words)
    assert time.monotonic() - start < 30


def test_missing_or_unknown_command_is_one_line():
    assert_usage_error(explain(), "required", "explain")
    assert_usage_error(explain("explian"), "explian")


def test_integers_are_accepted_as_integers():
    result = explain("explain", "--tp", "8", "--width", "16")
    assert result.returncode == 0, result.stderr
    assert "TP=8" in result.stdout


def test_choices_are_case_insensitive():
    result = explain(
        "explain",
        "--order",
        "nhd",
        "--packing",
        "SPLIT",
        "--attention",
        "Full",
        "--dtype",
        "BF16",
        "--tp",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert "full attention, split NHD, bfloat16" in result.stdout
    result = explain("explain", "--attention", "MLA", "--tp", "4", "--head-size", "576")
    assert result.returncode == 0, result.stderr
    assert "mla attention" in result.stdout


def test_largest_topology_answers_in_seconds():
    start = time.monotonic()
    result = explain("explain", "--tp", "1024", "--total-kv-heads", "8", "--width", "1024")
    assert result.returncode == 0, result.stderr
    assert "(1024 ranks)" in result.stdout
    assert time.monotonic() - start < 30


def test_uncertified_topology_is_explained_with_the_reason():
    result = explain("explain", "--tp", "3", "--width", "8")
    assert result.returncode == 0, result.stderr
    assert "certified: NO" in result.stdout
    assert "tp_size=3 does not divide total_kv_heads=8" in result.stdout


def test_help_shows_defaults():
    result = explain("explain", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for default in ("(default: 128)", "(default: 16)", "(default: bfloat16)", "(default: NHD)"):
        assert default in text, default


def test_readme_example_picture():
    """The README's `python -m layouts explain` example prints what the README shows."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```console\n$ python -m layouts explain ", 1)[1].split("```", 1)[0]
    command, *shown = block.splitlines()
    result = explain("explain", *command.split())
    assert result.returncode == 0, result.stderr
    shown = [line for line in shown if line != "..."]
    assert shown and all(line in result.stdout.splitlines() for line in shown), result.stdout


def test_a_hostile_argument_is_shown_escaped_on_the_one_error_line():
    """argparse quotes unrecognised arguments raw: the error line shows them escaped (no
    terminal escape, no forged line), for every CLI of the project (one ``CliParser``)."""
    from helpers.hostile import FORGED, HOSTILE, assert_no_forgery

    for command in (["-m", "layouts", "explain"], ["-m", "canonical_ops", "store", "stats"]):
        result = subprocess.run(
            [sys.executable, *command, ".", HOSTILE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and result.stdout == ""
        assert len(result.stderr.splitlines()) == 1 and FORGED in result.stderr
        assert_no_forgery(result.stderr)
