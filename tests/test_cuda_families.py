"""Every family on the CUDA path: tokens and every point's states against transformers.

The tests marked ``cuda`` (skipped where no GPU is available) run the CPU harness
(``family_harness``) with the transformers model and its inputs on the GPU, and tapllm there
twice: on its default backend (CUDA graphs, Triton kernels) and with ``enforce_eager=True``.
Both must give transformers' greedy tokens and states, alone, batched, chunked, after
prefix-cache hits and through preemption, and steer as hooks doing the same operation do;
the graph engines must have replayed graphs and captured none after start-up.

Without a GPU, the Llama family runs the same harness on the CUDA backend on the CPU
(``backend="cuda"``: the Triton kernels in Triton's interpreter, graphs emulated by running the
body a graph holds), so the graph path is checked against transformers here too. A one-block
Llama and small buckets keep it about a minute.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, random_prompts, save_tiny_model
from family_configs import SMALL, VOCAB, family_configs
from family_harness import check_points, check_situations, check_steering
from tapllm.kernels import triton_tap

LAYOUT_OF = {"llama": "test_family_llama", "llama3-rope": "test_family_llama", "mistral": "test_family_llama",
             "qwen2": "test_family_llama", "qwen3": "test_family_llama", "gemma2": "test_family_gemma2",
             "gemma3": "test_family_gemma2", "phi3": "test_family_phi3", "phi3-longrope": "test_family_phi3",
             "olmo2": "test_family_olmo2", "gpt2": "test_family_gpt2", "pythia": "test_family_gpt_neox"}
# The harness makes seven engines per family: few sequences, so few graphs to capture at each start.
GPU_ENGINE = {"device": "cuda", "max_num_seqs": 8}
# The CUDA backend on the CPU: the interpreter costs about a second per step, whatever the bucket's padding.
CPU_GRAPHS = {"device": "cpu", "backend": "cuda", "max_num_seqs": 8, "max_num_batched_tokens": 16,
              "cuda_graph_sizes": [1, 2, 4, 8], "cuda_graph_token_sizes": [16], "max_model_len": 128}

interpreted = pytest.mark.skipif(not triton_tap.available(torch.device("cpu")),
                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1, no GPU)")


def _layout(name: str):
    import importlib

    return importlib.import_module(LAYOUT_OF[name]).LAYOUT


def _ran_on_graphs(engines) -> None:
    """Each engine with graphs replayed some (a family whose graphs are off says why in ``policy.off``)
    and captured none after start-up."""
    for llm in engines:
        runner = llm.engine.runner
        if runner.graph_step is None:
            assert runner.policy.off, "graphs off without a reason"
            continue
        assert runner.policy.graph_steps > 0, runner.policy.eager_steps
        assert runner.graph_step.graphs.captures_after_warmup == 0


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["graph", "eager"])
@pytest.mark.parametrize("name", sorted(family_configs()))
def test_family_on_cuda_matches_transformers(tmp_path, default_model_folder, name, path):
    from transformers import AutoModelForCausalLM

    from tapllm import LLM

    folder = save_tiny_model(tmp_path / name, family_configs()[name], default_model_folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    prompts = random_prompts([1, 9, 37], seed=32)
    engine = {**GPU_ENGINE, "enforce_eager": path == "eager"}
    with torch.device("cuda"):  # the references' inputs on the GPU, where the model is
        engines = check_situations(folder, model, prompts, 6, **engine)
        llm = LLM(folder, dtype="float32", **engine)
        assert llm.engine.runner.backend.device.type == "cuda"
        check_points(llm, model, _layout(name), prompts, 5)
        engines += [llm, check_steering(folder, model, _layout(name), **engine)]
    if path == "graph":
        _ran_on_graphs(engines)
    else:
        assert all(e.engine.runner.policy.graph_steps == 0 for e in engines)


@pytest.mark.cuda
def test_graph_and_eager_steps_agree_in_bf16(tiny_models):
    """bf16 on the GPU: greedy tokens of the graph path (plain, tapped and steered rows) equal the eager step's."""
    from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer

    prompts = random_prompts([3, 17, 40, 64, 9, 25], seed=9)
    direction = torch.randn(TINY["hidden_size"], generator=torch.Generator().manual_seed(2)) * 4
    steer = [Steer(layers=[1], point="resid_post", vector=direction)]
    spec = HiddenStatesSpec(layers="all", points="resid_post", positions="all")
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                             hidden_states=spec if i % 3 == 1 else None, steering=steer if i % 3 == 2 else None)
              for i in range(len(prompts))]
    engines = [LLM(tiny_models["llama"], dtype="bfloat16", device="cuda", enforce_eager=eager)
               for eager in (False, True)]
    got = [e.generate(prompts, params, use_tqdm=False) for e in engines]
    assert [o.outputs[0].token_ids for o in got[0]] == [o.outputs[0].token_ids for o in got[1]]
    assert not engines[0].engine.runner.policy.eager_steps
    _ran_on_graphs(engines[:1])


@pytest.mark.cuda
def test_states_stay_on_the_gpu_when_asked(tiny_models):
    from tapllm import LLM, HiddenStatesSpec, SamplingParams

    llm = LLM(tiny_models["llama"], dtype="float32", device="cuda")
    prompt = random_prompts([12], seed=4)
    outs = [llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                hidden_states=HiddenStatesSpec(layers=[0, -1], device=where)),
                         use_tqdm=False)[0].hidden_states["resid_post"] for where in ("cuda", None)]
    assert outs[0].device.type == "cuda" and outs[1].device.type == "cpu"
    torch.testing.assert_close(outs[0].cpu(), outs[1])


# ---- the graph path on the CPU --------------------------------------------------------------
@pytest.fixture(scope="module")
def one_block_llama(tmp_path_factory, default_model_folder):
    """A one-block Llama and its transformers model (one block: the interpreter's time is per block)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, **{**SMALL, "num_hidden_layers": 1})
    config.architectures = ["LlamaForCausalLM"]
    folder = save_tiny_model(tmp_path_factory.mktemp("llama1"), config, default_model_folder)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@interpreted
def test_llama_graph_path_on_the_cpu_in_every_situation(one_block_llama):
    folder, model = one_block_llama
    engines = check_situations(folder, model, random_prompts([3, 9], seed=31), 3, **CPU_GRAPHS)
    _ran_on_graphs(engines)


@interpreted
def test_llama_graph_path_on_the_cpu_captures_and_steers_as_transformers(one_block_llama):
    from tapllm import LLM

    folder, model = one_block_llama
    layout = _layout("llama")
    llm = LLM(folder, dtype="float32", **CPU_GRAPHS)
    check_points(llm, model, layout, random_prompts([2, 9], seed=32), 3)
    steered = check_steering(folder, model, layout, 3, **CPU_GRAPHS)
    _ran_on_graphs([llm, steered])
    assert not steered.engine.runner.policy.eager_steps
