"""distkv.names: each name parses back into what built it, and other names into None."""

from hypothesis import given
from hypothesis import strategies as st

from distkv.names import (
    agent_name,
    parse_agent_name,
    parse_segment_name,
    parse_shard_name,
    segment_name,
    shard_name,
)

PART = st.text(alphabet="abcdefXYZ019_.", min_size=1, max_size=12)


def test_parse_segment_name_inverts_segment_name():
    assert parse_segment_name(segment_name("0123abcd", "engine_1.x")) == ("0123abcd", "engine_1.x")
    assert parse_segment_name("some-other-pool") is None


@given(PART, PART)
def test_every_segment_name_parses_back(namespace, replica):
    assert parse_segment_name(segment_name(namespace, replica)) == (namespace, replica)


def test_names_segment_name_never_builds_are_not_segment_names():
    for name in ("distkv-ns", "distkv--r", "distkv-ns-", "distkv-ns-../x", "distkv-ns-a-b", "pool-ns-r", None, 7):
        assert parse_segment_name(name) is None, name


@given(st.text(min_size=1, max_size=12), st.integers(min_value=0, max_value=1 << 20))
def test_every_shard_name_parses_back(namespace, shard):
    assert parse_shard_name(shard_name(namespace, shard)) == (namespace, shard)


def test_other_actor_names_are_not_shard_names():
    for name in ("directory-ns", "directory-ns-", "directory-ns-x", "node-agent-abc", "directory--1"):
        assert parse_shard_name(name) is None, name


def test_agent_names_parse_back_and_others_do_not():
    assert parse_agent_name(agent_name("a" * 56)) == "a" * 56
    assert parse_agent_name(shard_name("ns", 0)) is None
