"""Region operations: a second, complete region that follows the active one and takes over.

What each module holds: `authority` (the region epochs on `<prefix>.regions`, the fence check),
`failover` (`tapeline region failover`), `rejoin` (a region rejoining as the standby),
`mirror` (MirrorMaker 2's configuration and process), `replicator` (the media replicator) with
`media_copy` (one verified copy) and `replicator_process` (its background process), `measure` and
`mirror_lag` (how far the standby is behind), `object_audit` (the replicator's status reads) and
`monitor` (the standby's metrics). The pure rules live in `domain/regions.py` and
`domain/replication.py`; docs/regions.md is the guide.
"""
