"""``SAE``: a sparse autoencoder (or transcoder) over one point of the model, in one canonical form.

Every format tapllm reads (SAELens, EleutherAI sparsify, Gemma Scope; see ``formats.py``) is
turned into the same weights, in SAELens' orientation:

* ``W_enc`` ``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``, ``W_dec`` ``[d_sae, d_in]``, ``b_dec`` ``[d_in]``;
* ``threshold`` ``[d_sae]`` (JumpReLU), ``k`` (top-k), ``b_gate``/``b_mag``/``r_mag`` (gated);
* ``W_skip`` ``[d_out, d_in]`` (sparsify's skip connection).

Encoding, for an input row ``x``::

    x_in = normalize(x) - b_dec * apply_b_dec_to_input
    pre  = x_in @ W_enc + b_enc             (times the decoder row norms with rescale_acts_by_decoder_norm)
    z    = relu(pre)                        standard
         = relu(pre) * (pre > threshold)    jumprelu
         = relu(pre) kept at its k largest  topk (the others 0)
         = (x_in @ W_enc + b_gate > 0) * relu(x_in @ (W_enc * exp(r_mag)) + b_mag)   gated

and decoding ``denormalize(z @ W_dec + b_dec) (+ x @ W_skip.T)``. ``normalize`` is SAELens'
``normalize_activations``: ``constant_norm_rescale`` scales each row to norm ``sqrt(d_in)``,
``layer_norm`` centres and divides by the (unbiased) standard deviation; decoding undoes it
with the same row's factors.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import torch

from tapllm.sae.sae_config import SAEConfig

ARCHITECTURES = ("standard", "topk", "jumprelu", "gated")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
_LN_EPS = 1e-5  # SAELens' layer_norm epsilon (added to the standard deviation)


class SAE:
    """A sparse autoencoder over one point of the model (see the module docstring).

    Load one with :meth:`load` (SAELens, sparsify or Gemma Scope; a folder, a file or a hub
    id) or build one from tensors. ``encode`` gives the dense latents ``[..., d_sae]``,
    ``decode`` the reconstruction; both run in float32 by default on the SAE's device.

    Attributes:
        cfg: the :class:`SAEConfig`.
        W_enc, b_enc, W_dec, b_dec: the weights (SAELens' orientation).
        threshold: JumpReLU thresholds, or None.
        b_gate, b_mag, r_mag: a gated SAE's extra parameters, or None.
        W_skip: a skip connection ``[d_out, d_in]`` (sparsify), or None.
    """

    def __init__(self, cfg: SAEConfig, W_enc: torch.Tensor, b_enc: torch.Tensor | None, W_dec: torch.Tensor,
                 b_dec: torch.Tensor, *, threshold: torch.Tensor | None = None, b_gate: torch.Tensor | None = None,
                 b_mag: torch.Tensor | None = None, r_mag: torch.Tensor | None = None,
                 W_skip: torch.Tensor | None = None) -> None:
        self.cfg = cfg
        self.W_enc = W_enc
        self.b_enc = b_enc if b_enc is not None else W_enc.new_zeros(cfg.d_sae)
        self.W_dec = W_dec
        self.b_dec = b_dec
        self.threshold = threshold
        self.b_gate, self.b_mag, self.r_mag = b_gate, b_mag, r_mag
        self.W_skip = W_skip
        self._digest: bytes | None = None
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # oneDNN copies of W_enc.T, W_dec.T (CPU)
        self._check()

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, *, hookpoint: str | None = None, point: str | None = None,
             layer: int | None = None, revision: str | None = None, download_dir: str | os.PathLike | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> SAE:
        """Read an SAE from a folder, a file or a Hugging Face hub id (through the local cache).

        Formats: SAELens (``cfg.json`` + ``sae_weights.safetensors``), EleutherAI sparsify
        (``cfg.json`` + ``sae.safetensors``, one folder per hookpoint: pick one with
        ``hookpoint``), Gemma Scope (``params.npz``). ``point``/``layer`` override (or supply,
        for a Gemma Scope file outside its ``layer_N`` folder) where the SAE reads. Options a
        format has that tapllm does not implement are refused by name (``ValueError``).

        A hub id is ``org/name``, optionally followed by the SAE's folder in the repository as
        SAELens' releases and Gemma Scope lay them out (``org/name/blocks.8.hook_resid_pre``,
        ``google/gemma-scope-2b-pt-res/layer_3/width_16k/average_l0_50``); a sparsify
        repository's hookpoint is named with ``hookpoint``. It is read from the Hugging Face
        cache (``download_dir``, else ``HF_HUB_CACHE``/``HF_HOME``) at ``revision``, and
        downloaded only when missing and ``HF_HUB_OFFLINE`` is unset, as models are.
        """
        from tapllm.sae.formats import read_sae

        config, weights = read_sae(path, hookpoint=hookpoint, point=point, layer=layer, revision=revision,
                                   download_dir=download_dir)
        return cls(config, **weights).to(device, dtype)

    def _check(self) -> None:
        c = self.cfg
        if c.architecture not in ARCHITECTURES:
            raise ValueError(f"SAE architecture {c.architecture!r} is not supported; supported: {list(ARCHITECTURES)}")
        if c.normalize_activations not in NORMALIZATIONS:
            raise ValueError(f"SAE normalize_activations={c.normalize_activations!r} is not supported; supported: "
                             f"{list(NORMALIZATIONS)}")
        shapes = {"W_enc": (c.d_in, c.d_sae), "b_enc": (c.d_sae,), "b_dec": (c.d_in,)}
        d_out = self.b_dec.shape[0] if self.b_dec.dim() == 1 else -1
        shapes["W_dec"] = (c.d_sae, d_out)
        if c.architecture == "jumprelu":
            if self.threshold is None:
                raise ValueError("a jumprelu SAE needs 'threshold'")
            shapes["threshold"] = (c.d_sae,)
        if c.architecture == "gated":
            if self.b_gate is None or self.b_mag is None or self.r_mag is None:
                raise ValueError("a gated SAE needs 'b_gate', 'b_mag' and 'r_mag'")
            shapes.update(b_gate=(c.d_sae,), b_mag=(c.d_sae,), r_mag=(c.d_sae,))
        if c.architecture == "topk" and (c.k is None or not 1 <= c.k <= c.d_sae):
            raise ValueError(f"a topk SAE needs k in [1, d_sae={c.d_sae}], got k={c.k!r}")
        if not c.transcoder and d_out != c.d_in:
            raise ValueError(f"SAE b_dec has {d_out} entries; an SAE (not a transcoder) reconstructs d_in={c.d_in}")
        if self.W_skip is not None:
            shapes["W_skip"] = (d_out, c.d_in)
        for name, shape in shapes.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"SAE weight {name!r} has shape {tuple(t.shape)}, expected {shape} "
                                 f"(d_in={c.d_in}, d_sae={c.d_sae})")

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "b_gate", "b_mag", "r_mag", "W_skip")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> SAE:
        """A copy on ``device`` in ``dtype`` (``self`` when nothing changes)."""
        tensors = self._tensors()
        if all((device is None or t.device == torch.device(device)) and (dtype is None or t.dtype == dtype)
               for t in tensors.values()):
            return self
        moved = {n: t.to(device=device, dtype=dtype) for n, t in tensors.items()}
        out = SAE(replace(self.cfg), **moved)
        out._digest = self._digest
        return out

    def pack(self) -> bool:
        """Prepack the encoder and decoder for oneDNN where the platform allows it (CPU; see
        ``tapllm.layers.linear``): at decode sizes a prepacked matmul is several times faster.
        Returns whether it did. The engine packs its own device copies; results equal the plain
        matmuls up to float rounding."""
        from tapllm.backends.select import prepack_available

        if self._packed is not None or self.cfg.architecture == "gated" or \
                not prepack_available(self.device, self.dtype):
            return self._packed is not None
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self._packed = (reorder(self.W_enc.T.contiguous(), 16), reorder(self.W_dec.T.contiguous(), 16))
        return True

    def _linear(self, x: torch.Tensor, which: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W_enc (+ b)`` (which=0) or ``x @ W_dec (+ b)`` (which=1), prepacked when packed."""
        if self._packed is not None and x.dim() == 2 and x.dtype == self.dtype:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed[which], bias, "none", [None], "")
        y = x @ (self.W_enc if which == 0 else self.W_dec)
        return y + bias if bias is not None else y

    # ---- properties ----------------------------------------------------------------------
    @property
    def d_sae(self) -> int:
        """Number of latents (features)."""
        return self.cfg.d_sae

    @property
    def d_in(self) -> int:
        """Width of the input row."""
        return self.cfg.d_in

    @property
    def point(self) -> str | None:
        """The tapllm point the encoder reads (``resid_post``, ``mlp_out``, ``z``, ...)."""
        return self.cfg.point

    @property
    def layer(self) -> int | None:
        """The block index the encoder reads (None for ``embed``/``final``)."""
        return self.cfg.layer

    @property
    def architecture(self) -> str:
        """``standard``, ``topk``, ``jumprelu`` or ``gated``."""
        return self.cfg.architecture

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.W_enc.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return self.W_enc.dtype

    def digest(self) -> bytes:
        """A hash of the configuration and every weight (the prefix-cache key of an SAE steer)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            c = self.cfg
            h.update(repr((c.architecture, c.d_in, c.d_sae, c.point, c.layer, c.k, c.apply_b_dec_to_input,
                           c.normalize_activations, c.rescale_acts_by_decoder_norm, c.out_point,
                           c.out_layer)).encode())
            for name, t in self._tensors().items():
                h.update(name.encode())
                h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
            self._digest = h.digest()
        return self._digest

    def __repr__(self) -> str:
        c = self.cfg
        where = f"{c.point}@{c.layer}" if c.layer is not None else str(c.point)
        extra = f", k={c.k}" if c.k is not None else ""
        out = f" -> {c.out_point}@{c.out_layer}" if c.transcoder else ""
        return f"SAE({c.architecture}{extra}, d_in={c.d_in}, d_sae={c.d_sae}, {where}{out}, format={c.format})"

    # ---- the computation -------------------------------------------------------------------
    def normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The normalized input and the per-row factors ``(scale, shift)`` decoding undoes (None: none)."""
        mode = self.cfg.normalize_activations
        if mode == "constant_norm_rescale":
            coeff = (self.cfg.d_in ** 0.5) / x.norm(dim=-1, keepdim=True)
            return x * coeff, (1.0 / coeff, torch.zeros_like(coeff))
        if mode == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            centred = x - mu
            std = centred.std(dim=-1, keepdim=True)
            return centred / (std + _LN_EPS), (std, mu)
        return x, None

    def encode_normalized(self, x_norm: torch.Tensor) -> torch.Tensor:
        """Latents from an already normalized input (``normalize(x)[0]``)."""
        c = self.cfg
        x_in = x_norm - self.b_dec if c.apply_b_dec_to_input else x_norm
        if c.architecture == "gated":
            gate = (x_in @ self.W_enc + self.b_gate) > 0
            mag = torch.relu(x_in @ (self.W_enc * self.r_mag.exp()) + self.b_mag)
            return mag * gate.to(mag.dtype)
        pre = self._linear(x_in, 0, self.b_enc)
        if c.architecture == "standard":
            return torch.relu(pre)
        if c.architecture == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        if c.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        values, ids = torch.topk(pre, c.k, dim=-1)
        return torch.zeros_like(pre).scatter_(-1, ids, torch.relu(values))

    def decode_normalized(self, z: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor] | None,
                          bias: bool = True) -> torch.Tensor:
        """``z @ W_dec (+ b_dec)``, de-normalized with the input rows' ``factors`` (no skip connection)."""
        if self.cfg.rescale_acts_by_decoder_norm:
            z = z / self.W_dec.norm(dim=-1)
        y = self._linear(z, 1, self.b_dec if bias else None)
        if factors is not None:
            scale, shift = factors
            y = y * scale + (shift if bias else 0.0)
        return y

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        if x.shape[-1] != self.cfg.d_in and x.dim() >= 2 and x.shape[-2] * x.shape[-1] == self.cfg.d_in:
            x = x.flatten(-2)  # per-head rows [..., heads, head_dim] (TransformerLens' hook_z reshape)
        if x.shape[-1] != self.cfg.d_in:
            raise ValueError(f"SAE input has width {x.shape[-1]}, but d_in is {self.cfg.d_in}")
        return x.to(self.dtype), tuple(x.shape[:-1])

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The dense latents ``[..., d_sae]`` of input rows ``x`` ``[..., d_in]``."""
        x, _ = self._rows(x)
        return self.encode_normalized(self.normalize(x)[0])

    @torch.no_grad()
    def decode(self, z: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction of latents ``z`` ``[..., d_sae]``.

        ``x``, the rows that were encoded, is needed when the SAE normalizes its input (the
        output is scaled back by each row's factors) or has a skip connection.
        """
        z = z.to(self.dtype)
        factors = None
        if self.cfg.normalize_activations != "none" or self.W_skip is not None:
            if x is None:
                raise ValueError(f"this SAE (normalize_activations={self.cfg.normalize_activations!r}"
                                 f"{', skip connection' if self.W_skip is not None else ''}) decodes with the "
                                 "input rows: pass decode(z, x)")
            x, _ = self._rows(x)
            factors = self.normalize(x)[1]
        y = self.decode_normalized(z, factors)
        if self.W_skip is not None:
            y = y + x @ self.W_skip.T
        return y

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: the reconstruction (the prediction, for a transcoder)."""
        return self.decode(self.encode(x), x)

    __call__ = forward
