"""Train a tiny top-k SAE on the default model's states, collected with ``tapllm collect``.

A small demonstration, not a research-grade SAE: a few thousand ``resid_post`` rows of one
block of SmolLM2-135M-Instruct (its replies to a few dozen short prompts, greedy, so the rows
are the model's own text), a few hundred Adam steps in plain torch (no new dependency), saved
in SAELens' layout (``cfg.json`` + ``sae_weights.safetensors``, architecture ``topk``) so
``tapllm.SAE.load``, SAELens and the ``tapllm features`` command read it.

The recipe is sparsify's for top-k SAEs: decoder rows of unit norm (renormalized after each
step), the encoder initialized to the decoder's transpose, ``b_dec`` to the data mean, the loss
the fraction of variance unexplained (FVU); without its AuxK loss (too few steps to matter).
Position 0 of every sequence is left out (its norm is tens of times the others').

Run from the repository root (a few minutes of CPU)::

    python scripts/train_tiny_sae.py --out /tmp/tiny-sae            # the SAE in /tmp/tiny-sae/sae
    tapllm features "The cat sat on the mat" --sae /tmp/tiny-sae/sae --top 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

TOPICS = ["the ocean", "a small village", "the history of bread", "how rain forms", "a chess game", "the moon",
          "learning to swim", "a city at night", "the first computers", "bees and flowers", "a long train journey",
          "winter in the mountains", "how to cook rice", "a lost cat", "the planets", "an old library",
          "volcanoes", "friendship", "a football match", "the human heart", "music and mathematics",
          "a rainy Monday", "desert plants", "the printing press", "electric cars", "a birthday party",
          "ancient Rome", "photosynthesis", "a thunderstorm", "learning a new language", "the stock market",
          "a garden in spring"]
STYLES = ["Write a short story about {}.", "Explain {} to a child.", "Give three facts about {}.",
          "Write a poem about {}."]


def collect(out: Path, layer: int, max_tokens: int) -> Path:
    """Greedy replies to the prompts, their ``resid_post`` rows at ``layer`` (prompt and reply)."""
    from tapllm.cli import main as tapllm_main

    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    with prompts.open("w") as f:
        for i, topic in enumerate(TOPICS):
            for style in STYLES[i % 2 :: 2]:
                f.write(json.dumps({"messages": [{"role": "user", "content": style.format(topic)}]}) + "\n")
    acts = out / "acts"
    code = tapllm_main(["collect", "--input", str(prompts), "--out", str(acts), "--layers", str(layer),
                        "--points", "resid_post", "--positions", "all", "--max-tokens", str(max_tokens),
                        "--dtype", "float32", "--quiet"])
    if code != 0:
        raise SystemExit(f"tapllm collect failed ({code})")
    return acts


def train(x: torch.Tensor, d_sae: int, k: int, steps: int, batch: int, seed: int = 0):
    """A top-k SAE on rows ``x`` ``[n, d_in]``: returns ``(W_enc, b_enc, W_dec, b_dec)``."""
    g = torch.Generator().manual_seed(seed)
    d_in = x.shape[1]
    w_dec = torch.nn.functional.normalize(torch.randn(d_sae, d_in, generator=g), dim=-1)
    params = {"W_enc": w_dec.T.clone(), "b_enc": torch.zeros(d_sae), "W_dec": w_dec, "b_dec": x.mean(0)}
    for p in params.values():
        p.requires_grad_(True)
    lr = 2e-4 / (d_sae / 2**14) ** 0.5  # sparsify's default scaling
    opt = torch.optim.Adam(params.values(), lr=lr, eps=6.25e-10)
    var = (x - x.mean(0)).pow(2).sum(-1).mean()
    for step in range(steps):
        rows = x[torch.randint(0, len(x), (batch,), generator=g)]
        pre = (rows - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
        vals, ids = pre.topk(k, dim=-1)
        recon = torch.nn.functional.embedding_bag(ids, params["W_dec"], per_sample_weights=vals.relu(),
                                                  mode="sum") + params["b_dec"]
        loss = (rows - recon).pow(2).sum(-1).mean() / var
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            params["W_dec"] /= params["W_dec"].norm(dim=-1, keepdim=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step:4d}  FVU {loss.item():.3f}")
    return tuple(params[n].detach() for n in ("W_enc", "b_enc", "W_dec", "b_dec"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layer", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=96, help="reply tokens per prompt")
    p.add_argument("--expansion", type=int, default=4, help="d_sae = expansion x hidden")
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=512)
    args = p.parse_args(argv)

    import tapllm.datasets
    from tapllm import SAE
    from tapllm.sae.formats import save_saelens
    from tapllm.sae.model import SAEConfig

    t0 = time.perf_counter()
    acts = args.out / "acts"
    if not (acts / "run.json").exists():
        acts = collect(args.out, args.layer, args.max_tokens)
    ds = tapllm.datasets.open(acts)
    rows = ds[list(range(len(ds)))]
    x = rows["resid_post"][:, 0].float()[rows["position"] > 0]
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    held, x = x[perm[: len(x) // 10]], x[perm[len(x) // 10 :]]
    print(f"{len(x)} training rows, {len(held)} held out, of resid_post at block {args.layer} "
          f"({time.perf_counter() - t0:.0f} s)")
    d_sae = args.expansion * x.shape[1]
    w_enc, b_enc, w_dec, b_dec = train(x, d_sae, args.k, args.steps, args.batch)
    cfg = SAEConfig("topk", x.shape[1], d_sae, "resid_post", args.layer, k=args.k)
    sae = SAE(cfg, w_enc.contiguous(), b_enc, w_dec.contiguous(), b_dec)
    z = sae.encode(held)
    fvu = float((held - sae.decode(z)).pow(2).sum() / (held - held.mean(0)).pow(2).sum())
    dead = int((sae.encode(x).amax(0) <= 0).sum())
    folder = save_saelens(sae, args.out / "sae")
    print(f"held-out FVU {fvu:.3f} (explained variance {1 - fvu:.1%}), {dead} of {d_sae} latents never fire "
          f"on the training rows; saved {folder} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
