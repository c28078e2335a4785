"""A graph step's tap sites inside the Llama block's norms, rotary and activation, and the residual add carried
across blocks: the same values as the site kernel between plain ops and as the eager step, in
fewer launches.

No GPU here: kernels run in Triton's interpreter and graphs are emulated (see ``test_graph_step``);
:func:`test_fused_site_kernels_compile_for_a_gpu` compiles the kernels for a GPU target.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import random_prompts
from tapllm import LLM, HiddenStatesSpec, SamplingParams, Steer
from tapllm.kernels import triton_elementwise as te
from tapllm.kernels import triton_fused_sites as fs
from tapllm.kernels import triton_tap
from tapllm.kernels.constants import ACT_GELU_TANH, ACT_SILU, RMS_LLAMA
from tapllm.tap.fused import HeadSites, KernelSites, NormSites
from tapllm.tap.points import DENSE_POINTS as POINTS  # the dense models here have no router
from tapllm.tap.sites import Sites
from tapllm.tap.tables import NO_END, OP_ADD, SlotCapture, SlotOp, TapTables
from test_graph_step import DECODE, MIXED, _close, _eager, _same
from test_tap_tables import HEAD_DIM, HEADS, HIDDEN, LAYERS, SHAPES, _random_ops

pytestmark = pytest.mark.skipif(not triton_tap.available(torch.device("cpu")),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

ROOT = Path(__file__).resolve().parent.parent
KV_HEADS = SHAPES["k"][0]


# ---- the kernels against the site kernel between plain ops ------------------------------------------


def _steered_tables(dtype: torch.dtype, g: torch.Generator) -> tuple[TapTables, KernelSites]:
    """Slots 0-4 steer at random sites with every kind of operation (odd ones capture every site too; slot 4
    also adds at every site), slot 5 taps nothing; 12 rows on these slots at random positions."""
    sites = Sites(LAYERS, SHAPES)
    tables = TapTables(sites, 6, 12, torch.device("cpu"), dtype, max_ops=2048, pool_rows=4096,
                       capture_numbers=12 * sum(s.width for s in sites.all))
    every = SlotCapture({s.index: sum(x.width for x in sites.all[: s.index]) for s in sites.all},
                        sum(s.width for s in sites.all), 0, 1 << 40)
    for slot in range(5):
        ops = _random_ops(g, sites, dtype)
        if slot == 4:
            ops += [SlotOp(s.index, OP_ADD, 0, NO_END, torch.randn(1, s.width, generator=g)) for s in sites.all]
        assert tables.write(slot, every if slot % 2 else None, ops) is None
    tables.flush_pending()
    row_slot, positions = torch.tensor([0, 1, 2, 3, 4, 5, 4, 3, 2, 1, 0, 4]), torch.randint(0, 8, (12,), generator=g)
    tables.prologue(row_slot, positions, torch.ones(12, dtype=torch.bool))
    return tables, KernelSites(tables, row_slot, positions)


def _between(x: torch.Tensor, sites: tuple[int, ...], rows: KernelSites) -> None:
    for s in sites:
        triton_tap.tap_site(x, rows.tables.sites.all[s], rows.tables, rows.row_slot, rows.positions)


def _equal(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["block_end", "post_attention", "block_0", "final"])
def test_norm_with_sites_equals_site_kernels_around_the_plain_norm(dtype, where):
    g = torch.Generator().manual_seed(3)
    tables, rows = _steered_tables(dtype, g)
    idx = rows.index
    sites = {"block_end": NormSites(rows, (idx("mlp_out", 1),), (idx("resid_post", 1), idx("resid_pre", 2))),
             "post_attention": NormSites(rows, (idx("attn_out", 0),), (idx("resid_mid", 0),)),
             "block_0": NormSites(rows, (), (idx("embed", -1), idx("resid_pre", 0))),
             "final": NormSites(rows, (idx("mlp_out", 2),), (idx("resid_post", 2),), (idx("final", -1),))}[where]
    x, r = (torch.randn(12, HIDDEN, generator=g) * 3).to(dtype), torch.randn(12, HIDDEN, generator=g).to(dtype)
    w = torch.randn(HIDDEN, generator=g).to(dtype)
    add = bool(sites.on_r)
    outs = []
    for fused in (False, True):
        tables.cap_out.zero_()
        xs, rs = x.clone(), r.clone()
        if fused:
            h = fs.rms_norm_sites(xs, rs if add else None, w, 1e-5, RMS_LLAMA, sites)
        else:
            _between(rs, sites.on_r, rows)
            if add:
                xs += rs
            _between(xs, sites.on_x, rows)
            h = te.rms_norm(xs, w, 1e-5, RMS_LLAMA)
            _between(h, sites.on_out, rows)
        outs.append((xs, h, tables.cap_out.clone()))
    (x0, h0, c0), (x1, h1, c1) = outs
    _equal(x1, x0), _equal(h1, h0), _equal(c1, c0)
    assert (c0 != 0).any()  # rows were captured
    assert not torch.equal(x0, x + r if add else x)  # and steered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("write", [True, False])
def test_rotary_with_sites_equals_site_kernels_between_rotary_and_the_kv_write(dtype, write):
    from tapllm.kernels import triton_attention

    g = torch.Generator().manual_seed(4)
    tables, rows = _steered_tables(dtype, g)
    sites = HeadSites(rows, rows.index("q", 1), rows.index("k", 1), rows.index("v", 1))
    qkv = torch.randn(12, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    cos, sin = torch.randn(12, HEAD_DIM, generator=g).to(dtype), torch.randn(12, HEAD_DIM, generator=g).to(dtype)
    cache = torch.zeros(KV_HEADS, 5, 4, HEAD_DIM, dtype=dtype)
    slots = torch.randperm(20, generator=g)[:12]
    outs = []
    for fused in (False, True):
        tables.cap_out.zero_()
        a, k_cache, v_cache = qkv.clone(), cache.clone(), cache.clone()
        q, k, v = (t.view(12, -1, HEAD_DIM) for t in a.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                              KV_HEADS * HEAD_DIM], dim=-1))
        if fused:
            fs.rotary_sites(q, k, v, cos, sin, (k_cache, v_cache, slots) if write else None, sites)
        else:
            te.rotary_(q, k, cos, sin)
            _between(q, (sites.q,), rows), _between(k, (sites.k,), rows), _between(v, (sites.v,), rows)
            if write:
                triton_attention.kv_write(k, v, k_cache, v_cache, slots)
        outs.append((a, k_cache, v_cache, tables.cap_out.clone()))
    for got, want in zip(outs[1], outs[0]):
        _equal(got, want)
    assert (outs[0][3] != 0).any() and (not write or (outs[0][1] != 0).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [ACT_SILU, ACT_GELU_TANH])
def test_gated_act_with_its_site_equals_the_site_kernel_after_the_plain_act(dtype, mode):
    g = torch.Generator().manual_seed(6)
    tables, rows = _steered_tables(dtype, g)
    site = rows.index("mlp_post", 2)
    gate_up = (torch.randn(12, 2 * SHAPES["mlp_post"][0], generator=g) * 2).to(dtype)
    outs = []
    for fused in (False, True):
        tables.cap_out.zero_()
        if fused:
            h = fs.gated_act_sites(gate_up, mode, rows, site)
        else:
            h = te.gated_act(gate_up, mode)
            _between(h, (site,), rows)
        outs.append((h, tables.cap_out.clone()))
    _equal(outs[1][0], outs[0][0]), _equal(outs[1][1], outs[0][1])
    assert (outs[0][1] != 0).any() and not torch.equal(outs[0][0], te.gated_act(gate_up, mode))


def test_rows_wider_than_a_tile_are_left_to_the_caller():
    g = torch.Generator().manual_seed(5)
    _, rows = _steered_tables(torch.float32, g)
    x = torch.randn(2, te.ONE_PASS_WIDTH + 1)
    before = x.clone()
    assert fs.rms_norm_sites(x, x.clone(), torch.ones(x.shape[1]), 1e-5, RMS_LLAMA, NormSites(rows)) is None
    assert torch.equal(x, before)
    assert fs.gated_act_sites(torch.randn(1, 2 * te.ONE_PASS_WIDTH + 2), ACT_SILU, rows, 0) is None


@pytest.mark.parametrize("rows", [1, 12, 300])
def test_the_prologue_kernel_places_rows_as_the_tables_do(rows):
    g = torch.Generator().manual_seed(rows)
    sites = Sites(LAYERS, SHAPES)
    kern, ref = (TapTables(sites, 6, 300, torch.device("cpu"), torch.float32, max_ops=1, pool_rows=1,
                           capture_numbers=1 << 20) for _ in range(2))
    for t in (kern, ref):
        for slot, (lo, hi, last) in enumerate([(0, 5, False), (2, 1 << 40, True), (3, 9, False), (0, 1 << 40, False)]):
            assert t.write(slot, SlotCapture({0: 0}, 10 + slot, lo, hi, last), []) is None
        t.flush_pending()
    row_slot = torch.randint(0, 6, (rows,), generator=g)
    positions = torch.randint(0, 12, (rows,), generator=g)
    last_rows = torch.randint(0, 2, (rows,), generator=g)
    kern.row_base.fill_(-7)
    triton_tap.prologue(kern, row_slot, positions, last_rows)
    ref.prologue(row_slot, positions, last_rows)
    host, _ = ref.places(row_slot.numpy(), positions.numpy(), last_rows.numpy())
    assert kern.row_base[:rows].tolist() == ref.row_base[:rows].tolist() == host.tolist()
    assert (kern.row_base[rows:] == -7).all()  # rows past the step's are not written
    assert rows == 1 or ((kern.row_base[:rows] >= 0).any() and (kern.row_base[:rows] < 0).any())


def test_fused_site_kernels_compile_for_a_gpu():
    """Every variant the launchers use, compiled for an sm_90 target (no GPU needed), with the site logic
    of ``triton_tap_kernels`` inlined, and the tap's prologue kernel, in a process where TRITON_INTERPRET
    is not set."""
    script = textwrap.dedent("""
        import inspect, os
        os.environ.pop("TRITON_INTERPRET", None)
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from tapllm.kernels import triton_fused_sites_kernels as k

        def compile(fn, types, **constants):
            sig = {}
            for name in inspect.signature(fn.fn).parameters:
                sig[name] = "constexpr" if name in constants else types.get(name, "i32")
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constants), target=GPUTarget("cuda", 90, 32))

        for dt in ("bf16", "fp32"):
            p = "*" + dt
            tables = dict(row_slot_ptr="*i64", pos_ptr="*i64", row_base_ptr="*i64", cap_off_ptr="*i32",
                          cap_out_ptr=p, st_first_ptr="*i32", st_count_ptr="*i32", op_ptr="*i64",
                          op_value_ptr="*fp32", pool_ptr="*fp32")
            norm = dict(tables, x_ptr=p, r_ptr=p, w_ptr=p, out_ptr=p, eps="fp32")
            compile(k.rms_norm_sites_kernel, norm, MODE=0, ADD=True, ON_R=1, ON_X=2, ON_OUT=1, STORE_X=True,
                    BLOCK=2048, EMULATE_RNE=False)
            compile(k.rms_norm_sites_kernel, norm, MODE=2, ADD=False, ON_R=0, ON_X=3, ON_OUT=0, STORE_X=True,
                    BLOCK=16384, EMULATE_RNE=False)
            rot = dict(tables, q_ptr=p, k_ptr=p, v_ptr=p, cos_ptr=p, sin_ptr=p, k_cache_ptr=p, v_cache_ptr=p,
                       slots_ptr="*i64")
            compile(k.rotary_sites_kernel, rot, HEAD_DIM=128, ROT=128, PAGE=16, BLOCK_H=8, BLOCK_D=128,
                    ROUND=dt != "fp32", WRITE=True, ON_Q=True, ON_K=True, ON_V=True, EMULATE_RNE=False)
            compile(k.rotary_sites_kernel, dict(rot, cos_ptr="*fp32", sin_ptr="*fp32"), HEAD_DIM=80, ROT=32, PAGE=1,
                    BLOCK_H=16, BLOCK_D=128, ROUND=False, WRITE=False, ON_Q=True, ON_K=False, ON_V=True,
                    EMULATE_RNE=False)
            for act, block in ((0, 16384), (1, 2048)):
                compile(k.gated_act_sites_kernel, dict(tables, x_ptr=p, out_ptr=p), ACT=act, BLOCK=block,
                        EMULATE_RNE=False)
        from tapllm.kernels import triton_tap_kernels as tk
        compile(tk.prologue_kernel, dict(row_slot_ptr="*i64", pos_ptr="*i64", last_ptr="*i64", cap_rec_ptr="*i64",
                                         cap_lo_ptr="*i64", cap_hi_ptr="*i64", cap_last_ptr="*i1",
                                         row_base_ptr="*i64"), BLOCK=512)
        print("compiled")
    """)
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no GPUTarget")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


# ---- the model's steps --------------------------------------------------------------------------------


def _graphed(folder, dtype: str = "float32") -> LLM:
    return LLM(folder, dtype=dtype, backend="cuda", max_num_seqs=8, max_num_batched_tokens=MIXED[-1],
               cuda_graph_sizes=DECODE, cuda_graph_token_sizes=MIXED)


FUSED_STEER_POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "q", "k", "v", "mlp_post")


def _every_op_at_every_fused_site(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                                  d_mlp: int) -> list[SamplingParams]:
    """A request capturing every point at every position, and one per steering operation that steers
    every point a kernel applies (at some block, some heads or positions) and captures the residual."""
    g = torch.Generator().manual_seed(7)
    rows = {"q": (heads, head_dim), "k": (kv_heads, head_dim), "v": (kv_heads, head_dim)}

    width = {"mlp_post": d_mlp, **{p: head_dim for p in rows}}

    def unit(point: str) -> torch.Tensor:
        v = torch.randn(width.get(point, hidden), generator=g)
        return v / v.norm()

    def steers(op: str) -> list[Steer]:
        out = []
        for n, point in enumerate(FUSED_STEER_POINTS):
            layer = [n % layers]
            heads_kw = {"heads": [n % rows[point][0]]} if point in rows and n % 2 else {}
            if op == "set":
                shape = (rows[point][0] if not heads_kw else 1, head_dim) if point in rows else \
                    (width.get(point, hidden),)
                out.append(Steer(layers=layer, point=point, op="set", positions=[1, 6, 12],
                                 values=torch.randn(3, *shape, generator=g), **heads_kw))
            elif op == "scale":
                out.append(Steer(layers=layer, point=point, op="scale", scale=0.7, **heads_kw))
            else:
                kw = {"add": dict(scale=0.8), "ablate": {}, "clamp": dict(value=1.5)}[op]
                out.append(Steer(layers=layer, point=point, op=op, vector=unit(point),
                                 positions="generated" if n % 3 == 1 else "all", **heads_kw, **kw))
        return out

    def p(**kw) -> SamplingParams:
        return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, **kw)

    every = [name for name in POINTS if name != "attn_pattern"]
    resid = HiddenStatesSpec(layers="all", points=["resid_post", "final"], positions="all")
    return [p(hidden_states=HiddenStatesSpec(layers="all", points=every, positions="all")),
            *(p(steering=steers(op), hidden_states=resid) for op in ("add", "ablate", "clamp", "scale", "set")),
            p()]


def test_tapped_graph_steps_equal_eager_steps_with_every_site_fused(tiny_models):
    folder = tiny_models["llama"]
    graphed = _graphed(folder)
    cfg = graphed.engine.model_config
    prompts = random_prompts([5, 9, 7, 10, 8, 11, 6], seed=21)
    params = _every_op_at_every_fused_site(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                                           cfg.head_dim, int(cfg.hf_config.intermediate_size))
    want = _eager(folder).generate(prompts, params, use_tqdm=False)
    got = graphed.generate(prompts, params, use_tqdm=False)
    policy = graphed.engine.runner.policy
    assert policy.graph_steps > 0 and not policy.eager_steps, policy.eager_steps
    assert graphed.engine.runner.graph_step.graphs.replays
    _same(want, got)


def test_bfloat16_fused_sites_give_the_unfused_tapped_graph_s_tokens(tiny_models):
    folder = tiny_models["llama"]
    runs = []
    for fuse in (False, True):
        graphed = _graphed(folder, "bfloat16")
        graphed.engine.runner.graph_step.graphs.fuse_sites = fuse
        cfg = graphed.engine.model_config
        params = _every_op_at_every_fused_site(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                                               cfg.head_dim, int(cfg.hf_config.intermediate_size))
        runs.append(graphed.generate(random_prompts([5, 9, 7, 10, 8, 11, 6], seed=21), params, use_tqdm=False))
        assert graphed.engine.runner.policy.graph_steps > 0 and not graphed.engine.runner.policy.eager_steps
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.hidden_states is not None:
            for point in a.hidden_states.points:
                _close(a.hidden_states[point].float(), b.hidden_states[point].float())


# ---- kernels per block ---------------------------------------------------------------------------------


def _step_budget():
    spec = importlib.util.spec_from_file_location("step_budget", ROOT / "benchmarks" / "step_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decode_kernels(llm: LLM, params: SamplingParams) -> tuple[list[list[str]], list[str]]:
    """What each block of the last decode graph body launches while ``params``' requests run, and what the
    body launches outside the blocks, counted as ``benchmarks/step_budget.py`` counts (aten ops that launch
    a kernel, and Triton launches)."""
    from tapllm.kernels import triton_attention, triton_fused_sites

    sb = _step_budget()
    triton = sb.TritonCount([m._kernels() for m in (triton_attention, te, fs, triton_tap)])
    graphs = llm.engine.runner.graph_step.graphs
    layers = llm.engine.runner.model.layers
    body = graphs.body
    seen: list[list[str]] = []
    step: list[str] = []

    def counted(key):
        if key.kind != "decode":
            return body(key)
        counter = sb.OpCount()
        counter.phase = "step"
        triton.counter = counter
        triton.launches.clear()
        hooks = [h for i, layer in enumerate(layers) for h in (
            layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "phase", f"block{i}")),
            layer.register_forward_hook(lambda m, a, o: setattr(counter, "phase", "step")))]
        try:
            with counter:
                out = body(key)
        finally:
            for h in hooks:
                h.remove()
            triton.counter = None
        seen[:] = [counter.ops.get(f"block{i}", []) + triton.launches.get(f"block{i}", []) for i in range(len(layers))]
        step[:] = counter.ops.get("step", []) + triton.launches.get("step", [])
        return out

    graphs.body = counted
    try:
        llm.generate(random_prompts([6, 9], seed=2), params, use_tqdm=False)
    finally:
        del graphs.body
        triton.restore()
    assert seen, "no decode graph ran"
    return seen, step


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tapped_decode_block_launches_one_kernel_more_than_a_plain_one(tiny_models, dtype):
    """A plain decode block: input norm with the previous block's residual add, qkv, rotary with the KV
    write, attention (split over the context: plus its merge), o, post norm with its add, gate/up,
    gated activation, down. A tapped one: the same, with its sites in the norms, rotary and activation,
    plus the ``z`` site kernel; and the step outside the blocks one more, the prologue that places the
    captured rows (the final norm applies the ``final`` site)."""
    llm = _graphed(tiny_models["llama"], dtype)
    plain, plain_step = _decode_kernels(llm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    tapped, tapped_step = _decode_kernels(llm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                              hidden_states=HiddenStatesSpec(points="final",
                                                                                             positions="last")))
    unsited = sorted(name.replace("_sites_kernel", "_kernel") for name in tapped_step)
    assert unsited == sorted(plain_step + ["prologue_kernel"]), (plain_step, tapped_step)
    for block, tapped_block in zip(plain, tapped, strict=True):
        merge = block.count("decode_reduce_kernel")
        assert len(block) <= 9 + merge <= 10, block
        assert "aten::add" not in block and block.count("rms_norm_kernel") == 2, block
        assert len(tapped_block) == len(block) + 1, tapped_block
        assert tapped_block.count("tap_site_kernel") == 1 and tapped_block.count("rms_norm_sites_kernel") == 2
        assert tapped_block.count("rotary_sites_kernel") == 1 and tapped_block.count("gated_act_sites_kernel") == 1
