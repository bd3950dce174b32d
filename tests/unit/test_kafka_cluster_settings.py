"""The local Kafka cluster's layout and the topics' replication, from the settings (issue 24 item 1)."""

from __future__ import annotations

from pathlib import Path

from tapeline.settings import Settings
from tapeline.home import HomePaths
from devstack.kafka_nodes import _server_properties, kafka_nodes


def test_one_broker_by_default_replicates_nothing():
    settings = Settings(kafka_bootstrap="127.0.0.1:19092", kafka_controller_port=19093)
    assert settings.kafka_nodes == [(1, "127.0.0.1", 19092, 19093)]
    assert settings.kafka_bootstrap_servers == "127.0.0.1:19092"
    assert (settings.replication_factor, settings.min_insync_replicas) == (1, 1)


def test_three_brokers_take_every_other_port_and_replicate_as_production():
    settings = Settings(kafka_bootstrap="127.0.0.1:19092", kafka_controller_port=19093, kafka_brokers=3)
    assert settings.kafka_nodes == [(1, "127.0.0.1", 19092, 19093), (2, "127.0.0.1", 19094, 19095),
                                    (3, "127.0.0.1", 19096, 19097)]
    assert settings.kafka_bootstrap_servers == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    assert (settings.replication_factor, settings.min_insync_replicas) == (3, 2)
    five = Settings(kafka_brokers=5)
    assert (five.replication_factor, five.min_insync_replicas) == (3, 2)


def test_a_bootstrap_list_given_is_used_as_it_is_and_replication_can_be_named():
    settings = Settings(kafka_bootstrap="a:9092,b:9092", kafka_brokers=3, topic_replication_factor=2,
                        topic_min_insync_replicas=1)
    assert settings.kafka_bootstrap_servers == "a:9092,b:9092"
    assert (settings.replication_factor, settings.min_insync_replicas) == (2, 1)


def test_each_node_has_its_own_files_and_every_node_votes():
    settings = Settings(kafka_bootstrap="127.0.0.1:19092", kafka_controller_port=19093, kafka_brokers=3)
    nodes = kafka_nodes(settings, HomePaths(Path("/h")))
    assert [n.dir for n in nodes] == [Path("/h/kafka/node-1"), Path("/h/kafka/node-2"), Path("/h/kafka/node-3")]
    text = _server_properties(settings, nodes[1], nodes)
    lines = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert lines["node.id"] == "2"
    assert lines["controller.quorum.voters"] == "1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097"
    assert lines["listeners"] == "PLAINTEXT://127.0.0.1:19094,CONTROLLER://127.0.0.1:19095"
    assert lines["log.dirs"] == "/h/kafka/node-2/data"
    assert (lines["default.replication.factor"], lines["min.insync.replicas"], lines["transaction.state.log.min.isr"],
            lines["offsets.topic.replication.factor"], lines["unclean.leader.election.enable"]) == ("3", "2", "2", "3", "false")
    single = Settings(kafka_bootstrap="127.0.0.1:19092", kafka_controller_port=19093)
    one = kafka_nodes(single, HomePaths(Path("/h")))
    assert one[0].dir == Path("/h/kafka") and one[0].data == Path("/h/kafka/data")  # the one-node layout as before
    lines = dict(line.split("=", 1) for line in _server_properties(single, one[0], one).splitlines()
                 if "=" in line and not line.startswith("#"))
    assert (lines["controller.quorum.voters"], lines["min.insync.replicas"]) == ("1@127.0.0.1:19093", "1")
