"""vLLM half of ``benchmarks/throughput.py``, run in vLLM's own interpreter.

vLLM is a large install that is kept in a venv of its own, so ``throughput.py`` runs this
file through ``--vllm-python`` with a JSON job file and reads back a JSON result file::

    python _vllm_worker.py JOB.json RESULT.json

The job holds ``model`` (a Hugging Face model folder), ``dtype``, ``max_num_seqs``,
``max_model_len``, optionally ``load_format`` (``"dummy"``: random weights) and ``runs``: a list of
``{"name", "prompts", "new_tokens"}`` where each prompt is a list of token ids. The result holds,
per run name, the output tokens produced and the seconds taken, plus memory: the peak RSS of this
(front-end) process and, with psutil, the current RSS of its whole process tree after the runs (vLLM
computes in child processes).
Nothing from tapllm is imported here.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from _rss import peak_rss_mib


def tree_rss_mib() -> float | None:
    """Current RSS of this process and all its descendants (vLLM's engine core and worker), MiB."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def build_llm(job: dict[str, Any]) -> Any:
    """Construct ``vllm.LLM`` over the job's model folder."""
    from vllm import LLM

    return LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_model_len=job["max_model_len"],
        seed=0,
        enable_prefix_caching=False,
        load_format=job.get("load_format", "auto"),  # "dummy": random weights from a folder of config only
    )


def timed_generate(llm: Any, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    """Greedy-generate exactly ``new_tokens`` per prompt; return (tokens produced, seconds)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), seconds


def main(job_path: str, result_path: str) -> None:
    """Run every timed run of the job after one small warm-up and write the results."""
    with open(job_path) as f:
        job = json.load(f)
    llm = build_llm(job)
    warm = job["runs"][0]["prompts"][0][:16]
    timed_generate(llm, [warm, warm], 4)
    results: dict[str, dict[str, float]] = {}
    for run in job["runs"]:
        tokens, seconds = timed_generate(llm, run["prompts"], run["new_tokens"])
        results[run["name"]] = {"tokens": tokens, "seconds": seconds}
    summary = {"runs": results, "peak_rss_mib": peak_rss_mib(), "tree_rss_mib": tree_rss_mib()}
    with open(result_path, "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: _vllm_worker.py JOB.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
