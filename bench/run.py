"""Run the benchmarks, check that each ends with a parsable RESULT line, and optionally record them.

    python bench/run.py [--smoke] [--record] [--only NAME ...] [--timeout S]

Each benchmark of `BENCHMARKS` runs as a child process (`python bench/<name>.py`, with `--smoke`
under `--smoke`: tiny parameters, seconds each, the same code path against the same services). A
benchmark fails when it exits non-zero, runs past its timeout (it gets SIGINT so its `finally`
drops its topics and database, then SIGKILL after `GRACE_S`), or prints no parsable `RESULT` line;
the runner names it and shows the tail of its output, runs the rest, and exits 1 if any failed.

`--record` appends one row per benchmark that passed to `docs/benchmarks.md`, under `## Runs`:
`| YYYY-MM-DD | <short commit> | <benchmark> | <RESULT line> |` (UTC date; the commit gets `-dirty`
when tracked files differ from it; a smoke run's benchmark cell reads `<name> --smoke`). `make bench-smoke` is `--smoke`, `make bench` full size with
`--record`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent

BENCHMARKS = ("stall_latency", "replay", "chaos", "transcode", "transcode_overhead", "intake", "broker_failover",
              "failover", "partitions")
"""Every benchmark (bench/<name>.py); helpers (common, lifecycles, intake_load) are not run."""

TIMEOUT_S = {"smoke": 240.0, "full": 3 * 3600.0}
"""Default timeout of one benchmark, seconds, per mode."""

GRACE_S = 30.0
"""After SIGINT at the timeout, how long a benchmark may clean up before SIGKILL."""

RUNS_HEADING = "## Runs"
TABLE_HEADER = "| date | commit | benchmark | RESULT |"
TABLE_RULE = "|---|---|---|---|"

_RESULT = re.compile(r"^RESULT((?:\s+[A-Za-z_][A-Za-z0-9_]*=\S+)+)\s*$")


class ResultError(ValueError):
    """A benchmark's output holds no parsable `RESULT key=value ...` line."""


def parse_result(output: str) -> tuple[str, dict[str, float | str]]:
    """The last `RESULT` line of `output` and its figures.

    A RESULT line is `RESULT` then one or more `key=value` pairs separated by blanks (a key is an
    identifier; a value has no blanks). A value that `float` reads (`5`, `0.93`, `nan`) becomes a
    float, anything else (`native`) stays a word. Lines that start with `RESULT` but are not of that
    shape are skipped, so the last well-formed one counts.

    Returns:
        (the line without surrounding blanks, {key: value}).

    Raises:
        ResultError: no line of that shape, or a key given twice.
    """
    for line in reversed(output.splitlines()):
        found = _RESULT.match(line.strip())
        if not found:
            continue
        figures: dict[str, float | str] = {}
        for pair in found.group(1).split():
            key, value = pair.split("=", 1)
            if key in figures:
                raise ResultError(f"RESULT line names {key} twice: {line.strip()}")
            try:
                figures[key] = float(value)
            except ValueError:
                figures[key] = value
        return line.strip(), figures
    raise ResultError("no RESULT line (`RESULT key=value ...`) in the output")


@dataclass
class Outcome:
    """One benchmark's run: `error` is None when it passed (then `line` and `figures` are set)."""

    name: str
    seconds: float
    returncode: int | None
    output: str
    line: str = ""
    figures: dict[str, float | str] = field(default_factory=dict)
    error: str | None = None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def _default_sigint() -> None:
    """In the benchmark's process, before exec: SIGINT back to its default. A shell starts
    background jobs with SIGINT ignored, the child inherits that, and Python installs its
    KeyboardInterrupt handler only where SIGINT is not ignored, so the timeout's SIGINT would do
    nothing and the benchmark's `finally` would never run (the SIGKILL after GRACE_S would end it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_benchmark(script: Path, smoke: bool, timeout_s: float, env: dict[str, str] | None = None,
                  args: tuple[str, ...] = ()) -> Outcome:
    """Run one benchmark script as a child (its own session) and judge it (see the module docstring).

    `script`: path of a Python script; `smoke` adds `--smoke`, `args` follow it; stdout and stderr
    are read together.
    Never raises for the benchmark's failures: they are in `Outcome.error`.
    """
    name = script.stem
    command = [sys.executable, str(script)] + (["--smoke"] if smoke else []) + list(args)
    started = time.monotonic()
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_default_sigint)
    timed_out = False
    try:
        out, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(child.pid, signal.SIGINT)  # KeyboardInterrupt: the benchmark's finally cleans up
        try:
            out, _ = child.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, _ = child.communicate()
    outcome = Outcome(name, time.monotonic() - started, child.returncode, out.decode(errors="replace"))
    if timed_out:
        outcome.error = f"timed out after {timeout_s:g} s"
        return outcome
    if child.returncode != 0:
        outcome.error = f"exited with code {child.returncode}"
        return outcome
    try:
        outcome.line, outcome.figures = parse_result(outcome.output)
    except ResultError as exc:
        outcome.error = str(exc)
    return outcome


def append_runs(path: Path, rows: list[str]) -> None:
    """Add `rows` (table rows, `| ... |`) to the table under `RUNS_HEADING` in the Markdown file `path`.

    The rows go right after the table's last row (or its header when it has none), so text after
    the table, and every other byte of the file, stays as it was. A file without the heading gets
    the heading and `TABLE_HEADER` appended at its end; a missing file is created with them.
    """
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines(keepends=True)
    heading = next((i for i, line in enumerate(lines) if line.rstrip() == RUNS_HEADING), None)
    if heading is None:
        prefix = text if not text or text.endswith("\n") else text + "\n"
        prefix += "\n" if prefix else ""
        path.write_text(prefix + f"{RUNS_HEADING}\n\n{TABLE_HEADER}\n{TABLE_RULE}\n" + "".join(r + "\n" for r in rows))
        return
    at = heading + 1
    while at < len(lines) and not lines[at].lstrip().startswith("|") and not lines[at].startswith("#"):
        at += 1  # blank lines or prose between the heading and its table
    if at == len(lines) or not lines[at].lstrip().startswith("|"):
        block = f"\n{TABLE_HEADER}\n{TABLE_RULE}\n" + "".join(r + "\n" for r in rows)
        insert_at = heading + 1
        lines.insert(insert_at, block)
    else:
        while at < len(lines) and lines[at].lstrip().startswith("|"):
            at += 1
        if not lines[at - 1].endswith("\n"):
            lines[at - 1] += "\n"
        lines.insert(at, "".join(r + "\n" for r in rows))
    path.write_text("".join(lines))


def run_row(date: str, commit: str, name: str, line: str) -> str:
    """One table row; a `|` inside a cell is escaped so the row keeps its four cells."""
    cells = [date, commit, name, line]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def short_commit() -> str:
    """`git rev-parse --short HEAD` of this repository, `-dirty` added when tracked files differ."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode != 0
    return commit + ("-dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny parameters (each benchmark's --smoke)")
    parser.add_argument("--record", action="store_true", help="append a row per passed benchmark to docs/benchmarks.md")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds per benchmark (default {TIMEOUT_S['smoke']:g} with --smoke, else "
                             f"{TIMEOUT_S['full']:g})")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md", help="file --record appends to")
    args = parser.parse_args(argv)
    timeout_s = args.timeout or TIMEOUT_S["smoke" if args.smoke else "full"]
    commit = short_commit() if args.record else ""
    outcomes = []
    for name in args.only or BENCHMARKS:
        print(f"bench: {name}{' --smoke' if args.smoke else ''} ...", flush=True)
        outcome = run_benchmark(BENCH / f"{name}.py", args.smoke, timeout_s)
        outcomes.append(outcome)
        if outcome.error:
            print(f"bench: {name} FAILED after {outcome.seconds:.0f} s: {outcome.error}; last lines of its output:\n"
                  f"{outcome.tail()}", flush=True)
        else:
            nan = [k for k, v in outcome.figures.items() if isinstance(v, float) and math.isnan(v)]
            print(f"bench: {name} passed in {outcome.seconds:.1f} s: {outcome.line}"
                  + (f" (nan: {', '.join(nan)})" if nan else ""), flush=True)
        if args.record and not outcome.error:
            date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
            label = f"{name} --smoke" if args.smoke else name  # a smoke row is never read as a full-size figure
            append_runs(args.docs, [run_row(date, commit, label, outcome.line)])
    failed = [o.name for o in outcomes if o.error]
    print("bench: " + ", ".join(f"{o.name} {o.seconds:.1f} s{' FAILED' if o.error else ''}" for o in outcomes))
    if failed:
        print(f"bench: {len(failed)} of {len(outcomes)} failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
