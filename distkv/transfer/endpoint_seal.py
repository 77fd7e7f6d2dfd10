"""A replica's NIXL endpoint sealed so that only members of its cache namespace can use it.

Whoever holds a `PoolEndpoint` (its agent's metadata carries UCX's memory keys) and reaches
the node's fabric reads and writes the registered pool one-sidedly, with no check on the
holder's side. The Directory answers any Ray caller who names the namespace, and the
namespace is public (it names actors and segments), so the endpoint goes into the
Directory only sealed: AES-256-GCM under a key that only the namespace's members derive,
with the holder's pool name (its namespace and replica) as associated data, so that a
sealed endpoint opens only as the endpoint of the pool it was sealed for.

The key is HKDF-SHA256 of the namespace's secret (32 random bytes its first member
created and keeps in Ray's GCS, `ray_actors.namespace_secret`) and the tenant salt: a
member needs both, so Ray's token alone opens no endpoint of a salted namespace, and a
salt guessed from the namespace's public digest opens none without Ray's token.

Plain logic, no Ray: `EndpointSeal.open` never raises; what does not open is no endpoint.
"""

from __future__ import annotations

import os
import secrets
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from distkv.transfer.rdma import PoolEndpoint

# the namespace's secret, as its first member creates it
SECRET_BYTES = 32
_VERSION = b"\x01"
_NONCE_BYTES = 12
_TAG_BYTES = 16
_KEY_INFO = b"distkv pool endpoint v1\x00"
# agent name length, metadata length; then address and bytes of the registered segment
_LENGTHS = struct.Struct("<HI")
_SEGMENT = struct.Struct("<QQ")


def new_secret() -> bytes:
    """A namespace secret for a first member to offer."""
    return secrets.token_bytes(SECRET_BYTES)


class EndpointSeal:
    """Seals this replica's endpoint and opens those of the other members of `namespace`."""

    def __init__(self, namespace: str, secret: bytes, tenant_salt: str) -> None:
        if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
            raise ValueError(f"the secret of cache namespace {namespace!r} must be {SECRET_BYTES} bytes")
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KEY_INFO + namespace.encode()).derive(
            secret + tenant_salt.encode()
        )
        self._aead = AESGCM(key)

    def seal(self, pool_name: str, endpoint: PoolEndpoint) -> bytes:
        """`endpoint` of the pool `pool_name`, readable only by the namespace's members."""
        name = endpoint.agent_name.encode()
        plain = b"".join(
            (
                _LENGTHS.pack(len(name), len(endpoint.agent_metadata)),
                name,
                endpoint.agent_metadata,
                _SEGMENT.pack(endpoint.address, endpoint.nbytes),
            )
        )
        nonce = os.urandom(_NONCE_BYTES)
        return _VERSION + nonce + self._aead.encrypt(nonce, plain, pool_name.encode())

    def open(self, pool_name: str, sealed: object) -> PoolEndpoint | None:
        """The endpoint `seal` sealed for `pool_name`, or None for anything else: another
        namespace's or salt's, another pool's, altered, or not a sealed endpoint at all."""
        if not isinstance(sealed, bytes) or len(sealed) < 1 + _NONCE_BYTES + _TAG_BYTES or sealed[:1] != _VERSION:
            return None
        try:
            plain = self._aead.decrypt(sealed[1 : 1 + _NONCE_BYTES], sealed[1 + _NONCE_BYTES :], pool_name.encode())
        except InvalidTag:
            return None
        # authentic, so `seal` made it
        name_bytes, metadata_bytes = _LENGTHS.unpack_from(plain)
        metadata_at = _LENGTHS.size + name_bytes
        segment_at = metadata_at + metadata_bytes
        address, nbytes = _SEGMENT.unpack_from(plain, segment_at)
        return PoolEndpoint(plain[_LENGTHS.size : metadata_at].decode(), plain[metadata_at:segment_at], address, nbytes)
