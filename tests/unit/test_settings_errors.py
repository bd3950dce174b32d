"""A setting that fails validation is one clear line naming its variable, exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("value, reason", [("inf", "finite number"), ("nan", "finite number"),
                                           ("1e12", "less than or equal to 86400"), ("0", "greater than 0")])
def test_a_bad_lease_is_refused_in_one_line(value, reason):
    done = subprocess.run([sys.executable, "-m", "tapeline.cli", "status"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TAPELINE_LEASE_S": value})
    assert done.returncode == 2
    assert f"invalid setting TAPELINE_LEASE_S='{value}'" in done.stderr and reason in done.stderr
    assert "Traceback" not in done.stderr
