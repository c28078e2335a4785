"""SAE features at serving speed: tapllm against SAELens, and what features cost over plain generation.

What it measures
    A random SAE in SAELens' layout (standard ReLU, ``d_sae = --expansion x hidden``, reading
    ``resid_post`` of block ``--layer``) on the default model (SmolLM2-135M-Instruct), float32
    by default so latents can be compared exactly. Its encoder bias is calibrated on the model's
    states so that about ``--l0`` latents fire per token (64 by default), as sparse as trained
    SAEs are (a sparse SAE's reconstruction gathers its active decoder rows).

    (1) Against SAELens: the top ``--top`` latents of every token of ``--prompts`` random-token
        prompts of ``--prompt-len`` tokens. tapllm: one ``LLM.encode`` call with
        ``HiddenStatesSpec(sae=..., features="topk:K")``. SAELens (``--saelens-python``, its own
        virtual environment; ``_sae_saelens_worker.py``): ``HookedSAETransformer
        .run_with_cache_with_saes`` on the same weights and SAE, batches of ``--batch``, caching
        only ``hook_sae_acts_post``, then ``topk``. Both load first (not timed) and warm up;
        tokens/s and their ratio are printed, and the first prompt's top latents are compared
        (max difference relative to the largest activation).
    (2) Cost of features in tapllm: greedy generation of ``--new-tokens`` tokens per prompt,
        EOS ignored, without capture and with the SAE's top-k features at every position
        (prompt and generated). After a warm-up of both, ``--rounds`` rounds run plain and
        featured generation back to back in one process on fresh prompts (the same two runs
        share a round's prompts; the order alternates), so load on a shared machine hits both
        alike. Printed: the median of the rounds' ratios featured / plain (the figure to
        quote on a quiet machine), the ratio of the best times, each round's ratio, the same
        ratios of the process's CPU time (steadier when other processes share the cores) and
        the load average. Since
        the noise can exceed the effect, the SAE work itself (``FeatureBatch.run``: encode,
        reconstruction error, top-k and the copies to the host, for every step) is also timed
        inside the featured calls and reported as a share of them.

How to run (from the repository root)
    python benchmarks/sae.py --saelens-python /tmp/saelens/bin/python
    python benchmarks/sae.py --quick                  # 4 prompts x 64 tokens, no SAELens
    python benchmarks/sae.py --cost-only              # part (2) alone, at the full size
    python benchmarks/sae.py --cost-only --threads 1  # the same on one thread: steadier on a shared machine
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saelens-python", default=None, help="python of a venv with sae-lens: run it as the peer")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per prompt for the overhead part")
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--layer", type=int, default=15)
    p.add_argument("--expansion", type=int, default=16, help="d_sae = expansion x hidden")
    p.add_argument("--l0", type=int, default=64,
                   help="calibrate the encoder bias to about this many active latents per token (0: leave it)")
    p.add_argument("--batch", type=int, default=16, help="SAELens' batch size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of part (2); part (1) takes the best of 3")
    p.add_argument("--cost-only", action="store_true", help="part (2) only")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 makes CPU-time ratios steady on a shared machine)")
    p.add_argument("--quick", action="store_true", help="4 prompts x 64 tokens, 16 new tokens, 9 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.rounds = 4, 64, 16, 9
    return args


def random_sae(hidden: int, d_sae: int, layer: int, seed: int = 0):
    """A standard ReLU SAE whose latents are sparse on real residual states (negative encoder bias)."""
    from tapllm import SAE
    from tapllm.sae.model import SAEConfig

    g = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(d_sae, hidden, generator=g)
    w_dec /= w_dec.norm(dim=-1, keepdim=True)
    return SAE(SAEConfig("standard", hidden, d_sae, "resid_post", layer), w_dec.T.contiguous() * 0.5,
               torch.full((d_sae,), -0.5) + 0.1 * torch.randn(d_sae, generator=g), w_dec,
               0.01 * torch.randn(hidden, generator=g))


def calibrate(sae, llm, vocab: int, l0: int) -> float:
    """Set ``b_enc`` so that each latent fires on about ``l0 / d_sae`` of the model's real states at the
    SAE's point (random-token prompts): a random SAE as sparse as trained ones. Returns the mean L0."""
    from tapllm import HiddenStatesSpec

    g = torch.Generator().manual_seed(7)
    sample = torch.randint(100, vocab, (4, 128), generator=g).tolist()
    outs = llm.encode(sample, HiddenStatesSpec(layers=[sae.layer], points=[sae.point]), use_tqdm=False)
    x = torch.cat([o.hidden_states[sae.point][:, 0] for o in outs]).float()
    pre = (x - sae.b_dec) @ sae.W_enc
    sae.b_enc = -torch.quantile(pre, 1 - l0 / sae.d_sae, dim=0)
    return float((sae.encode(x) > 0).sum(-1).float().mean())


def best_of(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from tapllm import LLM, HiddenStatesSpec
    from tapllm.config import EngineConfig
    from tapllm.loader import resolve_model
    from tapllm.sae.formats import save_saelens

    folder = resolve_model(None)
    cfg = json.loads((folder / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, vocab, (args.prompts, args.prompt_len), generator=g).tolist()
    sae = random_sae(hidden, args.expansion * hidden, args.layer)
    llm = LLM(config=EngineConfig(model=str(folder), dtype=args.dtype, max_num_seqs=args.prompts,
                                  enable_prefix_caching=False))
    l0 = f", L0 {calibrate(sae, llm, vocab, args.l0):.0f} on real states" if args.l0 else ""
    print(f"model {folder.name} ({args.dtype}, CPU threads {torch.get_num_threads()}); {sae!r}{l0}; "
          f"{args.prompts} prompts x {args.prompt_len} tokens, top {args.top}")
    if args.cost_only:
        feature_cost(llm, sae, args, vocab)
        return
    spec = HiddenStatesSpec(sae=sae, features=f"topk:{args.top}")
    llm.encode(prompts[:1], spec, use_tqdm=False)  # warm-up (moves the SAE once)
    outs: list = []

    def encode() -> None:
        outs[:] = llm.encode(prompts, spec, use_tqdm=False)

    secs = best_of(encode, 3)
    tokens = args.prompts * args.prompt_len
    ours = tokens / secs
    print(f"(1) tapllm: top-{args.top} features of {tokens} prompt tokens in {secs:.2f} s = {ours:,.0f} tok/s")
    first = outs[0].hidden_states.features

    if args.saelens_python:
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            save_saelens(sae, tmp_path / "sae")
            (tmp_path / "prompts.json").write_text(json.dumps(prompts))
            cmd = [args.saelens_python, str(Path(__file__).with_name("_sae_saelens_worker.py")), "--model",
                   str(folder), "--sae", str(tmp_path / "sae"), "--prompts", str(tmp_path / "prompts.json"),
                   "--top", str(args.top), "--batch", str(args.batch), "--dtype", args.dtype,
                   "--out", str(tmp_path / "top.pt")]
            done = subprocess.run(cmd, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
            if done.returncode != 0:
                print(f"    SAELens failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else '?'}")
            else:
                res = json.loads(done.stdout.strip().splitlines()[-1])
                theirs = torch.load(tmp_path / "top.pt")
                diff = float((theirs["values"] - first.values.float()).abs().max())
                scale = float(theirs["values"].abs().max())
                same_ids = float((theirs["ids"] == first.ids.long()).float().mean())
                print(f"    SAELens {res['torch']}: {res['seconds']:.2f} s = {res['tok_per_s']:,.0f} tok/s; tapllm is "
                      f"{ours / res['tok_per_s']:.1f}x; first prompt's top-{args.top} values differ by at most "
                      f"{diff:.2e} ({diff / scale:.1e} of the largest), ids equal at {same_ids:.1%}")

    feature_cost(llm, sae, args, vocab)


def feature_cost(llm, sae, args: argparse.Namespace, vocab: int) -> None:
    """Part (2): plain and featured generation interleaved in one process, fresh prompts each round."""
    import os
    import statistics

    from tapllm import HiddenStatesSpec, SamplingParams
    from tapllm.sae import batch as feature_module

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    featured = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True,
                              hidden_states=HiddenStatesSpec(sae=sae, features=f"topk:{args.top}", positions="all"))
    spent = [0.0]
    original = feature_module.FeatureBatch.run

    def timed_run(self, *a, **kw):  # the SAE work of a step, timed (benchmark only)
        t0 = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    def prompts_of(round_: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(1000 + round_)
        return torch.randint(100, vocab, (args.prompts, args.prompt_len), generator=g).tolist()

    feature_module.FeatureBatch.run = timed_run
    try:
        llm.generate(prompts_of(-1), params, use_tqdm=False)  # warm-up of both paths, not counted
        llm.generate(prompts_of(-1), featured, use_tqdm=False)
        load = os.getloadavg()[0]
        times: dict[str, list[float]] = {"plain": [], "features": []}
        cpu: dict[str, list[float]] = {"plain": [], "features": []}
        shares, ratios, cpu_ratios = [], [], []
        for r in range(args.rounds):
            prompts = prompts_of(r)  # fresh prompts each round, the same for both runs of the round
            for name in (["plain", "features"] if r % 2 == 0 else ["features", "plain"]):
                spent[0] = 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                llm.generate(prompts, params if name == "plain" else featured, use_tqdm=False)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                if name == "features":
                    shares.append(spent[0] / times[name][-1])
            ratios.append(times["features"][-1] / times["plain"][-1])
            cpu_ratios.append(cpu["features"][-1] / cpu["plain"][-1])
    finally:
        feature_module.FeatureBatch.run = original
    plain, feat = min(times["plain"]), min(times["features"])
    gen = args.prompts * args.new_tokens
    print(f"(2) generation of {args.new_tokens} tokens x {args.prompts} prompts of {args.prompt_len}, top-{args.top} "
          f"features at every position, {args.rounds} interleaved rounds (fresh prompts each), load average "
          f"{load:.2f} before, {os.getloadavg()[0]:.2f} after:")
    print(f"    plain best {plain:.2f} s ({gen / plain:,.0f} generated tok/s), median "
          f"{statistics.median(times['plain']):.2f} s; with features best {feat:.2f} s, median "
          f"{statistics.median(times['features']):.2f} s")
    print(f"    features / plain: median of the rounds' ratios {statistics.median(ratios):.3f} (overhead "
          f"{statistics.median(ratios) - 1:+.1%}; rounds {', '.join(f'{x:.3f}' for x in ratios)}); best / best "
          f"{feat / plain:.3f}")
    print(f"    CPU time of this process (less sensitive to other processes than wall time): median of the "
          f"rounds' ratios {statistics.median(cpu_ratios):.3f} (overhead {statistics.median(cpu_ratios) - 1:+.1%}; "
          f"rounds {', '.join(f'{x:.3f}' for x in cpu_ratios)})")
    print(f"    the SAE work itself (FeatureBatch.run: encode, error norm, top-k, copies) is "
          f"{statistics.median(shares):.1%} of the featured call (median; least {min(shares):.1%})")


if __name__ == "__main__":
    main()
