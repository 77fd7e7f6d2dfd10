"""Two real vLLM Schedulers share blocks only when their KV bytes are interchangeable.

vLLM's block hashes cover the tokens only: two deployments of one model name whose weights
or configuration differ compute other KV bytes for the same prompt. Replica A computes a
prefix; replica B, of the same name and KV format but differing in one setting that changes
the KV bytes (its revision, weights dtype, quantization, config overrides, ...), joins once
A's blocks are in the Directory and must share nothing: no hit, no retry, no promotion. A
replica of A's configuration, or one that differs only in settings that change no KV byte,
still loads A's blocks, exact.
"""

import logging
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import ray  # noqa: E402
from huggingface_hub._revision import ResolvedRevision  # noqa: E402
from replica_engine import DISTKV_EXTRA, GPU_BLOCK_TOKENS, EngineReplica, kv_cache_config, vllm_config  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402

from distkv.directory.wire import decode_answer  # noqa: E402
from distkv import vllm as distkv_vllm  # noqa: E402
from ray_actors.directory import get_or_create_shards, kill_shards  # noqa: E402

PREFIX_TOKENS = 1024
CHUNK_TOKENS = 64  # extra_config block_size: 4 GPU blocks per offloaded block

# A's configuration: the test's defaults (float16 weights, float16 KV), or an fp8 KV cache,
# under which weights of another dtype give the same KV dtype.
BASES = {"float16 KV": {}, "fp8 KV": {"cache": {"cache_dtype": "fp8"}}}
# (what B changes, A's base, B's settings beside the base's)
DIFFERENT = [
    ("revision", "float16 KV", {"model": {"revision": "v2"}}),
    ("weights dtype", "fp8 KV", {"model": {"dtype": "bfloat16"}}),
    # set once the config is built: vLLM's fp8 method imports compressed-tensors, which the
    # CPU install of vLLM lacks; the spec reads the same field a serving engine's has
    ("quantization", "float16 KV", {"built": {"quantization": "fp8"}}),
    ("hf_overrides", "float16 KV", {"model": {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}}),
    ("max_model_len", "float16 KV", {"model": {"max_model_len": 4096}}),
    ("disable_sliding_window", "float16 KV", {"model": {"disable_sliding_window": True}}),
    ("code_revision", "float16 KV", {"model": {"code_revision": "c2"}}),
    ("trust_remote_code", "float16 KV", {"model": {"trust_remote_code": True}}),
    ("model_weights", "float16 KV", {"model": {"model_weights": "s3://bucket/merged-lora"}}),
    ("model_impl", "float16 KV", {"model": {"model_impl": "transformers"}}),
    ("kv_cache_dtype_skip_layers", "fp8 KV", {"cache": {"kv_cache_dtype_skip_layers": ["layer"]}}),
]
# Settings that change no KV byte: replicas differing only in them share.
NOT_KV = {
    "model": {"seed": 7, "served_model_name": "canary", "max_logprobs": 5, "enforce_eager": True,
              "generation_config": "vllm", "override_generation_config": {"temperature": 0.5}},
}


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 50_000, n).tolist()


PREFIX = tokens(0, PREFIX_TOKENS)


class Replicas:
    """The module's replicas, all of one tenant salt; A of each base made once, on first use."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.salt = uuid.uuid4().hex
        self.made: list[EngineReplica] = []
        self._holders: dict[str, EngineReplica] = {}

    def make(self, model=None, cache=None, built=None) -> EngineReplica:
        config = {**DISTKV_EXTRA, "block_size": CHUNK_TOKENS, "cpu_bytes_to_use": 8 << 20, "tenant_salt": self.salt}

        def configure(vllm_config):
            for name, value in (built or {}).items():
                setattr(vllm_config.model_config, name, value)

        self.made.append(EngineReplica(self.model_dir, config, model=model, cache=cache, configure=configure))
        return self.made[-1]

    def holder(self, base: str) -> EngineReplica:
        """A of `base`, once its prefix's blocks are all in the Directory."""
        if base not in self._holders:
            a = self.make(**BASES[base])
            a.add("a0", PREFIX + tokens(1, 100))
            a.run()
            assert a.preloaded["a0"][1]
            namespace = a.manager.cluster.link.namespace
            (shard,) = get_or_create_shards(namespace, 1)
            stored = a.manager.cluster.local.ready_keys()
            assert len(stored) >= PREFIX_TOKENS // CHUNK_TOKENS
            # how soon A's stores reach the Directory is not under test: the bound only
            # keeps a broken link from hanging the suite
            deadline = time.monotonic() + 60
            while not all(decode_answer(ray.get(shard.query.remote(stored, namespace), timeout=60), len(stored))[0]):
                assert time.monotonic() < deadline, "A's blocks never reached the Directory"
                time.sleep(0.01)
            self._holders[base] = a
        return self._holders[base]

    def close(self) -> None:
        namespaces = {r.manager.cluster.link.namespace for r in self.made}
        for r in self.made:
            r.shutdown()
        for namespace in namespaces:
            kill_shards(namespace)


@pytest.fixture(scope="module")
def replicas(ray_session, model_dir):
    made = Replicas(model_dir)
    yield made
    made.close()


def serve_prefix(replica: EngineReplica, req_id: str) -> tuple[list[int | None], tuple[int, bool]]:
    replica.add(req_id, PREFIX + tokens(2, 100))
    replica.run()
    return replica.matched[req_id], replica.preloaded[req_id]


@pytest.mark.parametrize("base", list(BASES))
def test_a_replica_of_the_same_configuration_shares(replicas, base, caplog):
    a = replicas.holder(base)
    caplog.clear()  # A's join logs too where an earlier test left distkv's loggers at INFO
    with caplog.at_level(logging.INFO, logger="distkv.replica.join"):
        c = replicas.make(**BASES[base])
    assert c.manager.cluster.link.namespace == a.manager.cluster.link.namespace
    answers, (loaded, exact) = serve_prefix(c, f"c-{base}")
    assert answers[0] is None and answers[-1] >= PREFIX_TOKENS - GPU_BLOCK_TOKENS
    assert loaded >= PREFIX_TOKENS - GPU_BLOCK_TOKENS and exact
    # the replica logs what its namespace digests, the tenant salt only as set
    (joined,) = [r.getMessage() for r in caplog.records if "joins cache namespace" in r.getMessage()]
    assert "model_settings=[" in joined and "revision=null" in joined and "tenant_salt=set" in joined
    assert replicas.salt not in joined


def test_a_replica_differing_only_in_settings_that_change_no_kv_byte_shares(replicas):
    a = replicas.holder("float16 KV")
    c = replicas.make(**NOT_KV)
    assert c.manager.cluster.link.namespace == a.manager.cluster.link.namespace
    answers, (loaded, exact) = serve_prefix(c, "c-not-kv")
    assert loaded >= PREFIX_TOKENS - GPU_BLOCK_TOKENS and exact


@pytest.mark.parametrize("setting, base, other", DIFFERENT, ids=[d[0] for d in DIFFERENT])
def test_a_replica_differing_in_one_setting_that_changes_kv_bytes_shares_nothing(replicas, setting, base, other):
    a = replicas.holder(base)
    b = replicas.make(
        model={**BASES[base].get("model", {}), **other.get("model", {})},
        cache={**BASES[base].get("cache", {}), **other.get("cache", {})},
        built=other.get("built"),
    )
    # B joined once A's blocks were in the Directory: in A's namespace its first lookups
    # would have found them (a retry, then a promotion)
    answers, (loaded, exact) = serve_prefix(b, f"b-{setting}")
    assert set(answers) == {0}, f"B was offered A's blocks: {answers}"
    assert loaded == 0 and exact
    assert b.manager.cluster.promoter.bytes_same_node == b.manager.cluster.promoter.bytes_cross_node == 0
    assert b.manager.cluster.link.namespace != a.manager.cluster.link.namespace


def test_the_revision_is_the_snapshot_vllm_resolved_it_to(model_dir):
    """On the Hub vLLM resolves a revision to its commit: "main" and that commit's hash are
    one snapshot, and "main" once it moved to another commit is another."""
    config = vllm_config(model_dir, DISTKV_EXTRA)

    def settings(revision):
        config.model_config.revision = revision
        return distkv_vllm.vllm_model_settings(config)

    assert settings(ResolvedRevision("c" * 40, "main")) == settings(ResolvedRevision("c" * 40, None)) == settings("c" * 40)
    assert settings(ResolvedRevision("d" * 40, "main")) != settings(ResolvedRevision("c" * 40, "main"))


def test_a_spec_built_without_vllms_connector_stops_at_start_saying_why(model_dir):
    """Built from an OffloadingConfig alone, the spec could not tell which weights it caches."""
    config = build_offloading_config(vllm_config(model_dir, {**DISTKV_EXTRA, "cpu_bytes_to_use": 1 << 20}), kv_cache_config())
    with pytest.raises(ValueError, match="must be built by vLLM's OffloadingConnector.*'kv_connector': 'OffloadingConnector'"):
        distkv_vllm.RayOffloadingSpec(config)
