"""llama.cpp half of ``benchmarks/throughput.py``, run in llama-cpp-python's own interpreter.

llama-cpp-python compiles llama.cpp at install time and is kept in a venv of its own, so
``throughput.py`` runs this file through ``--llamacpp-python`` with a JSON job file and reads
back a JSON result file::

    python _llamacpp_worker.py JOB.json RESULT.json

The job holds ``gguf`` (the checkpoint file, read directly: its weights stay quantized as
stored), ``n_ctx``, ``threads`` and ``runs``: a list of ``{"name", "prompts", "new_tokens"}``
where each prompt is a list of token ids. The high-level ``Llama`` object serves one sequence
at a time, so a run's prompts are generated one after another (greedy, EOS ignored: exactly
``new_tokens`` each; llama-cpp-python keeps the KV of the longest prefix a prompt shares with
the one before, so every timed prompt must be fresh). The result holds, per run name, the
output tokens, the seconds, and the decode-only seconds (after each prompt's first token),
plus the peak RSS of this process. Nothing from tapllm is imported here.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from _rss import peak_rss_mib


def build_llama(job: dict[str, Any]) -> Any:
    """``llama_cpp.Llama`` over the job's GGUF file, CPU only, quiet."""
    from llama_cpp import Llama

    return Llama(
        model_path=job["gguf"],
        n_ctx=job["n_ctx"],
        n_batch=512,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_gpu_layers=0,
        seed=0,
        verbose=False,
    )


CLOCK = time.perf_counter


def generate_one(llm: Any, prompt: list[int], new_tokens: int) -> tuple[int, float, float]:
    """Greedy tokens after ``prompt`` until ``new_tokens`` (EOS does not stop ``Llama.generate``);
    returns (tokens, seconds, seconds after the first token)."""
    start = CLOCK()
    first = start
    count = 0
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        count += 1
        if count == 1:
            first = CLOCK()
        if count == new_tokens:
            break
    end = CLOCK()
    return count, end - start, end - first


def timed_run(llm: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Every prompt in turn; totals of tokens, seconds and decode seconds."""
    tokens, seconds, decode = 0, 0.0, 0.0
    for prompt in prompts:
        n, s, d = generate_one(llm, prompt, new_tokens)
        tokens, seconds, decode = tokens + n, seconds + s, decode + d
    return {"tokens": tokens, "seconds": seconds, "decode_seconds": decode}


def main(job_path: str, result_path: str) -> None:
    """Run every timed run of the job after one small warm-up and write the results."""
    global CLOCK
    with open(job_path) as f:
        job = json.load(f)
    if job.get("cpu_time"):  # process CPU time (all of llama.cpp's threads) instead of wall time
        CLOCK = time.process_time
    llm = build_llama(job)
    # warm-up on other tokens than any timed prompt starts with: llama-cpp-python reuses the KV of
    # the longest common prefix with the previous prompt, which would flatter the first timed run
    first = job["runs"][0]["prompts"][0]
    timed_run(llm, [[t for t in first[-16:] if t != first[0]] or [first[0] + 1]], 4)
    results = {run["name"]: timed_run(llm, run["prompts"], run["new_tokens"]) for run in job["runs"]}
    with open(result_path, "w") as f:
        json.dump({"runs": results, "peak_rss_mib": peak_rss_mib()}, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: _llamacpp_worker.py JOB.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
