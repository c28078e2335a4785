"""Weights kept quantized: what int8 / int4 / GGUF-as-stored cost in hidden-state error, and what
they buy in decode speed and memory, side by side in one run.

What it measures (per model: the default SmolLM2-135M, ``llama1b``, Llama-3.2-1B's shape
with random weights, from ``benchmarks/_families.py``, and ``llama1b-q4km``: that model as a
Q4_K_M file made by llama.cpp's own quantizer, Q4_K and Q6_K tensors as Ollama users run them;
its float reference is ``llama1b``'s float checkpoint, and it needs ``--llamacpp-python``)
    * errors: each quantization against the same model with float weights (``--dtype``, float32
      by default so the figure is the quantization's alone): per block at ``resid_post``, over
      every position of fresh text prompts, the mean and minimum cosine similarity and the mean
      relative error ``|a - b| / |b|``; the greedy-token agreement over 64 new tokens (the share
      of positions with the same token, and the length of the common prefix); and the
      perplexity of a small text set (prompt logprobs), float and quantized.
    * speed: batch 1 and 16, prompt 128 random tokens, 64 new tokens, greedy;
      tapllm in the float dtype (``--speed-dtype``: the machine's fastest by default) and each
      quantization interleaved, best of ``--repeats`` whole calls, fresh prompts every call; with
      ``--llamacpp-python``, llama.cpp on a GGUF of the same weights (the default model's own
      Q4_1 file; for llama1b a Q4_0 file written here with the ``gguf`` package), batch 1.
      ``--threads 1 --cpu-time`` times by process CPU time on one thread, which other
      processes' load barely moves (wall time on a shared machine varies several-fold).
    * memory (``rss`` part): the peak RSS (VmHWM) of a fresh process that loads the model in
      bf16 or a quantization and generates 8 tokens, and its RSS after that (the resident model:
      the load's transient reads of the checkpoint are in the peak only).

How to run (from the repository root)
    python benchmarks/quantized.py --models default --parts errors,speed
    python benchmarks/quantized.py --models default,llama1b --parts errors,speed,rss \
        --llamacpp-python /tmp/llamacpp/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

TEXTS = [  # the perplexity set and the error prompts: plain English prose, written for this benchmark
    "The river rose slowly through the night, and by morning the low fields along its banks were under water. "
    "Farmers moved their animals to the higher ground and waited for the rain to stop.",
    "A compiler translates a program written in one language into another, usually lower-level, language. "
    "Most compilers work in several passes: parsing, analysis, optimisation and code generation.",
    "She opened the old notebook and found her grandmother's recipes, written in a small, careful hand, "
    "with notes in the margins about which ones had been served at each family wedding.",
    "Photosynthesis converts light energy into chemical energy. Plants capture sunlight with chlorophyll "
    "and use it to turn carbon dioxide and water into sugar, releasing oxygen as a by-product.",
    "The committee met on Tuesday to discuss the budget for next year. After a long debate, the members "
    "agreed to spend more on the library and less on new office furniture.",
    "In the mountains the weather changes quickly. A clear blue sky at noon can turn into a storm within an "
    "hour, so experienced hikers always carry a jacket and enough water.",
    "The museum's new exhibition shows how maps have changed over five centuries, from hand-drawn charts of "
    "coastlines to satellite images that cover the whole planet.",
    "When the train finally arrived, the platform was crowded with travellers who had been waiting since early "
    "afternoon. Nobody complained; everyone was simply glad to be going home.",
]
# "+a8": the same weights with quantize_activations (inputs of the quantized linears rounded to int8)
QUANTS = {"default": ["int8", "int4", "gguf", "int8+a8", "int4+a8", "gguf+a8"],
          "llama1b": ["int8", "int4", "q4_k", "int8+a8", "int4+a8", "q4_k+a8"],
          "llama1b-q4km": ["gguf", "gguf+a8"]}
LLAMACPP: str | None = None  # --llamacpp-python: also makes llama1b-q4km's file


def model_path(name: str, quant: str | None = None) -> str | None:
    """The checkpoint of ``name`` (llama1b-q4km: its GGUF for a quantization, else llama1b's floats)."""
    if name == "default":
        return None
    if name == "llama1b-q4km":
        return str(gguf_for(name)) if quant else model_path("llama1b")
    from _families import family_model

    return str(family_model(name))


def build(name: str, dtype: str, quant: str | None):
    from tapllm import LLM

    a8 = quant is not None and quant.endswith("+a8")
    return LLM(model_path(name, quant), dtype=dtype, quantization=quant.removesuffix("+a8") if quant else None,
               quantize_activations=a8, kv_cache_memory_gb=1.0)


# ---- errors -------------------------------------------------------------------------------
def _states_and_tokens(llm, prompts: list[str]):
    from tapllm import HiddenStatesSpec, SamplingParams

    spec = HiddenStatesSpec(points="resid_post", layers="all", positions="prompt")
    states = [o.hidden_states["resid_post"].float() for o in llm.encode(prompts, spec, use_tqdm=False)]
    gen = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    lp = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for o in lp:
        for tok, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
            nll -= entry[tok].logprob
            count += 1
    return states, [o.outputs[0].token_ids for o in gen], float(torch.tensor(nll / count).exp())


def errors(name: str, dtype: str, out: dict) -> None:
    ref = build(name, dtype, None)
    ref_states, ref_tokens, ref_ppl = _states_and_tokens(ref, TEXTS)
    del ref
    out["errors"] = {"reference": f"float weights, {dtype}", "perplexity_float": ref_ppl, "quant": {}}
    for quant in QUANTS[name]:
        llm = build(name, dtype, quant)
        states, tokens, ppl = _states_and_tokens(llm, TEXTS)
        del llm
        a, b = torch.cat(states), torch.cat(ref_states)  # [positions, layers, hidden]
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [positions, layers]
        rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
        same = [sum(x == y for x, y in zip(t, r)) / len(r) for t, r in zip(tokens, ref_tokens)]
        prefix = [next((i for i, (x, y) in enumerate(zip(t, r)) if x != y), len(r)) for t, r in zip(tokens, ref_tokens)]
        out["errors"]["quant"][quant] = {
            "cos_mean_per_block": cos.mean(0).tolist(), "cos_min_per_block": cos.min(0).values.tolist(),
            "rel_err_per_block": rel.mean(0).tolist(), "greedy_agreement": sum(same) / len(same),
            "greedy_common_prefix_mean": sum(prefix) / len(prefix), "perplexity": ppl}
        e = out["errors"]["quant"][quant]
        print(f"[{name}] {quant}: cos min over blocks {min(e['cos_mean_per_block']):.5f} (worst position "
              f"{min(e['cos_min_per_block']):.4f}), rel err max over blocks {max(e['rel_err_per_block']):.4f}, "
              f"greedy agreement {e['greedy_agreement']:.3f} (prefix {e['greedy_common_prefix_mean']:.1f}/64), "
              f"ppl {ppl:.3f} vs {ref_ppl:.3f}", flush=True)


# ---- speed --------------------------------------------------------------------------------
def _prompts(batch: int, length: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch * 1000 + seed)
    return [torch.randint(100, 49152, (length,), generator=g).tolist() for _ in range(batch)]


CLOCK = time.perf_counter  # process CPU time with --cpu-time


def speed(name: str, batches: list[int], repeats: int, out: dict, llamacpp: str | None, dtype: str) -> None:
    from tapllm import SamplingParams

    engines = {"float": build(name, dtype, None)}
    for quant in QUANTS[name]:
        engines[quant] = build(name, dtype, quant)
    out["speed_dtype"] = str(engines["float"].engine.model_config.dtype)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    table = {}
    for batch in batches:
        best = {k: [1e9, 1e9] for k in engines}
        for rep in range(repeats):
            for i, (key, llm) in enumerate(engines.items()):  # interleaved: each repeat runs every engine once
                # fresh prompts for every timed call (a prefix-cache hit would flatter a repeat)
                prompts, other = _prompts(batch, seed=2 * (rep * 100 + i)), _prompts(batch, seed=2 * (rep * 100 + i) + 1)
                t0 = CLOCK()
                llm.generate(prompts, params, use_tqdm=False)
                t1 = CLOCK()
                llm.generate(other, one, use_tqdm=False)  # prefill + first token alone
                t2 = CLOCK()
                best[key] = [min(best[key][0], t1 - t0), min(best[key][1], t2 - t1)]
        table[batch] = {k: {"tok_s": batch * 64 / v[0], "decode_tok_s": batch * 63 / max(v[0] - v[1], 1e-9)}
                        for k, v in best.items()}
    if llamacpp:
        table["llamacpp_b1"] = run_llamacpp(name, llamacpp, [_prompts(1, seed=10_000 + r) for r in range(repeats)])
    out["speed"] = table
    for batch, row in table.items():
        print(f"[{name}] batch {batch}: " + ", ".join(f"{k} {v['tok_s']:.1f} tok/s (decode {v['decode_tok_s']:.1f})"
                                                     for k, v in row.items()), flush=True)


# llama.cpp's quantizer (ftype 15 = LLAMA_FTYPE_MOSTLY_Q4_K_M), run in its own venv
_QUANTIZE = ("import ctypes, sys, llama_cpp\n"
             "p = llama_cpp.llama_model_quantize_default_params()\n"
             "p.ftype, p.nthread = 15, 2\n"
             "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")


def gguf_for(name: str) -> Path:
    """The GGUF llama.cpp reads: the default model's own file, llama1b-q4km's Q4_K_M (llama.cpp's
    quantizer on an F16 conversion of llama1b), else a Q4_0 conversion of ``name``."""
    from tapllm.loader import default_model_path
    from tapllm.loader.gguf_convert import cache_root

    if name == "default":
        return default_model_path()
    if name == "llama1b-q4km":
        target = cache_root() / "bench-models" / "llama1b.Q4_K_M.gguf"
        if not target.is_file():
            if LLAMACPP is None:
                raise SystemExit("llama1b-q4km: llama.cpp's quantizer makes its file: pass --llamacpp-python")
            f16 = _write_gguf("llama1b", cache_root() / "bench-models" / "llama1b.F16.gguf", "F16")
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            subprocess.run([LLAMACPP, "-c", _QUANTIZE, str(f16), str(tmp)], check=True)
            os.replace(tmp, target)
            f16.unlink()
        return target
    target = cache_root() / "bench-models" / f"{name}.Q4_0.gguf"
    return target if target.is_file() else _write_gguf(name, target, "Q4_0")


def _write_gguf(name: str, target: Path, kind: str) -> Path:
    """``name``'s float checkpoint as a GGUF whose linears are ``kind`` (token_embd Q8_0, or F16 with F16)."""
    from safetensors import safe_open

    sys.path.insert(0, str(HERE.parent / "tests"))
    from gguf_writer import permute_for_llama_cpp, write_gguf

    folder = Path(model_path(name))
    cfg = json.loads((folder / "config.json").read_text())
    tensors, types = {}, {}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        tensors["token_embd.weight"] = f.get_tensor("model.embed_tokens.weight")
        tensors["output_norm.weight"] = f.get_tensor("model.norm.weight")
        types["token_embd.weight"] = "F16" if kind == "F16" else "Q8_0"
        for i in range(cfg["num_hidden_layers"]):
            for hf, cpp in names.items():
                w = f.get_tensor(f"model.layers.{i}.{hf}.weight")
                if cpp == "attn_q":
                    w = permute_for_llama_cpp(w, cfg["num_attention_heads"])
                elif cpp == "attn_k":
                    w = permute_for_llama_cpp(w, cfg["num_key_value_heads"])
                tensors[f"blk.{i}.{cpp}.weight"] = w
                if "norm" not in cpp:
                    types[f"blk.{i}.{cpp}.weight"] = kind
    kv = {"block_count": cfg["num_hidden_layers"], "context_length": 4096, "embedding_length": cfg["hidden_size"],
          "feed_forward_length": cfg["intermediate_size"], "attention.head_count": cfg["num_attention_heads"],
          "attention.head_count_kv": cfg["num_key_value_heads"], "rope.freq_base": 500000.0,
          "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]), "vocab_size": cfg["vocab_size"],
          "rope.dimension_count": cfg["hidden_size"] // cfg["num_attention_heads"]}
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    write_gguf(tmp, "llama", kv, tensors, types)
    os.replace(tmp, target)
    return target


def run_llamacpp(name: str, python: str, runs: list[list[list[int]]]) -> dict:
    """llama.cpp on ``name``'s GGUF, one timed run per prompt list of ``runs`` (fresh prompts each)."""
    job = {"gguf": str(gguf_for(name)), "n_ctx": 512, "threads": torch.get_num_threads(),
           "cpu_time": CLOCK is time.process_time,
           "runs": [{"name": f"r{i}", "prompts": prompts, "new_tokens": 64} for i, prompts in enumerate(runs)]}
    with tempfile.TemporaryDirectory() as tmp:
        jp, rp = Path(tmp) / "job.json", Path(tmp) / "result.json"
        jp.write_text(json.dumps(job))
        subprocess.run([python, str(HERE / "_llamacpp_worker.py"), str(jp), str(rp)], check=True, cwd=HERE)
        done = json.loads(rp.read_text())["runs"].values()
    best, dec = min(r["seconds"] for r in done), min(r["decode_seconds"] for r in done)
    n = len(runs[0])
    return {"llamacpp": {"tok_s": n * 64 / best, "decode_tok_s": n * 63 / dec}}


# ---- memory -------------------------------------------------------------------------------
def rss(name: str, out: dict) -> None:
    table = {}
    weights = dict.fromkeys(q.removesuffix("+a8") for q in QUANTS[name])  # +a8 holds the same weights
    for quant in ["none", *weights]:
        proc = subprocess.run([sys.executable, __file__, "--rss-child", name, quant], capture_output=True, text=True)
        if proc.returncode != 0:
            table[quant] = f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
            continue
        table[quant] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["rss_mib"] = table
    base = table.get("none")
    for what in ("peak", "after_load"):
        print(f"[{name}] {what} RSS MiB: " + ", ".join(
            f"{k} {v[what]:.0f}" + (f" ({v[what] / base[what]:.2f}x)" if isinstance(base, dict) else "")
            if isinstance(v, dict) else f"{k} {v}" for k, v in table.items()), flush=True)


def rss_child(name: str, quant: str) -> None:
    from _rss import peak_rss_mib

    from tapllm import SamplingParams

    llm = build(name, "bfloat16", None if quant == "none" else quant)  # bf16: what the RSS target compares
    llm.generate([_prompts(1, 32)[0]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    print(json.dumps({"peak": peak_rss_mib(), "after_load": now}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="default", help="default,llama1b")
    p.add_argument("--parts", default="errors,speed", help="errors,speed,rss")
    p.add_argument("--dtype", default="float32", help="dtype of the error comparison")
    p.add_argument("--speed-dtype", default="auto",
                   help="activation dtype of the speed runs and of the float engine they compare with "
                        "(auto: the machine's fastest, bf16 where the CPU has AVX512-BF16/AMX, else float32)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quants", default=None,
                   help="only these quantizations (e.g. gguf,gguf+a8; model:quant for one model, e.g. llama1b:int4+a8)")
    p.add_argument("--llamacpp-python", default=None)
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (and llama.cpp's)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time speed runs by process CPU time (robust on a shared machine; use with --threads 1)")
    p.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    global CLOCK, LLAMACPP
    LLAMACPP = args.llamacpp_python
    if args.rss_child:
        return rss_child(*args.rss_child)
    import logging

    logging.disable(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK = time.process_time
    if args.quants:  # "int8" for every model, "llama1b:int4+a8" for one
        wanted = args.quants.split(",")
        for name in QUANTS:
            QUANTS[name] = [q for q in QUANTS[name] if q in wanted or f"{name}:{q}" in wanted]
    report = {"threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    for name in args.models.split(","):
        out = report.setdefault(name, {})
        parts = args.parts.split(",")
        if "errors" in parts:
            errors(name, args.dtype, out)
        if "speed" in parts:
            speed(name, [int(b) for b in args.batch_sizes.split(",")], args.repeats, out, args.llamacpp_python,
                  args.speed_dtype)
        if "rss" in parts:
            rss(name, out)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
