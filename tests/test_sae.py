"""Sparse autoencoders: the formats (random SAEs written in each format's own layout), features
with generation (equal to ``SAE.encode`` of the captured states, in every batch situation) and
feature steering (equal to transformers with hooks doing the reference computation)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import hf_greedy, random_prompts
from helpers import assert_close
from tapllm import LLM, SAE, HiddenStates, HiddenStatesSpec, SamplingParams, Steer
from tapllm.sae.model import SAEConfig

D = 64  # the tiny models' hidden size
NEW = 6


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed)) * scale


# ---- writing random SAEs in each format's layout ----------------------------------------------
def write_saelens(folder: Path, arch: str, *, d_in: int = D, d_sae: int = 256, hook: str = "blocks.1.hook_resid_post",
                  seed: int = 0, v6: bool = True, **cfg_extra) -> Path:
    """cfg.json + sae_weights.safetensors as SAELens' ``save_model`` writes them (v6), or a pre-6 config."""
    folder.mkdir(parents=True, exist_ok=True)
    w = {"W_enc": _rand(d_in, d_sae, seed=seed, scale=0.3), "W_dec": _rand(d_sae, d_in, seed=seed + 1, scale=0.1),
         "b_dec": _rand(d_in, seed=seed + 2, scale=0.1)}
    if arch == "gated":
        w.update(b_gate=_rand(d_sae, seed=seed + 3, scale=0.2), b_mag=_rand(d_sae, seed=seed + 4, scale=0.2),
                 r_mag=_rand(d_sae, seed=seed + 5, scale=0.2))
    else:
        w["b_enc"] = _rand(d_sae, seed=seed + 3, scale=0.1)
    if arch == "jumprelu":
        w["threshold"] = torch.rand(d_sae, generator=_g(seed + 6)) * 0.5
    save_file(w, str(folder / "sae_weights.safetensors"))
    if v6:
        cfg = {"architecture": arch, "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
               "apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none",
               "metadata": {"hook_name": hook, "model_name": "tiny", "sae_lens_version": "6.5.0"}}
    else:
        cfg = {"d_in": d_in, "d_sae": d_sae, "hook_point": hook, "hook_point_layer": 1, "activation_fn_str": "relu",
               "apply_b_dec_to_input": True, "normalize_activations": False, "sae_lens_training_version": "3.0.0"}
    cfg.update(cfg_extra)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def write_sparsify(root: Path, hookpoint: str = "layers.1", *, d_in: int = D, d_sae: int = 256, k: int = 12,
                   seed: int = 10, transcode: bool = False, skip: bool = False) -> Path:
    """One hookpoint folder as sparsify's ``SparseCoder.save_to_disk`` writes it."""
    folder = root / hookpoint
    folder.mkdir(parents=True, exist_ok=True)
    w = {"encoder.weight": _rand(d_sae, d_in, seed=seed, scale=0.3), "encoder.bias": _rand(d_sae, seed=seed + 1, scale=0.1),
         "W_dec": _rand(d_sae, d_in, seed=seed + 2, scale=0.1), "b_dec": _rand(d_in, seed=seed + 3, scale=0.1)}
    if skip:
        w["W_skip"] = _rand(d_in, d_in, seed=seed + 4, scale=0.05)
    save_file(w, str(folder / "sae.safetensors"))
    cfg = {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True, "num_latents": d_sae, "k": k,
           "multi_topk": False, "skip_connection": skip, "transcode": transcode, "d_in": d_in}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def write_gemma_scope(root: Path, layer: int = 1, kind: str = "res", *, d_in: int = D, d_sae: int = 256,
                      seed: int = 20) -> Path:
    """``params.npz`` under Gemma Scope's folder scheme (``gemma-scope-2b-pt-res/layer_N/width_../average_l0_..``)."""
    folder = root / f"gemma-scope-2b-pt-{kind}" / f"layer_{layer}" / "width_16k" / "average_l0_10"
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "params.npz", W_enc=_rand(d_in, d_sae, seed=seed, scale=0.3).numpy(),
             W_dec=_rand(d_sae, d_in, seed=seed + 1, scale=0.1).numpy(), b_enc=_rand(d_sae, seed=seed + 2).numpy() * 0.1,
             b_dec=_rand(d_in, seed=seed + 3, scale=0.1).numpy(), threshold=(torch.rand(d_sae, generator=_g(seed + 4)) * 0.3).numpy())
    return folder / "params.npz"


# ---- independent references of each format's computation -------------------------------------
def ref_saelens(folder: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    w, cfg = load_file(str(folder / "sae_weights.safetensors")), json.loads((folder / "cfg.json").read_text())
    arch = cfg.get("architecture", "standard")
    sae_in = x - w["b_dec"]
    if arch == "gated":
        z = (sae_in @ w["W_enc"] + w["b_gate"] > 0).float() * torch.relu(sae_in @ (w["W_enc"] * w["r_mag"].exp()) + w["b_mag"])
    else:
        pre = sae_in @ w["W_enc"] + w["b_enc"]
        if arch == "jumprelu":
            z = torch.relu(pre) * (pre > w["threshold"]).float()
        elif arch == "topk":
            v, i = pre.topk(cfg["k"], dim=-1)
            z = torch.zeros_like(pre).scatter(-1, i, v.relu())
        else:
            z = torch.relu(pre)
    return z, z @ w["W_dec"] + w["b_dec"]


def ref_sparsify(folder: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    w, cfg = load_file(str(folder / "sae.safetensors")), json.loads((folder / "cfg.json").read_text())
    inp = x if cfg["transcode"] else x - w["b_dec"]
    pre = torch.relu(inp @ w["encoder.weight"].T + w["encoder.bias"])
    v, i = pre.topk(cfg["k"], dim=-1)
    y = (v[..., None] * w["W_dec"][i]).sum(-2) + w["b_dec"]
    if "W_skip" in w:
        y = y + x @ w["W_skip"].T
    return torch.zeros_like(pre).scatter(-1, i, v), y


def ref_gemma_scope(file: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = {k: torch.from_numpy(v) for k, v in np.load(file).items()}
    pre = x @ p["W_enc"] + p["b_enc"]
    z = (pre > p["threshold"]).float() * torch.relu(pre)
    return z, z @ p["W_dec"] + p["b_dec"]


# ---- formats ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated"])
def test_saelens_architectures(arch, tmp_path):
    extra = {"k": 9} if arch == "topk" else {}
    folder = write_saelens(tmp_path / arch, arch, **extra)
    sae = SAE.load(folder)
    assert (sae.point, sae.layer, sae.d_sae, sae.architecture) == ("resid_post", 1, 256, arch)
    x = _rand(7, D, seed=99, scale=2.0)
    z_ref, y_ref = ref_saelens(folder, x)
    z = sae.encode(x)
    assert_close(z, z_ref)
    assert_close(sae.decode(z), y_ref)
    assert 0 < int((z > 0).sum()) < z.numel()
    if arch == "topk":
        assert int((z > 0).sum(-1).max()) <= 9


def test_saelens_pre_6_config_and_hooks(tmp_path):
    folder = write_saelens(tmp_path / "old", "standard", hook="blocks.2.hook_mlp_out", v6=False)
    sae = SAE.load(folder)
    assert (sae.point, sae.layer, sae.architecture) == ("mlp_out", 2, "standard")
    old_topk = write_saelens(tmp_path / "oldk", "standard", v6=False, activation_fn_str="topk",
                             activation_fn_kwargs={"k": 5})
    assert SAE.load(old_topk).cfg.k == 5 and SAE.load(old_topk).architecture == "topk"
    for hook, where in [("blocks.0.hook_resid_pre", ("resid_pre", 0)), ("blocks.2.attn.hook_z", ("z", 2)),
                        ("blocks.1.hook_attn_out", ("attn_out", 1)), ("ln_final.hook_normalized", ("final", None))]:
        sae = SAE.load(write_saelens(tmp_path / hook, "standard", hook=hook))
        assert (sae.point, sae.layer) == where


def test_saelens_normalizations(tmp_path):
    x = _rand(5, D, seed=3, scale=4.0)
    for norm in ("constant_norm_rescale", "layer_norm"):
        sae = SAE.load(write_saelens(tmp_path / norm, "standard", normalize_activations=norm))
        if norm == "constant_norm_rescale":
            xn, undo = x * (D ** 0.5) / x.norm(dim=-1, keepdim=True), lambda y: y * x.norm(dim=-1, keepdim=True) / D ** 0.5
        else:
            mu, std = x.mean(-1, keepdim=True), (x - x.mean(-1, keepdim=True)).std(-1, keepdim=True)
            xn, undo = (x - mu) / (std + 1e-5), lambda y, mu=mu, std=std: y * std + mu
        pre = (xn - sae.b_dec) @ sae.W_enc + sae.b_enc
        assert_close(sae.encode(x), torch.relu(pre))
        assert_close(sae.decode(sae.encode(x), x), undo(torch.relu(pre) @ sae.W_dec + sae.b_dec))
        with pytest.raises(ValueError, match="decode\\(z, x\\)"):
            sae.decode(sae.encode(x))


@pytest.mark.parametrize("kind", ["sae", "skip_transcoder"])
def test_sparsify_layout(kind, tmp_path):
    root = tmp_path / "sparsify"
    write_sparsify(root, "layers.1", transcode=kind != "sae", skip=kind != "sae")
    write_sparsify(root, "layers.2.mlp", seed=30)
    with pytest.raises(ValueError, match="pick one with hookpoint"):
        SAE.load(root)
    sae = SAE.load(root, hookpoint="layers.1")
    x = _rand(6, D, seed=5, scale=2.0)
    z_ref, y_ref = ref_sparsify(root / "layers.1", x)
    assert_close(sae.encode(x), z_ref)
    assert_close(sae.decode(sae.encode(x), x), y_ref)
    if kind == "sae":
        assert (sae.point, sae.layer, sae.cfg.k) == ("resid_post", 1, 12)
    else:
        assert (sae.point, sae.cfg.out_point, sae.layer) == ("resid_pre", "resid_post", 1)
    mlp = SAE.load(root / "layers.2.mlp")
    assert (mlp.point, mlp.layer) == ("mlp_out", 2)


def test_gemma_scope_layout(tmp_path):
    file = write_gemma_scope(tmp_path, layer=2, kind="res")
    for where in (file, file.parent):
        sae = SAE.load(where)
        assert (sae.point, sae.layer, sae.architecture, sae.cfg.apply_b_dec_to_input) == ("resid_post", 2, "jumprelu",
                                                                                          False)
    x = _rand(6, D, seed=8, scale=2.0)
    z_ref, y_ref = ref_gemma_scope(file, x)
    assert_close(sae.encode(x), z_ref)
    assert_close(sae.decode(sae.encode(x)), y_ref)
    assert SAE.load(write_gemma_scope(tmp_path, layer=0, kind="mlp")).point == "mlp_out"
    att = SAE.load(write_gemma_scope(tmp_path, layer=1, kind="att"))
    assert att.point == "z"
    assert_close(att.encode(x.view(6, 4, 16)), att.encode(x))  # per-head rows are flattened, as hook_z is


@pytest.mark.parametrize("write, match", [
    (lambda p: write_saelens(p, "transcoder"), "architecture 'transcoder' is not supported"),
    (lambda p: write_saelens(p, "standard", normalize_activations="covariance_whitening"), "covariance_whitening"),
    (lambda p: write_saelens(p, "standard", metadata={"hook_name": "blocks.1.hook_resid_post", "hook_head_index": 2}),
     "hook_head_index"),
    (lambda p: write_saelens(p, "standard", hook="blocks.1.attn.hook_pattern"), "hook_name .* has no tapllm point"),
    (lambda p: write_saelens(p, "standard", v6=False, activation_fn_str="tanh-relu"), "activation_fn='tanh-relu'"),
    (lambda p: write_sparsify(p, "layers.1.mlp", transcode=True), "normalized input"),
    (lambda p: write_gemma_scope(p, kind="transcoders"), "transcoders"),
    (lambda p: p, "holds no SAE"),
])
def test_unsupported_is_refused_by_name(write, match, tmp_path):
    path = write(tmp_path / "x")
    path.mkdir(parents=True, exist_ok=True) if not path.exists() else None
    with pytest.raises(ValueError, match=match):
        SAE.load(path)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such SAE"):
        SAE.load(tmp_path / "missing")
    file = write_gemma_scope(tmp_path / "plain", layer=1)
    renamed = tmp_path / "elsewhere.npz"
    file.rename(renamed)
    with pytest.raises(ValueError, match="give point="):
        SAE.load(renamed)
    assert SAE.load(renamed, point="resid_pre", layer=0).point == "resid_pre"


def _hub_cache(hub: Path, repo: str, files: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
    """Put the folder ``files`` into the Hugging Face cache ``hub`` as ``repo`` at ``main``, laid out as
    huggingface_hub lays it out: content-addressed blobs, a snapshot of relative links to them, refs/main."""
    import hashlib
    import os

    root = hub / ("models--" + repo.replace("/", "--"))
    for f in sorted(x for x in files.rglob("*") if x.is_file()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / f.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)


def _same_sae(a: SAE, b: SAE) -> None:
    assert (a.point, a.layer, a.architecture, a.d_sae, a.cfg.k) == (b.point, b.layer, b.architecture, b.d_sae, b.cfg.k)
    assert a.digest() == b.digest()


def test_hub_ids_load_through_the_local_cache(tmp_path, monkeypatch, llm):
    """SAELens releases (one folder per SAE id), Gemma Scope (layer_N/width_../average_l0_..) and
    sparsify (hookpoint folders) by hub id, offline, from a real cache layout; a spec names one too."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub, src = tmp_path / "hub", tmp_path / "src"
    release = src / "release"
    write_saelens(release / "blocks.1.hook_resid_post", "topk", k=7)
    write_saelens(release / "blocks.2.hook_mlp_out", "standard", hook="blocks.2.hook_mlp_out", v6=False, seed=3)
    save_file({"sparsity": torch.zeros(256)}, str(release / "blocks.2.hook_mlp_out" / "sparsity.safetensors"))
    _hub_cache(hub, "tapllm-test/tiny-res-saes", release)
    gemma = write_gemma_scope(src / "gs", layer=2, kind="res").parent
    _hub_cache(hub, "tapllm-test/gemma-scope-2b-pt-res", src / "gs" / "gemma-scope-2b-pt-res")
    write_sparsify(src / "sp", "layers.1")
    write_sparsify(src / "sp", "layers.2.mlp", seed=30)
    _hub_cache(hub, "tapllm-test/sparsify-tiny", src / "sp")

    res = SAE.load("tapllm-test/tiny-res-saes/blocks.1.hook_resid_post", download_dir=hub)
    _same_sae(res, SAE.load(release / "blocks.1.hook_resid_post"))
    assert "/snapshots/" in res.cfg.source
    _same_sae(SAE.load("tapllm-test/tiny-res-saes", hookpoint="blocks.2.hook_mlp_out", download_dir=hub),
              SAE.load(release / "blocks.2.hook_mlp_out"))
    gs = SAE.load("tapllm-test/gemma-scope-2b-pt-res/layer_2/width_16k/average_l0_10", download_dir=hub)
    assert (gs.point, gs.layer) == ("resid_post", 2)  # read from the snapshot path, not the blob's
    _same_sae(gs, SAE.load(gemma))
    _same_sae(SAE.load("tapllm-test/sparsify-tiny", hookpoint="layers.2.mlp", download_dir=hub),
              SAE.load(src / "sp" / "layers.2.mlp"))
    with pytest.raises(ValueError, match="several SAEs .*pick one with hookpoint"):
        SAE.load("tapllm-test/sparsify-tiny", download_dir=hub)
    with pytest.raises(FileNotFoundError, match="has no 'blocks.9.hook_resid_post'.*blocks.1.hook_resid_post"):
        SAE.load("tapllm-test/tiny-res-saes/blocks.9.hook_resid_post", download_dir=hub)
    with pytest.raises(FileNotFoundError, match="'nobody/nothing'.*HF_HUB_OFFLINE"):
        SAE.load("nobody/nothing", download_dir=hub)
    with pytest.raises(ValueError, match="local path"):
        SAE.load(gemma, download_dir=hub)

    # the default cache (HF_HUB_CACHE) serves a spec that names the SAE by hub id, read once
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    from tapllm.sae.features import load_sae

    once = load_sae("tapllm-test/tiny-res-saes/blocks.1.hook_resid_post", "sae")
    assert load_sae("tapllm-test/tiny-res-saes/blocks.1.hook_resid_post", "sae") is once
    _same_sae(once, res)
    p = random_prompts([9], seed=2)
    out = llm.generate(p, SamplingParams(max_tokens=3, temperature=0, hidden_states=HiddenStatesSpec(
        layers=[1], points=["resid_post"], sae="tapllm-test/tiny-res-saes/blocks.1.hook_resid_post",
        features="topk:5")), use_tqdm=False)[0]
    _check_features(out, res, "topk", 5)


# ---- features with generation -------------------------------------------------------------------
def _sae(arch: str, point: str = "resid_post", layer: int = 1, d_sae: int = 256, seed: int = 0, k: int = 10) -> SAE:
    g = _g(seed)
    extra = {}
    if arch == "jumprelu":
        extra["threshold"] = torch.rand(d_sae, generator=g) * 0.5
    if arch == "gated":
        extra.update(b_gate=torch.randn(d_sae, generator=g) * 0.2, b_mag=torch.randn(d_sae, generator=g) * 0.2,
                     r_mag=torch.randn(d_sae, generator=g) * 0.2)
    cfg = SAEConfig(arch, D, d_sae, point, layer, k=k if arch == "topk" else None)
    return SAE(cfg, torch.randn(D, d_sae, generator=g) * 0.3, torch.randn(d_sae, generator=g) * 0.1,
               torch.randn(d_sae, D, generator=g) * 0.1, torch.randn(D, generator=g) * 0.1, **extra)


@pytest.mark.parametrize("arch", ["standard", "jumprelu", "gated"])
def test_sparse_latents_decode_by_gathering(arch):
    """A sparse SAE's reconstruction (for the error norm) gathers its active decoder rows; it equals
    the dense decode, with per-row normalization too, and a row with no active latent gives b_dec."""
    from tapllm.sae import encode as fm

    sae = _sae(arch, d_sae=512, seed=11)
    sae.b_enc -= 6.0  # about 1 latent in 100 active
    if sae.b_mag is not None:
        sae.b_mag -= 6.0
    x = _rand(40, D, seed=12)
    x[3] = sae.b_dec  # encodes to nothing, for standard and jumprelu
    for norm in ("none", "layer_norm"):
        sae.cfg.normalize_activations = norm
        z, y = fm.encode_and_reconstruct(sae, x)
        assert 0 < int(z.count_nonzero()) * fm.SPARSE_DECODE_DENSITY < z.numel()  # the gathering path
        assert_close(z, sae.encode(x))
        assert_close(y, sae.decode(z, x))
        assert_close(fm.sparse_decode(z, sae.W_dec), z @ sae.W_dec)
        if arch != "gated" and norm == "none":
            assert int(z[3].count_nonzero()) == 0
            assert_close(y[3], sae.b_dec)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", block_size=8)


def _check_features(out, sae: SAE, mode: str, k: int = 8) -> None:
    """The request's features equal ``SAE.encode`` of its own captured input states."""
    hs = out.hidden_states
    x = hs[sae.point][:, hs.layers.index(sae.layer)] if sae.point not in ("embed", "final") else hs[sae.point][:, 0]
    z = sae.encode(x)
    f = hs.features
    assert torch.equal(f.positions, hs.positions)
    assert_close(f.error_norm, (x.flatten(1) - sae.decode(z)).norm(dim=-1))
    if mode == "topk":
        v, i = torch.topk(z, k, dim=-1)
        assert_close(f.values, v)
        active = v > 1e-4  # where a value is clearly nonzero its id is determined
        assert torch.equal(f.ids.long()[active], i[active])
        assert f.ids.dtype == torch.int32 and f.values.dtype == torch.float32
    elif mode == "all":
        assert_close(f.dense, z)
    else:
        assert_close(f.dense, z[:, f.feature_ids])


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated"])
def test_features_equal_encode_of_captured_states(arch, llm):
    sae = _sae(arch)
    prompts = random_prompts([5, 19], seed=1)
    for features, mode in (("topk:8", "topk"), ("all", "all"), ([3, 77, 200], "ids")):
        spec = HiddenStatesSpec(layers=[1], points=["resid_post"], sae=sae, features=features)
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                    hidden_states=spec), use_tqdm=False)
        for out, p in zip(outs, prompts):
            assert len(out.hidden_states.features.positions) == len(p) + NEW - 1
            _check_features(out, sae, mode)


def test_features_only_mixed_batch_chunked_cached_preempted(tiny_models, llm):
    """Requests with different SAEs (and none) in one batch; each equals its solo run, in every situation."""
    saes = [_sae("topk", "resid_post", 2, seed=1), _sae("jumprelu", "mlp_out", 0, seed=2),
            _sae("standard", "resid_pre", 1, seed=3), _sae("topk", "resid_post", 2, seed=1)]
    prompts = random_prompts([33, 9, 21, 14, 40], seed=4)
    params = [SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                             hidden_states=HiddenStatesSpec(sae=s, features=f, positions=pos))
              for s, f, pos in zip(saes, ["topk:5", [1, 2, 250], "topk:12", "all"],
                                   ["all", "generated", "prompt", (3, 17)])]
    params.append(SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    path = tiny_models["llama"]
    solo = [LLM(path, dtype="float32", enable_prefix_caching=False).generate([p], q, use_tqdm=False)[0]
            for p, q in zip(prompts[:4], params[:4])]
    for out in solo:
        assert out.hidden_states.points == ()  # features only: no raw states returned
    # the solo features equal SAE.encode of states captured separately
    for out, p, q, sae in zip(solo, prompts, params, saes):
        raw = llm.generate([p], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, hidden_states=HiddenStatesSpec(
            layers=[sae.layer], points=[sae.point], positions=q.hidden_states.positions)), use_tqdm=False)[0]
        assert torch.equal(raw.hidden_states.positions, out.hidden_states.features.positions)
        z = sae.encode(raw.hidden_states[sae.point][:, 0])
        f = out.hidden_states.features
        assert_close(f.error_norm, (raw.hidden_states[sae.point][:, 0] - sae.decode(z)).norm(dim=-1))
        assert_close(f.values if f.values is not None else f.dense,
               torch.topk(z, f.values.shape[1]).values if f.values is not None else
               (z if f.feature_ids is None else z[:, f.feature_ids]))

    def same(outs) -> None:
        for a, b in zip(outs[:4], solo):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            fa, fb = a.hidden_states.features, b.hidden_states.features
            assert torch.equal(fa.positions, fb.positions)
            for name, t in fb.tensors().items():
                if name == "ids":
                    continue  # near-ties may swap ids under other batchings; values pin the result
                assert_close(fa.tensors()[name], t, 1e-4)

    same(llm.generate(prompts, params, use_tqdm=False))  # mixed batch
    chunked = LLM(path, dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False)
    same(chunked.generate(prompts, params, use_tqdm=False))
    cached = LLM(path, dtype="float32", block_size=4)
    plain = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    cached.generate(prompts, plain, use_tqdm=False)  # warm the prefix cache
    again = cached.generate(prompts, params, use_tqdm=False)
    same(again)
    assert again[4].metrics["num_cached_tokens"] > 0
    blocks = sum(-(-len(p) // 4) for p in prompts)
    tight = LLM(path, dtype="float32", block_size=4, kv_cache_blocks=blocks, enable_prefix_caching=False)
    same(tight.generate(prompts, params, use_tqdm=False))
    assert tight.engine.scheduler.num_preemptions > 0


def test_features_encode_last_and_save(llm, tmp_path):
    sae = _sae("topk", "resid_post", 0)
    p = random_prompts([12], seed=5)[0]
    enc = llm.encode([p], HiddenStatesSpec(points=["resid_post"], layers=[0], sae=sae, features="topk:4"),
                     use_tqdm=False)[0]
    _check_features(enc, sae, "topk", 4)
    last = llm.generate([p], SamplingParams(max_tokens=4, temperature=0, hidden_states=HiddenStatesSpec(
        points=["resid_post"], layers=[0], positions="last", sae=sae, features=[5, 6])), use_tqdm=False)[0]
    assert last.hidden_states.features.positions.tolist() == [len(p) + 2]
    _check_features(last, sae, "ids")
    path = enc.hidden_states.save(tmp_path / "hs.safetensors")
    back = HiddenStates.load(path)
    for name, t in enc.hidden_states.features.tensors().items():
        assert torch.equal(back.features.tensors()[name], t)
    assert back.features.top(3, 2) == enc.hidden_states.features.top(3, 2)


def test_features_of_per_head_and_neuron_points(llm):
    """SAEs on ``z`` (heads x head_dim, flattened as TransformerLens' hook_z) and ``mlp_post``."""
    p = random_prompts([8], seed=12)
    for point, width in (("z", 64), ("mlp_post", 128)):
        g = _g(5)
        sae = SAE(SAEConfig("standard", width, 96, point, 2), torch.randn(width, 96, generator=g) * 0.3,
                  torch.zeros(96), torch.randn(96, width, generator=g) * 0.1, torch.zeros(width))
        out = llm.encode(p, HiddenStatesSpec(points=[point], layers=[2], sae=sae, features="all"), use_tqdm=False)[0]
        x = out.hidden_states[point][:, 0].flatten(1)
        assert_close(out.hidden_states.features.dense, sae.encode(x))
        assert_close(out.hidden_states.features.error_norm, (x - sae.decode(sae.encode(x))).norm(dim=-1))


def test_features_of_several_samples(llm):
    sae = _sae("jumprelu", "resid_post", 1, seed=4)
    p = random_prompts([10], seed=9)
    out = llm.generate(p, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, hidden_states=HiddenStatesSpec(
        points=["resid_post"], layers=[1], sae=sae, features="topk:8")), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:  # each sample's features are its own, the shared prompt's included once
        assert len(c.hidden_states.features.positions) == 10 + 4
        _check_features(c, sae, "topk")
    assert len(llm.engine.saes._by_digest) >= 1 and all(s.device.type == "cpu" for s in llm.engine.saes._by_digest.values())


def test_feature_spec_errors(llm, tiny_models):
    sae = _sae("standard")
    with pytest.raises(ValueError, match="features needs an SAE"):
        HiddenStatesSpec(features="topk:3")
    with pytest.raises(ValueError, match="top-k needs k in"):
        HiddenStatesSpec(sae=sae, features="topk:0")
    with pytest.raises(ValueError, match="cannot be combined with reduce"):
        HiddenStatesSpec(sae=sae, reduce="mean")
    p = random_prompts([4], seed=1)
    with pytest.raises(ValueError, match="out of range for d_sae=256"):
        llm.generate(p, SamplingParams(max_tokens=2, hidden_states=HiddenStatesSpec(sae=sae, features=[256])),
                     use_tqdm=False)
    wide = SAE(SAEConfig("standard", 32, 8, "resid_post", 1), torch.zeros(32, 8), None, torch.zeros(8, 32),
               torch.zeros(32))
    with pytest.raises(ValueError, match="d_in is 32"):
        llm.generate(p, SamplingParams(max_tokens=2, hidden_states=HiddenStatesSpec(sae=wide)), use_tqdm=False)
    small = LLM(tiny_models["llama"], dtype="float32", hidden_states_max_bytes_per_request=20_000)
    with pytest.raises(ValueError, match="hidden_states_max_bytes_per_request"):
        small.generate(p, SamplingParams(max_tokens=50, hidden_states=HiddenStatesSpec(sae=sae, features="all")),
                       use_tqdm=False)
    ok = small.generate(p, SamplingParams(max_tokens=50, hidden_states=HiddenStatesSpec(sae=sae, features="topk:4")),
                        use_tqdm=False)[0]
    assert ok.hidden_states.features.ids.shape[1] == 4


def test_features_from_path_and_dict(llm, tmp_path):
    folder = write_saelens(tmp_path / "s", "jumprelu", hook="blocks.2.hook_resid_post")
    p = random_prompts([9], seed=2)
    out = llm.generate(p, SamplingParams(max_tokens=3, temperature=0, hidden_states={
        "sae": str(folder), "features": "topk:6", "points": ["resid_post"], "layers": [2]}), use_tqdm=False)[0]
    _check_features(out, SAE.load(folder), "topk", 6)


# ---- steering by features -----------------------------------------------------------------------
class _Hooks:
    """transformers forward hooks on block outputs (resid_post) doing ``fn(x)`` at every position."""

    def __init__(self, model, edits: dict[int, object]) -> None:
        self.handles = [model.model.layers[b].register_forward_hook(lambda m, i, o, fn=fn: fn(o))
                        for b, fn in edits.items()]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _hf_greedy(model, prompt: list[int], new: int, edits: dict[int, object]) -> list[int]:
    hooks = _Hooks(model, edits)
    try:
        return hf_greedy(model, prompt, new)[0]
    finally:
        hooks.remove()


def _clamp_ref(sae: SAE, feats: dict[int, float]):
    """SAELens' hooked-SAE clamp: decode the edited latents, plus the clean error term."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        z = sae.encode(x)
        z2 = z.clone()
        for i, v in feats.items():
            z2[..., i] = v
        return sae.decode(z2) + (x - sae.decode(z))
    return fn


def test_feature_steering_matches_transformers_hooks(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32")
    sae = _sae("jumprelu", "resid_post", 1, seed=7)
    prompts = random_prompts([6, 17], seed=8)
    add = {5: 8.0, 9: -4.0}
    clamp = {3: 20.0, 40: 0.0}
    plain = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False)
    steers = {
        "add": Steer(op="add", sae=sae, features=add, scale=1.5),
        "clamp": Steer(op="clamp", sae=sae, features=clamp),
        "set": Steer(op="set", sae=sae, features=clamp),
        "ablate": Steer(op="ablate", sae=sae, features=[3, 40]),
    }
    refs = {"add": lambda x: x + 1.5 * (8.0 * sae.W_dec[5] - 4.0 * sae.W_dec[9]),
            "clamp": _clamp_ref(sae, clamp), "set": _clamp_ref(sae, clamp), "ablate": _clamp_ref(sae, {3: 0.0, 40: 0.0})}
    # add equals the plain vector steer of scale * W_dec[id]
    vec = Steer(layers=[1], op="add", vector=8.0 * sae.W_dec[5] - 4.0 * sae.W_dec[9], scale=1.5)
    changed = 0
    for name, steer in steers.items():
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=[steer]),
                            use_tqdm=False)
        for prompt, out, base in zip(prompts, outs, plain):
            assert out.outputs[0].token_ids == _hf_greedy(model, prompt, NEW, {1: refs[name]}), name
            changed += out.outputs[0].token_ids != base.outputs[0].token_ids
        if name == "add":
            same = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                        steering=[vec]), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in same] == [o.outputs[0].token_ids for o in outs]
    assert changed
    # with capture: the captured (steered) prompt states are the reference's edit of the unsteered ones
    spec = HiddenStatesSpec(layers=[1], points=["resid_post"], positions="prompt", sae=sae, features=[3, 40])
    got, base = (llm.generate(prompts[1:], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                          steering=s, hidden_states=spec), use_tqdm=False)[0]
                 for s in ([steers["clamp"]], None))
    want = refs["clamp"](base.hidden_states["resid_post"][:, 0])
    assert_close(got.hidden_states["resid_post"][:, 0], want, 1e-4)
    _check_features(got, sae, "ids")


def test_feature_steering_batched_chunked_cached(tiny_models):
    path = tiny_models["llama"]
    sae = _sae("topk", "resid_post", 0, seed=9, k=16)
    other = _sae("standard", "mlp_out", 1, seed=10)
    shared = random_prompts([40], seed=3)[0]
    a, b = shared + [101, 102], shared + [201]
    clamp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                           steering=[Steer(op="clamp", sae=sae, features={7: 15.0}, positions="prompt")])
    mixed_steer = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                 steering=[Steer(op="ablate", sae=other, features=[1, 2, 3]),
                                           Steer(op="add", sae=sae, features={4: 10.0})])
    plain = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    solo = [LLM(path, dtype="float32", enable_prefix_caching=False).generate([p], q, use_tqdm=False)[0]
            for p, q in ((a, clamp), (b, mixed_steer), (a, plain))]
    tokens = [o.outputs[0].token_ids for o in solo]
    assert tokens[0] != tokens[2]
    llm = LLM(path, dtype="float32", block_size=8)
    assert [o.outputs[0].token_ids for o in llm.generate([a, b, a], [clamp, mixed_steer, plain],
                                                         use_tqdm=False)] == tokens
    chunked = LLM(path, dtype="float32", max_num_batched_tokens=6, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in chunked.generate([a, b, a], [clamp, mixed_steer, plain],
                                                             use_tqdm=False)] == tokens
    # the prefix-cache key covers the intervention: another clamp value never reuses these blocks
    cache = LLM(path, dtype="float32", block_size=8)
    assert cache.generate([a], clamp, use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    again = cache.generate([b], clamp, use_tqdm=False)[0]
    assert again.metrics["num_cached_tokens"] == 40
    other_value = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                 steering=[Steer(op="clamp", sae=sae, features={7: 14.0}, positions="prompt")])
    assert cache.generate([b], other_value, use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    assert cache.generate([b], plain, use_tqdm=False)[0].metrics["num_cached_tokens"] == 0
    ref = LLM(path, dtype="float32", enable_prefix_caching=False).generate([b], clamp, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids


def _same_run(a, b, what: str) -> None:
    """Same tokens, positions and states (1e-5 of scale), same feature values."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids, what
    ha, hb = a.hidden_states, b.hidden_states
    assert torch.equal(ha.positions, hb.positions) and ha.layers == hb.layers, what
    assert_close(ha["resid_post"], hb["resid_post"])
    for name, t in hb.features.tensors().items():
        if name != "ids":  # near-ties may swap ids under other batchings; values pin the result
            assert_close(ha.features.tensors()[name], t, 1e-4)


def test_feature_steering_preempted_and_chunked_with_a_cache_hit(tiny_models):
    """Every feature op (add, clamp, set, ablate), with capture, gives the tokens and states of its
    solo run when its request is preempted and recomputed, and under chunked prefill after a
    prefix-cache hit (with preemption on top)."""
    path = tiny_models["llama"]
    sae = _sae("jumprelu", "resid_post", 1, seed=7)
    steers = [Steer(op="add", sae=sae, features={5: 8.0, 9: -4.0}, scale=1.5),
              Steer(op="clamp", sae=sae, features={3: 20.0, 40: 0.0}),
              Steer(op="set", sae=sae, features={3: 12.0}, positions="prompt"),
              Steer(op="ablate", sae=sae, features=[3, 40], positions="generated")]
    shared = random_prompts([20], seed=13)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 1, 14], seed=14)]
    # positions from 16 on (the prompts' tails and the replies), so the first 16 tokens can come from the cache
    specs = [HiddenStatesSpec(layers=[1, 2], points=["resid_post"], sae=sae, features="topk:6",
                              positions=(16, len(p) + NEW - 1)) for p in prompts]
    params = [SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, steering=[s], hidden_states=spec)
              for s, spec in zip(steers, specs)]
    solo = [LLM(path, dtype="float32", enable_prefix_caching=False).generate([p], q, use_tqdm=False)[0]
            for p, q in zip(prompts, params)]
    plain = LLM(path, dtype="float32").generate(prompts, SamplingParams(max_tokens=NEW, temperature=0,
                                                                        ignore_eos=True), use_tqdm=False)
    assert all(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(solo[:2], plain[:2]))

    # (a) a KV cache holding the prompts only: decoding must preempt the latest admitted request,
    # so each op in turn comes last and is the one recomputed
    blocks = sum(-(-len(p) // 4) for p in prompts)
    tight = LLM(path, dtype="float32", block_size=4, kv_cache_blocks=blocks, enable_prefix_caching=False)
    for i, s in enumerate(steers):
        order = [j for j in range(4) if j != i] + [i]
        outs = tight.generate([prompts[j] for j in order], [params[j] for j in order], use_tqdm=False)
        assert outs[-1].metrics["num_preemptions"] > 0, s.op
        for j, a in zip(order, outs):
            _same_run(a, solo[j], f"{steers[j].op} preempted ({s.op} last)")

    # (b) chunked prefill (7-token budget) after a cache hit on the steered shared prefix
    cached = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=7)
    for a, b, s in zip(cached.generate(prompts, params, use_tqdm=False), solo, steers):
        _same_run(a, b, f"{s.op} chunked")
    again = cached.generate(prompts, params, use_tqdm=False)
    assert all(o.metrics["num_cached_tokens"] == 16 for o in again), [o.metrics for o in again]
    for a, b, s in zip(again, solo, steers):
        _same_run(a, b, f"{s.op} chunked after a cache hit")

    # (c) all at once: chunked, cached and preempted
    mixed = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=7, kv_cache_blocks=14)
    mixed.generate(prompts[:1], params[:1], use_tqdm=False)  # the add steer's prefix in the cache
    outs = mixed.generate(prompts, params, use_tqdm=False)
    assert outs[0].metrics["num_cached_tokens"] > 0 and mixed.engine.scheduler.num_preemptions > 0
    for a, b, s in zip(outs, solo, steers):
        _same_run(a, b, f"{s.op} chunked, cached, preempted")


@pytest.mark.parametrize("kwargs, match", [
    (dict(op="scale", features={1: 1.0}), "does not apply to SAE features"),
    (dict(op="clamp", features=[1, 2]), "must be \\{id: value\\}"),
    (dict(op="add", features={999: 1.0}), "out of range for d_sae"),
    (dict(op="add", features={1: 1.0}, layers=[2]), "the SAE reads block 1"),
    (dict(op="add", features={1: 1.0}, point="mlp_out"), "the SAE reads 'resid_post'"),
    (dict(op="add"), "features is required"),
    (dict(op="clamp", features={1: float("nan")}), "finite number"),
])
def test_feature_steer_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Steer(sae=_sae("standard"), **kwargs)


# ---- CLI and server -----------------------------------------------------------------------------
def test_cli_features_table_and_html(tiny_models, tmp_path, capsys):
    from tapllm.cli import main

    folder = write_saelens(tmp_path / "s", "topk", k=12, hook="blocks.1.hook_resid_post")
    page = tmp_path / "f.html"
    assert main(["features", "The cat sat", "--sae", str(folder), "--top", "4", "--max-tokens", "3",
                 "--model", str(tiny_models["llama"]), "--dtype", "float32", "--html", str(page), "--quiet"]) == 0
    table = capsys.readouterr().out.splitlines()
    llm = LLM(tiny_models["llama"], dtype="float32")
    ref = llm.generate(["The cat sat"], SamplingParams(max_tokens=3, temperature=0, hidden_states=HiddenStatesSpec(
        sae=str(folder), features="topk:4")), use_tqdm=False)[0]
    f = ref.hidden_states.features
    assert len(table) == 1 + len(f.positions)
    first = table[1].split()
    assert [int(x.split(":")[0]) for x in first[3:]] == f.ids[0].tolist()
    assert "*" in table[-1].split()[0]  # generated positions are marked
    assert page.read_text().split("<tbody>")[1].count("<tr><th>") == len(f.positions)
    assert main(["features", "x", "--sae", str(tmp_path / "missing"), "--model", str(tiny_models["llama"]),
                 "--quiet"]) == 2


def test_server_sae_features_and_steering(tiny_models, tmp_path):
    from server_util import Server
    from tapllm.hidden_states.json_codec import hidden_states_from_wire

    folder = write_saelens(tmp_path / "s", "jumprelu", hook="blocks.1.hook_resid_post")
    sae = SAE.load(folder)
    server = Server(tiny_models["llama"], "--enable-hidden-states", "--enable-steering", "--sae", f"res1={folder}")
    try:
        prompt = random_prompts([7], seed=3)[0]
        body = {"model": "tiny_llama", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "sae_features": {"sae": "res1", "features": "topk:5"}}
        status, resp = server.post("/v1/completions", body)
        assert status == 200, resp
        wire = resp["choices"][0]["hidden_states"]
        assert isinstance(wire["features"]["values"]["data"], str)  # binary (base64), like states
        got = hidden_states_from_wire(wire).features
        llm = LLM(tiny_models["llama"], dtype="float32")
        ref = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, hidden_states=HiddenStatesSpec(
            sae=sae, features="topk:5")), use_tqdm=False)[0].hidden_states.features
        assert torch.equal(got.positions, ref.positions) and torch.equal(got.ids, ref.ids)
        assert_close(got.values, ref.values, 1e-5)
        # with raw states too, listed features, list encoding
        body["hidden_states"] = {"layers": [1], "points": ["resid_post"], "encoding": "list"}
        body["sae_features"] = {"sae": "res1", "features": [1, 2, 3]}
        status, resp = server.post("/v1/completions", body)
        assert status == 200, resp
        hs = hidden_states_from_wire(resp["choices"][0]["hidden_states"])
        assert_close(hs.features.dense, sae.encode(hs["resid_post"][:, 0])[:, [1, 2, 3]], 1e-4)
        # steering by a served SAE equals the offline steer
        steer = {"op": "clamp", "sae": "res1", "features": {"3": 12.0}}
        status, resp = server.post("/v1/completions", {"model": "tiny_llama", "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0, "steering": [steer]})
        assert status == 200, resp
        want = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, steering=[
            Steer(op="clamp", sae=sae, features={3: 12.0})]), use_tqdm=False)[0]
        assert resp["choices"][0]["text"] == want.outputs[0].text
        # only SAEs the server was started with can be named: never a path
        body = {"model": "tiny_llama", "prompt": prompt, "max_tokens": 2,
                "sae_features": {"sae": str(folder)}}
        status, resp = server.post("/v1/completions", body)
        assert status == 400 and "unknown SAE" in resp["error"]["message"] and "res1" in resp["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("fmt", ["safetensors", "arrow"])
def test_collect_stores_sparse_top_latents(fmt, tiny_models, tmp_path):
    import tapllm.datasets
    from tapllm.cli import main

    model = tiny_models["llama"]
    folder = write_saelens(tmp_path / "s", "jumprelu", hook="blocks.2.hook_resid_post")
    prompts = random_prompts([9, 15, 4], seed=6)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "acts"
    assert main(["collect", "--model", str(model), "--input", str(inp), "--out", str(out), "--dtype", "float32",
                 "--quiet", "--points", "none", "--sae", str(folder), "--sae-top", "6", "--format", fmt]) == 0
    ds = tapllm.datasets.open(out)
    assert ds.metadata["points"] == [] and len(ds) == sum(map(len, prompts))
    run = json.loads((out / "run.json").read_text())
    assert run["sae"]["top"] == 6 and run["sae"]["digest"] == SAE.load(folder).digest().hex()
    llm = LLM(model, dtype="float32")
    refs = llm.encode(prompts, HiddenStatesSpec(layers=[2], points=["resid_post"], sae=str(folder),
                                                features="topk:6"), use_tqdm=False)
    batch = ds[list(range(len(ds)))]
    assert batch["sae_ids"].shape == (len(ds), 1, 6) and batch["sae_ids"].dtype == torch.int32
    row = 0
    sae = SAE.load(folder)
    for ref in refs:
        n = len(ref.prompt_token_ids)
        f = ref.hidden_states.features
        assert_close(batch["sae_values"][row : row + n, 0], f.values)
        assert_close(batch["sae_error_norm"][row : row + n], f.error_norm)
        # the sparse row is the dense latents' top: scattering it back gives encode's largest values
        dense = torch.zeros(n, sae.d_sae).scatter(1, batch["sae_ids"][row : row + n, 0].long(),
                                                  batch["sae_values"][row : row + n, 0])
        z = sae.encode(ref.hidden_states["resid_post"][:, 0])
        assert_close(dense.topk(6).values, z.topk(6).values)
        row += n


def test_tiny_sae_training_script_learns_and_saves_saelens(tmp_path):
    """scripts/train_tiny_sae.py's trainer recovers a sparse dictionary's data, and its SAE round-trips
    through SAELens' layout."""
    import importlib.util

    from tapllm.sae.formats import save_saelens

    spec = importlib.util.spec_from_file_location("train_tiny_sae", Path(__file__).parents[1] / "scripts" /
                                                  "train_tiny_sae.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    g = _g(21)
    atoms = torch.nn.functional.normalize(torch.randn(96, D, generator=g), dim=-1)
    codes = torch.zeros(3000, 96).scatter_(1, torch.randint(0, 96, (3000, 3), generator=g),
                                           torch.rand(3000, 3, generator=g) * 4 + 1)
    x = codes @ atoms + 0.5
    w_enc, b_enc, w_dec, b_dec = script.train(x, 128, 4, steps=150, batch=256)
    sae = SAE(SAEConfig("topk", D, 128, "resid_post", 1, k=4), w_enc.contiguous(), b_enc, w_dec.contiguous(), b_dec)
    fvu = float((x - sae(x)).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    assert fvu < 0.4, fvu  # from about 0.75 at the start
    back = SAE.load(save_saelens(sae, tmp_path / "sae"))
    assert_close(back.encode(x[:50]), sae.encode(x[:50]))
