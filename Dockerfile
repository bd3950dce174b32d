# The Tapeline processes (docker-compose.yml's `tapeline` and `tapeline-init` services).
FROM python:3.11-slim

# ffmpeg/ffprobe from Debian, as on the build machines. Not pinned to a version: the base image's
# Debian release fixes the major version, and a pin breaks the build at Debian's next security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml ./
COPY domain ./domain
COPY tapeline ./tapeline
COPY cli ./cli
COPY regions ./regions
COPY devstack ./devstack
COPY schemas ./schemas
COPY producers ./producers
COPY processors ./processors
COPY projections ./projections
RUN pip install --no-cache-dir .

# Never run as root; the state directory is the one writable place. USER is numeric so Kubernetes'
# runAsNonRoot can check it (deploy/helm/tapeline runs it as 10001 too).
RUN groupadd --system --gid 10001 tapeline \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tapeline --create-home tapeline
USER 10001:10001
ENV TAPELINE_HOME=/var/lib/tapeline \
    PYTHONUNBUFFERED=1

CMD ["tapeline", "run", "--role", "all"]
