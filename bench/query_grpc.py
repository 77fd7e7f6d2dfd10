"""The Directory's queries over gRPC: the library way of what `distkv.directory.query_channel` does by
hand, measured against it by `bench/query_channel.py` (docs/benchmarks.md).

Built to cost what a production version would, no less: the same request bytes (the
channel's keys) and the same typed answer (`distkv.directory.wire`), answered on the
shard's event loop (grpc.aio) by the shard's own `_answer`; both ends authenticated and every
byte protected, by mutual TLS under two self-signed certificates the shard makes per
incarnation (its own, whose key never leaves it, and one for its clients), handed out through
its Ray method (`grpc_endpoint`), the server's pinned by the client; the channel's bounds (a
request's size, a handshake deadline, the streams a connection may open, a key budget per
peer) and a deadline per call (the Querier's).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from concurrent.futures import Future

import grpc
import ray
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from distkv.directory.querier import QUERY_TIMEOUT_S
from distkv.directory import query_channel
from distkv.directory.wire import MAX_ANSWER_BYTES
from distkv.directory.query_channel import (
    HELLO_TIMEOUT_S,
    KEY_BURST,
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    KeyBudget,
    decode_keys,
    encode_keys,
)
from ray_actors.directory import FOLLOWERS_GROUP, MAX_FOLLOWERS, DirectoryShard

SERVER_NAME = "distkv-shard"
METHOD = "/distkv.Directory/Query"


def self_signed(name: str) -> tuple[bytes, bytes]:
    """(private key, certificate) in PEM, of a new P-256 key, certifying `name`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return private, certificate.public_bytes(serialization.Encoding.PEM)


# The bench asks back to back from one connection, some 100 times what a replica asks: the
# key budget of a connection (the channel's) and of a peer (gRPC's) is lifted to this, so
# that the figures are the paths' own, the budget's bookkeeping included.
BENCH_KEYS_PER_S = 1e9


class GrpcDirectoryShard(DirectoryShard.__ray_metadata__.modified_class):
    """A Directory shard that serves its queries over gRPC too, beside its channel."""

    def __init__(self, *args) -> None:
        query_channel.KEYS_PER_S = BENCH_KEYS_PER_S
        super().__init__(*args)
        self._server_key, self._server_certificate = self_signed(SERVER_NAME)
        self._client_key, self._client_certificate = self_signed("distkv-client")
        self._budgets: dict[str, KeyBudget] = {}
        self._grpc_port = self._loop.create_task(self._start_grpc())

    async def _start_grpc(self) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.server_handshake_timeout_ms", int(HELLO_TIMEOUT_S * 1000)),
                ("grpc.max_concurrent_streams", 128),
            ],
            maximum_concurrent_rpcs=MAX_CONNECTIONS,
        )
        handler = grpc.unary_unary_rpc_method_handler(self._grpc_query)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("distkv.Directory", {"Query": handler}),))
        credentials = grpc.ssl_server_credentials(
            [(self._server_key, self._server_certificate)],
            root_certificates=self._client_certificate,
            require_client_auth=True,
        )
        port = server.add_secure_port(f"{ray.util.get_node_ip_address()}:0", credentials)
        await server.start()
        self._grpc_server = server
        return port

    async def _grpc_query(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            _, keys = decode_keys(request)
        except ConnectionError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        peer = context.peer()
        budget = self._budgets.get(peer)
        if budget is None:
            budget = self._budgets[peer] = KeyBudget(query_channel.KEYS_PER_S, KEY_BURST, time.monotonic)
        while (wait_s := budget.wait_s(len(keys))) > 0:
            await asyncio.sleep(wait_s)
        try:
            return self._answer(keys)
        except Exception as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")

    async def grpc_endpoint(self, namespace: str) -> tuple[str, int, bytes, bytes, bytes]:
        """(host, port, the server's certificate, a client's key and certificate) of this
        incarnation's gRPC server, for a caller of this shard's namespace."""
        self._check(namespace)
        port = await self._grpc_port
        return ray.util.get_node_ip_address(), port, self._server_certificate, self._client_key, self._client_certificate


def start_grpc_shard(namespace: str, replica_timeout_s: float) -> ray.actor.ActorHandle:
    """A `GrpcDirectoryShard` of `namespace` on this node, as `get_or_create_shards` makes a shard."""
    actor_class = ray.remote(concurrency_groups={FOLLOWERS_GROUP: MAX_FOLLOWERS}, enable_task_events=False)(GrpcDirectoryShard)
    return actor_class.options(num_cpus=0).remote(replica_timeout_s, namespace, 0)


class GrpcQueryClient:
    """A replica process's gRPC connection to one `GrpcDirectoryShard`: `query(keys)` returns
    the Future of the shard's encoded answer, as `QueryChannel.query` does."""

    def __init__(self, actor: ray.actor.ActorHandle, namespace: str) -> None:
        host, port, server_certificate, client_key, client_certificate = ray.get(actor.grpc_endpoint.remote(namespace))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=server_certificate, private_key=client_key, certificate_chain=client_certificate
        )
        self._channel = grpc.secure_channel(
            f"{host}:{port}",
            credentials,
            options=[
                ("grpc.ssl_target_name_override", SERVER_NAME),
                ("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
            ],
        )
        self._query = self._channel.unary_unary(METHOD)

    def query(self, keys) -> Future:
        call = self._query.future(encode_keys(0, keys), timeout=QUERY_TIMEOUT_S)
        future: Future = Future()
        call.add_done_callback(lambda done: _settle(future, done))
        return future

    def close(self) -> None:
        self._channel.close()


def _settle(future: Future, call: grpc.Future) -> None:
    error = call.exception()
    if error is None:
        future.set_result(call.result())
    else:
        future.set_exception(error)
