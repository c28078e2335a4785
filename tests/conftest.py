"""Shared fixtures: tiny random checkpoints in every supported family, and HF references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, every Triton kernel of tapllm runs in Triton's interpreter on CPU tensors: that is how the
# CUDA backend's modules are tested here. Triton reads this when a kernel is defined, so it is set before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep test runs hermetic: converted checkpoints go to a per-run cache unless one is given.
os.environ.setdefault("TAPLLM_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "tapllm"))
torch.set_num_threads(max(1, os.cpu_count() or 1))

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaked logits: no near-ties for greedy decoding to trip on
    rms_norm_eps=1e-6,
)


def _tiny_configs() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    vocab = 49152
    return {
        "llama": LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **TINY),
        "llama3-rope-tied": LlamaConfig(
            vocab_size=vocab,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **TINY,
        ),
        "mistral": MistralConfig(vocab_size=vocab, tie_word_embeddings=False, sliding_window=None, **TINY),
        "qwen2": Qwen2Config(vocab_size=vocab, tie_word_embeddings=False, **TINY),
        "qwen3": Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, head_dim=32, **TINY),
    }


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The default model, converted from its GGUF file to the cached folder form."""
    from tapllm.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model_folder) -> dict[str, Path]:
    """Tiny random models saved with ``save_pretrained``, with the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_folder))
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, cfg in _tiny_configs().items():
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if name == "qwen2":  # random biases, so the qkv bias path is really exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.2)
        folder = root / name
        # The Mistral checkpoint is sharded, so the shard index path is exercised too.
        model.save_pretrained(folder, max_shard_size="2MB" if name == "mistral" else "10GB")
        tok.save_pretrained(folder)
        out[name] = folder
    return out


def save_tiny_model(folder: Path, config, tokenizer_folder: Path, seed: int = 1234, shard: str = "10GB",
                    init=None) -> Path:
    """A random model of ``config`` saved with ``save_pretrained`` (plus the default tokenizer) in ``folder``.

    ``init(model)`` may change weights first (e.g. random biases, non-trivial norm weights).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if init is not None:
        init(model)
    model.save_pretrained(folder, max_shard_size=shard)
    AutoTokenizer.from_pretrained(str(tokenizer_folder)).save_pretrained(folder)
    return folder


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with transformers and its KV cache: tokens and their logprobs."""
    ids = torch.tensor([prompt_ids])
    tokens: list[int] = []
    lps: list[float] = []
    cache = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, cache=cache, use_cache=True)
            cache = out.cache
            logp = out.logits[0, -1].float().log_softmax(-1)
            nxt = int(logp.argmax())
            tokens.append(nxt)
            lps.append(float(logp[nxt]))
            ids = torch.tensor([[nxt]])
    return tokens, lps


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids away from the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_matches_reference(outs, refs, atol: float = 1e-4) -> None:
    """Each output's greedy tokens equal the reference's, and chosen-token logprobs within ``atol``."""
    for out, (tokens, lps) in zip(outs, refs, strict=True):
        c = out.outputs[0]
        assert c.token_ids == tokens
        got = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < atol


@pytest.fixture(scope="session", autouse=True)
def _kernels_built() -> None:
    """Build (or find cached) the fused C++ kernels before the first test: a server a test starts
    would otherwise pay a machine's first build inside its start-up timeout."""
    from tapllm.kernels import fused_kernels

    fused_kernels()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` skip where no CUDA GPU is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
