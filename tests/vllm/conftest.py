"""Fixtures for tests against vLLM 0.33 on the CPU (scripts/install_vllm_cpu.sh installs it).

Test modules skip themselves with pytest.importorskip when vLLM is not importable.
"""

import json
import os

import pytest

# vLLM reads these when it is first imported.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# An OPT-125m-shaped config (smaller, with room for 8k-token prompts): vLLM reads the
# model's config.json but never its weights or tokenizer in these tests.
MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "ffn_dim": 128,
    "max_position_embeddings": 8192,
    "vocab_size": 50272,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A local model directory holding only config.json."""
    path = tmp_path_factory.mktemp("opt-tiny")
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return str(path)
