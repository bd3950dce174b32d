"""A setting that fails validation is one clear line naming its variable, exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from tapeline.settings import Settings


@pytest.mark.parametrize("value, reason", [("inf", "finite number"), ("nan", "finite number"),
                                           ("1e12", "less than or equal to 86400"), ("0", "greater than 0")])
def test_a_bad_lease_is_refused_in_one_line(value, reason):
    done = subprocess.run([sys.executable, "-m", "cli.main", "status"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TAPELINE_LEASE_S": value})
    assert done.returncode == 2
    assert f"invalid setting TAPELINE_LEASE_S='{value}'" in done.stderr and reason in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("env, reason", [
    ({"TAPELINE_HEARTBEAT_INTERVAL_S": "120"}, "TAPELINE_HEARTBEAT_INTERVAL_S (120 s) must be more than 0 and less "
                                               "than TAPELINE_LEASE_S (120 s)"),
    ({"TAPELINE_LEASE_S": "5"}, "TAPELINE_TRANSACTION_TIMEOUT_MS (10000 ms) must be less than TAPELINE_LEASE_S (5 s)"),
    ({"TAPELINE_LEASE_S": "8", "TAPELINE_TRANSACTION_TIMEOUT_MS": "4000", "TAPELINE_WEBHOOK_URL": "http://127.0.0.1:1"},
     "TAPELINE_WEBHOOK_TIMEOUT_S (10 s) must be less than TAPELINE_LEASE_S (8 s)"),
])
def test_timeouts_that_do_not_fit_inside_the_lease_are_refused_in_one_line(env, reason):
    done = subprocess.run([sys.executable, "-m", "cli.main", "status"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 2
    assert f"invalid settings: {reason}" in done.stderr
    assert "Traceback" not in done.stderr


def test_timeouts_inside_the_lease_are_accepted():
    settings = Settings(lease_s=4.0, heartbeat_interval_s=0.5, transaction_timeout_ms=3000, webhook_url="http://x",
                        webhook_timeout_s=3.0)
    assert settings.heartbeat_s == 0.5
    assert Settings(lease_s=8.0, transaction_timeout_ms=4000).heartbeat_s == 2.0  # lease / 4; no webhook, no check
    with pytest.raises(ValidationError, match="TAPELINE_HEARTBEAT_INTERVAL_S"):
        Settings(heartbeat_interval_s=0.0)
