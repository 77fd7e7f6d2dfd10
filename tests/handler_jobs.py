"""Helpers shared by the CPU (tests/unit) and CUDA (tests/gpu) handler tests."""

from distkv.abstract import make_offload_key


def keys(n: int, tag: int = 0) -> list[bytes]:
    return [make_offload_key(tag.to_bytes(4, "big") + i.to_bytes(4, "big"), 0) for i in range(n)]


def run(handler, job_id: int, spec):
    """Submit one job, wait for it, and return its result (reported exactly once)."""
    assert handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    (result,) = handler.get_finished()
    assert result.job_id == job_id
    return result
