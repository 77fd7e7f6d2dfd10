"""scripts/gpu_check.sh where there is no GPU: it runs, and reports every part skipped."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_without_cuda_every_part_is_reported_skipped(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"tests_gpu", "transfer", "nixl_to_gpu", "seconds"}
    for part in ("tests_gpu", "transfer", "nixl_to_gpu"):
        assert report[part]["status"] == "skipped"
        assert "CUDA" in report[part]["reason"]
