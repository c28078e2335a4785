"""SAELens' side of ``benchmarks/sae.py``: runs in SAELens' own virtual environment
(``python3 -m venv /tmp/saelens && /tmp/saelens/bin/pip install torch==2.13.0 sae-lens``) and
prints one JSON line.

The model is the same local Llama-family checkpoint (transformers weights converted into a
``HookedSAETransformer`` with TransformerLens' Llama conversion; the config is written out
from the checkpoint's ``config.json``, since TransformerLens would otherwise fetch it from the
Hub). The SAE is read with ``SAE.load_from_disk`` from the folder tapllm wrote in SAELens'
layout. Timed: ``run_with_cache_with_saes`` over the prompts in batches, caching only
``hook_sae_acts_post``, then ``topk`` of the latents of every token (what tapllm returns).
"""

from __future__ import annotations

import argparse
import json
import time


def build_model(folder: str, dtype: str):
    """A HookedSAETransformer holding the checkpoint's weights (no LayerNorm folding: the raw model)."""
    import torch
    from sae_lens import HookedSAETransformer
    from transformer_lens.config import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 10000.0)
    cfg = HookedTransformerConfig(
        d_model=c.hidden_size, d_head=head_dim, n_heads=c.num_attention_heads, n_key_value_heads=c.num_key_value_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=min(c.max_position_embeddings, 4096),
        d_vocab=c.vocab_size, act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
        rotary_dim=head_dim, rotary_base=rope, eps=c.rms_norm_eps, gated_mlp=True, final_rms=True,
        original_architecture="LlamaForCausalLM", dtype=getattr(torch, dtype), default_prepend_bos=False,
    )
    model = HookedSAETransformer(cfg)
    model.load_and_process_state_dict(convert_llama_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False, refactor_factored_attn_matrices=False)
    return model.eval()


def main() -> None:
    """Load, warm up, time; print the timings (and the first prompt's top latents for the parity check)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--sae", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True, help="where to save the first prompt's top latents (torch.save)")
    args = p.parse_args()

    import torch
    from sae_lens import SAE

    prompts = json.load(open(args.prompts))
    model = build_model(args.model, args.dtype)
    sae = SAE.load_from_disk(args.sae)
    hook = sae.cfg.metadata.hook_name + ".hook_sae_acts_post"

    def run(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            _, cache = model.run_with_cache_with_saes(torch.tensor(batch), saes=[sae], names_filter=[hook])
            top = cache[hook].topk(args.top, dim=-1)
        return top.values, top.indices

    run(prompts[:1])  # warm-up
    t0 = time.perf_counter()
    first = None
    for i in range(0, len(prompts), args.batch):
        values, ids = run(prompts[i : i + args.batch])
        if first is None:
            first = (values[0].clone(), ids[0].clone())
    seconds = time.perf_counter() - t0
    torch.save({"values": first[0], "ids": first[1]}, args.out)
    tokens = sum(len(x) for x in prompts)
    print(json.dumps({"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
