"""Ports: what the loops (processors, projector) ask of the outside world, as small Protocols.

Adapters behind them live outside `domain/` (Kafka in `tapeline/kafka.py`, PostgreSQL in
`tapeline/postgres.py` and `tapeline/read.py`, S3 in `tapeline/objectstore.py`, ffmpeg in
`processors/media.py`) and are built and wired in one place, `tapeline/wiring.py`. A port names only
standard-library and domain types, so `domain/` stays pure.
"""

from __future__ import annotations

from typing import Protocol
