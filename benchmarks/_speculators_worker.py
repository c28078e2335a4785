"""One EAGLE-3 training step of vLLM speculators on a tapllm-made dataset (``eagle3_check.py``).

Runs in speculators' own virtual environment (``python3 -m venv /tmp/speculators &&
/tmp/speculators/bin/pip install torch==2.13.0 speculators``, then ``pip uninstall
torchvision torchaudio``: the wheels pulled in do not match torch 2.13). Arguments are
``speculators train``'s own flags. Everything up to the first batch is speculators' code path
of ``speculators train`` (``TrainConfig``, vocabulary mappings read from ``--data-path``, the
draft model, ``create_train_val_loaders`` over its ``ArrowDataset`` and ``CollateFn``); its
``Trainer`` needs an accelerator, so the step itself is taken here the way its
``train_epoch`` takes it (``model(**batch, **train_call_kwargs)``, backward, clip, AdamW) on
the CPU. Prints one JSON line: the batch's shapes, the loss and the metrics.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> None:
    """Load, take one step, report."""
    from hs_connectors import HiddenStatesBackend
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.eagle3.rotary_partial import install_partial_neox_rotary
    from speculators.train import cli as train_cli
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders

    cfg = TrainConfig.resolve(sys.argv[1:])
    args = argparse.Namespace(**cfg.flatten())
    train_cli.set_seed(args.seed)
    install_partial_neox_rotary()
    d2t, t2d, draft_vocab_size = train_cli.parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry[args.speculator_type]
    model = train_cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    hidden = model.config.transformer_layer_config.hidden_size
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    train_loader, _ = create_train_val_loaders(
        data_path=args.data_path, total_seq_len=args.total_seq_len, hidden_states_dtype=torch.float32,
        transfer=transfer, vllm_endpoint=args.vllm_endpoint, on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path, request_timeout=args.request_timeout,
        max_retries=args.max_retries, generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures, hidden_size=hidden,
        num_target_layers=len(model.target_layer_ids), num_workers=0, prefetch_factor=args.prefetch_factor,
        preprocess=shift_batch, train_data_ratio=args.train_data_ratio, seed=args.seed)
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    batch = next(iter(train_loader))
    shapes = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    batch = {k: v for k, v in batch.items() if k != "error_records"}
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    _draft, loss, metrics = model(**batch, **train_kwargs)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    moved = sum(int(not torch.equal(before[n], p.detach())) for n, p in model.named_parameters() if n in before)
    print(json.dumps({"dataset_rows": len(train_loader.dataset), "batches": len(train_loader), "batch": shapes,
                      "loss": float(loss), "parameters_updated": moved,
                      "metrics": {k: float(v.float().mean()) for k, v in metrics.items()
                                  if isinstance(v, torch.Tensor)}}))


if __name__ == "__main__":
    main()
