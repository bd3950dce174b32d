"""Kafka secured (issue 40 item 1): one `tapeline stack up --secure` broker for the module (SASL_SSL,
SCRAM-SHA-512, a principal per role, ACLs from domain/policy/kafka_access.py), on ports and a home of
its own beside the shared plain stack (whose PostgreSQL and S3 it reuses).

The whole pipeline runs on it with each role's own principal; an unauthenticated client, a wrong
password, an untrusted certificate and a principal writing outside its ACL are refused, each with an
error that names which (authentication, tls, authorisation), and nothing reaches the log (read back as
the admin)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from devstack.kafka_secure import admin_settings, client_settings
from domain import events as ev
from domain.errors import KafkaAccessRefused
from producers.submit import publish, upload_completed
from tapeline.home import home_paths
from tapeline.kafka import cluster_answers
from tapeline.samples import sample_video
from tapeline.settings import Settings
from tests.conftest import Pipeline, isolated_settings, own_database, settings_env, tapeline_cli, wait_for
from tests.integration.helpers import committed_events, free_ports, of_job

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack_settings(base_settings: Settings, tmp_path_factory: pytest.TempPathFactory):
    """The module's settings as they are before `--secure` (own home, ports, topics, database), with the
    secured broker up for the whole module; stopped (its own process only) afterwards."""
    tag = uuid.uuid4().hex[:8]
    port, controller = free_ports(2)
    jars = base_settings.kafka_jars or home_paths(base_settings).kafka_libs
    with own_database(base_settings, tag) as url:
        settings = isolated_settings(base_settings, tag, url, home=tmp_path_factory.mktemp("secure-home"),
                                     kafka_bootstrap=f"127.0.0.1:{port}", kafka_controller_port=controller,
                                     kafka_jars=Path(jars))
        up = tapeline_cli(settings, "stack", "up", "--secure", timeout_s=240)
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            yield settings
        finally:
            down = tapeline_cli(client_settings(settings, home_paths(settings)), "stack", "down", timeout_s=60)
            print(down.stdout, down.stderr)


@pytest.fixture(scope="module")
def secured(stack_settings: Settings) -> Settings:
    """The clients' settings of the secured stack (what `stack up --secure` prints to export)."""
    return client_settings(stack_settings, home_paths(stack_settings))


@pytest.fixture(scope="module")
def admin(stack_settings: Settings) -> Settings:
    return admin_settings(stack_settings, home_paths(stack_settings))


def upload_event(settings: Settings) -> ev.UploadCompleted:
    """A forged `UploadCompleted` naming an object that is not there, as `tapeline submit` builds one."""
    upload_id = f"forged-{uuid.uuid4().hex[:8]}"
    return upload_completed(settings, upload_id, f"uploads/{upload_id}/source.mp4", 1, "0" * 64, "source.mp4",
                            "standard", "attacker", recorded_by="attacker")


def upload_ids(admin: Settings) -> set[str]:
    """Upload ids of every committed record of the uploads topic, read as the admin."""
    return {e.upload_id for e in committed_events(admin, admin.uploads_topic)}


def test_stack_up_secure_writes_no_secret_in_its_output_and_serves_only_sasl_ssl(stack_settings, secured):
    credentials = json.loads(Path(secured.kafka_credentials_file).read_text())
    assert set(credentials) >= {"intake", "transcode", "thumbnails", "publish", "projector", "watchdog", "notify",
                                "operator", "mirror", "admin"}
    assert oct(Path(secured.kafka_credentials_file).stat().st_mode & 0o777) == "0o600"
    status = tapeline_cli(secured, "stack", "status", "--json")
    report = json.loads(status.stdout)["kafka"]
    assert report["up"] and report["security"]["protocol"] == "SASL_SSL", report
    assert "client_error" not in report, report
    text = status.stdout + status.stderr
    for entry in credentials.values():
        assert entry["password"] not in text


def test_whole_pipeline_runs_with_a_principal_per_role(secured, tmp_path):
    pipeline = Pipeline(secured, tmp_path / "run.log").start()
    try:
        done = tapeline_cli(secured, "submit", str(sample_video("carphone_pristine.mp4")), "--wait", "--json",
                            "--timeout", "300")
        assert done.stdout.strip(), done.stderr + pipeline.log_text()[-3000:]
        result = json.loads(done.stdout)
        assert result["state"] == "completed", (result, pipeline.log_text()[-3000:])
        events = of_job(committed_events(secured), result["job_id"])
        assert [e.event_type for e in events].count("JobCompleted") == 1
        log = pipeline.log_text()
        assert "refused" not in log
        # No principal's password reaches the processors' (structlog) output.
        for entry in json.loads(Path(secured.kafka_credentials_file).read_text()).values():
            assert entry["password"] not in log
    finally:
        pipeline.stop()


def test_unauthenticated_client_is_refused_as_authentication(secured, admin):
    plain = secured.model_copy(update={"kafka_security_protocol": "PLAINTEXT", "kafka_credentials_file": None,
                                       "kafka_ssl_ca_location": None})
    ok, why = cluster_answers(plain)
    assert not ok and why.startswith("Kafka refused this client (authentication)"), why
    forged = upload_event(secured)
    with pytest.raises(KafkaAccessRefused) as refused:
        publish(plain, forged, timeout_s=10)
    assert refused.value.kind == "authentication"
    # `tapeline stack status` of that environment says so too.
    env = {**settings_env(plain), "TAPELINE_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"}
    env.pop("TAPELINE_KAFKA_CREDENTIALS_FILE", None)
    status = tapeline_cli(plain, "stack", "status", "--json", env=env)
    assert "Kafka refused this client (authentication)" in json.loads(status.stdout)["kafka"]["error"]
    assert forged.upload_id not in upload_ids(admin)


def test_wrong_password_is_refused_as_authentication(secured, admin):
    wrong = secured.model_copy(update={"kafka_credentials_file": None, "kafka_sasl_username": "intake",
                                       "kafka_sasl_password": SecretStr("not-the-password")})
    forged = upload_event(secured)
    with pytest.raises(KafkaAccessRefused) as refused:
        publish(wrong, forged, timeout_s=10)
    assert refused.value.kind == "authentication" and "invalid credentials" in str(refused.value)
    assert "not-the-password" not in str(refused.value)
    # The stack's status, as this environment: the stack answers its admin, refuses this principal.
    env = {**settings_env(wrong), "TAPELINE_KAFKA_SASL_PASSWORD": "not-the-password"}
    env.pop("TAPELINE_KAFKA_CREDENTIALS_FILE", None)
    status = tapeline_cli(wrong, "stack", "status", "--json", env=env)
    report = json.loads(status.stdout)["kafka"]
    assert report["up"] and report["client_error"].startswith("Kafka refused this client (authentication)"), report
    assert "not-the-password" not in status.stdout + status.stderr
    assert forged.upload_id not in upload_ids(admin)


def test_untrusted_certificate_is_refused_as_tls(secured, admin, tmp_path):
    # Another CA, as a man in the middle's would be: the broker's certificate does not chain to it.
    import subprocess

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k"),
                    "-out", str(tmp_path / "other-ca.pem"), "-days", "1", "-subj", "/CN=other"],
                   check=True, capture_output=True)
    untrusted = secured.model_copy(update={"kafka_ssl_ca_location": tmp_path / "other-ca.pem"})
    forged = upload_event(secured)
    with pytest.raises(KafkaAccessRefused) as refused:
        publish(untrusted, forged, timeout_s=10)
    assert refused.value.kind == "tls" and "certificate verify failed" in str(refused.value)
    assert forged.upload_id not in upload_ids(admin)


def test_notifier_cannot_forge_an_upload(secured, admin):
    notifier = secured.model_copy(update={"kafka_role": "notify"})
    forged = upload_event(secured)
    with pytest.raises(KafkaAccessRefused) as refused:
        publish(notifier, forged, timeout_s=10)
    assert refused.value.kind == "authorisation" and "Topic authorization failed" in str(refused.value), refused.value
    assert forged.upload_id not in upload_ids(admin)
    # The intake's principal may write it (the ACL is what refused the notifier, not the record).
    publish(secured.model_copy(update={"kafka_role": "intake"}), upload_event(secured), timeout_s=10)


def test_foreign_transactional_id_and_group_are_refused_as_authorisation(secured):
    """The notifier may not take a transcode attempt's transactional id (which would fence it), and
    the projector may not join a group outside the deployment's."""
    from tapeline.kafka import KafkaEventLog

    notifier = KafkaEventLog(secured.model_copy(update={"kafka_role": "notify"}), f"{secured.app_name}.notify.lso")
    with pytest.raises(KafkaAccessRefused) as refused:
        notifier.transactional_producer(f"{secured.app_name}.transcode.some-job")
    assert refused.value.kind == "authorisation" and "Transactional Id authorization failed" in str(refused.value)
    projector = KafkaEventLog(secured.model_copy(update={"kafka_role": "projector"}), f"{secured.app_name}.p.lso")
    reader = projector.consumer("another-deployment.transcode")
    reader.subscribe([secured.jobs_topic])
    try:
        with pytest.raises(KafkaAccessRefused) as refused:
            for _ in range(40):
                reader.poll(0.5)
        assert refused.value.kind == "authorisation" and "Group authorization failed" in str(refused.value)
    finally:
        reader.close()


def test_refused_role_is_not_ready_and_says_why(secured, tmp_path):
    """A processor whose principal the cluster refuses answers /health/ready 503 with the reason and
    stays stopped (no retry loop); SIGTERM ends it with exit code 78."""
    import subprocess
    import sys

    port, = free_ports(1)
    env = {**settings_env(secured), "TAPELINE_KAFKA_CREDENTIALS_FILE": "", "TAPELINE_KAFKA_SASL_USERNAME": "projector",
           "TAPELINE_KAFKA_SASL_PASSWORD": "not-the-password", "TAPELINE_HEALTH_PORT": str(port)}
    env.pop("TAPELINE_KAFKA_CREDENTIALS_FILE")
    log = open(tmp_path / "projector.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "projector"], env=env,
                               stdout=log, stderr=log)
    try:
        def ready_body():
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2)
            except urllib.error.HTTPError as exc:
                body = exc.read().decode()
                return body if "refused" in body else None
            except OSError:
                return None
            return None

        body = wait_for(ready_body, 60, "the projector's /health/ready to name the refusal")
        assert "Kafka refused this client (authentication)" in body, body
        assert process.poll() is None  # not restarted, not spinning: it waits to be stopped
    finally:
        process.terminate()
        code = process.wait(30)
        log.close()
    assert code == 78, (tmp_path / "projector.log").read_text()[-2000:]
    assert "not-the-password" not in (tmp_path / "projector.log").read_text()
