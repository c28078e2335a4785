"""One EAGLE-3 training step of SGLang SpecForge on a tapllm-made dataset (``eagle3_check.py``).

Runs in SpecForge's own virtual environment: ``python3 -m venv /tmp/specforge &&
/tmp/specforge/bin/pip install torch==2.13.0 transformers datasets safetensors pydantic pyyaml
psutil tqdm accelerate numpy huggingface-hub triton`` and ``pip install --no-deps specforge``
(its declared ``sglang`` and CUDA pins are for capture on GPUs; reading offline features and
training the draft need none of them).

SpecForge's offline data path, as its trainer assembles it: ``OfflineManifestReader`` lists the
``.ckpt`` files, ``LocalFeatureStore`` reads them, ``FeatureDataLoader`` applies the EAGLE-3
normalizer and collator; then its ``LlamaForCausalLMEagle3`` draft (one layer, sized from the
target's config, the dataset's ``vocab_mapping.pt`` loaded), ``OnlineEagle3Model`` and
``Eagle3TrainStrategy.forward_loss`` with the frozen ``TargetHead`` (its LM head: the tied
embedding here, which ``TargetHead.load_weights`` does not look for, so it is copied in), one
backward and AdamW step on the CPU. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # its fused loss is a Triton kernel: Triton's interpreter runs it here
import torch  # noqa: E402


def main() -> None:
    """Load, take one step, report."""
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="the specforge/ folder of a tapllm eagle3 dataset")
    p.add_argument("--model", required=True, help="the target model's folder (config.json, model.safetensors)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--ttt-length", type=int, default=3)
    args = p.parse_args()

    from safetensors import safe_open
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer, build_offline_reader
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import AutoConfig, LlamaConfig

    torch.manual_seed(0)
    refs = build_offline_reader(args.data, run_id="tapllm", ttt_length=args.ttt_length, max_len=args.max_len).read()
    loader = FeatureDataLoader(LocalFeatureStore(), refs=refs, batch_size=1, collate_fn=build_offline_collator(),
                               per_sample_transform=build_offline_normalizer(args.max_len), ack=False,
                               gc_interval_s=None)
    batch = next(iter(loader))
    shapes = {k: list(v.shape) for k, v in batch.tensors.items() if isinstance(v, torch.Tensor)}

    vocab = torch.load(f"{args.data}/vocab_mapping.pt")
    target = AutoConfig.from_pretrained(args.model)
    cfg = LlamaConfig(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                      num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                      num_hidden_layers=1, vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                      max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False,
                      rope_theta=getattr(target, "rope_theta", 10000.0), hidden_act="silu")
    cfg.draft_vocab_size = int(vocab["d2t"].numel())
    draft = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
    draft.load_vocab_mapping(f"{args.data}/vocab_mapping.pt")
    head = TargetHead(args.model)
    with safe_open(f"{args.model}/model.safetensors", "pt") as f:
        key = "lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight"
        head.fc.weight.data.copy_(f.get_tensor(key))
    head.freeze_weights()
    head = head.eval().to(torch.bfloat16)  # as TargetHead.from_pretrained leaves it
    with safe_open(f"{args.model}/model.safetensors", "pt") as f:
        draft.embed_tokens.weight.data.copy_(f.get_tensor("model.embed_tokens.weight"))
    model = OnlineEagle3Model(draft, length=args.ttt_length, attention_backend="sdpa")
    strategy = Eagle3TrainStrategy(model, target_head=head)
    params = [q for q in draft.parameters() if q.requires_grad]
    before = [q.detach().clone() for q in params]
    opt = torch.optim.AdamW(params, lr=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision, as its trainer runs
        out = strategy.forward_loss(batch)
    opt.zero_grad()
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    moved = sum(int(not torch.equal(b, q.detach())) for b, q in zip(before, params))
    print(json.dumps({"files": len(refs), "batch": shapes, "target_repr": batch.metadata.get("target_repr"),
                      "loss": float(out.loss.detach()), "parameters_updated": moved,
                      "plosses": [float(x) for x in out.metrics["plosses"]],
                      "acces": [float(x) for x in out.metrics["acces"]]}))


if __name__ == "__main__":
    main()
