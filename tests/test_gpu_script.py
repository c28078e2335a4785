"""``benchmarks/gpu.py --smoke``: the GPU check runs end to end on the CPU with tiny shapes (its graph
engines on the CUDA backend there), as on a bare GPU machine: the packages such a machine lacks cannot
be imported, and the tokenizer comes from ``--tokenizer``. Its JSON has every section, every target
and the run's provenance, so the script works the first time it meets a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a machine with only torch, CUDA, triton and transformers lacks of tapllm's (and its tests') packages.
NOT_ON_A_GPU_MACHINE = ("gguf", "pydantic", "llguidance", "fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec",
                        "psutil", "accelerate", "pyarrow", "datasets", "ray", "matplotlib", "openai", "jsonschema")
# None in sys.modules: ``import`` fails and ``importlib.util.find_spec`` finds nothing, as where not installed.
RUN = ("import runpy, sys\n"
       "for name in {missing!r}:\n"
       "    sys.modules[name] = None\n"
       "sys.argv = {argv!r}\n"
       "runpy.run_path(sys.argv[0], run_name='__main__')\n")
PATHS = ("plain", "tapped", "steered")
TARGETS = {"parity.float32.plain.tokens", "parity.float32.plain.error", "parity.float32.tapped.tokens",
           "parity.float32.tapped.error", "parity.float32.steered.tokens", "parity.float32.steered.error",
           "speed.small.step_over_bound", "speed.large.step_over_bound", "speed.small.b16_vs_transformers",
           "speed.small.b64_vs_transformers", "speed.large.b256_tok_s", "capture.last position (final)",
           "capture.mean over the prompt, 3 blocks", "capture.3 blocks, every position",
           "capture.every block, every position", "capture.half the batch steered", "capture.SAE top-16, one block",
           "serving.eager_share", "serving.tapped_over_plain", "moe.parity.tokens", "moe.parity.error",
           "moe.eager_decode_steps", "moe.b16_vs_transformers", "moe.b64_vs_transformers",
           "graphs.captures_after_warmup"}


def test_gpu_check_smoke_runs_every_section(tmp_path, default_model_folder):
    out = tmp_path / "gpu.json"
    argv = [str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--json", str(out), "--budget", "0",
            "--tokenizer", str(default_model_folder)]
    proc = subprocess.run([sys.executable, "-c", RUN.format(missing=NOT_ON_A_GPU_MACHINE, argv=argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TAPLLM_GPU_BENCH_DIR": str(tmp_path / "models")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["skipped"] == {}
    for key in ("device", "torch", "cuda", "triton", "transformers", "date", "commit"):
        assert key in report, key
    assert report["smoke"] and report["transformers"] and report["date"]
    assert report["bandwidth_gbs"] > 0

    # parity: both dtypes, every path through graphs only; float32 equal to transformers and the eager step
    for dtype in ("float32", "bfloat16"):
        for path in PATHS:
            row = report["parity"][dtype][path]
            for key in ("tokens_equal", "tokens_vs_eager", "eager_tokens_equal", "max_rel_error",
                        "eager_max_rel_error", "vs_eager_max_rel_error"):
                assert key in row, (dtype, path, key)
            assert row["graph_steps"] > 0 and row["eager_steps"] == {}, (dtype, path)
    for path in PATHS:
        row = report["parity"]["float32"][path]
        for key in ("tokens_equal", "tokens_vs_eager", "eager_tokens_equal"):
            done, total = row[key].split("/")
            assert done == total, (path, key, row[key])
        assert row["max_rel_error"] < 1e-4 and row["eager_max_rel_error"] < 1e-4, path

    # speed: two shapes, three engines
    assert len(report["models"]) == 2
    for name, rows in report["models"].items():
        for engine in ("tapllm", "tapllm-eager", "transformers"):
            assert rows[engine]["b1"] > 0, (name, engine)
        assert rows["tapllm"]["step_ms"] > 0 and rows["tapllm"]["bound_ms"] > 0
        assert rows["tapllm"]["graphs"] > 0 and rows["tapllm"]["graph_capture_s"] is not None
        assert "b1_vs_transformers" in rows["tapllm"]
    for name, engine in report["graph_engines"].items():
        assert engine["captures_after_warmup"] == 0 and engine["graph_steps"] > 0, name

    # the decode step's split, capture costs, serving
    for row in report["step_split"]["rows"].values():
        assert row["steps"] > 0 and 0 < row["replay_ms"] <= row["step_ms"] and row["outside_replay_ms"] >= 0
    cases = report["capture"]["cases"]
    assert set(cases) == {"none", *(t.split(".", 1)[1] for t in TARGETS if t.startswith("capture."))}
    assert all(row["tok_s"] > 0 and isinstance(row["cost_pct"], float) for row in cases.values())
    assert report["capture"]["steps"]["eager_steps"] == {}
    serving = report["serving"]
    assert set(serving["runs"]) == {"plain", "half tapped"} and serving["tapped_over_plain"] > 0
    for run in serving["runs"].values():
        assert run["output_tokens"] > 0 and run["itl_p50_ms"] > 0 and run["itl_p99_ms"] >= run["itl_p50_ms"]
        assert run["eager_share"] == 0 and run["captures_after_warmup"] == 0 and run["replays"].get("mixed", 0) >= 0
    assert any("tapped" in kind for kind in serving["runs"]["half tapped"]["replays"])

    # mixture of experts: both families through the fused kernels in graphs, equal to transformers and eager
    moe = report["moe"]
    for family in ("mixtral", "qwen3_moe"):
        rows = moe["parity"][family]
        assert rows["fused_kernels"], family
        for path in ("plain", "router", "ban"):
            row = rows[path]
            for key in ("tokens_equal", "tokens_vs_eager"):
                if key in row:
                    done, total = row[key].split("/")
                    assert done == total, (family, path, key, row[key])
            assert row["decode_graph_steps"] > 0 and row["eager_decode_steps"] == {} and row["eager_steps"] == {}
            assert row.get("max_rel_error", 0) < 1e-4, (family, path)
        assert rows["ban"]["ban_held"] and rows["ban"]["changed_vs_plain"] != "0/3"
    speed = moe["speed"]["rows"]
    assert speed["tapllm"]["b1"] > 0 and speed["transformers"]["b1"] > 0 and speed["tapllm"]["fused_kernels"]
    assert speed["tapllm"]["step_ms"] > 0 and speed["tapllm"]["active_gb"] > 0
    assert "b1_vs_transformers" in speed["tapllm"]
    assert speed["tapllm"]["eager_decode_steps"] == {} and speed["tapllm"]["captures_after_warmup"] == 0

    # targets: every one, with its value and a verdict
    assert {t["id"] for t in report["targets"]} == TARGETS
    for t in report["targets"]:
        assert set(t) == {"id", "label", "value", "want", "status"} and t["status"] in ("PASS", "MISS", "NOT MEASURED")
        if t["id"].startswith(("parity.", "moe.parity.")) or t["id"] in ("graphs.captures_after_warmup",
                                                                            "moe.eager_decode_steps"):
            assert t["status"] == "PASS", t
    assert "== targets" in proc.stdout
