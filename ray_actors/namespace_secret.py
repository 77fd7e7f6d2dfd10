"""The secret a cache namespace's replicas share, kept in Ray's GCS, where Ray's token guards it.

A replica's NIXL endpoint goes to the Directory sealed under a key derived from this secret
and the tenant salt (`distkv.transfer.endpoint_seal`). The first replica of a namespace creates the
secret; every later one reads it. The GCS's internal KV keeps it for the cluster's life:
one entry of SECRET_BYTES per namespace ever joined.
"""

from __future__ import annotations

from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

from distkv.transfer.endpoint_seal import SECRET_BYTES, new_secret
from distkv.names import RAY_NAMESPACE



def secret_key(namespace: str) -> str:
    """The key of cache `namespace`'s secret in the GCS's internal KV (its namespace RAY_NAMESPACE)."""
    return f"endpoint-secret-{namespace}"


def namespace_secret(namespace: str) -> bytes:
    """The secret of cache `namespace`, created if this is its first replica. Replicas that
    join at once agree: each offers a secret without overwriting and takes what the GCS kept."""
    key = secret_key(namespace)
    _internal_kv_put(key, new_secret(), overwrite=False, namespace=RAY_NAMESPACE)
    secret = _internal_kv_get(key, namespace=RAY_NAMESPACE)
    if secret is None or len(secret) != SECRET_BYTES:
        raise RuntimeError(
            f"Ray's GCS holds no {SECRET_BYTES}-byte secret under {key!r} (Ray namespace {RAY_NAMESPACE!r}) "
            "after this replica offered one: something else writes that key"
        )
    return secret
