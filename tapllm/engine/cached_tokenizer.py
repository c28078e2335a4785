"""The engine's tokenizer without importing transformers at every start.

``AutoTokenizer.from_pretrained`` is what resolves a checkpoint's tokenizer files (which class,
which special tokens, which post-processor adds BOS, which chat template), but importing
transformers costs 1-3 s. A fast tokenizer's work is then done by the ``tokenizers`` library
alone: encoding and decoding are its Rust pipeline. So transformers loads a checkpoint's
tokenizer once, and what it resolved is kept in tapllm's cache (the pipeline as
``tokenizers`` JSON, the special tokens and the chat template), keyed by the folder's files and
the transformers version; later starts build a :class:`CachedTokenizer` from that.

Only tokenizers whose encode and decode are transformers' generic fast-tokenizer code are kept
(no class-specific override, no clean-up of decoded spaces, no splitting of special tokens);
any other comes back as the transformers tokenizer itself. Whatever the engine does not call
(chat templates above all) is answered by the transformers tokenizer, loaded on first use.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tapllm.utils.cache import cache_root, files_key
from tapllm.utils.files import atomic_path
from tapllm.utils.hf_config import transformers_version

_HF_LOAD = threading.Lock()  # the first load of transformers' tokenizer (see CachedTokenizer.hf)

logger = logging.getLogger("tapllm")

_FORMAT = "1"  # bump when what a snapshot holds changes
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx")
# The methods of transformers' fast tokenizer whose behaviour CachedTokenizer reproduces.
_GENERIC = ("__call__", "encode", "decode", "_decode", "_encode_plus", "convert_ids_to_tokens",
            "convert_tokens_to_string", "get_vocab", "__len__")
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


class CachedTokenizer:
    """A fast tokenizer as transformers resolved it, run by ``tokenizers`` alone.

    ``encode``, ``decode``, ``__call__``, ``convert_ids_to_tokens``, ``convert_tokens_to_string``,
    ``get_vocab``, ``len()``, the special token ids and ``chat_template`` give what the
    transformers tokenizer gives; any other attribute (``apply_chat_template``, ...) is the
    transformers tokenizer's (:attr:`hf`, loaded on first use).
    """

    def __init__(self, backend: Tokenizer, meta: dict[str, Any], folder: Path, hf: Any = None) -> None:
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self._meta = meta
        self._folder = folder
        self._hf = hf
        self._chat_template = meta.get("chat_template")
        self.all_special_ids: list[int] = list(meta["all_special_ids"])
        self.all_special_tokens: list[str] = list(meta["all_special_tokens"])
        self.bos_token_id: int | None = meta["bos_token_id"]
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.pad_token_id: int | None = meta["pad_token_id"]
        self.unk_token_id: int | None = meta["unk_token_id"]

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer`` that does the work."""
        return self._backend

    @property
    def hf(self) -> Any:
        """The transformers tokenizer of the same files (imports transformers on first use)."""
        if self._hf is None:
            # A server renders chat templates on several threads at once; transformers' lazy
            # module is not safe to import from two of them ("cannot import name AutoTokenizer").
            with _HF_LOAD:
                if self._hf is None:
                    from transformers import AutoTokenizer

                    hf = AutoTokenizer.from_pretrained(str(self._folder))
                    hf.chat_template = self._chat_template
                    self._hf = hf
        return self._hf

    @property
    def chat_template(self) -> Any:
        """The chat template (a ``chat_template=`` given to the engine replaces the checkpoint's)."""
        return self._hf.chat_template if self._hf is not None else self._chat_template

    @chat_template.setter
    def chat_template(self, value: Any) -> None:
        self._chat_template = value
        if self._hf is not None:
            self._hf.chat_template = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # private names and pickle's and copy's protocol lookups are never the HF object's
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore, (self._backend.to_str(), self._meta, self._folder, self.chat_template)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text`` (with the BOS/EOS the tokenizer adds, unless ``add_special_tokens`` is False)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """``{"input_ids": ids}`` for a text, or a list of id lists for a list of texts."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [e.ids for e in self._backend.encode_batch(list(text), add_special_tokens=add_special_tokens)]}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        """The text of ``ids`` (an id, a list of ids, or a list of such lists: a list of texts)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], list | tuple):
            return [self._backend.decode(list(seq), skip_special_tokens=skip_special_tokens) for seq in ids]
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | list[str]:
        """The token strings of ``ids`` (one string for one id)."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Token strings joined into text by the tokenizer's decoder."""
        decoder = self._backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)


def _restore(backend: str, meta: dict[str, Any], folder: Path, chat_template: Any) -> CachedTokenizer:
    """A pickled :class:`CachedTokenizer` (without its transformers object, which loads again on use)."""
    tokenizer = CachedTokenizer(Tokenizer.from_str(backend), meta, folder)
    tokenizer.chat_template = chat_template
    return tokenizer


def _key_files(folder: Path) -> list[Path]:
    files = [f for f in folder.iterdir() if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES)]
    extra = folder / "additional_chat_templates"
    return files + (sorted(extra.iterdir()) if extra.is_dir() else [])


def read_tokenizer(folder: Path) -> Any:
    """The tokenizer of ``folder``: a :class:`CachedTokenizer` from tapllm's cache when it holds
    this folder's snapshot, else transformers' (which is then snapshotted where it can be)."""
    key = files_key(_key_files(folder), transformers_version(), _FORMAT)
    cached = cache_root() / "tokenizers" / key
    try:
        meta = json.loads((cached / "meta.json").read_text())
        return CachedTokenizer(Tokenizer.from_file(str(cached / "tokenizer.json")), meta, folder)
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - a damaged snapshot (tokenizers raises plain Exception): rebuild it
        logger.warning("ignoring the unreadable tokenizer snapshot %s: %s", cached, exc)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    meta = _snapshot_meta(hf)
    if meta is None:
        return hf
    backend = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cached, folder=True) as tmp:
            (tmp / "tokenizer.json").write_text(backend.to_str())
            (tmp / "meta.json").write_text(json.dumps(meta))
    except OSError as exc:  # read-only cache, or another process wrote it first: use what we have
        logger.debug("could not cache the tokenizer of %s: %s", folder, exc)
    return CachedTokenizer(backend, meta, folder, hf)


def _snapshot_meta(hf: Any) -> dict[str, Any] | None:
    """What a :class:`CachedTokenizer` needs besides the pipeline, or None when ``hf`` is not a
    tokenizer it reproduces."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not isinstance(hf, TokenizersBackend):
        return None
    if any(getattr(type(hf), name) is not getattr(TokenizersBackend, name) for name in _GENERIC):
        return None  # a class that encodes or decodes its own way
    if getattr(hf, "split_special_tokens", False):
        return None
    bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    cleans = hf.clean_up_tokenization_spaces and not (
        bpe and not getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    if cleans:
        return None
    template = hf.chat_template
    if template is not None and not isinstance(template, str | dict):
        return None
    return {"class": type(hf).__name__, "chat_template": template, "all_special_ids": list(hf.all_special_ids),
            "all_special_tokens": list(hf.all_special_tokens), **{name: getattr(hf, name) for name in _IDS}}
