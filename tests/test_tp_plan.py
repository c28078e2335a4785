"""Plans of tensor-parallel splits (``plan_split``, ``tapllm plan``): each rank's shard built on the meta
device, its bytes counted as a running rank counts them.

A 70B-shaped Llama at TP 8 fits 80 GB GPUs with its KV cache, and does not fit one at TP 1, planned in
well under a second with no weight allocated; for every registered family the plan's bytes per rank
are what a real TP 2 engine holds and reports in ``describe()``.
"""

from __future__ import annotations

import resource
import time

import pytest
import torch

from tapllm import LLM
from tapllm.parallel import SplitPlan, plan_split
from tapllm.parallel import plan as plan_module
from tapllm.parallel.sharding import weight_bytes

# The fields of Llama-3.3-70B-Instruct's config.json (untied head, bf16, 8 KV heads, llama3 rotary scaling).
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu", "hidden_size": 8192,
    "initializer_range": 0.02, "intermediate_size": 28672, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
PARAMS_70B = 70_553_706_496  # Llama-3.3-70B's parameter count
GB = 10**9


def test_70b_at_tp8_fits_80gb_gpus_planned_on_meta(monkeypatch):
    plan_split({**LLAMA_70B, "num_hidden_layers": 1}, 1)  # transformers' config and rotary modules imported untimed
    shards = []
    build = plan_module.build_shard

    def spy(*args, **kwargs):
        shards.append(build(*args, **kwargs))
        return shards[-1]

    monkeypatch.setattr(plan_module, "build_shard", spy)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    plan = plan_split(LLAMA_70B, 8, "bfloat16", kv_tokens=8 * 8192, gpu_memory_gib=80)
    seconds = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert seconds < 3, seconds
    assert shards and all(p.is_meta for s in shards for p in [*s.parameters(), *s.buffers()])
    assert grown < 1 << 20, f"the peak resident set grew by {grown} KiB"  # a rank's weights would be 17.6 GB
    print(f"\n{plan}\nplanned in {seconds:.2f} s")

    assert plan.model_weight_bytes == 2 * PARAMS_70B  # the whole model in bf16: 141.1 GB
    assert plan.tensor_parallel_size == 8
    for r, rank in enumerate(plan.ranks):
        assert rank.weight_bytes_by_dtype.keys() == {torch.bfloat16}
        assert rank.weight_bytes <= plan.model_weight_bytes * (1 / 8 + 0.05)
        lay = rank.layout
        assert (lay.heads, lay.kv_heads, lay.neurons, lay.vocab) == (8, 1, 3584, 16032)
        assert (lay.head_start, lay.vocab_start) == (8 * r, 16032 * r)
        assert rank.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # K and V, 80 blocks, one KV head of 128, bf16
        assert plan.rank_bytes(r) < 80 * GB
    assert plan.kv_bytes() == 8 * 8192 * 40960  # 2.7 GB
    assert plan.fits is True

    whole = plan_split(LLAMA_70B, 1, "bfloat16", kv_tokens=8 * 8192, gpu_memory_gib=80)
    assert whole.ranks[0].weight_bytes == whole.model_weight_bytes > 140 * GB
    assert whole.fits is False and whole.kv_tokens_that_fit() == 0
    assert "NO" in str(whole) and "does NOT fit" in str(whole)


def test_plan_reads_folders_json_files_and_transformers_configs(tmp_path):
    from transformers import LlamaConfig

    from conftest import TINY

    config = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, **TINY)
    from_object = plan_split(config, 2, "float32")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path / "folder")
    (tmp_path / "tiny.json").write_text((tmp_path / "folder" / "config.json").read_text())
    for source in (tmp_path / "folder", tmp_path / "folder" / "config.json", str(tmp_path / "tiny.json")):
        plan = plan_split(source, 2, "float32")
        assert [r.weight_bytes for r in plan.ranks] == [r.weight_bytes for r in from_object.ranks]
        assert plan.kv_tokens == 512  # one sequence of the model's context
    assert plan.model == "tiny" and plan_split(tmp_path / "folder", 1).dtype == torch.float32
    with pytest.raises(FileNotFoundError, match="no model folder"):
        plan_split(tmp_path / "missing", 2)


def test_sizes_that_do_not_divide_name_the_field():
    with pytest.raises(ValueError, match="size=12 does not divide the model: num_key_value_heads=8 is fewer than"):
        plan_split(LLAMA_70B, 12)
    with pytest.raises(ValueError, match="num_attention_heads=64 is fewer than the 65 ranks"):
        plan_split(LLAMA_70B, 65)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        plan_split(LLAMA_70B, 0)


def test_command_line(tmp_path, capsys):
    import json

    from tapllm.cli.main import main

    (tmp_path / "llama70b.json").write_text(json.dumps(LLAMA_70B))
    args = ["plan", str(tmp_path / "llama70b.json"), "--tensor-parallel-size", "8", "--dtype", "bfloat16",
            "--gpu-memory-gib", "80", "--max-model-len", "8192", "--max-num-seqs", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel_size=8" in out and "1 of 8 KV heads" in out and "16032 of 128256 vocabulary rows" in out
    assert out.count("  yes") == 8 and "x 65536 tokens" in out and "17.64 GB" in out
    assert main(["plan", str(tmp_path / "llama70b.json"), "--tensor-parallel-size", "12"]) == 2
    assert "num_key_value_heads=8" in capsys.readouterr().err


# One tiny model per registered architecture, tied heads among them (llama3-rope, phi3-longrope, qwen3).
FAMILIES = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3-longrope", "olmo2",
            "gpt2", "pythia"]


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory, default_model_folder):
    """Each family's tiny config and the default tokenizer: the engines below run random weights (dummy)."""
    from transformers import AutoTokenizer

    from family_configs import family_configs

    configs = family_configs()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_folder))
    root = tmp_path_factory.mktemp("plan-families")
    for name in FAMILIES:
        configs[name].save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {name: root / name for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_equals_what_a_tp2_engine_holds(family, family_folders):
    """The plan's weight and KV bytes per rank are those of a real TP 2 engine (counted on its loaded
    parameters, printed by describe()); the whole model's are a real one-process model's. Every tiny
    model has 4 heads and 2 KV heads, so TP 2 splits each. The 1/N + 5% bound holds on these shapes:
    everything but the norms (and GPT-2's position table) is split, the vocabulary included."""
    from tapllm.config import ModelConfig
    from tapllm.models import build_model

    folder = family_folders[family]
    plan = plan_split(folder, 2, "float32")
    whole = build_model(ModelConfig.from_folder(folder, "float32", "cpu"))  # real storage: the tiny model
    assert plan.model_weight_bytes == weight_bytes(whole)
    two = LLM(folder, tensor_parallel_size=2, dtype="float32", load_format="dummy", kv_cache_blocks=8)
    try:
        tp, runner = two.engine.runner.tp, two.engine.runner
        assert tp.weight_bytes == [r.weight_bytes for r in plan.ranks]
        held = sum(c.nbytes for pair in runner.kv_caches for c in pair)  # rank 0's cache, padding block included
        assert held == (runner.num_blocks + 1) * 16 * plan.ranks[0].kv_bytes_per_token
        described = two.describe()
        assert ", ".join(f"{r.weight_bytes / 1e6:.1f} MB" for r in plan.ranks) in described
        assert f"{held / 1e9:.3f} GB per rank" in described
    finally:
        two.close()
    for rank in plan.ranks:
        assert rank.weight_bytes <= plan.model_weight_bytes * (1 / 2 + 0.05), (family, rank.weight_bytes)


def test_plan_is_a_split_plan_with_readable_text():
    plan = plan_split(LLAMA_70B, 4, "bfloat16", max_model_len=4096, max_num_seqs=2)
    assert isinstance(plan, SplitPlan) and plan.kv_tokens == 8192 and plan.fits is None
    text = str(plan)
    assert "16 of 64 query heads, 2 of 8 KV heads (split)" in text and "fits" not in text.splitlines()[3]


def test_kv_heads_fewer_than_ranks_are_replicated_in_the_plan():
    plan = plan_split(LLAMA_70B, 16, "bfloat16")
    lay = plan.ranks[0].layout
    assert (lay.heads, lay.kv_heads, lay.kv_replicas) == (4, 1, 2)
    assert [r.layout.kv_head_start for r in plan.ranks[:4]] == [0, 0, 1, 1]
    assert plan.ranks[0].kv_bytes_per_token == 40960  # one KV head a rank, as at TP 8
    assert "1 of 8 KV heads (each held by 2 ranks)" in str(plan)


@pytest.mark.parametrize("quant", [dict(quantization="int8"), dict(quantization="int4", quantization_group_size=32),
                                   dict(quantization="q4_k", quantize_embedding=False)], ids=["int8", "int4", "q4_k"])
def test_quantized_plan_equals_what_a_quantized_tp2_engine_holds(quant, tiny_models):
    """The plan's bytes per rank, packed blocks included, are what a running quantized TP 2 engine holds."""
    plan = plan_split(tiny_models["llama3-rope-tied"], 2, "float32", **quant)
    assert plan.quantization.startswith(quant["quantization"]) and "weights, tensor_parallel_size" in str(plan)
    two = LLM(tiny_models["llama3-rope-tied"], tensor_parallel_size=2, dtype="float32", kv_cache_blocks=8, **quant)
    try:
        assert two.engine.runner.tp.weight_bytes == [r.weight_bytes for r in plan.ranks]
    finally:
        two.close()
    one = LLM(tiny_models["llama3-rope-tied"], dtype="float32", kv_cache_blocks=8, **quant)
    assert plan.model_weight_bytes == weight_bytes(one.engine.runner.model)
    for rank in plan.ranks:
        assert torch.uint8 in rank.weight_bytes_by_dtype
        assert rank.weight_bytes <= plan.model_weight_bytes * (1 / 2 + 0.05)


def test_70b_in_int4_at_tp2_plans_its_blocks():
    """Llama-3.3-70B in int4 (groups of 128 with a float16 scale and min: 4.25 bits a weight): 37.5 GB, 18.7 GB
    a rank at TP 2; gguf has no layouts without its file."""
    plan = plan_split(LLAMA_70B, 2, "bfloat16", quantization="int4", kv_tokens=8192, gpu_memory_gib=80)
    assert 36 * GB < plan.model_weight_bytes < 42 * GB
    assert all(r.weight_bytes <= plan.model_weight_bytes * (1 / 2 + 0.05) for r in plan.ranks) and plan.fits
    with pytest.raises(ValueError, match="quantization='gguf' cannot be planned"):
        plan_split(LLAMA_70B, 2, quantization="gguf")
