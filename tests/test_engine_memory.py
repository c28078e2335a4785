"""An LLM that is dropped frees its engine and weights, although the engine freezes the heap."""

from __future__ import annotations

import gc
import weakref

from tapllm import LLM, SamplingParams


def test_a_dropped_llm_frees_its_engine_and_model(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert gc.get_freeze_count() > 0  # the engine moved the loaded objects out of the collector's passes
    engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.model)
    del llm
    gc.collect()
    assert engine() is None and model() is None
