"""Tapeline: event-sourced media jobs (upload -> transcode -> publish) on Kafka.

This shared package holds only settings, the CLI, the wiring and the adapters (Kafka client
factory, object store, database pool, local stack). The pure lifecycle core is `domain/`; the
schema files are in `schemas/`; the loops are in `producers/`, `processors/` and `projections/`.
"""

__version__ = "0.1.0"
