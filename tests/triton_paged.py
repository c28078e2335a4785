"""What the Triton attention tests share: the interpreter's set-up, tolerances and a paged cache.

Triton fixes its mode when it is first imported: interpreted under ``TRITON_INTERPRET=1``,
compiled otherwise, for the whole process. On a machine without CUDA this module sets the
variable when it is first imported (by a test module, at collection), imports triton (no
earlier test module imports it) and removes the variable again, so other tests never see it;
the interpreter tests set it again for themselves (the ``interpret`` fixture). There the
kernels run in the interpreter on CPU tensors, at small shapes (it runs every program in
numpy). On a CUDA machine the tests marked ``cuda`` compile the kernels, compare at real
sizes and replay captured CUDA graphs; the interpreter tests run there when the whole run is
started with ``TRITON_INTERPRET=1``. The interpreter needs a Triton whose interpreter accepts
NumPy 2.4 (3.9 does; 3.6's turns scalar tensors into ints in a way NumPy 2.4 rejects,
triton-lang/triton#9171).

Every cache slot that holds no key of the batch (stale rows of a partly filled block, unused
blocks, the blocks that padding table entries point at) holds NaN in the kernels' copy of
:class:`Paged` and 0 in the reference's copy: a kernel that read one, even with zero weight,
would give NaN.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
_SET_HERE = not CUDA and "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ
if _SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"
try:  # triton, and the kernels' module, decide their mode here
    from tapllm.kernels.triton_attention_kernels import INTERPRETED
except ImportError:
    INTERPRETED = None
finally:
    if _SET_HERE:
        del os.environ["TRITON_INTERPRET"]
if INTERPRETED is None:
    pytest.skip("triton is not importable", allow_module_level=True)

from tapllm.layers.attention import AttentionOptions  # noqa: E402

# Kernel minus float32 reference on the same (rounded) inputs: float32 sums in another order;
# half precisions also round the softmax weights before the weighted sum of values, and the output.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
cuda = pytest.mark.skipif(not CUDA or INTERPRETED, reason="needs a CUDA device and compiled kernels")

# (heads, kv_heads, head_dim, block_size, dtype): real model shapes (Llama-3-8B's, MHA, GQA 3 and 8, head 256)
CUDA_CASES = [
    (32, 8, 128, 16, torch.bfloat16),
    (32, 8, 128, 16, torch.float16),
    (32, 8, 128, 16, torch.float32),
    (16, 16, 64, 32, torch.bfloat16),
    (12, 4, 80, 16, torch.bfloat16),
    (8, 1, 96, 16, torch.float16),
    (8, 2, 256, 8, torch.bfloat16),
]


@pytest.fixture
def interpret(monkeypatch):
    """CPU tensors run in Triton's interpreter (with the variable set, as Triton expects, for this test)."""
    if not INTERPRETED:
        if CUDA:
            pytest.skip("compiled kernels on this CUDA machine (TRITON_INTERPRET=1 runs these in the interpreter)")
        pytest.fail("triton was imported before this module could set TRITON_INTERPRET=1: run the file alone, "
                    "or with TRITON_INTERPRET=1 set")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def options(dim: int, window: int, softcap: float) -> AttentionOptions:
    """A layer's options: scale 1/sqrt(dim), and a window and soft-cap where > 0."""
    return AttentionOptions(scale=dim**-0.5, window=window or None, softcap=softcap or None)


class Paged:
    """Sequences of ``totals`` tokens in scattered blocks of head-major caches.

    ``k``/``v`` are the kernels' caches (``dtype``, NaN wherever no sequence has a key);
    ``k32``/``v32`` the reference's (float32 of the same values, 0 there). ``tables`` rows
    are padded to ``width`` with block 0, which no sequence uses.
    """

    def __init__(self, g: torch.Generator, totals: list[int], kv_heads: int, dim: int, page: int,
                 dtype: torch.dtype, spare: int = 2, index_dtype: torch.dtype = torch.int64,
                 scale: float = 1.0) -> None:
        need = [-(-n // page) for n in totals]
        self.width = max(need + [1]) + spare
        num_blocks = sum(need) + 3
        order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.poison = 0  # only padding entries point at it (and a masked-off table read yields it)
        self.tables_list: list[list[int]] = []
        valid = torch.zeros(num_blocks, page, dtype=torch.bool)
        for n, nb in zip(totals, need):
            blocks = [order.pop() for _ in range(nb)]
            self.tables_list.append(blocks)
            for p in range(n):
                valid[blocks[p // page], p % page] = True
        self.tables = torch.tensor([t + [self.poison] * (self.width - len(t)) for t in self.tables_list],
                                   dtype=index_dtype).reshape(len(totals), self.width)
        self.page, self.valid = page, valid
        shape = (kv_heads, num_blocks, page, dim)
        self.k = (torch.randn(shape, generator=g) * scale).to(dtype)
        self.v = torch.randn(shape, generator=g).to(dtype)
        self.k32 = self.k.float().masked_fill(~valid[None, :, :, None], 0.0)
        self.v32 = self.v.float().masked_fill(~valid[None, :, :, None], 0.0)
        self.k.masked_fill_(~valid[None, :, :, None], float("nan"))
        self.v.masked_fill_(~valid[None, :, :, None], float("nan"))

    def to(self, device: str) -> Paged:
        for name in ("tables", "k", "v", "k32", "v32"):
            setattr(self, name, getattr(self, name).to(device))
        return self
