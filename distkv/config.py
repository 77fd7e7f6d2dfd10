"""distkv's settings, read from vLLM's ``kv_connector_extra_config``, and the cache namespace.

Every key is checked at start: an unknown key or a bad value raises a ValueError that
names the key and says what would be accepted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

POLICIES = ("lru", "arc")
STORE_POLICIES = ("always", "dedupe")
TRANSPORTS = ("auto", "nixl", "object_store")
# how a replica learns what others hold (distkv.directory.link.DirectoryLink's `view`)
DIRECTORY_VIEWS = ("auto", "push", "query")
# The format of what crosses between a replica and its Directory (distkv.directory.wire). A
# part of the cache namespace: replicas and shards of different formats never meet, and a
# rolling upgrade across a change of it runs the two side by side, each in a namespace of
# its own (docs/operations.md, "Rolling upgrades").
DIRECTORY_FORMAT = 2

# Keys that vLLM's OffloadingConnector itself reads from the same dict.
CONNECTOR_KEYS = frozenset({"spec_name", "spec_module_path", "block_size"})


@dataclass(frozen=True)
class DistkvConfig:
    """The settings of one replica's offloading."""

    # host pool per replica, in bytes
    cpu_bytes_to_use: int = 1 << 30
    # "lru" or "arc"
    eviction_policy: str = "lru"
    # mixed into the cache namespace: replicas with different salts never share blocks
    tenant_salt: str = ""
    # Ray cluster to join ("auto", "ray://...", "host:port"); None starts an embedded local one
    ray_address: str | None = None
    # "always": every replica keeps what it computes; "dedupe": skip blocks another replica holds
    store_policy: str = "always"
    # a promotion not done by then is a miss
    promotion_timeout_s: float = 5.0
    # Directory actors the keys are spread over
    directory_shards: int = 1
    # how blocks come from other nodes: "object_store", "nixl" (one-sided reads), or "auto"
    # (NIXL toward a node where it measured faster than the object store)
    transport: str = "auto"
    # how the replica learns what others hold: "push" (follow every shard's changes), "query"
    # (ask on a miss), or "auto" (push while the namespace is small, query beyond)
    directory_view: str = "auto"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "DistkvConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - CONNECTOR_KEYS, key=repr)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config key(s) {unknown}; distkv reads {sorted(known)}"
            )
        values = {k: extra[k] for k in known if k in extra}
        if "cpu_bytes_to_use" in values:
            v = values["cpu_bytes_to_use"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 or int(v) != v:
                raise ValueError(
                    f"kv_connector_extra_config 'cpu_bytes_to_use'={v!r} must be a positive "
                    "whole number of bytes"
                )
            values["cpu_bytes_to_use"] = int(v)
        if "eviction_policy" in values and values["eviction_policy"] not in POLICIES:
            raise ValueError(
                f"kv_connector_extra_config 'eviction_policy'={values['eviction_policy']!r} "
                f"must be one of {list(POLICIES)}"
            )
        for key in ("tenant_salt", "ray_address"):
            if key in values and not isinstance(values[key], str) and not (key == "ray_address" and values[key] is None):
                raise ValueError(f"kv_connector_extra_config {key!r}={values[key]!r} must be a string")
        if "store_policy" in values and values["store_policy"] not in STORE_POLICIES:
            raise ValueError(
                f"kv_connector_extra_config 'store_policy'={values['store_policy']!r} "
                f"must be one of {list(STORE_POLICIES)}"
            )
        if "promotion_timeout_s" in values:
            v = values["promotion_timeout_s"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(
                    f"kv_connector_extra_config 'promotion_timeout_s'={v!r} must be a positive number of seconds"
                )
            values["promotion_timeout_s"] = float(v)
        if "directory_shards" in values:
            v = values["directory_shards"]
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1024:
                raise ValueError(
                    f"kv_connector_extra_config 'directory_shards'={v!r} must be a whole number in 1..1024"
                )
        if "transport" in values and values["transport"] not in TRANSPORTS:
            raise ValueError(
                f"kv_connector_extra_config 'transport'={values['transport']!r} must be one of {list(TRANSPORTS)}"
            )
        if "directory_view" in values and values["directory_view"] not in DIRECTORY_VIEWS:
            raise ValueError(
                f"kv_connector_extra_config 'directory_view'={values['directory_view']!r} "
                f"must be one of {list(DIRECTORY_VIEWS)}"
            )
        return cls(**values)


# Settings of an engine's model (the fields of vLLM's ModelConfig) that change no KV byte a
# prompt produces: left out of the cache namespace, so that replicas differing only in them
# share. Every other setting counts, one a later vLLM adds included. docs/configuration.md
# says why each is out.
MODEL_SETTINGS_OUTSIDE_KV = frozenset(
    {
        # text to token ids: a block's key is the token ids up to it
        "tokenizer", "tokenizer_mode", "tokenizer_revision", "skip_tokenizer_init",
        # after the last hidden state: sampling, logprobs, logits and pooling heads
        "seed", "generation_config", "override_generation_config", "max_logprobs", "logprobs_mode",
        "use_fp64_gumbel", "return_sampling_mask", "enable_trace_replay", "logits_processors", "pooler_config",
        # naming, credentials, request input handling
        "served_model_name", "hf_token", "allowed_local_media_path", "allowed_media_domains",
        "io_processor_plugin", "renderer_num_workers", "enable_prompt_embeds",
        # the multimodal front end (its language_model_only counts: distkv.vllm.vllm_model_settings)
        "multimodal_config",
        # how kernels run, not what they compute; memory management; permissions
        "enforce_eager", "disable_cascade_attn", "enable_sleep_mode", "sleep_preserve_parameter_names",
        "sleep_mode_backend", "sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend", "enable_cumem_allocator",
        "allow_deprecated_quantization",
        # a draft model's, not this model's
        "spec_target_max_model_len",
        # the model's name: KVIdentity.model
        "model",
    }
)


# How the model's Hugging Face config is found, parsed and edited: where the engine reports
# that config itself (`hf_config`), it counts instead, whatever made it (a callable override
# included).
HF_CONFIG_SOURCES = frozenset({"hf_config_path", "config_format", "hf_overrides"})


def model_settings(settings: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """KVIdentity.model_settings of an engine's model `settings` (name -> value): each one
    but MODEL_SETTINGS_OUTSIDE_KV (and HF_CONFIG_SOURCES beside an `hf_config`), its value
    as canonical JSON, in name order."""
    outside = MODEL_SETTINGS_OUTSIDE_KV | (HF_CONFIG_SOURCES if "hf_config" in settings else frozenset())
    return tuple(
        (name, json.dumps(value, sort_keys=True, default=str))
        for name, value in sorted(settings.items())
        if name not in outside
    )


@dataclass(frozen=True)
class KVIdentity:
    """What makes two replicas' KV bytes interchangeable: a block stored by one is loaded by
    the other only if every field is equal. Each engine adapter fills it from its engine's
    configuration; a field its engine does not report stays None (or empty), for every
    replica of that engine alike.
    """

    # the model's name
    model: str | None
    # the KV cache's dtype
    dtype: str
    # tokens per GPU block of each KV-cache group, context parallelism included
    group_block_tokens: tuple[int, ...]
    # GPU blocks per offloaded block (vLLM 0.33's blocks_per_chunk, the seed's block_size_factor)
    blocks_per_chunk: int
    # the parallel layout's sizes, in the order the adapter lists them
    parallel: tuple[int, ...]
    # bytes of one GPU block of each group on one worker, all its layers (the seed's spec)
    group_page_bytes: tuple[int, ...] | None = None
    # KV bytes one worker stores per GPU block (vLLM 0.33)
    worker_kv_bytes_per_block: int | None = None
    # the KV cache's layout name (vLLM 0.33)
    kv_cache_layout: str | None = None
    # tokens per block hash (vLLM 0.33)
    tokens_per_hash: int | None = None
    # a digest of the seed the engine chains its block hashes from: another seed, other keys
    prefix_hash_seed: str | None = None
    # what else of the engine's model changes the KV bytes a prompt produces: its weights
    # (revision and resolved snapshot, dtype, quantization), its configuration after
    # overrides, ... as `model_settings` gives them
    model_settings: tuple[tuple[str, str], ...] = ()
    # How a pool row holds a block: None in distkv's spec (a slot per worker rank, in its
    # handlers' page order); in its vLLM tier, the bytes of vLLM's primary-tier chunk, named
    # by their layout (distkv.vllm_tier.primary_chunk_format)
    chunk_format: str | None = None


# a setting's value longer than this is logged as its digest (a model's whole configuration)
_LOGGED_VALUE_CHARS = 80


def namespace_inputs(identity: KVIdentity, tenant_salt: str) -> str:
    """What the cache namespace digests, as a replica logs it at start: every field of
    `identity`, long values as their digests, and whether a tenant salt is set (never the salt)."""

    def shown(items: Iterable[tuple[str, Any]]) -> str:
        parts = []
        for name, value in items:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if len(text) > _LOGGED_VALUE_CHARS:
                text = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
            parts.append(f"{name}={text}")
        return ", ".join(parts)

    kv_fields = [(name, value) for name, value in asdict(identity).items() if name != "model_settings"]
    return (
        f"{shown(kv_fields)}, model_settings=[{shown(identity.model_settings)}], "
        f"tenant_salt={'set' if tenant_salt else 'none'}"
    )


def cache_namespace(identity: KVIdentity, tenant_salt: str = "") -> str:
    """The cache namespace: a short digest of `identity` and the tenant salt. Replicas share
    blocks only within one namespace."""
    canonical = json.dumps(
        {"kv": asdict(identity), "salt": tenant_salt, "directory": DIRECTORY_FORMAT}, sort_keys=True, default=str
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
