"""Every benchmark runs in its smoke mode and ends with a parsable RESULT line (issue 21, C.5).

Each benchmark is the real script (`bench/<name>.py --smoke`: tiny parameters, the same code path)
against the real services, as `bench/run.py --smoke` runs it: a benchmark that rots (exits non-zero,
hangs past its timeout, stops printing its RESULT line) fails here, not on someone's next full run.
Each benchmark makes its own topics, app name and database and drops them (bench/common.py).
"""

from __future__ import annotations

import math

import pytest

from bench.run import BENCHMARKS, BENCH, TIMEOUT_S, run_benchmark
from tapeline.settings import Settings

KEYS = {
    "stall_latency": {"lease_s", "worker_restart_median_s", "worker_restart_max_s", "host_detect_median_s",
                      "host_restart_median_s", "host_restart_max_s", "no_progress_detect_median_s"},
    "replay": {"decode_events_per_s", "replay_events_per_s", "copy_rows_per_s", "replay_engine"},
    "chaos": {"crash_points", "covered", "duplicates", "lost"},
    "transcode": {"overhead_ratio", "waste_max_s", "segment_s"},
    "transcode_overhead": {"bare_s", "pipeline_s", "overhead_pct"},
    "intake": {"accepted_per_s", "p50_ms", "p99_ms"},
    "broker_failover": {"pause_median_s", "pause_max_s", "elect_median_s", "duplicates", "lost"},
    "failover": {"failover_accepting_s", "resumed_first_s", "all_done_s", "rpo_events", "rpo_s", "reencoded_s",
                 "duplicates", "lost", "needs_review"},
    "partitions": {"partitions", "takeover_s", "takeover_max_s", "duplicates", "lost", "false_stalls"},
}
"""Figures each benchmark's RESULT line must carry (the ones its docstring and docs cite)."""


def test_every_benchmark_is_smoked():
    assert set(KEYS) == set(BENCHMARKS)
    assert {path.stem for path in BENCH.glob("*.py")} - set(BENCHMARKS) == {"__init__", "common", "lifecycles",
                                                                            "intake_load", "run"}


SMOKED_ELSEWHERE = {"failover": "tests/faults/test_region_failover.py runs its smoke round (two region stacks: "
                                "the suite starts that pair once)",
                    "broker_failover": "tests/faults/test_broker_failover.py runs its smoke on the module's "
                                       "three-node cluster (the suite starts one such cluster)"}
"""Benchmarks whose smoke round a test of its own runs, with more assertions than a RESULT line."""


def test_a_benchmark_smoked_elsewhere_is_run_there():
    from pathlib import Path

    for name, where in SMOKED_ELSEWHERE.items():
        test = Path(__file__).resolve().parents[2] / where.split()[0]
        text = test.read_text()
        assert f"from bench.{name} import" in text or f'BENCH / "{name}.py"' in text, (name, where)


SMOKE_TIMEOUT_S = {"partitions": 480.0}
"""Smoke rounds that need more than `TIMEOUT_S["smoke"]` on a loaded CI machine: the partitions round
resumes a 32 s 1280x720 transcode on the other worker host after its cut and then publishes it (about
90 s on an idle machine; over 240 s once while the other test process ran a pipeline beside it)."""


@pytest.mark.parametrize("name", [n for n in BENCHMARKS if n not in SMOKED_ELSEWHERE])
def test_benchmark_smoke_ends_with_a_result_line(name: str, base_settings: Settings):
    outcome = run_benchmark(BENCH / f"{name}.py", smoke=True, timeout_s=SMOKE_TIMEOUT_S.get(name, TIMEOUT_S["smoke"]))
    print(f"{name}: {outcome.seconds:.1f} s: {outcome.line}")
    assert outcome.error is None, f"{name} --smoke: {outcome.error}; last lines:\n{outcome.tail()}"
    assert KEYS[name] <= set(outcome.figures), outcome.line
    numbers = {k: v for k, v in outcome.figures.items() if k in KEYS[name] and isinstance(v, float)}
    assert numbers and not any(math.isnan(v) for v in numbers.values()), outcome.line
    if name in ("chaos", "partitions"):
        assert outcome.figures["duplicates"] == 0 and outcome.figures["lost"] == 0
    if name == "partitions":
        assert outcome.figures["partitions"] == 2 and outcome.figures["false_stalls"] == 0, outcome.line
    if name == "chaos":
        assert outcome.figures["covered"] >= 1, "the smoke's crash point did not fire"
