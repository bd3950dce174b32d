"""`projections.fold_state.KeySet` (also `bulk.KeySet`), the bulk replay's compact set of applied dedup keys, behaves as a set of str."""

from __future__ import annotations

from projections.bulk import KeySet


def test_keyset_is_a_set_of_the_keys_it_was_given():
    keys = ["j1:transcode:1:Heartbeat:1", "j1:transcode:1:Heartbeat:2", "j2:transcode:1:Heartbeat:1",
            "plain-key", "j1:", ":leading", "j3:a:b:c"]
    found = KeySet()
    for key in keys + keys[:3]:  # adding again changes nothing
        found.add(key)
    assert len(found) == len(keys)
    assert sorted(found) == sorted(keys)
    for key in keys:
        assert key in found
    for absent in ("j1:transcode:1:Heartbeat:3", "j2:transcode:1:Heartbeat:2", "plain", "j1", "j4:a:b:c", "j1:x"):
        assert absent not in found
    # The part after the job id is stored once for every job that shares it.
    assert found.rests["transcode:1:Heartbeat:1"] is next(r for r in found.by_head["j2"])
