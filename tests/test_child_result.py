"""The line a child process reports its result on (`graphsan.command_line`): `write_result`
writes one `RESULT {json}` line and flushes it, `read_result` takes the last such line of the
child's output, and a damaged one is one ValueError saying what is wrong."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys

import pytest

from graphsan.command_line import read_result, write_result
from graphsan.selftest.runner import BUG, CORRECT, ERROR, judge

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def line_of(obj) -> str:
    out = io.StringIO()
    write_result(obj, out)
    return out.getvalue()


def test_a_result_is_one_line_and_reads_back_whole():
    obj = {"text": "two\nlines", "name": "caf\u00e9", "losses": [1.5, math.inf], "none": None}
    line = line_of(obj)
    assert line.startswith("RESULT {") and line.endswith("}\n") and line.count("\n") == 1
    assert read_result(line) == obj
    nan = read_result(line_of({"loss": math.nan}))  # a diverged run's losses survive
    assert math.isnan(nan["loss"])


def test_the_last_result_line_counts_and_other_lines_are_noise():
    text = (
        "warming up\n"
        + line_of({"n": 1})
        + "a log line that mentions RESULT {not this}\n"
        + line_of({"n": 2})
        + "Traceback (most recent call last):\n"
    )
    assert read_result(text) == {"n": 2}


@pytest.mark.parametrize("text", ["", "no result here\n", "RESULT\n", " RESULT {}\n"])
def test_output_without_a_result_line_reads_as_none(text):
    assert read_result(text) is None


@pytest.mark.parametrize(
    "damaged,message",
    [
        ('RESULT {"outcome": "stopp\n', "the RESULT line is not JSON (Unterminated string"),
        ("RESULT [1, 2]\n", "the RESULT line holds an array; expected a JSON object"),
        ("RESULT null\n", "the RESULT line holds null; expected a JSON object"),
        ("RESULT 3.5\n", "the RESULT line holds a number; expected a JSON object"),
    ],
)
def test_a_damaged_last_line_is_one_error_even_after_a_good_one(damaged, message):
    with pytest.raises(ValueError) as err:
        read_result(line_of({"n": 1}) + damaged)
    assert str(err.value).startswith(message), err.value
    assert "\n" not in str(err.value)


def test_write_result_goes_to_the_stdout_of_the_moment(capsys):
    write_result({"n": 3})
    assert read_result(capsys.readouterr().out) == {"n": 3}


def test_a_child_that_dies_right_after_writing_still_reports():
    """The line is flushed: a child that ends at once (no interpreter shutdown, so no buffer is
    flushed for it) still leaves its result, and what it printed before, to the parent."""
    code = (
        "import os; from graphsan.command_line import write_result; "
        "print('before'); write_result({'n': 4}); os._exit(3)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as usual
    env["PYTHONPATH"] = SRC
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 3 and proc.stdout.startswith("before\n")
    assert read_result(proc.stdout) == {"n": 4}


@pytest.mark.parametrize("kind", [CORRECT, BUG])
def test_the_selftest_judges_a_damaged_result_as_an_error_not_a_miss(kind):
    verdict = judge("x", kind, None, "log", 0, "the RESULT line is not JSON (cut)")
    assert verdict.verdict == ERROR
    assert verdict.detail == "the child's result: the RESULT line is not JSON (cut)"
