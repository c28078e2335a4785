"""``benchmarks/gpu.py --smoke``: the GPU check runs end to end on CPU with tiny shapes, so the
script works the first time it meets a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_smoke_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--json", str(out),
                           "--budget", "0"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "TAPLLM_GPU_BENCH_DIR": str(tmp_path / "models")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {}
    assert report["bandwidth_gbs"] > 0
    for name, rows in report["models"].items():
        for engine in ("tapllm", "tapllm-eager", "transformers"):
            assert rows[engine]["b1"] > 0, (name, engine)
        assert rows["tapllm"]["step_ms"] > 0 and rows["tapllm"]["bound_ms"] > 0
    cases = report["capture"]["cases"]
    assert set(cases) >= {"none", "last position (final)", "every block, every position", "half the batch steered",
                          "SAE top-16, one block"}
    for engine in ("tapllm", "tapllm-eager"):
        assert report["parity"][engine]["tokens_equal"] == "6/6"
        assert report["parity"][engine]["max_rel_state_error"] < 1e-4
