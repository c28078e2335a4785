"""Start-up: what each entry point imports, and what tapllm's own imports cost next to torch's.

``benchmarks/gpu.py`` runs where only torch, transformers and triton are installed: ``import tapllm``
and ``LLM(...)`` must import none of the server's packages. The command line must parse its
arguments (and ``tapllm serve`` check its port) before importing torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Packages only some paths need: the server's, the optional extras', and transformers (a checkpoint
# read for the first time, chat templates). LLM(...) on a cached checkpoint needs none of them.
NOT_AT_START = ("transformers", "pydantic", "fastapi", "starlette", "uvicorn", "msgspec", "zmq", "gguf",
                "llguidance", "prometheus_client", "jinja2", "matplotlib", "datasets", "pyarrow", "ray", "openai")


def _python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _imported(code: str) -> list[str]:
    """The packages of ``("torch", *NOT_AT_START)`` that ``code`` left imported."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps([m for m in {('torch', *NOT_AT_START)!r} if m in sys.modules]))"
    proc = _python("-c", probe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_tapllm_and_the_command_line_parser_import_no_torch():
    code = "import tapllm, tapllm.tap.points\nfrom tapllm.cli import build_parser\nbuild_parser().parse_args(['serve'])"
    assert _imported(code) == []


def test_the_public_names_still_import_as_before():
    code = ("import tapllm\nfrom tapllm import LLM, SamplingParams, HiddenStatesSpec, Steer, SAE\n"
            "assert tapllm.LLM is LLM and tapllm.hidden_states.HiddenStatesSpec is HiddenStatesSpec\n"
            "assert set(tapllm.__all__) <= set(dir(tapllm))\n"
            "try:\n    tapllm.no_such_name\nexcept AttributeError as e:\n    print('refused', e)\n")
    proc = _python("-c", code)
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stderr[-3000:]


def test_llm_imports_neither_the_servers_packages_nor_transformers(tiny_models):
    code = (f"from tapllm import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_models['llama'])!r}, dtype='float32', kv_cache_blocks=64)\n"
            f"llm.generate('hello there', SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)")
    _imported(code)  # the first load of a checkpoint reads its config and tokenizer with transformers, once
    assert _imported(code) == ["torch"]


def _import_times(code: str) -> dict[str, int]:
    """Microseconds per top-level import of ``python -X importtime -c code`` (with its subimports)."""
    proc = _python("-X", "importtime", "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    times: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m:
            times[m[2]] = times.get(m[2], 0) + int(m[1])
    return times


def test_tapllms_own_imports_cost_a_fraction_of_torchs():
    """Everything ``from tapllm import LLM`` imports beyond torch costs at most a quarter of what torch's
    own import costs (measured in the same process, so a busy machine slows both alike; the
    collector is off so that its pauses land in neither)."""
    times = _import_times("import gc; gc.disable()\nimport torch\nfrom tapllm import LLM")
    torch_us = times.pop("torch")
    startup = {"site", "encodings", "_distutils_hack", "__editable___tapllm_0_1_0_finder"}
    ours = sum(us for name, us in times.items() if name not in startup and not name.startswith("encodings"))
    assert ours <= 0.25 * torch_us, (ours, torch_us, sorted(times.items(), key=lambda kv: -kv[1])[:10])
