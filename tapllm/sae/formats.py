"""Reading SAEs from the formats people have: SAELens, EleutherAI sparsify and Gemma Scope.

Each reader maps the format's names onto :class:`tapllm.sae.model.SAE`'s config and weights
(``SAEParts``: ``SAE(config, **weights)`` builds it) and its point onto tapllm's (point, block).
Whatever a format can express that tapllm does not implement is refused by name, never
silently approximated.

* SAELens: ``cfg.json`` + ``sae_weights.safetensors``. ``hook_name`` is a TransformerLens hook
  (``blocks.5.hook_resid_post`` -> ``resid_post`` of block 5; ``blocks.5.attn.hook_z`` -> ``z``,
  flattened over heads as SAELens' ``hook_z`` reshaping does). Configs from before SAELens 6
  (``hook_point``, ``activation_fn_str="topk"`` with ``activation_fn_kwargs.k``, boolean
  ``normalize_activations``) are read as SAELens reads them.
* sparsify: ``cfg.json`` + ``sae.safetensors`` per hookpoint folder (``layers.5`` is the block's
  output, ``resid_post``; ``layers.5.mlp`` ``mlp_out``; ``layers.5.self_attn`` ``attn_out``).
  Weights ``encoder.weight`` ``[d_sae, d_in]``, ``encoder.bias``, ``W_dec`` ``[d_sae, d_out]``,
  ``b_dec``, optional ``W_skip``. A transcoder (``transcode``) over a whole block reads
  ``resid_pre`` and predicts ``resid_post``.
* Gemma Scope: ``params.npz`` with ``W_enc``, ``W_dec``, ``b_enc``, ``b_dec``, ``threshold``
  (JumpReLU, no ``b_dec`` subtraction); ``-res`` releases read ``resid_post``, ``-mlp``
  ``mlp_out``, ``-att`` ``z``; the block is the ``layer_N`` folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from tapllm.sae.sae_config import SAEConfig
from tapllm.tap import POINTS

SAEParts = tuple[SAEConfig, dict[str, torch.Tensor | None]]  # SAE(config, **weights)

SAELENS_WEIGHTS = "sae_weights.safetensors"
SPARSIFY_WEIGHTS = "sae.safetensors"
GEMMA_SCOPE_FILE = "params.npz"

# TransformerLens hook names (after "blocks.N.") and the tapllm point they are.
TL_HOOKS = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
    "attn.hook_z": "z",
    "mlp.hook_post": "mlp_post",
}
_TL_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_SPARSIFY_HOOK = re.compile(r"^(?:model\.|gpt_neox\.|transformer\.)?(?:layers|h)\.(\d+)(?:\.(mlp|self_attn|attn|attention))?$")
_SAELENS_TENSORS = {"W_enc", "b_enc", "W_dec", "b_dec", "threshold", "log_threshold", "b_gate", "b_mag", "r_mag",
                    "scaling_factor"}


def point_of_hook(hook_name: str) -> tuple[str, int | None]:
    """tapllm's (point, block) of a TransformerLens hook name; ``ValueError`` names the ones supported."""
    if hook_name == "ln_final.hook_normalized":
        return "final", None
    m = _TL_BLOCK.match(hook_name)
    if m and m.group(2) in TL_HOOKS:
        return TL_HOOKS[m.group(2)], int(m.group(1))
    raise ValueError(f"SAE hook_name {hook_name!r} has no tapllm point; supported: blocks.N.<"
                     f"{'|'.join(TL_HOOKS)}> and ln_final.hook_normalized")


def hook_of_point(point: str, layer: int | None) -> str:
    """The TransformerLens hook name of tapllm's (point, block)."""
    if point == "final":
        return "ln_final.hook_normalized"
    for hook, p in TL_HOOKS.items():
        if p == point:
            return f"blocks.{layer}.{hook}"
    raise ValueError(f"point {point!r} has no TransformerLens hook name")


def read_sae(path: str | os.PathLike, *, hookpoint: str | None = None, point: str | None = None,
             layer: int | None = None, revision: str | None = None,
             download_dir: str | os.PathLike | None = None) -> SAEParts:
    """Read the SAE at ``path`` (a folder, a ``params.npz``/``.safetensors`` file or a hub id) on CPU:
    its config and weights (``SAE.load`` builds the SAE)."""
    folder = _locate(path, revision, download_dir, hookpoint)
    if folder.is_file():
        if folder.name.endswith(".npz"):
            return _override(read_gemma_scope(folder), point, layer)
        folder = folder.parent
    if hookpoint is not None:
        sub = folder / hookpoint
        if not sub.is_dir():
            raise FileNotFoundError(f"SAE folder {folder} has no hookpoint folder {hookpoint!r}; it has "
                                    f"{_sae_folders(folder) or 'none'}")
        folder = sub
    if (folder / SAELENS_WEIGHTS).is_file():
        sae = read_saelens(folder)
    elif (folder / SPARSIFY_WEIGHTS).is_file():
        sae = read_sparsify(folder)
    elif (folder / GEMMA_SCOPE_FILE).is_file():
        sae = read_gemma_scope(folder / GEMMA_SCOPE_FILE)
    else:
        subs = _sae_folders(folder)
        if subs:
            raise ValueError(f"{folder} holds several SAEs ({subs}): pick one with hookpoint=")
        raise ValueError(f"{folder} holds no SAE tapllm reads: expected {SAELENS_WEIGHTS} (SAELens), "
                         f"{SPARSIFY_WEIGHTS} (sparsify) or {GEMMA_SCOPE_FILE} (Gemma Scope)")
    return _override(sae, point, layer)


def locate_sae(path: str | os.PathLike, revision: str | None = None, download_dir: str | os.PathLike | None = None,
               hookpoint: str | None = None) -> Path:
    """Where the SAE named by ``path`` is on disk: a local path as given, a hub id's folder in the
    Hugging Face cache (fetched if missing and allowed; see ``SAE.load``)."""
    return _locate(path, revision, download_dir, hookpoint)


def _sae_folders(folder: Path, limit: int = 12) -> list[str]:
    """The folders under ``folder`` (up to three levels down) that hold an SAE, relative to it."""
    if not folder.is_dir():
        return []
    found = {f.parent.relative_to(folder).as_posix() for name in (SAELENS_WEIGHTS, SPARSIFY_WEIGHTS, GEMMA_SCOPE_FILE)
             for depth in ("*/", "*/*/", "*/*/*/") for f in folder.glob(depth + name)}
    return sorted(found)[:limit]


def _locate(path: str | os.PathLike, revision: str | None, download_dir: str | os.PathLike | None,
            hookpoint: str | None) -> Path:
    """A local folder/file, or a hub id ``org/name[/subfolder...]`` resolved through the Hugging Face cache.

    On the hub an SAE lives in the repository's root, in a subfolder (a SAELens release's SAE
    path, such as ``blocks.8.hook_resid_pre`` or ``layer_3/width_16k/average_l0_50``) or in a
    sparsify hookpoint folder (``hookpoint=``); only that part of the repository is fetched.
    """
    p = Path(path).expanduser()
    if p.exists():
        if revision is not None or download_dir is not None:
            raise ValueError(f"SAE {p} is a local path: revision= and download_dir= apply to hub ids only")
        return p
    text = str(path)
    parts = text.split("/")
    if len(parts) < 2 or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"no such SAE file or folder: {text}")
    from tapllm.loader.hub import looks_like_repo_id, snapshot

    repo, sub = "/".join(parts[:2]), "/".join(x for x in parts[2:] if x)
    if not looks_like_repo_id(repo):
        raise FileNotFoundError(f"no such SAE file or folder: {text}")
    within = "/".join(x for x in (sub, hookpoint) if x)
    patterns = [within, f"{within}/*"] if within else ["*.json", "*.safetensors", "*.npz"]
    root = snapshot(repo, revision, cache_dir=download_dir, patterns=patterns, what="SAE")
    if sub and not (root / sub).exists():
        raise FileNotFoundError(f"SAE repository {repo!r} (at {root}) has no {sub!r}; the SAEs in it: "
                                f"{_sae_folders(root) or 'none'}")
    return root / sub if sub else root


def _override(sae: SAEParts, point: str | None, layer: int | None) -> SAEParts:
    config = sae[0]
    if point is not None:
        if point not in POINTS:
            raise ValueError(f"SAE point {point!r} is not a tapllm point; choose from {list(POINTS)}")
        config.point = point
    if layer is not None:
        config.layer = int(layer)
    if config.point is None:
        raise ValueError(f"SAE from {config.source}: its point is unknown (hook {config.hook_name!r}); "
                         "give point= (and layer=)")
    if config.point not in ("embed", "final") and config.layer is None:
        raise ValueError(f"SAE from {config.source}: its block is unknown; give layer=")
    return sae


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for a corrupt file
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable SAE config ({exc})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: the SAE config must be a JSON object")
    return out


# ---- SAELens ----------------------------------------------------------------------------------
def read_saelens(folder: Path) -> SAEParts:
    """An SAE saved by SAELens (``SAE.save_model``): ``cfg.json`` + ``sae_weights.safetensors``."""
    cfg = _read_json(folder / "cfg.json")
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    where = f"SAELens SAE {folder}"
    hook = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    if not hook:
        raise ValueError(f"{where}: cfg.json names no hook_name")
    head = meta.get("hook_head_index", cfg.get("hook_head_index", cfg.get("hook_point_head_index")))
    if head is not None:
        raise ValueError(f"{where}: hook_head_index={head} (an SAE on one head) is not supported")
    arch = cfg.get("architecture", "standard")
    act = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
    k = cfg.get("k")
    if act == "topk":
        arch, k = "topk", (cfg.get("activation_fn_kwargs") or {}).get("k", k)
    elif arch in ("standard", "gated", "jumprelu") and act not in ("relu", None):
        raise ValueError(f"{where}: activation_fn={act!r} is not supported (only relu, and topk)")
    if arch not in ("standard", "topk", "jumprelu", "gated"):
        raise ValueError(f"{where}: architecture {arch!r} is not supported; supported: standard, topk, jumprelu, "
                         "gated")
    norm = cfg.get("normalize_activations", "none")
    if isinstance(norm, bool) or norm is None:
        norm = "expected_average_only_in" if norm else "none"
    if norm == "expected_average_only_in":
        norm = "none"  # SAELens applies no run-time normalization for it: the scaling factor is folded in
    if norm not in ("none", "constant_norm_rescale", "layer_norm"):
        raise ValueError(f"{where}: normalize_activations={norm!r} is not supported; supported: none, "
                         "expected_average_only_in, constant_norm_rescale, layer_norm")
    try:
        point, layer = point_of_hook(hook)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    w = _load_safetensors(folder / SAELENS_WEIGHTS)
    unknown = sorted(set(w) - _SAELENS_TENSORS)
    if unknown:
        raise ValueError(f"{where}: weights {unknown} are not supported (a transcoder or another architecture)")
    scaling = w.pop("scaling_factor", None)
    if scaling is not None and not torch.allclose(scaling.float(), torch.ones_like(scaling.float())):
        raise ValueError(f"{where}: a finetuning scaling_factor other than 1 is not supported")
    if "log_threshold" in w:
        w["threshold"] = w.pop("log_threshold").float().exp()
    for name in ("W_enc", "W_dec", "b_dec"):
        if name not in w:
            raise ValueError(f"{where}: {SAELENS_WEIGHTS} has no {name!r}")
    d_in, d_sae = w["W_enc"].shape
    if cfg.get("d_in", d_in) != d_in or cfg.get("d_sae", d_sae) != d_sae:
        raise ValueError(f"{where}: cfg.json says d_in={cfg.get('d_in')}, d_sae={cfg.get('d_sae')} but W_enc is "
                         f"{tuple(w['W_enc'].shape)}")
    config = SAEConfig(arch, d_in, d_sae, point, layer, k=k if arch == "topk" else None,
                       apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)), normalize_activations=norm,
                       rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
                       hook_name=hook, format="saelens", source=str(folder),
                       metadata={k_: v for k_, v in meta.items() if isinstance(v, str | int | float | bool)})
    return config, dict(W_enc=w["W_enc"], b_enc=w.get("b_enc"), W_dec=w["W_dec"], b_dec=w["b_dec"],
                        threshold=w.get("threshold"), b_gate=w.get("b_gate"), b_mag=w.get("b_mag"), r_mag=w.get("r_mag"))


# ---- sparsify ---------------------------------------------------------------------------------
def read_sparsify(folder: Path) -> SAEParts:
    """A sparse coder saved by EleutherAI sparsify (``SparseCoder.save_to_disk``)."""
    cfg = _read_json(folder / "cfg.json")
    where = f"sparsify SAE {folder}"
    activation = cfg.get("activation", "topk")
    if activation != "topk":
        raise ValueError(f"{where}: activation={activation!r} is not supported (only topk)")
    w = _load_safetensors(folder / SPARSIFY_WEIGHTS)
    for name in ("encoder.weight", "W_dec", "b_dec"):
        if name not in w:
            raise ValueError(f"{where}: {SPARSIFY_WEIGHTS} has no {name!r}")
    unknown = sorted(set(w) - {"encoder.weight", "encoder.bias", "W_dec", "b_dec", "W_skip"})
    if unknown:
        raise ValueError(f"{where}: weights {unknown} are not supported")
    d_sae, d_in = w["encoder.weight"].shape
    if cfg.get("d_in", d_in) != d_in:
        raise ValueError(f"{where}: cfg.json says d_in={cfg.get('d_in')} but encoder.weight is {tuple(w['encoder.weight'].shape)}")
    transcode = bool(cfg.get("transcode", False))
    hook = folder.name
    point, layer, out_point = _sparsify_point(hook, transcode, where)
    config = SAEConfig("topk", d_in, d_sae, point, layer, k=int(cfg.get("k", 32)),
                       apply_b_dec_to_input=not transcode, hook_name=hook, format="sparsify", source=str(folder),
                       out_point=out_point, out_layer=layer if out_point else None)
    return config, dict(W_enc=w["encoder.weight"].T.contiguous(), b_enc=w.get("encoder.bias"), W_dec=w["W_dec"],
                        b_dec=w["b_dec"], W_skip=w.get("W_skip"))


def _sparsify_point(hook: str, transcode: bool, where: str) -> tuple[str | None, int | None, str | None]:
    """(point, block, transcoder's output point) of a sparsify hookpoint folder name."""
    m = _SPARSIFY_HOOK.match(hook)
    if m is None:
        if transcode:
            raise ValueError(f"{where}: transcoder hookpoint {hook!r} is not supported (only whole blocks, layers.N)")
        return None, None, None  # the caller asks for point=/layer=
    layer, sub = int(m.group(1)), m.group(2)
    if transcode:
        if sub is not None:
            raise ValueError(f"{where}: a transcoder over {hook!r} reads the sublayer's normalized input, which "
                             "tapllm does not tap; only whole-block transcoders (layers.N) are supported")
        return "resid_pre", layer, "resid_post"
    return {None: "resid_post", "mlp": "mlp_out"}.get(sub, "attn_out"), layer, None


# ---- Gemma Scope ------------------------------------------------------------------------------
def read_gemma_scope(file: Path) -> SAEParts:
    """A Gemma Scope JumpReLU SAE (``params.npz``)."""
    import numpy as np

    where = f"Gemma Scope SAE {file}"
    try:
        with np.load(file) as data:
            w = {k: torch.from_numpy(np.asarray(data[k], dtype=np.float32)) for k in data.files}
    except Exception as exc:  # numpy raises several types for a corrupt file
        raise ValueError(f"{where}: unreadable ({exc})") from None
    missing = [n for n in ("W_enc", "W_dec", "b_enc", "b_dec", "threshold") if n not in w]
    if missing:
        raise ValueError(f"{where}: params.npz has no {missing}")
    text = os.path.abspath(file)  # not resolve(): in the hub cache the file is a link into blobs/
    if "transcoder" in text:
        raise ValueError(f"{where}: Gemma Scope transcoders read the MLP's normalized input, which tapllm does "
                         "not tap; they are not supported")
    m = re.search(r"layer_(\d+)", text)
    layer = int(m.group(1)) if m else None
    kind = re.search(r"-(res|mlp|att)(?:-|/|$)", text)
    point = {"res": "resid_post", "mlp": "mlp_out", "att": "z"}[kind.group(1)] if kind else None
    d_in, d_sae = w["W_enc"].shape
    config = SAEConfig("jumprelu", d_in, d_sae, point, layer, apply_b_dec_to_input=False,
                       hook_name=hook_of_point(point, layer) if point else None, format="gemma_scope",
                       source=str(file))
    return config, dict(W_enc=w["W_enc"], b_enc=w["b_enc"], W_dec=w["W_dec"], b_dec=w["b_dec"],
                        threshold=w["threshold"])


def save_saelens(sae: Any, folder: str | os.PathLike) -> Path:
    """Write ``sae`` (a ``tapllm.sae.model.SAE``) in SAELens' layout (``cfg.json`` +
    ``sae_weights.safetensors``), readable by SAELens 6."""
    from safetensors.torch import save_file

    c = sae.cfg
    if c.transcoder or sae.W_skip is not None:
        raise ValueError("a transcoder has no SAELens SAE layout")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "architecture": c.architecture, "d_in": c.d_in, "d_sae": c.d_sae, "dtype": "float32", "device": "cpu",
        "apply_b_dec_to_input": c.apply_b_dec_to_input, "normalize_activations": c.normalize_activations,
        "reshape_activations": "hook_z" if c.point == "z" else "none",
        "metadata": {"hook_name": hook_of_point(c.point, c.layer), "hook_head_index": None, "sae_lens_version": "6.0.0"},
    }
    if c.architecture == "topk":
        cfg.update(k=c.k, rescale_acts_by_decoder_norm=c.rescale_acts_by_decoder_norm)
    tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in sae._tensors().items()}
    if c.architecture == "gated":
        tensors.pop("b_enc")
    save_file(tensors, str(folder / SAELENS_WEIGHTS))
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder
