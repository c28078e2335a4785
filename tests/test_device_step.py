"""A step is device-resident: one upload of its inputs, one download of its results, no other host sync.

On CPU the "device" is the CPU too, so the test watches what a GPU would pay for: every
``.item()``/``bool()``/``.tolist()``/``.cpu()``/``.numpy()`` of a tensor, every tensor made from
host data (``torch.tensor``), every op that must read a device value to size its result
(``nonzero``, boolean masks), and the copies into the device buffer from the staging buffer
(uploads) and out of the device into the download buffer (downloads).
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import random_prompts
from tapllm import LLM, SamplingParams

_HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "tensor",
               "as_tensor"}
_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique")


def _within(t: torch.Tensor, owner: torch.Tensor) -> bool:
    start = owner.untyped_storage().data_ptr()
    return start <= t.data_ptr() < start + owner.untyped_storage().nbytes()


def _host_buffers(runner) -> list[torch.Tensor]:
    return [runner.staging.host, *(h for ring in runner.download._host.values() for h in ring)]


class StepWatch(TorchFunctionMode):
    """Records host reads and host-made tensors (function level) while active; reads of the
    staging and download buffers themselves are host memory, not device reads."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner = runner
        self.host: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in _HOST_READS:
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and any(_within(first, h) for h in _host_buffers(self.runner))):
                self.host.append(name)
        return func(*args, **(kwargs or {}))


class CopyWatch(TorchDispatchMode):
    """Counts uploads from ``staging``, downloads into ``download``, and ops that sync a device."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner = runner
        self.uploads = self.downloads = 0
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _SYNC_OPS:
            self.syncs.append(name)
        if name == "aten::index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.syncs.append("boolean index")
        if name == "aten::copy_":
            dst, src = args[0], args[1]
            if _within(src, self.runner.staging.host):
                self.uploads += 1
            elif any(_within(dst, h) for ring in self.runner.download._host.values() for h in ring):
                self.downloads += 1
        return func(*args, **kwargs)


def _watched_decode_step(llm: LLM, params: list[SamplingParams]):
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(random_prompts([9, 21, 16, 5], seed=3), params)):
        engine.add(engine.input_processor.prepare(prompt, p, request_id=f"r{i}"))
    engine.step()  # the prompts
    engine.step()  # a first decode (buffers sized)
    runner = engine.runner
    sched = engine.scheduler.schedule()
    assert all(it.num_tokens == 1 for it in sched.items) and len(sched.items) == len(params)
    functions, copies = StepWatch(runner), CopyWatch(runner)
    with functions, copies:
        result = runner.execute(sched.items)
    return result, functions, copies


@pytest.mark.parametrize("eager,graphs", [(False, False), (True, False), (False, True)])
def test_a_decode_step_uploads_once_downloads_once_and_never_syncs(tiny_models, eager, graphs):
    if graphs:  # the CUDA backend's graph step, without a GPU: the function a graph holds, on its buffers
        llm = LLM(tiny_models["llama"], dtype="float32", backend="cuda", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
                  cuda_graph_token_sizes=[])
    else:
        llm = LLM(tiny_models["llama"], dtype="float32", enforce_eager=eager)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, min_p=0.05, seed=8, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)]
    result, functions, copies = _watched_decode_step(llm, params)
    assert len(result.sampled) == 4 and not result.failed
    assert copies.uploads == 1, copies.uploads
    assert copies.downloads == 1, copies.downloads
    assert copies.syncs == [], copies.syncs
    assert functions.host == [], functions.host
    if graphs:
        assert llm.engine.runner.policy.graph_steps >= 2


def test_the_watch_sees_what_it_must_refuse(tiny_models):
    """The counters are live: a host read, a sync op and an extra upload inside the watch are seen."""
    llm = LLM(tiny_models["llama"], dtype="float32")
    runner = llm.engine.runner
    functions, copies = StepWatch(runner), CopyWatch(runner)
    x = torch.arange(6.0)
    with functions, copies:
        x.tolist()
        float(x.sum())
        x.nonzero()
        runner.staging.begin()
        runner.staging.add([1, 2, 3], torch.int64)
        runner.staging.upload()
        runner.download.fetch(x)
    assert "tolist" in functions.host and "__float__" in functions.host
    assert "aten::nonzero" in copies.syncs and "aten::_local_scalar_dense" in copies.syncs
    assert copies.uploads == 1 and copies.downloads == 1


def test_where_states_live_is_checked_where_it_enters(tiny_models):
    from tapllm import HiddenStatesSpec

    with pytest.raises(ValueError, match="hidden_states.device"):
        HiddenStatesSpec(device="tpu")
    with pytest.raises(ValueError, match="hidden_states.device"):
        HiddenStatesSpec(device=3.5)
    llm = LLM(tiny_models["llama"], dtype="float32")
    prompt = random_prompts([6], seed=9)
    params = SamplingParams(max_tokens=2, temperature=0, hidden_states=HiddenStatesSpec(device="cuda"))
    with pytest.raises(ValueError, match=r"hidden_states.device='cuda'.*model's device \(cpu\)"):
        llm.generate(prompt, params, use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, hidden_states=HiddenStatesSpec(device="cpu")),
                       use_tqdm=False)[0]
    assert out.hidden_states["resid_post"].device.type == "cpu"
