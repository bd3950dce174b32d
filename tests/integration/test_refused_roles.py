"""A processor PostgreSQL or S3 refuses (issue 40: "a wrong or missing certificate, password or ACL is
named in the message and in /health/ready, never a hang or a retry loop that hides it"): with a wrong
password for the shared PostgreSQL, `tapeline run --role projector` answers /health/ready 503 naming
the refused login, stays up without retrying until it is stopped, and exits 78 (EX_CONFIG); `run
--role all` exits 78 at once with the same reason. The same for a transcode worker whose S3 secret
key is wrong (the shared endpoint checks signatures), and for one told to speak TLS to the plain
endpoint. No secret is ever printed. (PostgreSQL's TLS refusals take the same path:
`tests/integration/test_tls_postgres.py` checks `connect`'s TLS messages.)"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import settings_env, wait_for
from tests.integration.helpers import free_ports

pytestmark = pytest.mark.integration

WRONG = "not-the-password-4b1f"


def free_port() -> int:
    return free_ports(1)[0]


def wrong_password_env(settings) -> dict[str, str]:
    url = settings.database_url
    scheme, rest = url.split("://", 1)
    user_info, host = rest.split("@", 1)
    user = user_info.split(":", 1)[0]
    return {**settings_env(settings), "TAPELINE_DATABASE_URL": f"{scheme}://{user}:{WRONG}@{host}"}


def held_refusal(env: dict[str, str], role: str, log_path) -> tuple[str, int]:
    """Run `tapeline run --role ROLE` with `env`; once its /health/ready answers 503 with a reason other
    than "warming up" (a loaded machine answers that before the refusal is known), check it is held
    (alive, logging nothing more for 3 s), stop it; (the 503 body, its exit code)."""
    port = free_port()
    env = {**env, "TAPELINE_HEALTH_PORT": str(port)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", role], env=env,
                                   stdout=log, stderr=log)
        try:
            def ready_body() -> str | None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2)
                except urllib.error.HTTPError as exc:
                    answer = exc.read().decode()
                    return None if "warming up" in answer else answer  # not the refusal yet: still starting
                except OSError:
                    return None
                return None

            body = wait_for(ready_body, 90, f"the {role}'s /health/ready to answer 503 with its refusal")
            size = log_path.stat().st_size
            time.sleep(3)  # held, not retried: nothing more is logged and the process is still there
            assert process.poll() is None
            assert log_path.stat().st_size == size, log_path.read_text()[-2000:]
        finally:
            process.terminate()
            code = process.wait(30)
    return body, code


def test_a_role_refused_by_postgresql_is_not_ready_says_why_and_does_not_retry(isolated, tmp_path):
    env = wrong_password_env(isolated)
    log_path = tmp_path / "projector.log"
    body, code = held_refusal(env, "projector", log_path)
    assert "refused the login: the password is wrong for this user" in body, body
    text = log_path.read_text()
    assert code == 78, text[-2000:]
    assert "postgresql refused this process" in text and WRONG not in text

    everything = subprocess.run([sys.executable, "-m", "cli.main", "run", "--role", "all"], env=env,
                                capture_output=True, text=True, timeout=120)
    assert everything.returncode == 78, everything.stdout + everything.stderr
    assert "refused the login" in everything.stderr and WRONG not in everything.stdout + everything.stderr


def test_a_worker_refused_by_s3_is_not_ready_says_why_and_does_not_retry(isolated, tmp_path):
    env = {**settings_env(isolated), "TAPELINE_S3_SECRET_KEY": WRONG}
    body, code = held_refusal(env, "transcode", tmp_path / "transcode.log")
    assert "S3 refused the credentials (SignatureDoesNotMatch)" in body, body
    text = (tmp_path / "transcode.log").read_text()
    assert code == 78 and "s3 refused this process" in text and WRONG not in text, text[-2000:]

    plain = isolated.s3_endpoint
    assert plain.startswith("http://")
    env = {**settings_env(isolated), "TAPELINE_S3_ENDPOINT": "https://" + plain.removeprefix("http://")}
    body, code = held_refusal(env, "transcode", tmp_path / "transcode-tls.log")
    assert "S3 refused over TLS" in body and code == 78, body

    # The projector never touches the bucket: its start does not depend on S3's credentials.
    env = {**settings_env(isolated), "TAPELINE_S3_SECRET_KEY": WRONG, "TAPELINE_HEALTH_PORT": str(free_port())}
    with open(tmp_path / "projector.log", "wb") as log:
        projector = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "projector"], env=env,
                                     stdout=log, stderr=log)
    try:
        port = env["TAPELINE_HEALTH_PORT"]

        def ready() -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2).status == 200
            except OSError:
                return False
        wait_for(ready, 60, "the projector ready despite the wrong S3 secret")
    finally:
        projector.terminate()
        projector.wait(30)
