"""The cache namespace covers what changes the KV bytes a prompt produces, beyond the model's
name and the KV format: the seed spec's identity carries every setting its model config
offers but those that change no KV byte; a replica's log of it never shows the tenant salt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from distkv.config import KVIdentity, model_settings, namespace_inputs
from distkv.replica.specs import LocalOffloadingSpec


def seed_namespace(**settings) -> str:
    model_config = SimpleNamespace(model="org/model", dtype="bfloat16", **settings)
    return LocalOffloadingSpec.from_layout(
        {"tenant_salt": "t"}, gpu_block_sizes=[16], group_page_bytes=[4096], model_config=model_config
    ).namespace


@pytest.mark.parametrize(
    "setting, value",
    [
        ("revision", "v2"),
        ("quantization", "fp8"),
        ("hf_overrides", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("max_model_len", 4096),
        ("code_revision", "c2"),
        ("model_weights", "s3://bucket/merged-lora"),
    ],
)
def test_a_seed_replica_whose_model_differs_in_a_kv_setting_is_another_namespace(setting, value):
    assert seed_namespace(**{setting: value}) != seed_namespace()
    assert seed_namespace(**{setting: value}) == seed_namespace(**{setting: value})


@pytest.mark.parametrize(
    "setting, value",
    [("seed", 7), ("served_model_name", "canary"), ("tokenizer", "org/other-tokenizer"), ("hf_token", "hf_secret"),
     ("max_logprobs", 5), ("enforce_eager", True)],
)
def test_settings_that_change_no_kv_byte_leave_the_namespace_alone(setting, value):
    assert seed_namespace(**{setting: value}) == seed_namespace()


def test_how_the_hf_config_was_made_counts_only_where_the_config_itself_is_not_reported():
    overrides = {"hf_overrides": {"rope_theta": 1e6}}
    assert dict(model_settings(overrides)) == {"hf_overrides": '{"rope_theta": 1000000.0}'}
    assert dict(model_settings({**overrides, "hf_config": "{...}"})) == {"hf_config": '"{...}"'}


def test_a_replica_logs_its_namespaces_inputs_but_never_the_tenant_salt():
    identity = KVIdentity(
        model="org/model", dtype="float16", group_block_tokens=(16,), blocks_per_chunk=4, parallel=(1, 1, 1),
        model_settings=model_settings({"revision": "v2", "hf_config": "x" * 500, "dtype": "torch.bfloat16"}),
    )
    logged = namespace_inputs(identity, "tenant-secret-salt")
    assert "tenant-secret-salt" not in logged and "tenant_salt=set" in logged
    assert "model=org/model, dtype=float16" in logged
    assert 'model_settings=[dtype="torch.bfloat16", hf_config=sha256:' in logged and 'revision="v2"]' in logged
    assert "x" * 81 not in logged  # a whole model config is logged as its digest
    assert namespace_inputs(identity, "").endswith("tenant_salt=none")
