"""A pickle whose loading runs code: what an impostor on a shard's port, or a poisoned call,
would send. A test sends it where distkv reads input and asserts `EXPLODED` stays empty."""

EXPLODED: list[bool] = []


def explode() -> None:
    EXPLODED.append(True)


class Bomb:
    def __reduce__(self):
        return (explode, ())
