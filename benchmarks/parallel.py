"""Tensor and pipeline parallelism on this CPU: TP 2 and PP 2 (one process and one thread per rank)
against TP 1 (one process, two threads), output tokens/s and the cost of capture, plus what the
collectives move.

Models: ``default`` is the default model itself (SmolLM2-135M, its weights; 9 query heads over 3 KV
heads split unevenly, 6 + 3, at TP 2); the others are Llama shapes with random weights
(``load_format="dummy"``, the default model's tokenizer): ``1b`` is Llama-3.2-1B's block shape
(hidden 2048, 32 heads, 8 KV heads, 8192 neurons), ``small`` a 135M-sized Llama with 8 heads.
``--layers`` cuts the depth of the shapes for a quicker run. ``tp1`` and ``tp2`` are what a user gets by default
(the fused CPU kernels; untapped decode blocks in one C++ call, which at TP 2 all-reduces in shared
memory itself); ``tp1_eager`` (the plain PyTorch step) is given for reference. ``pp2`` splits the blocks into two
stages with two batches in flight (each step takes half the requests), ``pp2_turns`` with one batch at a
time (``async_scheduling=False``: the stages take turns).

What it prints (and writes with ``--json FILE``), per model
    tok_s[config]        output tokens/s at batch ``--batch`` (configs: tp1, tp1_eager, tp2), plain
    tok_s_capture[...]   the same with 3 blocks' ``resid_post`` captured at every position
    tp2_over_tp1         tok_s[tp2] / tok_s[tp1]
    pp2_over_tp1         tok_s[pp2] / tok_s[tp1] (and pp2_turns_over_tp1)
    capture_cost_tp1/2   1 - tok_s_capture / tok_s: the share of throughput capture costs
    collectives          per forward at TP 2: calls, bytes rank 0 sent, seconds rank 0 waited in them
                         (the Python-side ones: the C++ runner's waits are inside its call), and the
                         transport (shared memory or gloo)
    bound_ms             a decode step's floor: the model's weight bytes over the bandwidth measured in
                         the same run (``bandwidth_gbs``, a GEMV over 1.6 GB with both threads)

How to run
    python benchmarks/parallel.py --json parallel.json
    python benchmarks/parallel.py --models small --layers 4 --tokens 16     # quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VOCAB = 49152
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "small": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                  num_key_value_heads=4),
}


def _folder(name: str, layers: int | None, root: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig

    from tapllm.loader import resolve_model

    if name == "default":
        return Path(resolve_model(None))
    shape = dict(SHAPES[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    folder = root / name
    LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=2048, torch_dtype="float32",
                architectures=["LlamaForCausalLM"],
                **shape).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(resolve_model(None))).save_pretrained(folder)
    return folder


def _run(llm: Any, batch: int, prompt_len: int, tokens: int, capture: bool, layers: int) -> float:
    from tapllm import HiddenStatesSpec, SamplingParams

    spec = HiddenStatesSpec(layers=[0, layers // 2, layers - 1], points=["resid_post"], positions="all") \
        if capture else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, hidden_states=spec)
    g = torch.Generator().manual_seed(int(capture))
    warm, prompts = ([torch.randint(100, VOCAB, (prompt_len,), generator=g).tolist() for _ in range(batch)]
                     for _ in range(2))
    # The same shapes first (oneDNN makes a primitive per shape on first use), on other prompts (no cache hits).
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, hidden_states=spec),
                 use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - start)


def bench(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from tapllm import LLM

    folder = _folder(name, args.layers, root)
    if name == "default":
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(str(folder)).num_hidden_layers
        common = dict(dtype="float32", max_num_seqs=args.batch, kv_cache_memory_gb=0.5)
    else:
        layers = args.layers or SHAPES[name]["num_hidden_layers"]
        common = dict(dtype="float32", load_format="dummy", max_num_seqs=args.batch, kv_cache_memory_gb=0.5)
    out: dict[str, Any] = {"tok_s": {}, "tok_s_capture": {}}
    for config, options, threads in (("tp1", {}, 2), ("tp1_eager", dict(enforce_eager=True), 2),
                                     ("tp2", dict(tensor_parallel_size=2), 1),
                                     ("pp2", dict(pipeline_parallel_size=2), 1),
                                     ("pp2_turns", dict(pipeline_parallel_size=2, async_scheduling=False), 1)):
        torch.set_num_threads(threads)
        llm = LLM(folder, **common, **options)
        try:
            out["tok_s"][config] = _run(llm, args.batch, args.prompt_len, args.tokens, False, layers)
            tp = llm.engine.runner.tp
            if tp is not None and tp.pp == 1:
                group, model = tp.group, llm.engine.runner.model
                calls, sent, waited, forwards = group.calls, group.bytes_moved, group.wait_s, model.forwards
            out["tok_s_capture"][config] = _run(llm, args.batch, args.prompt_len, args.tokens, True, layers)
            if tp is not None and tp.pp == 1:
                n = max(1, model.forwards - forwards)
                out["collectives"] = {"calls_per_forward": (group.calls - calls) / n,
                                      "bytes_per_forward": (group.bytes_moved - sent) / n,
                                      "wait_s_per_forward": (group.wait_s - waited) / n,
                                      "transport": group.transport}
        finally:
            llm.close()
        print(f"{name} {config}: {out['tok_s'][config]:.1f} tok/s plain, "
              f"{out['tok_s_capture'][config]:.1f} tok/s capturing", flush=True)
    tok, cap = out["tok_s"], out["tok_s_capture"]
    from _bandwidth import stream_bandwidth_gbs, streamed_weight_bytes

    torch.set_num_threads(2)
    out["weight_bytes"] = streamed_weight_bytes(folder, torch.float32)
    out["bandwidth_gbs"] = stream_bandwidth_gbs(torch.float32)
    out["bound_ms"] = out["weight_bytes"] / (out["bandwidth_gbs"] * 1e9) * 1e3
    out["step_ms"] = {c: args.batch / t * 1e3 for c, t in tok.items()}
    out["tp2_over_tp1"] = tok["tp2"] / tok["tp1"]
    out["pp2_over_tp1"] = tok["pp2"] / tok["tp1"]
    out["pp2_turns_over_tp1"] = tok["pp2_turns"] / tok["tp1"]
    out["capture_cost_tp1"] = 1 - cap["tp1"] / tok["tp1"]
    out["capture_cost_tp2"] = 1 - cap["tp2"] / tok["tp2"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="default,1b", help="comma-separated: default, " + ", ".join(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="blocks per model (default: the shape's)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = bench(name, args, Path(tmp))
            r = results[name]
            print(f"{name}: tp2_over_tp1 {r['tp2_over_tp1']:.2f}, pp2_over_tp1 {r['pp2_over_tp1']:.2f} (taking "
                  f"turns {r['pp2_turns_over_tp1']:.2f}), capture cost tp1 {r['capture_cost_tp1']:.1%}, "
                  f"tp2 {r['capture_cost_tp2']:.1%}; collectives per forward {r.get('collectives')}", flush=True)
            steps = ", ".join(f"{c} {ms:.1f}" for c, ms in r["step_ms"].items())
            print(f"{name}: ms per step (prefill included) {steps}; weight-streaming floor {r['bound_ms']:.1f} ms "
                  f"at {r['bandwidth_gbs']:.1f} GB/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
