"""Sealed NIXL endpoints: only a member of the cache namespace (its secret and its tenant
salt) opens one, only as the endpoint of the pool it was sealed for; anything else opens
to None, never to an error."""

from __future__ import annotations

import pytest

from distkv.transfer.endpoint_seal import SECRET_BYTES, EndpointSeal, new_secret
from distkv.names import segment_name
from distkv.transfer.rdma import PoolEndpoint

NAMESPACE = "0123456789abcdef"
POOL = segment_name(NAMESPACE, "replica_a")
ENDPOINT = PoolEndpoint("distkv-4242-cafe", b"UCX-RKEY:" + bytes(range(256)) * 2, 0x7F00_0000_1000, 1 << 30)
SECRET = new_secret()


@pytest.fixture
def sealed() -> bytes:
    return EndpointSeal(NAMESPACE, SECRET, "salt-a").seal(POOL, ENDPOINT)


def test_a_member_opens_what_another_member_sealed(sealed):
    assert EndpointSeal(NAMESPACE, SECRET, "salt-a").open(POOL, sealed) == ENDPOINT
    unsalted = EndpointSeal(NAMESPACE, SECRET, "")
    assert unsalted.open(POOL, unsalted.seal(POOL, ENDPOINT)) == ENDPOINT


def test_the_sealed_endpoint_shows_nothing_of_the_agent():
    seal = EndpointSeal(NAMESPACE, SECRET, "salt-a")
    sealed = seal.seal(POOL, ENDPOINT)
    assert ENDPOINT.agent_metadata[:16] not in sealed and ENDPOINT.agent_name.encode() not in sealed
    assert seal.seal(POOL, ENDPOINT) != sealed  # a fresh nonce each time


@pytest.mark.parametrize(
    "stranger",
    [
        EndpointSeal(NAMESPACE, SECRET, "salt-b"),  # Ray's token (the secret), another salt
        EndpointSeal(NAMESPACE, SECRET, ""),  # Ray's token, no salt
        EndpointSeal(NAMESPACE, new_secret(), "salt-a"),  # the salt without the namespace's secret
        EndpointSeal("fedcba9876543210", SECRET, "salt-a"),  # another namespace
    ],
    ids=["other salt", "no salt", "no secret", "other namespace"],
)
def test_a_non_member_opens_nothing(sealed, stranger):
    assert stranger.open(POOL, sealed) is None


def test_an_endpoint_opens_only_as_that_of_the_pool_it_was_sealed_for(sealed):
    assert EndpointSeal(NAMESPACE, SECRET, "salt-a").open(segment_name(NAMESPACE, "replica_b"), sealed) is None


def test_a_tampered_or_foreign_blob_opens_to_none(sealed):
    member = EndpointSeal(NAMESPACE, SECRET, "salt-a")
    for i in range(len(sealed)):
        for bit in (0x01, 0x80):
            tampered = sealed[:i] + bytes([sealed[i] ^ bit]) + sealed[i + 1 :]
            assert member.open(POOL, tampered) is None, f"byte {i} bit {bit:#x}"
    for foreign in (b"", sealed[:20], sealed + b"\x00", sealed[:-1], b"\x02" + sealed[1:], bytearray(sealed), ENDPOINT, None, 7):
        assert member.open(POOL, foreign) is None


@pytest.mark.parametrize("secret", [b"", b"\x00" * (SECRET_BYTES - 1), "x" * SECRET_BYTES, None])
def test_a_secret_of_the_wrong_size_or_type_is_refused(secret):
    with pytest.raises(ValueError, match=f"secret of cache namespace '{NAMESPACE}' must be {SECRET_BYTES} bytes"):
        EndpointSeal(NAMESPACE, secret, "")
