"""Security: pools private to their user, names that never collide, calls refused across
cache namespaces, Ray token authentication left on in every cluster distkv starts."""

import dataclasses
import os
import re
import stat
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distkv.config import KVIdentity, cache_namespace
from distkv.directory.wire import check_namespace
from distkv.names import check_pool_namespace, replica_name, segment_name
from distkv.storage.pool import HostPool, PoolLayout
from distkv.replica.specs import LocalOffloadingSpec

ROOT = Path(__file__).resolve().parents[2]
NAME_CHARS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.", min_size=1, max_size=12)


def test_segment_is_0600_and_owned_by_the_running_user_whatever_the_umask():
    old = os.umask(0)
    try:
        pool = HostPool(f"distkv-sec{uuid.uuid4().hex[:8]}-r", PoolLayout(4, 1, 4096))
    finally:
        os.umask(old)
    try:
        st_ = os.stat(pool.path)
        assert stat.S_IMODE(st_.st_mode) == 0o600
        assert st_.st_uid == os.getuid()
    finally:
        pool.close()


@settings(max_examples=300)
@given(NAME_CHARS, NAME_CHARS, NAME_CHARS, NAME_CHARS)
def test_segment_names_of_different_namespaces_or_replicas_never_collide(ns1, r1, ns2, r2):
    if (ns1, r1) != (ns2, r2):
        assert segment_name(ns1, r1) != segment_name(ns2, r2)


@settings(max_examples=300)
@given(st.text(min_size=1, max_size=16), st.text(min_size=1, max_size=16))
def test_engine_ids_map_to_distinct_replica_names(a, b):
    """Every engine id gives a valid pool name part, and two ids never the same one."""
    for engine_id in (a, b):
        segment_name("0123456789abcdef", replica_name(engine_id))
    if a != b:
        assert replica_name(a) != replica_name(b)


def test_engines_whose_ids_differ_only_in_punctuation_get_different_pools():
    pools = {
        LocalOffloadingSpec.from_layout({}, gpu_block_sizes=[16], group_page_bytes=[4096], engine_id=e).pool_name
        for e in ("engine-1", "engine_1", "engine.1", "engine 1")
    }
    assert len(pools) == 4


def test_replicas_that_name_no_engine_id_never_share_one_but_a_replicas_processes_do():
    """Without an engine_id every replica was "engine-0": replicas on different nodes were
    one replica to the Directory. Each now gets a fresh id, kept in its configuration, so
    that its scheduler and workers (handed the same configuration) still meet in one pool."""
    a, b = (LocalOffloadingSpec.from_layout({}, gpu_block_sizes=[16], group_page_bytes=[4096]) for _ in range(2))
    assert a.replica_id != b.replica_id and a.pool_name != b.pool_name
    worker = LocalOffloadingSpec(a.vllm_config, a.kv_cache_config)
    assert worker.replica_id == a.replica_id and worker.pool_name == a.pool_name


@settings(max_examples=100)
@given(st.text(max_size=8), st.text(max_size=8))
def test_tenant_salts_give_different_namespaces(s1, s2):
    kv = KVIdentity(model="m", dtype="bf16", group_block_tokens=(16,), blocks_per_chunk=1, parallel=(1,))
    assert (cache_namespace(kv, s1) == cache_namespace(kv, s2)) == (s1 == s2)


def test_every_field_of_the_kv_identity_is_part_of_the_namespace():
    """Replicas that differ in anything that makes their bytes differ never share a namespace."""
    kv = KVIdentity(model="m", dtype="bf16", group_block_tokens=(16,), blocks_per_chunk=1, parallel=(1,))
    others = {
        "model": "m2", "dtype": "fp8", "group_block_tokens": (32,), "blocks_per_chunk": 4, "parallel": (2,),
        "group_page_bytes": (4096,), "worker_kv_bytes_per_block": 4096, "kv_cache_layout": "HND",
        "tokens_per_hash": 16, "prefix_hash_seed": "ab", "model_settings": (("revision", '"v2"'),),
        "chunk_format": "vllm-primary-direct",
    }
    assert set(others) == {f.name for f in dataclasses.fields(KVIdentity)}
    namespaces = {cache_namespace(dataclasses.replace(kv, **{name: value})) for name, value in others.items()}
    assert len(namespaces | {cache_namespace(kv)}) == len(others) + 1


def test_calls_for_another_namespace_are_refused():
    check_namespace("aaaa", "aaaa", "shard")
    with pytest.raises(ValueError, match="serves cache namespace 'aaaa' and refuses a call for namespace 'bbbb'"):
        check_namespace("aaaa", "bbbb", "shard")
    with pytest.raises(ValueError, match="refuses a call for namespace None"):
        check_namespace("aaaa", None, "shard")  # a caller must say which namespace it is of

    check_pool_namespace(segment_name("aaaa", "r1"), "aaaa")
    with pytest.raises(ValueError, match="belongs to cache namespace 'bbbb', not to 'aaaa'"):
        check_pool_namespace(segment_name("bbbb", "r1"), "aaaa")
    for bad in ("../etc/passwd", "distkv-aaaa-../../x", "distkv-aaaa", "other-aaaa-r", 7, None):
        with pytest.raises(ValueError):
            check_pool_namespace(bad, "aaaa")


# ---- Ray token authentication --------------------------------------------------------

# RAY_AUTH_MODE is what Ray 2.60 reads (ray/_private/authentication); "token" is the only
# value that keeps authentication on. AUTH_MODE in a _system_config is refused by Ray
# unless "disabled", so any mention of it there is a way to turn it off.
AUTH_SETTING = re.compile(r"""(?<![A-Za-z_])(RAY_)?AUTH_MODE["']?\s*[:=]\s*["']?([A-Za-z_$\-{}]*)""")


def config_files() -> list[Path]:
    roots = [ROOT / "cluster", ROOT / "scripts", ROOT / "distkv", ROOT / "ray_actors", ROOT / ".ci"]
    return [
        p for root in roots if root.exists() for p in root.rglob("*")
        if p.is_file() and p.suffix not in (".pyc", ".png", ".json") and "__pycache__" not in p.parts
    ]


def test_no_configuration_turns_token_auth_off():
    offending = []
    for path in config_files():
        text = path.read_text(errors="replace")
        for match in AUTH_SETTING.finditer(text):
            if match.group(2).lower() != "token":
                offending.append(f"{path.relative_to(ROOT)}: {match.group(0)!r}")
        if re.search(r"unset\s+RAY_AUTH_MODE|pop\(\s*['\"]RAY_AUTH_MODE", text):
            offending.append(f"{path.relative_to(ROOT)}: clears RAY_AUTH_MODE")
    assert not offending, f"token authentication turned off in: {offending}"


def test_every_cluster_distkv_starts_has_token_auth_on():
    """A node joining with `ray start` and ray.cluster_utils.Cluster do not turn token auth on
    by themselves: whatever starts a cluster must."""
    missing = []
    for path in config_files():
        text = path.read_text(errors="replace")
        if re.search(r"\bray\s+start\b", text) and not re.search(r"RAY_AUTH_MODE[\"']?\s*[:=]\s*[\"']?token", text):
            missing.append(str(path.relative_to(ROOT)))
        if path.suffix == ".py" and re.search(r"\bCluster\(", text) and "token_auth_on()" not in text:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"clusters started without token authentication: {missing}"


def test_the_scan_sees_what_turns_auth_off():
    for line in ("export RAY_AUTH_MODE=disabled", 'env: {"RAY_AUTH_MODE": "disabled"}', "_system_config={'AUTH_MODE': 'x'}"):
        assert any(m.group(2).lower() != "token" for m in AUTH_SETTING.finditer(line)), line
    assert all(m.group(2).lower() == "token" for m in AUTH_SETTING.finditer("export RAY_AUTH_MODE=token"))
