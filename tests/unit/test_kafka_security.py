"""Kafka security without a broker: the client factory's security settings and principals, the
classification of librdkafka's refusals, the roles' ACL grants, MirrorMaker 2's security lines, the
secured stack's files, and that no secret is shown (tests/integration/test_kafka_security.py runs
them against a secured broker)."""

from __future__ import annotations

import json

import pytest
from confluent_kafka import KafkaError, KafkaException
from pydantic import SecretStr

from devstack import kafka_secure
from domain.errors import ConfigurationError, KafkaAccessRefused
from domain.pipeline import STAGE_NAMES
from domain.policy.kafka_access import ROLES, grants
from regions.mirror import mm2_properties, mm2_security
from tapeline import kafka
from tapeline.health import HealthState
from tapeline.home import HomePaths
from tapeline.settings import Settings

SASL = dict(kafka_security_protocol="SASL_SSL", kafka_ssl_ca_location="/etc/ca.pem")


def credentials_file(tmp_path, **roles) -> str:
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({role: {"username": f"user-{role}", "password": password}
                                for role, password in roles.items()}))
    return str(path)


def test_plaintext_clients_get_only_the_address_the_protocol_and_the_refusal_callback():
    config = kafka.client_config(Settings())
    assert set(config) == {"bootstrap.servers", "security.protocol", "error_cb"}
    assert config["security.protocol"] == "PLAINTEXT"


def test_a_role_uses_its_own_principal_from_the_credentials_file(tmp_path):
    path = credentials_file(tmp_path, intake="pw-intake", operator="pw-operator")
    intake = kafka.client_config(Settings(**SASL, kafka_credentials_file=path, kafka_role="intake"))
    assert (intake["sasl.username"], intake["sasl.password"]) == ("user-intake", "pw-intake")
    assert intake["sasl.mechanism"] == "SCRAM-SHA-512" and intake["ssl.ca.location"] == "/etc/ca.pem"
    cli = kafka.client_config(Settings(**SASL, kafka_credentials_file=path))  # no role: the operator's
    assert cli["sasl.username"] == "user-operator"
    # A role without an entry falls back to the process's own user name and password.
    fallback = kafka.client_config(Settings(**SASL, kafka_credentials_file=path, kafka_role="notify",
                                            kafka_sasl_username="n", kafka_sasl_password="p"))
    assert (fallback["sasl.username"], fallback["sasl.password"]) == ("n", "p")


def test_mutual_tls_and_plain_sasl_settings_reach_the_client():
    config = kafka.client_config(Settings(kafka_security_protocol="SSL", kafka_ssl_ca_location="/ca.pem",
                                          kafka_ssl_certificate_location="/c.pem", kafka_ssl_key_location="/k.pem",
                                          kafka_ssl_key_password="kp"))
    assert (config["ssl.certificate.location"], config["ssl.key.location"], config["ssl.key.password"]) == \
        ("/c.pem", "/k.pem", "kp")
    assert "sasl.mechanism" not in config
    plain = kafka.client_config(Settings(kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="PLAIN",
                                         kafka_sasl_username="key", kafka_sasl_password="secret"))
    assert (plain["sasl.mechanism"], plain["sasl.username"]) == ("PLAIN", "key")
    assert "ssl.ca.location" not in plain  # the system's CA store (a managed cluster's public CA)


def test_sasl_without_a_principal_or_an_extra_setting_overriding_one_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigurationError, match="needs a user name and password for role 'intake'"):
        kafka.client_config(Settings(**SASL, kafka_role="intake"))
    with pytest.raises(ConfigurationError, match="may not set sasl.password"):
        kafka.client_config(Settings(**SASL, kafka_sasl_username="u", kafka_sasl_password="p",
                                     kafka_extra_config={"sasl.password": "x"}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigurationError, match="not readable JSON"):
        kafka.client_config(Settings(**SASL, kafka_credentials_file=str(broken)))
    oauth = kafka.client_config(Settings(kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="OAUTHBEARER",
                                         kafka_extra_config={"sasl.oauthbearer.method": "oidc"}))
    assert oauth["sasl.oauthbearer.method"] == "oidc" and "sasl.username" not in oauth


def test_secrets_are_never_shown_by_the_settings(tmp_path):
    settings = Settings(**SASL, kafka_sasl_username="u", kafka_sasl_password="hunter2-password",
                        kafka_ssl_key_password="key-password", kafka_extra_config={"sasl.oauthbearer.client.secret": "cs"})
    shown = repr(settings) + str(settings) + settings.model_dump_json()
    for secret in ("hunter2-password", "key-password", '"cs"'):
        assert secret not in shown


@pytest.mark.parametrize("code, kind", [
    (KafkaError._SSL, "tls"), (KafkaError._AUTHENTICATION, "authentication"),
    (KafkaError.SASL_AUTHENTICATION_FAILED, "authentication"),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, "authorisation"), (KafkaError.GROUP_AUTHORIZATION_FAILED, "authorisation"),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "authorisation"),
    (KafkaError.CLUSTER_AUTHORIZATION_FAILED, "authorisation")])
def test_librdkafka_refusals_are_classified(code, kind):
    refusal = kafka.access_refusal(KafkaError(code, "refused here"))
    assert isinstance(refusal, KafkaAccessRefused) and refusal.kind == kind
    assert str(refusal).startswith(f"Kafka refused this client ({kind}): ")
    assert kafka.access_refusal(KafkaException(KafkaError(code, "x"))).kind == kind  # also inside an exception
    with pytest.raises(KafkaAccessRefused):
        kafka.raise_refusal(KafkaError(code, "x"))


def test_other_errors_are_no_refusal_but_an_ssl_handshake_transport_failure_is():
    for code in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError.NOT_COORDINATOR):
        assert kafka.access_refusal(KafkaError(code, "down")) is None
        kafka.raise_refusal(KafkaError(code, "down"))  # returns: librdkafka retries these
    handshake = kafka.access_refusal(KafkaError(KafkaError._TRANSPORT, "SSL handshake failed: certificate verify failed"))
    assert handshake.kind == "tls"
    assert kafka.access_refusal(ValueError("no kafka error")) is None


def test_a_writer_raises_the_refusal_not_a_retriable_log_error():
    class Refusing:
        def begin_transaction(self):
            raise KafkaException(KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "no"))

    with pytest.raises(KafkaAccessRefused) as refused:
        kafka.KafkaWriter(Refusing()).begin_transaction()
    assert refused.value.kind == "authorisation"


def test_only_the_intake_and_the_operator_write_the_uploads_topic():
    writers = {g.role for role in ROLES for g in grants(role, "app", "tl")
               if g.resource == "topic" and "WRITE" in g.operations
               and ("tl.uploads".startswith(g.name) if g.pattern == "PREFIXED" else g.name == "tl.uploads")}
    assert writers == {"intake", "operator", "mirror"}  # the mirror writes the standby region's copy


def test_each_stage_gets_only_its_own_transactional_ids_and_the_notifier_only_the_jobs_topic():
    for stage in STAGE_NAMES:
        ids = [g for g in grants(stage, "app", "tl") if g.resource == "transactional_id"]
        assert [(g.name, g.pattern) for g in ids] == [(f"app.{stage}.", "PREFIXED")]
    notify_writes = [(g.name, g.pattern) for g in grants("notify", "app", "tl") if "WRITE" in g.operations]
    assert notify_writes == [("tl.jobs", "LITERAL"), ("app.notify", "LITERAL")]
    assert not [g for g in grants("projector", "app", "tl") if "WRITE" in g.operations]
    with pytest.raises(ValueError, match="unknown role"):
        grants("attacker", "app", "tl")


def test_the_mirror_gets_its_principal_and_the_ca_for_each_secured_cluster():
    secured = Settings(**SASL)
    lines = mm2_security("a", secured, ("mirror", SecretStr('p"w\\d')))
    assert "a.security.protocol = SASL_SSL" in lines and "a.sasl.mechanism = SCRAM-SHA-512" in lines
    jaas = next(line for line in lines if line.startswith("a.sasl.jaas.config"))
    # JAAS quoting (\" and \\), then java.util.Properties escaping (every backslash doubled).
    assert jaas.endswith('username="mirror" password="p\\\\"w\\\\\\\\d";'), jaas
    assert "a.ssl.truststore.location = /etc/ca.pem" in lines
    assert mm2_security("a", Settings(), (None, None)) == []
    with pytest.raises(ValueError, match="needs a principal"):
        mm2_security("a", secured, (None, None))
    with pytest.raises(ValueError, match="OAUTHBEARER is not built"):
        mm2_security("a", Settings(**SASL, kafka_sasl_mechanism="OAUTHBEARER"), ("m", SecretStr("p")))
    text = mm2_properties(secured, secured.for_region("b"), {"a": ("mirror", SecretStr("pa")),
                                                             "b": ("mirror", SecretStr("pb"))})
    assert "a.security.protocol = SASL_SSL" in text and "b.security.protocol = SASL_SSL" in text


def test_the_secured_stack_makes_a_principal_per_role_and_its_broker_properties(tmp_path):
    directory = tmp_path / "secure"
    credentials = kafka_secure.ensure_credentials(directory)
    assert set(credentials) == {*ROLES, "admin"}
    assert oct((directory / "credentials.json").stat().st_mode & 0o777) == "0o600"
    assert kafka_secure.ensure_credentials(directory) == credentials  # made once, then read
    args = kafka_secure.scram_format_args(credentials)
    assert args.count("--add-scram") == len(credentials)
    text = kafka_secure.listener_properties("127.0.0.1", 1, 2, directory, credentials)
    for line in ("authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                 "super.users=User:admin;User:CN=tapeline-broker", "listener.security.protocol.map=SECURE:SASL_SSL,CONTROLLER:SSL",
                 "listener.name.controller.ssl.client.auth=required", "allow.everyone.if.no.acl.found=false"):
        assert line in text
    bindings = kafka_secure.acl_bindings(Settings())
    assert len({tuple(b.values()) for b in bindings}) == len(bindings)
    client = kafka_secure.client_settings(Settings(), HomePaths(tmp_path))
    assert client.kafka_security_protocol == "SASL_SSL"
    assert client.kafka_credentials_file == tmp_path / "kafka" / "secure" / "credentials.json"
    assert "password" not in json.dumps(kafka_secure.client_environment(Settings(), HomePaths(tmp_path))).lower()


def test_a_refused_process_is_not_ready_and_says_why():
    health = HealthState("projector")
    health.mark_ready()
    health.mark_refused("Kafka refused this client (authentication): invalid credentials")
    assert health.readiness() == (False, "Kafka refused this client (authentication): invalid credentials")


def test_docs_security_names_every_role_and_every_kafka_security_setting():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    for role in ROLES:
        assert f"`{role}`" in text, role
    for name in Settings.model_fields:
        if name.startswith(("kafka_security", "kafka_sasl", "kafka_ssl", "kafka_credentials", "kafka_role",
                            "kafka_extra")):
            assert f"TAPELINE_{name.upper()}" in text or f"_{name.upper().removeprefix('KAFKA_')}" in text, name
