"""The Helm chart (deploy/helm/tapeline, issue 40 item 5), checked without a cluster: `helm lint` and
`helm template` run (helm is built by scripts/bootstrap.sh into .venv/bin), and the rendered manifests
are read back (PyYAML) and held against what the code does:

- every role of `tapeline run --role` (cli/run_command.py ROLE_CHOICES) and `tapeline serve` is a Deployment;
- `terminationGracePeriodSeconds` exceeds the drain bound `shutdown_grace_s` of the settings the pod runs with;
- the probes ask the paths the health server answers, on the port the pod's settings make it serve;
- the leader-locked roles (projector, watchdog, notify) run one replica, replaced by Recreate;
- every credential setting comes from a `secretKeyRef`, no Secret is rendered, none is accepted as a value;
- the KEDA trigger names the transcode workers' consumer group and work topics (`Settings.stage_group`,
  `Settings.work_topics`), and each Deployment has a PodDisruptionBudget that does not block a drain.

Each check is a function returning its problems, so the tests also break the rendered manifests (a grace period at
the bound, another probe port or path, two projectors, a secret as a plain value, another group or topic)
and assert that the same check reports them.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import typing
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from cli.run_command import ROLE_CHOICES
from processors.notify import NOTIFY_LOCK
from processors.watchdog import WATCHDOG_LOCK
from projections.projector import PROJECTOR_LOCK
from tapeline.health import HealthServer, HealthState
from tapeline.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tapeline"
RELEASE = "t"

LEADER_ROLES = {"projector": PROJECTOR_LOCK, "watchdog": WATCHDOG_LOCK, "notify": NOTIFY_LOCK}
"""Roles that work under a PostgreSQL advisory lock (one holder at a time): the chart runs one replica."""

CREDENTIAL_SETTINGS = {"database_url", "s3_access_key", "s3_secret_key", "intake_tokens"} | {
    name for name, field in Settings.model_fields.items() if SecretStr in getattr(field.annotation, "__args__", ())
    or field.annotation is SecretStr}
"""Settings that carry a credential: the DSN (its password), the S3 keys, the intake's tokens, and every
field the settings declare SecretStr (the admin token; the Kafka passwords where present)."""

EMPTY_MEANS_UNSET = {"s3_access_key", "s3_secret_key"}
"""Credentials an empty value turns off (the AWS default credential chain instead of static keys)."""


def helm_binary() -> str:
    local = ROOT / ".venv" / "bin" / "helm"
    binary = str(local) if local.exists() else shutil.which("helm")
    assert binary, "helm is missing: run scripts/bootstrap.sh (it builds helm with `go install`)"
    return binary


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def render(*sets: str) -> list[dict]:
    """`helm template` of the chart with `--set` overrides: the rendered objects."""
    flags = [arg for s in sets for arg in ("--set", s)]
    done = helm("template", RELEASE, str(CHART), *flags)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render()


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def role_of(deployment: dict) -> str:
    return deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]


def pod_settings(container: dict) -> Settings:
    """The Settings a container's process builds from its environment (only its environment: the test's
    own TAPELINE_* variables are removed). A variable from a Secret or a field reference stands as a
    placeholder (`{}` for a JSON map such as the intake tokens): its value is not in the manifest."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPELINE_")}
    for var in container.get("env", []):
        field = Settings.model_fields.get(var["name"].removeprefix("TAPELINE_").lower())
        placeholder = "{}" if field is not None and typing.get_origin(field.annotation) is dict else "placeholder"
        env[var["name"]] = var["value"] if "value" in var else placeholder
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        return Settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)


# -- the checks: each returns its problems ------------------------------------------------------------


def grace_problems(docs: list[dict]) -> list[str]:
    problems = []
    for d in kinds(docs, "Deployment"):
        pod = d["spec"]["template"]["spec"]
        bound = pod_settings(pod["containers"][0]).shutdown_grace_s
        grace = pod.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
        if not grace > bound:
            problems.append(f"{role_of(d)}: terminationGracePeriodSeconds {grace} <= drain bound {bound:g} s")
    return problems


def probe_problems(docs: list[dict]) -> list[str]:
    problems = []
    for d in kinds(docs, "Deployment"):
        role, container = role_of(d), d["spec"]["template"]["spec"]["containers"][0]
        settings = pod_settings(container)
        host, port = ((settings.serve_host, settings.serve_port) if role == "serve"
                      else (settings.health_host, settings.health_port))
        if host != "0.0.0.0":
            problems.append(f"{role}: listens on {host}, which the kubelet cannot reach")
        named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        for kind, path in (("livenessProbe", "/health/live"), ("readinessProbe", "/health/ready")):
            probe = container.get(kind, {}).get("httpGet")
            if probe is None:
                problems.append(f"{role}: no {kind}")
                continue
            probe_port = named.get(probe["port"], probe["port"])
            if probe_port != port or not port:
                problems.append(f"{role}: {kind} asks port {probe_port}, the process serves {port}")
            if probe["path"] != path:
                problems.append(f"{role}: {kind} asks {probe['path']}, not {path}")
    return problems


def single_problems(docs: list[dict]) -> list[str]:
    problems = []
    for d in kinds(docs, "Deployment"):
        role = role_of(d)
        single = d["metadata"]["annotations"].get("tapeline.io/single") == "true"
        if single != (role in LEADER_ROLES):
            problems.append(f"{role}: marked single={single}")
        if role in LEADER_ROLES and (d["spec"].get("replicas") != 1 or d["spec"]["strategy"]["type"] != "Recreate"):
            problems.append(f"{role}: {d['spec'].get('replicas')} replicas, strategy {d['spec']['strategy']['type']}")
    return problems


def secret_problems(docs: list[dict]) -> list[str]:
    problems = [f"a Secret {d['metadata']['name']} is rendered" for d in kinds(docs, "Secret")]
    credential_vars = {f"TAPELINE_{name.upper()}": name for name in CREDENTIAL_SETTINGS}
    for d in docs:
        if d["kind"] not in ("Deployment", "Job"):
            continue
        for container in d["spec"]["template"]["spec"]["containers"]:
            for var in container.get("env", []):
                name = credential_vars.get(var["name"])
                if name is None:
                    if "://" in var.get("value", "") and "@" in var["value"]:
                        problems.append(f"{d['metadata']['name']}: {var['name']} is a URL with credentials")
                    continue
                if "secretKeyRef" in var.get("valueFrom", {}):
                    continue
                if name in EMPTY_MEANS_UNSET and var.get("value") == "":
                    continue
                problems.append(f"{d['metadata']['name']}: {var['name']} is not from a secretKeyRef")
    return problems


def keda_problems(docs: list[dict]) -> list[str]:
    [transcode] = [d for d in kinds(docs, "Deployment") if role_of(d) == "transcode"]
    settings = pod_settings(transcode["spec"]["template"]["spec"]["containers"][0])
    scaled = kinds(docs, "ScaledObject")
    if len(scaled) != 1:
        return [f"{len(scaled)} ScaledObjects"]
    spec = scaled[0]["spec"]
    problems = []
    if spec["scaleTargetRef"]["name"] != transcode["metadata"]["name"]:
        problems.append(f"scales {spec['scaleTargetRef']['name']}")
    if "replicas" in transcode["spec"]:
        problems.append("the transcode Deployment sets replicas, which KEDA's HPA owns")
    if spec["maxReplicaCount"] > settings.work_partitions:
        problems.append(f"maxReplicaCount {spec['maxReplicaCount']} > {settings.work_partitions} partitions")
    kafka = [t for t in spec["triggers"] if t["type"] == "kafka"]
    groups = {t["metadata"]["consumerGroup"] for t in kafka}
    if groups != {settings.stage_group("transcode")}:
        problems.append(f"consumer groups {groups}, the workers use {settings.stage_group('transcode')}")
    topics = sorted(t["metadata"]["topic"] for t in kafka)
    if topics != sorted(settings.work_topics("transcode")):
        problems.append(f"topics {topics}, the workers read {settings.work_topics('transcode')}")
    if {t["metadata"]["bootstrapServers"] for t in kafka} != {settings.kafka_bootstrap}:
        problems.append("the triggers ask another Kafka than the workers")
    # security as the workers connect (KEDA's names: keda.sh docs, the kafka scaler's sasl and tls)
    env = {v["name"]: v.get("value") for v in transcode["spec"]["template"]["spec"]["containers"][0]["env"]}
    protocol = env.get("TAPELINE_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT")
    keda_sasl = {"SCRAM-SHA-512": "scram_sha512", "SCRAM-SHA-256": "scram_sha256", "PLAIN": "plaintext",
                 "OAUTHBEARER": "oauthbearer"}.get(env.get("TAPELINE_KAFKA_SASL_MECHANISM", ""))
    for t in kafka:
        want_tls = "enable" if protocol in ("SSL", "SASL_SSL") else "disable"
        if t["metadata"].get("tls", "disable") != want_tls:
            problems.append(f"trigger tls {t['metadata'].get('tls')}, the workers use {protocol}")
        if protocol.startswith("SASL") and (t["metadata"].get("sasl") != keda_sasl or "authenticationRef" not in t):
            problems.append(f"trigger sasl {t['metadata'].get('sasl')}, the workers use {protocol}")
    return problems


def pdb_problems(docs: list[dict]) -> list[str]:
    budgets = {json.dumps(p["spec"]["selector"]["matchLabels"], sort_keys=True): p["spec"]
               for p in kinds(docs, "PodDisruptionBudget")}
    problems = []
    for d in kinds(docs, "Deployment"):
        budget = budgets.get(json.dumps(d["spec"]["selector"]["matchLabels"], sort_keys=True))
        if budget is None:
            problems.append(f"{role_of(d)}: no PodDisruptionBudget")
        elif budget.get("maxUnavailable", 0) < 1 and budget.get("minAvailable", 0) >= d["spec"].get("replicas", 1):
            problems.append(f"{role_of(d)}: its budget lets no pod go (a node drain would hang)")
    return problems


# -- the tests ----------------------------------------------------------------------------------------


def test_helm_lint_passes():
    done = helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_role_is_one_deployment_running_that_role(rendered):
    deployments = {role_of(d): d for d in kinds(rendered, "Deployment")}
    assert set(deployments) == (set(ROLE_CHOICES) - {"all"}) | {"serve"}
    for role, d in deployments.items():
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args == (["tapeline", "serve"] if role == "serve" else ["tapeline", "run", "--role", role])


def test_grace_period_exceeds_the_drain_bound(rendered):
    assert grace_problems(rendered) == []
    bound = Settings.model_fields["shutdown_grace_s"].default
    broken = render(f"terminationGracePeriodSeconds={int(bound)}")
    assert len(grace_problems(broken)) == len(kinds(broken, "Deployment"))
    # a longer drain bound set for the pods needs a longer grace period
    assert grace_problems(render("settings.shutdown_grace_s=90"))


def test_probes_ask_the_health_port_and_paths_the_process_serves(rendered):
    assert probe_problems(rendered) == []
    for role, container_port, path in (("intake", 9500, None), ("serve", 8500, None), ("projector", None, "/health")):
        broken = copy.deepcopy(rendered)
        [container] = [d["spec"]["template"]["spec"]["containers"][0] for d in kinds(broken, "Deployment")
                       if role_of(d) == role]
        if container_port:
            container["ports"][0]["containerPort"] = container_port
        if path:
            container["readinessProbe"]["httpGet"]["path"] = path
        assert [p for p in probe_problems(broken) if p.startswith(role)], role


def test_settings_the_chart_sets_itself_are_refused_as_free_settings():
    for name in ("health_port", "serve_port", "app_name", "topic_prefix"):
        done = helm("template", RELEASE, str(CHART), "--set", f"settings.{name}=1")
        assert done.returncode != 0 and f"settings.{name} is set by the chart" in done.stderr, done.stderr


def test_the_probe_paths_are_answered_by_the_health_server(rendered):
    """The rendered paths, asked of a real HealthServer: live answers 200, ready answers 200 or 503."""
    paths = {d["spec"]["template"]["spec"]["containers"][0][kind]["httpGet"]["path"]
             for d in kinds(rendered, "Deployment") if role_of(d) != "serve"
             for kind in ("livenessProbe", "readinessProbe")}
    server = HealthServer(HealthState("transcode", "test"), "127.0.0.1", 0).start()
    try:
        for path in sorted(paths):
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5).status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status in ((200,) if path.endswith("live") else (200, 503)), (path, status)
    finally:
        server.stop()


def test_leader_locked_roles_run_one_replica(rendered):
    assert single_problems(rendered) == []
    assert single_problems(render("roles.watchdog.replicas=3")) == []  # the chart keeps one
    assert single_problems(render("roles.watchdog.single=false", "roles.watchdog.replicas=2"))
    broken = copy.deepcopy(rendered)
    for d in kinds(broken, "Deployment"):
        if role_of(d) == "projector":
            d["spec"]["replicas"] = 2
    assert single_problems(broken) == ["projector: 2 replicas, strategy Recreate"]


def test_credentials_come_from_secrets_only(rendered):
    assert {"database_url", "s3_secret_key", "admin_token", "intake_tokens"} <= CREDENTIAL_SETTINGS
    assert secret_problems(rendered) == []
    env = {var["name"]: var for d in kinds(rendered, "Deployment") if role_of(d) == "serve"
           for var in d["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TAPELINE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "tapeline-pg-app", "key": "uri"}
    assert "secretKeyRef" in env["TAPELINE_ADMIN_TOKEN"]["valueFrom"]
    # a credential given as a plain setting is refused at render time, naming it
    done = helm("template", RELEASE, str(CHART), "--set", "settings.database_url=postgresql://u:p@h/db")
    assert done.returncode != 0 and "settings.database_url is a credential" in done.stderr
    # the check itself sees a plain value (a chart edited to pass one through)
    broken = copy.deepcopy(rendered)
    for d in kinds(broken, "Deployment"):
        for var in d["spec"]["template"]["spec"]["containers"][0]["env"]:
            if var["name"] == "TAPELINE_S3_SECRET_KEY":
                var.pop("valueFrom")
                var["value"] = "inline"
    assert secret_problems(broken)


def test_static_s3_keys_can_be_left_to_the_default_credential_chain():
    docs = render("s3.credentialsSecret.name=")
    assert secret_problems(docs) == []
    [serve] = [d for d in kinds(docs, "Deployment") if role_of(d) == "serve"]
    env = {var["name"]: var for var in serve["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TAPELINE_S3_ACCESS_KEY"] == {"name": "TAPELINE_S3_ACCESS_KEY", "value": ""}


def test_keda_scales_transcode_on_the_group_and_topics_the_workers_use(rendered):
    assert keda_problems(rendered) == []
    # with another app name and prefix both sides move together, and so does the security protocol
    assert keda_problems(render("appName=media", "topicPrefix=media")) == []
    assert keda_problems(render("kafka.securityProtocol=PLAINTEXT", "kafka.caSecret.name=")) == []
    assert keda_problems(render("kafka.saslMechanism=SCRAM-SHA-256")) == []
    for key, value in (("consumerGroup", "tapeline.transcoder"), ("topic", "tapeline.work.transcode")):
        broken = copy.deepcopy(rendered)
        kinds(broken, "ScaledObject")[0]["spec"]["triggers"][0]["metadata"][key] = value
        assert keda_problems(broken), key


def test_every_deployment_has_a_disruption_budget_that_lets_a_drain_proceed(rendered):
    assert pdb_problems(rendered) == []
    assert pdb_problems(render("podDisruptionBudget.enabled=false"))


def test_pods_run_as_the_images_user(rendered):
    """The pods' runAsUser is the Dockerfile's numeric USER (whose home is TAPELINE_HOME)."""
    [user] = [line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    uid = int(user.split(":")[0])
    pods = [d["spec"]["template"]["spec"] for d in rendered if d["kind"] in ("Deployment", "Job")]
    assert pods and all(p["securityContext"]["runAsUser"] == uid and p["securityContext"]["runAsNonRoot"]
                        for p in pods)
