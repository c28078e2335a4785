"""Structured output: token-mask cost of grammar libraries, and tapllm's throughput overhead.

What it measures
    ``--part libraries``: for each grammar library that imports (llguidance, outlines-core,
    xgrammar), on the default model's tokenizer (49,152 tokens): the time to compile each of
    a few JSON schemas, and the time per token to compute the token mask while walking a
    valid instance of the schema token by token (the tokens of its compact JSON text). The
    instance walk is the same for every library, so the per-token figures compare directly.

    ``--part throughput``: output tokens per second of one ``LLM.generate`` call of ``--batch``
    requests, all constrained to one JSON schema, against the same call unconstrained, on the
    same model and prompts, each timed after a warm-up. The constrained rows stop when their
    JSON is complete, so tokens per second (not wall time) is compared. It also prints tapllm's
    own mask figures (``ModelRunner.token_masks.stats``): time computing masks per constrained
    token (in the background thread, during the forward) and time the step waited for them.

How to run (from the repository root)
    python benchmarks/structured.py --part libraries
    python benchmarks/structured.py --part throughput --batch 16 --new-tokens 128 [--model tiny]
    xgrammar is optional: install it in a folder of its own without its dependencies (it declares
    torch and triton) and put that folder on PYTHONPATH for this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMAS: list[tuple[dict[str, Any], Any]] = [
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                       "age": {"type": "integer"}, "ok": {"type": "boolean"}},
      "required": ["name", "age", "ok"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "ok": True}),
    ({"type": "object", "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 6},
        "owner": {"type": "object", "properties": {"email": {"type": "string", "maxLength": 40},
                                                   "level": {"enum": ["low", "mid", "high"]}},
                  "required": ["email", "level"], "additionalProperties": False},
        "score": {"type": "number"}},
      "required": ["id", "tags", "owner", "score"], "additionalProperties": False},
     {"id": 42, "tags": ["red", "green", "blue"], "owner": {"email": "ada@example.org", "level": "high"},
      "score": 3.25}),
    ({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"},
                                                                  "y": {"type": "number"},
                                                                  "label": {"type": "string", "maxLength": 16}},
                                 "required": ["x", "y"], "additionalProperties": False},
      "minItems": 2, "maxItems": 8},
     [{"x": 1.5, "y": -2.0, "label": "origin"}, {"x": 10, "y": 20}, {"x": 0.125, "y": 7, "label": "p3"}]),
]


def _default_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tapllm.loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


def _walk(start: Any, mask_and_advance: Any, tokens: list[int], repeats: int = 5) -> float:
    """Seconds per token of computing the mask then advancing, over ``tokens`` (best of ``repeats``
    walks from a fresh state; the first walk fills the library's caches)."""
    best = float("inf")
    for _ in range(repeats):
        state = start()
        t0 = time.perf_counter()
        for t in tokens:
            mask_and_advance(state, t)
        best = min(best, (time.perf_counter() - t0) / len(tokens))
    return best


def bench_llguidance(tok: Any) -> dict[str, list[float]]:
    import llguidance
    import numpy as np
    from llguidance.hf import from_tokenizer

    lltok = from_tokenizer(tok, n_vocab=49152)
    words = (49152 + 31) // 32
    mask = np.zeros((1, words), dtype=np.int32)
    out: dict[str, list[float]] = {"compile_ms": [], "mask_us": []}
    for schema, instance in SCHEMAS:
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lltok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        out["compile_ms"].append((time.perf_counter() - t0) * 1e3)
        tokens = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)

        def step(state: Any, t: int) -> None:
            state.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
            assert state.consume_token(t), state.get_error()

        out["mask_us"].append(_walk(m.deep_copy, step, tokens) * 1e6)
    return out


def bench_outlines(tok: Any) -> dict[str, list[float]]:
    import numpy as np
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    eos = tok.eos_token_id
    t0 = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    for token, tid in tok.get_vocab().items():
        if tid != eos:
            vocab.setdefault(tok.convert_tokens_to_string([token]), []).append(tid)
    vocabulary = outlines_core.Vocabulary(eos, vocab)
    print(f"  outlines-core vocabulary: {time.perf_counter() - t0:.2f}s")
    mask = np.zeros((1, 49152 // 32), dtype=np.int32)
    out: dict[str, list[float]] = {"compile_ms": [], "mask_us": []}
    for schema, instance in SCHEMAS:
        t0 = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(schema), r"")  # no whitespace, as above
        index = outlines_core.Index(regex, vocabulary)
        out["compile_ms"].append((time.perf_counter() - t0) * 1e3)
        tokens = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)

        def step(state: Any, t: int) -> None:
            state.write_mask_into(mask.ctypes.data, mask.size, 4)
            state.advance(t, return_tokens=False)

        out["mask_us"].append(_walk(lambda: outlines_core.Guide(index), step, tokens) * 1e6)
    return out


def bench_xgrammar(tok: Any) -> dict[str, list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    mask = xgr.allocate_token_bitmask(1, 49152)
    out: dict[str, list[float]] = {"compile_ms": [], "mask_us": []}
    for schema, instance in SCHEMAS:
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        out["compile_ms"].append((time.perf_counter() - t0) * 1e3)
        tokens = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)

        def step(state: Any, t: int) -> None:
            state.fill_next_token_bitmask(mask)
            assert state.accept_token(t)

        out["mask_us"].append(_walk(lambda: xgr.GrammarMatcher(compiled), step, tokens) * 1e6)
    return out


def libraries() -> None:
    tok = _default_tokenizer()
    for name, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines), ("xgrammar", bench_xgrammar)):
        try:
            r = fn(tok)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        print(f"{name}: compile ms per schema {[round(x, 1) for x in r['compile_ms']]}; mask+advance us per token "
              f"{[round(x, 1) for x in r['mask_us']]} (mean {statistics.mean(r['mask_us']):.1f})")


def throughput(batch: int, new_tokens: int, model: str | None, repeats: int) -> None:
    from tapllm import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max(batch, 16), seed=0)
    schema = {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 30, "maxItems": 60,
                  "items": {"type": "object", "properties": {"n": {"type": "integer"},
                                                             "w": {"type": "string", "maxLength": 8}},
                            "required": ["n", "w"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}
    prompts = [f"List {i + 30} numbered words as JSON: " for i in range(batch)]
    plain = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=1,
                                 structured_outputs={"json": schema, "disable_any_whitespace": True})
    llm.generate(prompts[:2], [plain, constrained])  # warm-up (and the grammar compiled once)
    stats = llm.engine.runner.token_masks.stats
    rates: dict[str, list[float]] = {"plain": [], "json": []}
    for _ in range(repeats):
        for name, params in (("plain", plain), ("json", constrained)):
            before = (stats.rows, stats.compute_seconds, stats.wait_seconds, stats.steps)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(n / dt)
            if name == "json":
                rows, comp, wait, steps = (a - b for a, b in zip((stats.rows, stats.compute_seconds,
                                                                  stats.wait_seconds, stats.steps), before))
                valid = sum(_parses(o.outputs[0].text) for o in outs)
                print(f"  json: {n} tokens in {dt:.2f}s, {valid}/{batch} outputs parse; masks: {comp / rows * 1e6:.0f} "
                      f"us per constrained token, {comp / steps * 1e3:.2f} ms per step computing, "
                      f"{wait / steps * 1e3:.2f} ms per step waited after the forward")
            else:
                print(f"  plain: {n} tokens in {dt:.2f}s")
    p, j = statistics.median(rates["plain"]), statistics.median(rates["json"])
    print(f"batch {batch}: plain {p:.1f} tok/s, all rows JSON schema {j:.1f} tok/s: overhead {100 * (1 - j / p):.1f}%")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["libraries", "throughput"], default="libraries")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--model", default=None, help="a model folder or .gguf (default: the default model)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.part == "libraries":
        libraries()
    else:
        throughput(args.batch, args.new_tokens, str(Path(args.model)) if args.model else None, args.repeats)


if __name__ == "__main__":
    main()
