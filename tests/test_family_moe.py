"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss) through the family harness.

Each family's tiny random model (``family_configs.moe_configs``) is saved with ``save_pretrained``
(per-expert tensors) and compared with transformers in float32: greedy tokens and logprobs alone,
batched, chunked, after prefix-cache hits and through preemption, on the eager path and on the
default (fused CPU) path, whose C++ block runner does not take MoE blocks (gpt-oss, whose attention
sinks only the PyTorch attention computes, runs the eager step on both), and on the CUDA backend
(Triton interpreted) with decode steps in graphs (tests/test_triton_moe.py has its kernels); every
residual-width point within 1e-5 of its scale, the logits likewise; the attention points; steering. The grouped
expert computation is also checked against a plain loop over tokens, and transformers' stacked
in-memory expert layout (``experts.gate_up_proj``) loads as well as the per-expert one.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_matches_reference, hf_greedy, random_prompts, save_tiny_model
from family_configs import moe_configs
from family_harness import (HFLayout, assert_close_states, check_logits, check_points, check_situations,
                            check_steering)
from tapllm import LLM, HiddenStatesSpec, SamplingParams
from tapllm.models.moe import Routing, gated, grouped_experts, route

FAMILIES = sorted(moe_configs())

LAYOUT = HFLayout(
    blocks=lambda m: m.model.layers,
    attn_out=lambda b: b.self_attn,
    mlp_out=lambda b: b.mlp,  # the sparse block's output, shared expert included
    final_norm=lambda m: m.model.norm,
)


def _init(model) -> None:
    """Norm weights away from 1, random biases (gpt-oss's experts and router too) and attention sinks, so
    every norm, bias and sink really acts."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def _router(mlp):
    """transformers' router module of a sparse block (``gate``; gpt-oss: ``router``), or None (a dense MLP)."""
    return getattr(mlp, "gate", None) or getattr(mlp, "router", None)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, default_model_folder):
    """family -> (checkpoint folder, the transformers model read back from it)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, cfg in moe_configs().items():
        # Mixtral's checkpoint is sharded, so the shard index path is exercised with per-expert tensors too
        folder = save_tiny_model(root / name, cfg, default_model_folder, shard="2MB" if name == "mixtral" else "10GB",
                                 init=_init)
        out[name] = (folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    assert len(list(out["mixtral"][0].glob("*.safetensors"))) > 1
    return out


def _naive_experts(x, weights, ids, gate_up, down):
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t]
            out[t] += (weights[t, j] * (down[e] @ (F.silu(h[:inter]) * h[inter:]))).to(x.dtype)
    return out


@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_experts_equal_a_loop_over_tokens(renormalize):
    g = torch.Generator().manual_seed(3)
    tokens, hidden, inter, experts = 9, 16, 8, 6
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(experts, hidden, inter, generator=g) * 0.3
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 5] = -1e4  # an expert no token picks: skipped
    weights, ids = route(logits, Routing(experts, 2, renormalize))
    assert 5 not in ids.tolist() and len(set(ids.flatten().tolist())) > 2
    if renormalize:
        assert torch.allclose(weights.sum(-1), torch.ones(tokens))
    got = grouped_experts(x, weights, ids, gate_up, down, gated(F.silu))
    assert torch.allclose(got, _naive_experts(x, weights, ids, gate_up, down), atol=1e-5)


class _WithoutMoeOp:
    """The backend's GEMV ops without ``moe_experts`` (the Python loop over experts)."""

    def __init__(self, ops) -> None:
        self.packed_linear = ops.packed_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_on_the_packed_gemv_equal_the_plain_path(dtype):
    """With the CPU backend's GEMV the stacked weights are laid out for it once (shapes that pad both
    dimensions of its blocks here), computed as the plain path within the kernel's rounding, and restored
    bit for bit by ``use_gemv(None)``."""
    from tapllm.backends.select import select_backend
    from tapllm.models.base import kernel_activation
    from tapllm.models.experts import Experts, blocked, unblocked

    backend = select_backend(torch.device("cpu"), dtype)
    if backend.gemv is None:
        pytest.skip(f"no packed GEMV for {dtype} here")
    g = torch.Generator().manual_seed(5)
    tokens, hidden, inter, num = 70, 40, 24, 6  # 70 rows: past GEMV_MAX_ROWS for an expert chosen by most
    experts = Experts(num, hidden, inter, dtype)
    for p in (experts.gate_up_proj, experts.down_proj):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    gate_up, down = (w.clone() for w in experts.plain())
    assert torch.equal(unblocked(blocked(down), inter), down)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, num, generator=g)
    logits[:, 0] += 3.0  # expert 0 takes most rows
    weights, ids = route(logits.to(dtype), Routing(num, 2, True))
    want = grouped_experts(x, weights, ids, gate_up, down, gated(F.silu))
    outs = []
    # the glu in Python; the fused gated activation in the Python loop; the loop in C++ (moe_experts)
    for act_ops, in_cpp in ((None, False), (backend.elementwise, False), (backend.elementwise, True)):
        experts.use_gemv(backend.gemv if in_cpp else _WithoutMoeOp(backend.gemv), act_ops, kernel_activation(F.silu))
        assert experts.gate_up_proj is None and experts.packed_gate_up is not None  # one copy kept
        outs.append(experts(x, weights, ids, gated(F.silu)))
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert ((outs[-1] - want).float().norm() / want.float().norm()).item() < tol
    assert torch.equal(outs[1], outs[2])  # the C++ loop runs the Python loop's ops in its order
    experts.use_gemv(None)
    assert experts.packed_gate_up is None and torch.equal(experts.plain()[0], gate_up)
    assert torch.equal(experts.plain()[1], down) and torch.equal(experts(x, weights, ids, gated(F.silu)), want)


def _hf_routes(model, prompt: list[int]) -> list[torch.Tensor]:
    """The experts transformers' routers pick for each token, per sparse block."""
    picks = []
    handles = [_router(layer.mlp).register_forward_hook(lambda m, i, o: picks.append(o[2]))
               for layer in model.model.layers if _router(layer.mlp) is not None]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]))
    finally:
        for h in handles:
            h.remove()
    return picks


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_models_route_tokens_to_every_expert(family, moe_models):
    """Not vacuous: a router sends the tokens of one prompt to every expert (in one block at least), so a
    wrongly placed expert weight or a wrong route shows."""
    _, model = moe_models[family]
    picks = _hf_routes(model, random_prompts([40], seed=9)[0])
    sparse = [i for i, layer in enumerate(model.model.layers) if _router(layer.mlp) is not None]
    assert len(picks) == len(sparse) >= 2
    if family == "qwen2_moe":
        assert sparse == [0, 2]  # block 1 is in mlp_only_layers: a dense MLP
    chosen = [set(ids.flatten().tolist()) for ids in picks]
    assert any(c == {0, 1, 2, 3} for c in chosen), chosen


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "default"])
@pytest.mark.parametrize("family", FAMILIES)
def test_situations(family, eager, moe_models):
    """Tokens and logprobs equal transformers alone, batched, chunked, after cache hits, preempted; the
    default path runs every block in Python on the fused ops (no C++ block runner for MoE blocks)."""
    folder, model = moe_models[family]
    llms = check_situations(folder, model, random_prompts([3, 14, 27], seed=31), 8, enforce_eager=eager)
    for llm in llms:
        runner = llm.engine.runner
        assert runner.model.stack is None
        if eager or family == "gpt_oss":  # gpt-oss's attention sinks: the eager step only
            assert runner.backend.name == "eager"
        else:
            assert runner.backend.stack is not None  # a dense model would run its untapped decode blocks there
        path = "fused" if runner.backend.fused else "eager"
        assert {p for _, _, p in runner.model.last_runs} == {path}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_point_and_the_logits(family, moe_models):
    """Residual-width points within 1e-5 of their scale, attention points, and the logits; no mlp_post."""
    folder, model = moe_models[family]
    llm = LLM(folder, dtype="float32")
    runner = llm.engine.runner
    if runner.backend.gemv is not None:  # the default path computes the experts on the packed GEMV
        from tapllm.models.moe import SparseMoE

        assert all(m.experts.gemv is not None for m in runner.model.modules() if isinstance(m, SparseMoE))
    prompts = random_prompts([1, 9, 22], seed=32)
    check_points(llm, model, LAYOUT, prompts, 5, tol=1e-5, mlp_post=False)
    check_logits(llm, model, prompts, 5)
    with pytest.raises(ValueError, match="does not expose 'mlp_post'"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, hidden_states=HiddenStatesSpec(points=["mlp_post"])),
                     use_tqdm=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_steering(family, moe_models):
    folder, model = moe_models[family]
    check_steering(folder, model, LAYOUT)


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_expert_checkpoint(family, moe_models, tmp_path):
    """A checkpoint in transformers' in-memory layout (``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``) loads as well as the per-expert tensors save_pretrained writes."""
    from safetensors.torch import save_file

    folder, model = moe_models[family]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (folder / name).is_file():
            (tmp_path / name).write_bytes((folder / name).read_bytes())
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == model.config.architectures
    prompts = random_prompts([5, 19], seed=41)
    refs = [hf_greedy(model, p, 6) for p in prompts]
    outs = LLM(tmp_path, dtype="float32").generate(
        prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert_matches_reference(outs, refs)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_cuda_backend_runs_moe_decode_steps_in_graphs(family, moe_models):
    """The CUDA backend (Triton interpreted, graphs emulated here) computes the experts in its fused kernels,
    which read nothing on the host, so decode steps replay graphs; gpt-oss (attention sinks, biased experts
    with a clamped SwiGLU) runs the eager step and says why. Tokens equal transformers' either way."""
    folder, model = moe_models[family]
    prompts = random_prompts([4, 11], seed=43)
    refs = [hf_greedy(model, p, 5) for p in prompts]
    llm = LLM(folder, dtype="float32", backend="cuda", max_num_seqs=2, max_num_batched_tokens=16,
              cuda_graph_sizes=[1, 2], cuda_graph_token_sizes=[16])
    runner = llm.engine.runner
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, refs)
    if family == "gpt_oss":
        assert runner.backend.name == "eager" and runner.graph_step is None
        assert "attention sinks" in llm.describe()
        assert "clamped SwiGLU" in runner.model.graphs_off
        return
    assert runner.backend.name == "cuda" and runner.graph_step is not None and runner.policy.off is None
    assert runner.policy.graph_steps > 0 and not runner.policy.eager_steps, runner.policy.eager_steps


def test_batch_invariant_is_refused(moe_models):
    folder, _ = moe_models["mixtral"]
    with pytest.raises(ValueError, match="batch_invariant=True is not supported for MixtralForCausalLM"):
        LLM(folder, dtype="float32", batch_invariant=True)


def test_quantization_keeps_routers_and_experts_in_the_model_dtype(moe_models):
    """int8 quantizes attention and the shared expert; routers (a rounding there changes the route) and
    the stacked experts stay float."""
    from tapllm.models.moe import Router, SparseMoE
    from tapllm.quant.linear import QuantLinear

    folder, _ = moe_models["qwen2_moe"]
    llm = LLM(folder, dtype="float32", quantization="int8")
    model = llm.engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == 2
    for moe in moes:
        assert type(moe.gate) is Router and type(moe.shared_expert_gate) is Router
        assert isinstance(moe.shared_expert.gate_up_proj, QuantLinear)
        assert moe.experts.dtype == torch.float32  # packed for the CPU backend's GEMV, or not
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    out = llm.generate([random_prompts([6], seed=44)[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_equal_transformers_output_router_logits(family, moe_models):
    """``router_logits`` at every block and position of a batched, chunked generate equals transformers'
    ``output_router_logits``; NaN at a dense block (Qwen2-MoE's ``mlp_only_layers``)."""
    folder, model = moe_models[family]
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=8)  # the 19-token prompt runs in chunks
    prompts = random_prompts([1, 19, 6], seed=45)
    spec = HiddenStatesSpec(layers="all", points=["router_logits"], positions="all")
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, hidden_states=spec),
                        use_tqdm=False)
    sparse = [i for i, layer in enumerate(model.model.layers) if _router(layer.mlp) is not None]
    for prompt, out in zip(prompts, outs):
        seq = (prompt + out.outputs[0].token_ids)[:-1]
        got = out.hidden_states["router_logits"]
        assert got.shape == (len(seq), len(model.model.layers), 4)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([seq]), output_router_logits=True).router_logits
        assert len(ref) == len(sparse)
        assert_close_states(got[:, sparse], torch.stack(list(ref), 1), f"router_logits (prompt {len(prompt)})", 1e-5)
        dense = [i for i in range(len(model.model.layers)) if i not in sparse]
        assert got[:, dense].isnan().all()


def test_dense_models_do_not_expose_router_logits(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    with pytest.raises(ValueError, match="does not expose 'router_logits'"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2,
                                                 hidden_states=HiddenStatesSpec(points=["router_logits"])),
                     use_tqdm=False)


def test_router_logits_mean_over_a_prompt_through_encode(moe_models):
    """``router_logits`` goes through the reductions like every point: its mean over a prompt (encode, run
    in chunks, twice) equals the mean of transformers' router logits."""
    folder, model = moe_models["olmoe"]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=5)
    prompt = random_prompts([13], seed=46)[0]
    spec = HiddenStatesSpec(layers=[0, -1], points=["router_logits"], positions="prompt", reduce="mean")
    first, again = (llm.encode([prompt], spec, use_tqdm=False)[0] for _ in range(2))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt]), output_router_logits=True).router_logits
    want = torch.stack([ref[0].mean(0), ref[-1].mean(0)])
    for out in (first, again):
        assert out.hidden_states["router_logits"].shape == (2, 4)
        assert torch.allclose(out.hidden_states["router_logits"], want, atol=1e-5)


def test_describe_says_how_moe_models_run(moe_models):
    """``LLM.describe`` names what runs: no C++ block runner for MoE blocks; gpt-oss's eager step and why."""
    text = LLM(moe_models["qwen3_moe"][0], dtype="float32").describe()
    assert "untapped decode blocks: Python (not Qwen3MoeForCausalLM's blocks)" in text
    text = LLM(moe_models["gpt_oss"][0], dtype="float32").describe()
    assert "forward backend: eager" in text and "enforce_eager=True" not in text
    assert "GptOssForCausalLM: attention sinks are computed by the PyTorch attention only" in text


def test_qwen3_moe_gguf_in_llama_cpp_layout_loads_and_matches(moe_models, tmp_path):
    """A Qwen3-MoE GGUF (``qwen3moe``: router ``ffn_gate_inp``, experts stacked as ``ffn_{gate,up,down}_exps``)
    loads to the same model: tapllm on the GGUF equals transformers on the folder."""
    from gguf_writer import write_gguf

    folder, model = moe_models["qwen3_moe"]
    cfg = model.config
    sd = model.state_dict()
    inter = cfg.moe_intermediate_size
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        for hf_name, cpp in names.items():
            tensors[f"blk.{i}.{cpp}.weight"] = sd[f"model.layers.{i}.{hf_name}.weight"]
        gate_up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, 2I, H]
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :inter].contiguous()
        tensors[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, inter:].contiguous()
        tensors[f"blk.{i}.ffn_down_exps.weight"] = sd[f"model.layers.{i}.mlp.experts.down_proj"]  # [E, H, I]
    kv = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
          "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
          "expert_feed_forward_length": inter, "expert_count": cfg.num_experts,
          "expert_used_count": cfg.num_experts_per_tok, "attention.head_count": cfg.num_attention_heads,
          "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": cfg.head_dim,
          "attention.value_length": cfg.head_dim, "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
          "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "vocab_size": cfg.vocab_size,
          "rope.dimension_count": cfg.head_dim}
    path = write_gguf(tmp_path / "tiny-qwen3moe.gguf", "qwen3moe", kv, tensors)
    prompts = random_prompts([5, 19], seed=47)
    refs = [hf_greedy(model, p, 6) for p in prompts]
    llm = LLM(path, dtype="float32")
    assert llm.engine.model_config.architecture == "Qwen3MoeForCausalLM"
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert_matches_reference(outs, refs)
