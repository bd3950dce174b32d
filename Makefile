# Tapeline: local stack, demo and tests on a Debian machine without Docker.
# `make test` is what CI runs (.ci/run); the tests' conftest brings the stack up itself.
SHELL := /bin/bash
VENV := .venv
TAPELINE := $(VENV)/bin/tapeline

.PHONY: bootstrap up demo test down

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
