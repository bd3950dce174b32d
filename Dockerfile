# The Tapeline processes (docker-compose.yml's `tapeline` and `tapeline-init` services).
FROM python:3.11-slim

# ffmpeg/ffprobe from Debian, as on the build machines.
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

# Never run as root; the state directory is the one writable place.
RUN useradd --system --uid 10001 --home-dir /var/lib/tapeline --create-home tapeline
USER tapeline
ENV TAPELINE_HOME=/var/lib/tapeline \
    PYTHONUNBUFFERED=1

CMD ["tapeline", "run", "--role", "all"]
