"""distkv runs without vLLM; its vLLM adapter says how to get vLLM when it is missing."""

import subprocess
import sys

BLOCK_VLLM = """
import sys
class BlockVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, BlockVllm())
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_VLLM + code], capture_output=True, text=True, timeout=120)


def test_distkv_imports_without_vllm():
    result = run(
        "import distkv, distkv.replica.specs, distkv.replica.cluster_manager, distkv.storage.handlers, distkv.config\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr


def test_the_vllm_adapter_names_the_extra_to_install():
    result = run(
        "try:\n"
        "    import distkv.vllm\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('imported without vLLM')\n"
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'ray-distkv[vllm]'" in result.stdout
