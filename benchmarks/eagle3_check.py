"""EAGLE-3 training data from ``tapllm collect --recipe eagle3``: speed, and the peers' loaders.

What it does, in one run (default model, bf16 compute and storage):

1. Speed: the same single-turn ShareGPT conversations (``_chat_data.py``) collected
   ``--rounds`` times each way, order alternating, the best and the median counted (the
   recipe's time includes its closing pass: the token frequencies, d2t/t2d, speculators' rows):
   - with ``--regenerate``: the recipe (replies written by the model, 4 layers at every
     position, loss mask, both layouts) against a plain ``tapllm collect`` of the same user
     turns as chat prompts with ``--max-tokens N --positions all`` and ``resid_post`` of the
     same four blocks (one shard of index columns and states);
   - without: the recipe against a plain collect of the very token ids the recipe renders
     (`prompt_token_ids`), prompt only.
   Rows/s of each, and the ratio (target: the recipe within 10%).
2. Peers: a dataset of ``--conversations`` conversations (every fourth with two exchanges,
   regenerated) is read by speculators' loader and by SpecForge's, each in its own virtual
   environment (``--speculators-python``, ``--specforge-python``; see
   ``_speculators_worker.py`` and ``_specforge_worker.py``), and one training step runs on each.

How to run (from the repository root)::

    python benchmarks/eagle3_check.py --speculators-python /tmp/speculators/bin/python \\
        --specforge-python /tmp/specforge/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _chat_data import conversations  # noqa: E402

from tapllm.collect.eagle3 import Eagle3Settings, default_aux_layers  # noqa: E402
from tapllm.collect.run import CollectConfig, collect  # noqa: E402
from tapllm.config import EngineConfig  # noqa: E402
from tapllm.loader import resolve_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=64, help="conversations of the peers' dataset")
    p.add_argument("--speed-conversations", type=int, default=64, help="conversations of each timed run")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per regenerated reply")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--speculators-python", default=None)
    p.add_argument("--specforge-python", default=None)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--rounds", type=int, default=2, help="timed runs of each side, per mode")
    p.add_argument("--prompt-only", action="store_true", help="time only the prompt-only comparison")
    return p.parse_args(argv)


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _recipe_tokens(folder: Path, convs: list[dict]) -> list[list[int]]:
    """The token ids the recipe collects for each (prompt-only) conversation: its chat rendering."""
    from tapllm.collect.chat import normalize, render_fn, tokens_with_mask
    from tapllm.engine.chat import render_chat
    from tapllm.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    render = render_fn(lambda messages, gen: render_chat(tok, messages, gen), tok)
    return [tokens_with_mask(normalize(c, f"conversation {i}"), render).ids for i, c in enumerate(convs)]


def speed(args: argparse.Namespace, tmp: Path, num_layers: int, folder: Path) -> None:
    """Recipe against plain collect, with and without regeneration. Without it, the plain side
    collects the very token ids the recipe does (``prompt_token_ids``), so both run equal forwards."""
    convs = [c for c in conversations(4 * args.speed_conversations, seed=7)
             if sum(t["from"] == "gpt" for t in c["conversations"]) == 1][: args.speed_conversations]
    chats = _write(tmp / "chats.jsonl", convs)
    as_messages = [[{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
                    for t in c["conversations"]] for c in convs]
    prompts = _write(tmp / "prompts.jsonl", [{"messages": [m for m in ms if m["role"] != "assistant"]}
                                             for ms in as_messages])
    whole = _write(tmp / "whole.jsonl", [{"prompt_token_ids": ids} for ids in _recipe_tokens(folder, convs)])
    layers = [k - 1 for k in default_aux_layers(num_layers)] + [num_layers - 1]
    engine = EngineConfig(dtype=args.dtype, max_num_seqs=64)
    common = dict(store_dtype=args.dtype, shard_tokens=1 << 20, engine=engine)
    print(f"speed: {len(convs)} single-turn conversations, default model {args.dtype}, resid_post of blocks {layers} "
          f"at every position", flush=True)
    for regen in (False,) if args.prompt_only else (True, False):
        runs = {
            "recipe": lambda out: collect(CollectConfig(out=out, input=chats, recipe=Eagle3Settings(
                regenerate=regen, max_new_tokens=args.max_tokens), **common), show_progress=False),
            "plain": lambda out: collect(CollectConfig(
                out=out, input=prompts if regen else whole, layers=layers, points=["resid_post"],
                positions="all", max_tokens=args.max_tokens if regen else 0, **common), show_progress=False),
        }
        rates: dict[str, list[float]] = {"recipe": [], "plain": []}
        rows: dict[str, int] = {}
        pairs = (("recipe", "plain"), ("plain", "recipe"))
        order = [name for r in range(args.rounds) for name in pairs[r % 2]]
        for n, name in enumerate(order):
            meta = runs[name](tmp / f"{name}-{regen}-{n}")
            rates[name].append(meta["num_rows"] / meta["seconds"])
            rows[name] = meta["num_rows"]
        label = f"--regenerate --max-tokens {args.max_tokens}" if regen else "prompt only"
        best = {k: max(v) for k, v in rates.items()}
        median = {k: statistics.median(v) for k, v in rates.items()}
        for name in ("recipe", "plain"):
            print(f"  {label:28s} {name:7s} {rows[name]:6d} rows, best {best[name]:8.0f} rows/s, median "
                  f"{median[name]:8.0f} ({', '.join(f'{r:.0f}' for r in rates[name])})", flush=True)
        print(f"  {label:28s} recipe / plain = {best['recipe'] / best['plain']:.2f}x best, "
              f"{median['recipe'] / median['plain']:.2f}x median", flush=True)


def peers(args: argparse.Namespace, tmp: Path, folder: Path) -> None:
    """The peers' loaders and one training step each on a tapllm-made dataset."""
    chats = _write(tmp / "peers.jsonl", conversations(args.conversations))
    out = tmp / "eagle3"
    t0 = time.perf_counter()
    meta = collect(CollectConfig(out=out, input=chats, store_dtype=args.dtype, recipe=Eagle3Settings(
        regenerate=True, max_new_tokens=args.max_tokens), engine=EngineConfig(dtype=args.dtype, max_num_seqs=64)),
        show_progress=False)
    print(f"peers: {meta['num_requests']} conversations regenerated by the default model, {meta['num_rows']} rows, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    aux = meta["eagle3"]["aux_layers"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    here = Path(__file__).resolve().parent
    if args.speculators_python:
        cmd = [args.speculators_python, str(here / "_speculators_worker.py"), "--verifier-name-or-path", str(folder),
               "--data-path", str(out / "speculators"), "--on-missing", "raise", "--total-seq-len", "1024",
               "--draft-vocab-size", "32000", "--save-path", str(tmp / "spec-ckpt"), "--draft-attn-impl", "sdpa",
               "--loss-implementation", "eager", "--target-layer-ids", *map(str, aux)]
        _report("speculators", subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp))
    if args.specforge_python:
        cmd = [args.specforge_python, str(here / "_specforge_worker.py"), "--data", str(out / "specforge"),
               "--model", str(folder)]
        _report("SpecForge", subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp))


def _report(name: str, done: subprocess.CompletedProcess) -> None:
    if done.returncode != 0:
        print(f"  {name}: FAILED (exit {done.returncode}): {done.stderr.strip().splitlines()[-3:]}", flush=True)
        return
    r = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {name}: loaded, batch {r['batch']}, one training step: loss {r['loss']:.3f}, "
          f"{r['parameters_updated']} parameter tensors updated", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Run the checks."""
    args = parse_args(argv)
    folder = resolve_model(None)
    num_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_speed:
            speed(args, Path(tmp), num_layers, folder)
        if args.speculators_python or args.specforge_python:
            peers(args, Path(tmp), folder)


if __name__ == "__main__":
    main()
