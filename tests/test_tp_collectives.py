"""The tensor-parallel collectives: the shared-memory transport of the ranks of one machine against
gloo, and a split model's forward path (the fused CPU kernels block by block) against the plain one.

The shared-memory all-reduce sums the ranks' parts in rank order on every rank, so with two ranks it
gives gloo's result to the bit; tensors past a slot go through in chunks; the region's file is gone
from ``/dev/shm`` once the ranks have mapped it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import random_prompts
from helpers import assert_close, greedy
from tapllm import LLM, HiddenStatesSpec, Steer
from tapllm.parallel.shm import SHM_ENV, SLOT_BYTES

ENGINE = dict(dtype="float32", kv_cache_blocks=96, max_num_batched_tokens=32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("tapllm-tp-")} if os.path.isdir("/dev/shm") else set()


def _rank(rank: int, port: int, shm: str, out: str) -> None:
    os.environ[SHM_ENV] = shm
    torch.set_num_threads(1)
    from tapllm.parallel.group import TPGroup

    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=timedelta(seconds=30))
    group = TPGroup(store, rank, 2, 30.0)
    g = torch.Generator().manual_seed(rank)
    results = {"transport": group.transport}
    # Past a slot (chunked), in every dtype the kernels sum; a gather past a slot; odd sizes.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(SLOT_BYTES // 2 + 123, generator=g).to(dtype)
        results[f"sum_{dtype}"] = group.all_reduce(x.clone())
        results[f"part_{dtype}"] = x
    y = torch.randn(7, SLOT_BYTES // 16 + 5, generator=g)
    results["gather"] = group.all_gather(y, dim=-1)
    results["gather0"] = group.all_gather(y[:, :3], dim=0)
    results["part_gather"] = y
    # parts of different sizes (an uneven split): rank 0 holds more rows / columns than rank 1
    results["uneven0"] = group.all_gather(y[:4 - 3 * rank], dim=0, sizes=[4, 1])  # past a slot
    results["uneven"] = group.all_gather(y[:, :5 - 3 * rank], dim=-1, sizes=[5, 2])
    group.barrier()
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.mark.parametrize("shm", ["1", "0"])
def test_collectives_sum_and_gather_exactly(shm, tmp_path):
    before = _shm_files()
    mp.start_processes(_rank, args=(_free_port(), shm, str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["transport"] == r1["transport"]
    assert (r0["transport"] == "shared memory") == (shm == "1"), r0["transport"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = (r0[f"part_{dtype}"].float() + r1[f"part_{dtype}"].float()).to(dtype)
        assert torch.equal(r0[f"sum_{dtype}"], want) and torch.equal(r1[f"sum_{dtype}"], want), dtype
    a, b = r0["part_gather"], r1["part_gather"]
    for r in (r0, r1):
        assert torch.equal(r["gather"], torch.cat([a, b], dim=-1))
        assert torch.equal(r["gather0"], torch.cat([a[:, :3], b[:, :3]], dim=0))
        assert torch.equal(r["uneven0"], torch.cat([a[:4], b[:1]], dim=0))
        assert torch.equal(r["uneven"], torch.cat([a[:, :5], b[:, :2]], dim=-1))
    assert _shm_files() == before  # the region's name was removed once both ranks mapped it


def test_shared_memory_and_gloo_and_eager_ranks_agree(tiny_models, monkeypatch):
    """TP 2 through shared memory (the default), through gloo, and on the plain PyTorch step: the same
    tokens, states within float32 rounding, at residual, sharded and steered points alike."""
    spec = HiddenStatesSpec(layers=[0, -1], points=["resid_post", "mlp_post", "z"], positions="all")
    steer = [Steer(layers=[1], point="resid_mid", vector=torch.linspace(-1, 1, 64), scale=2.0),
             Steer(layers=[0], point="z", op="scale", scale=0.0, heads=[1])]
    prompts = random_prompts([9, 40, 3], seed=31)
    runs = {}
    for name, env, options in (("shm", "1", {}), ("gloo", "0", {}), ("eager", "1", dict(enforce_eager=True))):
        monkeypatch.setenv(SHM_ENV, env)
        llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE, **options)
        try:
            transport = llm.engine.runner.tp.group.transport
            assert (transport == "shared memory") == (env == "1"), transport
            blocks = {"shm": "one C++ call per run of blocks", "gloo": "Python (the ranks meet over gloo)",
                      "eager": "PyTorch"}[name]
            assert f"untapped decode blocks: {blocks}" in llm.describe() and "collectives through" in llm.describe()
            runs[name] = llm.generate(prompts, [greedy(6, hidden_states=spec), greedy(6, steering=steer),
                                                greedy(6, hidden_states=spec, steering=steer)], use_tqdm=False)
        finally:
            llm.close()
    for name in ("gloo", "eager"):
        for a, b in zip(runs["shm"], runs[name], strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
            if a.hidden_states is not None:
                for point in ("resid_post", "mlp_post", "z"):
                    if name == "gloo":  # the same kernels, the same sums: the same bits
                        assert torch.equal(a.hidden_states[point], b.hidden_states[point]), point
                    else:
                        assert_close(a.hidden_states[point], b.hidden_states[point], 1e-5)
