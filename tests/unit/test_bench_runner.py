"""bench/run.py: the RESULT parser, the row appender, and how the runner judges a child process.

The judging tests run real (tiny) child scripts: a benchmark that exits non-zero, runs past its
timeout, or prints no RESULT line fails; one that ends with a RESULT line passes.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from bench.run import (RUNS_HEADING, TABLE_HEADER, TABLE_RULE, ResultError, append_runs, parse_result,
                       run_benchmark, run_row)


def test_parse_result_takes_the_last_result_line_with_numbers_and_words():
    output = ("warming up\nRESULT lease_s=1 old=2\nkill run 1: 4.5 s\n"
              "RESULT lease_s=5 detect_median_s=4.56 replay_engine=native no_progress_s=nan count=-3\ndone\n")
    line, figures = parse_result(output)
    assert line == "RESULT lease_s=5 detect_median_s=4.56 replay_engine=native no_progress_s=nan count=-3"
    assert figures["lease_s"] == 5.0 and figures["detect_median_s"] == 4.56 and figures["count"] == -3.0
    assert figures["replay_engine"] == "native"
    assert math.isnan(figures["no_progress_s"])
    assert "old" not in figures


@pytest.mark.parametrize("output", [
    "", "no result here\n", "RESULT\n", "RESULT: done\n", "RESULT lease_s=\n", "RESULT =5\n",
    "RESULTS a=1\n", "RESULT a=1 b\n", "  the RESULT a=1 is inside a sentence\n",
])
def test_parse_result_refuses_output_without_a_well_formed_line(output):
    with pytest.raises(ResultError):
        parse_result(output)


def test_parse_result_skips_a_malformed_last_line_for_an_earlier_good_one():
    line, figures = parse_result("RESULT a=1 b=two\nRESULT broken\n")
    assert line == "RESULT a=1 b=two" and figures == {"a": 1.0, "b": "two"}


def test_parse_result_refuses_a_key_given_twice():
    with pytest.raises(ResultError, match="twice"):
        parse_result("RESULT a=1 a=2\n")


ROW = "| 2026-12-01 | abc1234 | replay | RESULT a=1 |"


def test_append_runs_creates_the_file_with_heading_and_header(tmp_path: Path):
    docs = tmp_path / "benchmarks.md"
    append_runs(docs, [ROW])
    assert docs.read_text() == f"{RUNS_HEADING}\n\n{TABLE_HEADER}\n{TABLE_RULE}\n{ROW}\n"
    append_runs(docs, ["| 2026-12-02 | def5678 | chaos | RESULT b=2 |"])
    assert docs.read_text().splitlines()[-2:] == [ROW, "| 2026-12-02 | def5678 | chaos | RESULT b=2 |"]


def test_append_runs_keeps_every_other_byte_of_an_existing_file(tmp_path: Path):
    before = textwrap.dedent(f"""\
        # Benchmarks

        What each one measures | with a pipe in prose.

        {RUNS_HEADING}

        Rows are appended by `make bench`.

        {TABLE_HEADER}
        {TABLE_RULE}
        | 2026-11-30 | 1111111 | intake | RESULT accepted_per_s=6.5 |

        ## Notes

        | other | table |
        |---|---|
        | x | y |
        """)
    docs = tmp_path / "benchmarks.md"
    docs.write_text(before)
    append_runs(docs, [ROW, ROW.replace("replay", "chaos")])
    after = docs.read_text()
    old_row = "| 2026-11-30 | 1111111 | intake | RESULT accepted_per_s=6.5 |\n"
    assert after == before.replace(old_row, old_row + ROW + "\n" + ROW.replace("replay", "chaos") + "\n")


def test_append_runs_adds_the_section_to_a_file_without_it(tmp_path: Path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nProse without a final newline")
    append_runs(docs, [ROW])
    assert docs.read_text() == (f"# Benchmarks\n\nProse without a final newline\n\n{RUNS_HEADING}\n\n"
                                f"{TABLE_HEADER}\n{TABLE_RULE}\n{ROW}\n")


def test_append_runs_adds_the_table_under_a_heading_that_has_none(tmp_path: Path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n{RUNS_HEADING}\n\n## Later\n\ntext\n")
    append_runs(docs, [ROW])
    assert docs.read_text() == f"# B\n\n{RUNS_HEADING}\n\n{TABLE_HEADER}\n{TABLE_RULE}\n{ROW}\n\n## Later\n\ntext\n"


def test_run_row_has_four_cells_even_with_a_pipe_inside():
    assert run_row("2026-12-01", "abc1234", "chaos", "RESULT a=1") == "| 2026-12-01 | abc1234 | chaos | RESULT a=1 |"
    assert run_row("d", "c", "n", "RESULT a=x|y").count(" | ") == 3


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_runner_passes_a_benchmark_that_ends_with_a_result_line_and_hands_it_smoke(tmp_path: Path):
    script = _script(tmp_path, "fine", """\
        import sys
        print("working", file=sys.stderr)
        print("RESULT smoke=" + ("yes" if "--smoke" in sys.argv else "no") + " rate_per_s=12.5")
        """)
    outcome = run_benchmark(script, smoke=True, timeout_s=60)
    assert outcome.error is None, outcome.output
    assert outcome.figures == {"smoke": "yes", "rate_per_s": 12.5} and outcome.name == "fine"
    assert "working" in outcome.output


def test_runner_fails_a_benchmark_that_exits_non_zero_even_with_a_result_line(tmp_path: Path):
    script = _script(tmp_path, "broken", """\
        print("RESULT a=1")
        raise SystemExit("timed out waiting for attempt 2")
        """)
    outcome = run_benchmark(script, smoke=False, timeout_s=60)
    assert outcome.error == "exited with code 1"
    assert "timed out waiting for attempt 2" in outcome.tail()


def test_runner_fails_a_benchmark_without_a_result_line(tmp_path: Path):
    outcome = run_benchmark(_script(tmp_path, "silent", "print('all good, trust me')\n"), smoke=False, timeout_s=60)
    assert outcome.returncode == 0 and outcome.error is not None and "no RESULT line" in outcome.error


def test_runner_interrupts_a_benchmark_past_its_timeout_so_its_finally_runs(tmp_path: Path):
    marker = tmp_path / "cleaned"
    script = _script(tmp_path, "slow", f"""\
        import time
        try:
            print("started", flush=True)
            time.sleep(60)
            print("RESULT a=1")
        finally:
            open({str(marker)!r}, "w").write("yes")
        """)
    outcome = run_benchmark(script, smoke=True, timeout_s=2)
    assert outcome.error == "timed out after 2 s"
    assert marker.read_text() == "yes" and "started" in outcome.output
    assert outcome.seconds < 30
