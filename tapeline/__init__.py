"""Tapeline: event-sourced media jobs (upload -> transcode -> publish) on Kafka.

This shared package holds only settings, the CLI and the adapters (Kafka client factory, object
store, database pool, local stack). The domain lives in `schemas/`, `producers/`, `processors/`
and `projections/`.
"""

__version__ = "0.1.0"
