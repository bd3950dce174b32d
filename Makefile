# Tapeline: local stack, demo and tests on a Debian machine without Docker.
# `make test` is what CI runs (.ci/run); the tests' conftest brings the stack up itself.
SHELL := /bin/bash
VENV := .venv
TAPELINE := $(VENV)/bin/tapeline

.PHONY: bootstrap up demo test down bench-smoke bench

bootstrap:
	bash scripts/bootstrap.sh

up: bootstrap
	$(TAPELINE) stack up

demo: bootstrap
	$(TAPELINE) stack up
	$(TAPELINE) run --role all --detach
	$(TAPELINE) demo

# Test modules run on TEST_WORKERS processes (pytest-xdist, a whole module per process: each module
# has its own topics, app name and database); TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2

test: bootstrap
	$(VENV)/bin/pytest -ra -n $(TEST_WORKERS) --dist loadfile tests

# Stop the processors, then whatever the stack started; either may already be stopped.
down:
	-$(TAPELINE) run --stop
	-$(TAPELINE) stack down

# Every benchmark with tiny parameters (seconds each), checked for its RESULT line
# (tests/integration/test_bench_smoke.py runs the same under `make test`).
bench-smoke: bootstrap
	$(VENV)/bin/python bench/run.py --smoke

# Every benchmark at full size; one dated row per benchmark with the commit goes to docs/benchmarks.md.
bench: bootstrap
	$(VENV)/bin/python bench/run.py --record
