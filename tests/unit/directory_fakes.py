"""A Directory shard as a `distkv.directory.client.ShardClient` whose calls the test answers (no Ray)."""

from concurrent.futures import Future

from distkv.directory.state import DirectoryState
from distkv.directory.wire import decode_changes, decode_stored, encode_answer


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4 + b"\0\0\0\0"


class Clock:
    """A clock the test moves by hand (`now`)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class ShardDown(Exception):
    pass


class FakeShard:
    """A shard: its calls wait in `calls` until `answer` runs them on `state`, as the actor would."""

    def __init__(self) -> None:
        self.state = DirectoryState()
        self.calls: list[tuple[str, tuple, Future]] = []
        self.cancelled: list[Future] = []
        self.closed = False
        self.up = True

    def register(self, info, seq, stored, namespace) -> Future:
        return self._call("register", info, seq, stored, namespace)

    def publish(self, replica_id, seq, changes, report, namespace) -> Future:
        return self._call("publish", replica_id, seq, changes, report, namespace)

    def publish_many(self, items, namespace) -> Future:
        return self._call("publish_many", items, namespace)

    def unregister(self, replica_id, namespace) -> Future:
        return self._call("unregister", replica_id, namespace)

    def changes(self, cursor, timeout_s, namespace, follower) -> Future:
        return self._call("changes", cursor, timeout_s, namespace, follower)

    def query(self, keys, namespace) -> Future:
        return self._call("query", keys, namespace)

    def cancel(self, future: Future) -> None:
        self.cancelled.append(future)

    def close(self) -> None:
        self.closed = True

    def _call(self, method: str, *args) -> Future:
        future: Future = Future()
        self.calls.append((method, args, future))
        return future

    def in_flight(self) -> list[str]:
        """The methods of the calls not answered yet, in order."""
        return [method for method, _, _ in self.calls]

    def answer(self, methods=("register", "publish", "publish_many", "unregister", "changes", "query")) -> list[str]:
        """Run (or, when down, fail) the calls in flight of `methods`, in order; their names."""
        answered = []
        for call in [c for c in self.calls if c[0] in methods]:
            self.calls.remove(call)
            method, args, future = call
            answered.append(method)
            if not self.up:
                future.set_exception(ShardDown("the shard is down"))
                continue
            future.set_result(getattr(self, "_" + method)(*args))
        return answered

    def _register(self, info, seq, stored, namespace):
        self.state.register(info)
        self.state.publish(info.replica_id, seq, decode_stored(stored, "register"), ())
        return self.state.epoch, True, self.state.publish_interval()

    def _publish(self, replica_id, seq, changes, report, namespace):
        stored, removed = decode_changes(changes, "publish")
        known = self.state.publish(replica_id, seq, stored, removed)
        if known and report is not None:
            self.state.set_report(replica_id, report)
        return self.state.epoch, known, self.state.publish_interval()

    def _publish_many(self, items, namespace):
        return self.state.epoch, self.state.publish_relayed(items), self.state.publish_interval()

    def _unregister(self, replica_id, namespace):
        return self.state.unregister(replica_id)

    def _changes(self, cursor, timeout_s, namespace, follower):
        return self.state.packed_changes(cursor)

    def _query(self, keys, namespace):
        return encode_answer(*self.state.answer(keys))

    def held_by(self, replica_id: str) -> dict[bytes, tuple[int, int]]:
        entries = [e for e in self.state.changes(None).entries if e[0] == replica_id]
        return {k: (row, gen) for _, _, stored, _ in entries for k, row, gen in stored}
