"""The secured local Kafka of `tapeline stack up --secure` (docs/security.md): one combined KRaft node
whose clients' listener is SASL_SSL with SCRAM-SHA-512, one principal per role plus the broker's
`admin` super user, and ACLs from `domain.policy.kafka_access`.

Everything secret is made at start into `<home>/kafka/secure/` (never into the repository): a CA and
the broker's certificate (openssl; the broker reads PEM files directly, `ssl.keystore.type=PEM`,
KIP-651, so no keytool keystore is needed), and `credentials.json`, a random password per principal
(mode 0600), which is also the clients' `TAPELINE_KAFKA_CREDENTIALS_FILE`. The SCRAM users are
created when the node's storage is formatted (`StorageTool format --add-scram`, KRaft's way to have
users before the first start); the ACLs through the admin API once the node answers, as `admin`.

The controller listener is TLS with client certificates required: only a holder of a certificate the
stack's CA signed (the broker itself, principal `User:CN=tapeline-broker`, a super user) may talk to
the controller.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from devstack.tls import openssl, server_certificate, stack_ca
from domain.policy.kafka_access import ROLES
from tapeline.home import HomePaths
from tapeline.settings import Settings

ADMIN = "admin"
"""The broker's own SASL principal (inter-broker traffic) and the stack's super user."""
BROKER_CN = "tapeline-broker"
"""Common name of the broker's certificate; `User:CN=tapeline-broker` is its principal on the
controller listener (mutual TLS)."""
MECHANISM = "SCRAM-SHA-512"


def secure_dir(paths: HomePaths) -> Path:
    """`<home>/kafka/secure`: the secured node's files (data, properties, log, TLS material, credentials)."""
    return paths.kafka / "secure"


def client_settings(settings: Settings, paths: HomePaths, keep_given: bool = False) -> Settings:
    """`settings` as a client of the secured stack: SASL_SSL with SCRAM-SHA-512, the stack's CA and its
    credentials file (each process then uses its role's principal; the CLI the operator's). With
    `keep_given`, the Kafka settings the environment names itself (TAPELINE_KAFKA_SECURITY_PROTOCOL, ...)
    are kept (a `stack status` as that environment's client)."""
    directory = secure_dir(paths)
    update = {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": MECHANISM,
              "kafka_ssl_ca_location": directory / "ca.crt", "kafka_credentials_file": directory / "credentials.json"}
    return settings.model_copy(update={k: v for k, v in update.items()
                                       if not (keep_given and k in settings.model_fields_set)})


def client_environment(settings: Settings, paths: HomePaths) -> dict[str, str]:
    """The `TAPELINE_*` variables a process needs to use the secured stack (what `stack up --secure`
    prints for `export`); no secret among them (the passwords stay in the credentials file)."""
    secured = client_settings(settings, paths)
    return {"TAPELINE_KAFKA_SECURITY_PROTOCOL": secured.kafka_security_protocol,
            "TAPELINE_KAFKA_SASL_MECHANISM": secured.kafka_sasl_mechanism,
            "TAPELINE_KAFKA_SSL_CA_LOCATION": str(secured.kafka_ssl_ca_location),
            "TAPELINE_KAFKA_CREDENTIALS_FILE": str(secured.kafka_credentials_file)}


def ensure_tls(directory: Path, host: str) -> None:
    """Make the stack's CA (`ca.crt`, `ca.key`: `devstack.tls.stack_ca`) and the broker's key and
    certificate (`broker.pem`: the PKCS#8 key then the certificate, the broker's PEM keystore), unless
    they exist. The broker's certificate names `host`, 127.0.0.1 and localhost (subjectAltName), so
    clients verify it (librdkafka checks the host name by default:
    ssl.endpoint.identification.algorithm=https); its common name is `BROKER_CN` (a super user: the
    broker authenticates to its controller with it, mutual TLS).

    Raises StackError when openssl is missing or fails.
    """
    if (directory / "broker.pem").is_file() and (directory / "ca.crt").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    hosts = list(dict.fromkeys([host, "127.0.0.1", "localhost"]))
    broker = server_certificate(stack_ca(directory), directory, "broker", hosts, common_name=BROKER_CN,
                                client_auth=True)
    pkcs8 = directory / "broker.p8"
    openssl("pkcs8", "-topk8", "-nocrypt", "-in", str(broker.key), "-out", str(pkcs8))
    keystore = directory / "broker.pem"
    keystore.write_text(pkcs8.read_text() + broker.cert.read_text())
    for path in (pkcs8, keystore):
        os.chmod(path, 0o600)


def ensure_credentials(directory: Path) -> dict[str, dict[str, str]]:
    """`credentials.json` of the stack: `{role: {"username": role, "password": random}}` for every role of
    `domain.policy.kafka_access.ROLES` and `admin`; made once (mode 0600), then read. A role added
    since gets a password, but its SCRAM user exists only after the storage is formatted again
    (`tapeline stack down` and remove `<home>/kafka/secure/data`)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "credentials.json"
    existing: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.is_file() else {}
    wanted = {name: existing.get(name) or {"username": name, "password": secrets.token_urlsafe(24)}
              for name in (*ROLES, ADMIN)}
    if wanted != existing:
        path.write_text(json.dumps(wanted, indent=2) + "\n")
        os.chmod(path, 0o600)
    return wanted


def scram_format_args(credentials: dict[str, dict[str, str]]) -> list[str]:
    """`StorageTool format` arguments that create every principal as a SCRAM-SHA-512 user."""
    args: list[str] = []
    for entry in credentials.values():
        args += ["--add-scram", f"{MECHANISM}=[name={entry['username']},password={entry['password']}]"]
    return args


def listener_properties(host: str, port: int, controller_port: int, directory: Path,
                        credentials: dict[str, dict[str, str]]) -> str:
    """The server.properties section of a secured node (replaces the plain node's listeners): SASL_SSL
    for clients and between brokers, TLS with client certificates for the controller, the
    StandardAuthorizer with `admin` and the broker's certificate as super users."""
    admin = credentials[ADMIN]
    return f"""\
# SECURED (tapeline stack up --secure, devstack/kafka_secure.py): SASL_SSL + SCRAM-SHA-512 for clients,
# mutual TLS for the controller, ACLs from domain/policy/kafka_access.py.
listeners=SECURE://{host}:{port},CONTROLLER://{host}:{controller_port}
advertised.listeners=SECURE://{host}:{port}
listener.security.protocol.map=SECURE:SASL_SSL,CONTROLLER:SSL
inter.broker.listener.name=SECURE
controller.listener.names=CONTROLLER
sasl.enabled.mechanisms={MECHANISM}
sasl.mechanism.inter.broker.protocol={MECHANISM}
listener.name.secure.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="{admin['username']}" password="{admin['password']}";
ssl.keystore.type=PEM
ssl.keystore.location={directory / 'broker.pem'}
ssl.truststore.type=PEM
ssl.truststore.location={directory / 'ca.crt'}
listener.name.controller.ssl.client.auth=required
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:{admin['username']};User:CN={BROKER_CN}
allow.everyone.if.no.acl.found=false
"""


def admin_settings(settings: Settings, paths: HomePaths) -> Settings:
    """`client_settings` with the `admin` principal (the stack's own calls: topics, ACLs, status)."""
    return client_settings(settings, paths).model_copy(update={"kafka_role": ADMIN})


def acl_bindings(settings: Settings) -> list[dict[str, Any]]:
    """Every role's grants (`domain.policy.kafka_access.grants`) as `{principal, resource, name, pattern,
    operation}` rows, one per operation and no row twice, the principals named as in `credentials.json`."""
    from domain.policy.kafka_access import grants

    rows = [{"principal": f"User:{grant.role}", "resource": grant.resource, "name": grant.name,
             "pattern": grant.pattern, "operation": operation}
            for role in ROLES for grant in grants(role, settings.app_name, settings.topic_prefix)
            for operation in grant.operations]
    unique = {tuple(row.values()): row for row in rows}  # two grants may name one operation (CreateAcls refuses twins)
    return list(unique.values())
