"""``tapllm collect --recipe eagle3``: training data for EAGLE-3 drafters.

A drafter learns from the target model's hidden states at three auxiliary layers and at the
last layer, at every position of chat conversations, with a loss mask over the assistant
tokens. Per conversation (:mod:`tapllm.collect.chat` reads ShareGPT and UltraChat layouts):

1. the chat template renders it, and the assistant tokens are located (``loss_mask``);
2. with ``regenerate`` every assistant turn is written anew by the target model (turn by turn,
   each from the conversation so far; a conversation ending with a user turn gets a reply),
   and the last reply is generated in the same request that captures the states;
3. one request captures ``resid_post`` of blocks ``k - 1`` for each auxiliary layer ``k``
   (the input of block ``k``, as vLLM, SGLang and speculators number EAGLE-3's layers; by
   default ``[2, L // 2, L - 3]``) and of the last block (plus ``final``, the normed output,
   when SpecForge's layout is written) at every position;
4. the writer thread writes the conversation in each layout asked for
   (:mod:`~tapllm.collect.speculators_format`, :mod:`~tapllm.collect.specforge_format`, and
   ``tapllm``: the states in the run's own shards), and each group's shard holds its rows'
   ``token_id``, ``position``, ``request_index`` and ``loss_mask``.

At the end the token frequencies of the supervised tokens and the draft-vocabulary mapping
(:mod:`tapllm.collect.vocab`) are written beside each layout. Groups, resume, the lock, Ray
and ``metadata.json`` are ``tapllm collect``'s (:mod:`tapllm.collect.run`); conversations are
read by the driver and shipped to Ray workers like ``--input`` records.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tapllm.collect import specforge_format, speculators_format
from tapllm.collect.chat import Conversation, read_dataset, read_jsonl
from tapllm.collect.hf_input import DatasetSpec, open_dataset
from tapllm.collect.hf_input import fingerprint as dataset_fingerprint
from tapllm.collect.sources import fingerprint as file_fingerprint
from tapllm.collect.vocab import count_tokens, draft_mapping, frequency_dict
from tapllm.collect.writer import Manifest

FORMATS = ("speculators", "specforge", "tapllm")
FOLDERS = (speculators_format.FOLDER, specforge_format.FOLDER)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's auxiliary layers for a model of ``num_layers`` blocks (as vLLM, SGLang and speculators choose)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass(slots=True)
class Eagle3Settings:
    """What ``--recipe eagle3`` adds to a collection (see the module docstring).

    ``aux_layers``: the auxiliary layers (the input of these blocks; ``None``: EAGLE-3's).
    ``formats``: layouts written, any of ``speculators``, ``specforge``, ``tapllm``.
    ``regenerate``: write every assistant turn anew with the target model, sampling with
    ``temperature`` / ``top_p`` (``seed`` makes it reproducible) up to ``max_new_tokens``.
    ``draft_vocab_size``: the draft vocabulary of the ``d2t`` / ``t2d`` mapping (capped to the
    model's vocabulary). ``column``: the dataset column holding the conversations (``None``:
    the first of ``conversations``, ``conversation``, ``messages``, ``data``).
    ``max_conversations``: read at most this many.
    """

    aux_layers: list[int] | None = None
    formats: tuple[str, ...] = ("speculators", "specforge")
    regenerate: bool = False
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    draft_vocab_size: int = 32000
    column: str | None = None
    max_conversations: int | None = None
    resolved: list[int] = field(default_factory=list)  # the aux layers for this model (set by configure)

    def validate(self, cfg: Any) -> None:
        """``ValueError`` naming the bad setting (of the recipe or of ``cfg``, the run's)."""
        if (cfg.input is None) == (cfg.dataset is None):
            raise ValueError("give the conversations as either --input FILE or --dataset NAME_OR_PATH")
        used = [flag for flag, v in (("--context-size", cfg.context_size), ("--packing", cfg.packing or None),
                                     ("--truncate", cfg.truncate or None), ("--prepend-bos", cfg.prepend_bos),
                                     ("--max-tokens-total", cfg.max_tokens_total), ("--sae", cfg.sae),
                                     ("--exclude-special-tokens", cfg.exclude_special_tokens or None))
                if v is not None]
        if used:
            raise ValueError(f"{', '.join(used)} do not apply to --recipe eagle3 (whole conversations, every token)")
        bad = [f for f in self.formats if f not in FORMATS]
        if not self.formats or bad:
            raise ValueError(f"--eagle3-formats must name some of {list(FORMATS)}, got {list(self.formats)}")
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"--eagle3-formats names a layout twice: {list(self.formats)}")
        if self.aux_layers is not None:
            if len(self.aux_layers) != 3:
                raise ValueError(f"--aux-layers must name 3 layers (EAGLE-3 fuses three), got {self.aux_layers}")
            if any(k < 1 for k in self.aux_layers):
                raise ValueError(f"--aux-layers are the inputs of blocks 1..L-1 (block 0's input is the "
                                 f"embedding), got {self.aux_layers}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-tokens (per regenerated turn) must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"--temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
        if self.max_conversations is not None and self.max_conversations < 1:
            raise ValueError(f"--max-rows must be >= 1, got {self.max_conversations}")
        cfg.validate_output()

    def configure(self, cfg: Any, num_layers: int) -> Any:
        """``cfg`` set to capture what the recipe needs from a model of ``num_layers`` blocks."""
        aux = list(self.aux_layers) if self.aux_layers is not None else default_aux_layers(num_layers)
        if any(not 1 <= k < num_layers for k in aux):
            raise ValueError(f"--aux-layers {aux}: each must be in [1, {num_layers - 1}] for a {num_layers}-block "
                             "model (the input of that block)")
        if len(set(aux)) != 3:
            raise ValueError(f"--aux-layers {aux} must be 3 distinct layers")
        self.resolved = aux
        points = ["resid_post", "final"] if "specforge" in self.formats else ["resid_post"]
        return replace(cfg, layers=[k - 1 for k in aux] + [num_layers - 1], points=points, positions="all",
                       max_tokens=self.max_new_tokens if self.regenerate else 0)

    def identity(self) -> dict[str, Any]:
        """The recipe's part of ``run.json``."""
        return {"aux_layers": self.resolved, "formats": list(self.formats), "regenerate": self.regenerate,
                **({"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "seed": self.seed} if self.regenerate else {}),
                "draft_vocab_size": self.draft_vocab_size, "column": self.column,
                "max_conversations": self.max_conversations}


def read_conversations(cfg: Any) -> tuple[list[Conversation], dict[str, Any]]:
    """The conversations of ``cfg.input`` / ``cfg.dataset`` and the input's part of ``run.json``."""
    s: Eagle3Settings = cfg.recipe
    if cfg.input is not None:
        path = Path(cfg.input)
        if path.suffix in (".jsonl", ".json") and path.is_file():
            convs = read_jsonl(path)
        else:
            ds = _open(DatasetSpec(str(path)), s.column)
            convs = read_dataset(ds, str(path), s.column)
        source = {"input": str(path.resolve()), "input_sha256": file_fingerprint(path)}
    else:
        spec = cfg.dataset
        ds = _open(spec, s.column)
        convs = read_dataset(ds if s.max_conversations is None else _head(ds, s.max_conversations), spec.name,
                             s.column)
        name = str(Path(spec.name).expanduser().resolve()) if Path(spec.name).expanduser().exists() else spec.name
        source = {"dataset": {"name": name, "split": spec.split, "column": s.column,
                              "fingerprint": dataset_fingerprint(ds, spec)}}
    if s.max_conversations is not None:
        convs = convs[: s.max_conversations]
    return convs, {**source, "eagle3": s.identity()}


def _open(spec: DatasetSpec, column: str | None) -> Any:
    from tapllm.collect.chat import COLUMNS

    if column is not None:
        return open_dataset(DatasetSpec(spec.name, spec.split, column))
    last: ValueError | None = None
    for c in COLUMNS:
        try:
            return open_dataset(DatasetSpec(spec.name, spec.split, c))
        except ValueError as exc:
            if "is not a column" not in str(exc):
                raise
            last = exc
    raise ValueError(f"--dataset {spec.name}: no column named one of {list(COLUMNS)}; name it with --column "
                     f"({str(last).split('(columns: ')[-1].rstrip(')') if last else ''})")


def _head(ds: Any, n: int) -> Any:
    return ds.take(n) if hasattr(ds, "take") else ds.select(range(min(n, len(ds))))


def clean(out: Path) -> None:
    """Delete the temporaries a killed run left in the layouts' folders (no writer may run)."""
    for name in FOLDERS:
        folder = out / name
        if folder.is_dir():
            for f in folder.rglob(".*.tmp"):
                f.unlink()


def finish(out: Path, run: dict[str, Any], parts: int, vocab_size: int) -> None:
    """After every part: the per-layout files that cover the whole dataset (the speculators rows,
    token frequencies, the draft-vocabulary mapping), read back from the shards' index columns."""
    from tapllm.collect.mmap_shards import ShardView

    settings = run["eagle3"]
    shards = [e for k in range(parts) for e in Manifest(out, k).load()]
    ids: dict[int, torch.Tensor] = {}
    masks: dict[int, torch.Tensor] = {}
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in shards:  # the index columns only, each conversation's rows a slice
        columns = ShardView(out / e.file, run["storage"]).columns
        req, tok, mask = (columns[c].slice(0, e.rows) for c in ("request_index", "token_id", "loss_mask"))
        count_tokens(counts, tok, mask)
        edges = [0, *(torch.nonzero(torch.diff(req)).flatten() + 1).tolist(), len(req)]
        for a, b in zip(edges[:-1], edges[1:]):
            if b > a:
                ids[int(req[a])], masks[int(req[a])] = tok[a:b], mask[a:b].long()
    order = sorted(ids)
    if order != list(range(len(order))):
        raise RuntimeError("the shards do not hold every conversation once; rerun to complete the dataset")
    d2t, t2d = draft_mapping(counts, min(settings["draft_vocab_size"], vocab_size))
    if "speculators" in settings["formats"]:
        speculators_format.write_rows(out, [ids[i] for i in order], [masks[i] for i in order])
        speculators_format.write_vocab(out, frequency_dict(counts), d2t, t2d)
    if "specforge" in settings["formats"]:
        specforge_format.write_vocab(out, d2t, t2d)
