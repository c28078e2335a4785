"""The mixture-of-experts section of ``benchmarks/gpu.py``: the CUDA backend's Triton fused-MoE step inside
CUDA graphs, against transformers and tapllm's eager step (issue 52).

1. Parity, float32, on a small Mixtral and a small Qwen3-MoE (the parity section's Llama shapes; 8 experts,
   top-2; transformers' initialisation), a few prompts (one run in chunks), greedy tokens: the graph engine
   (``backend="cuda"``) against ``enforce_eager=True`` and transformers on the same device, on three paths:
   *plain* (tokens, chosen tokens' logprobs), *router* (``router_logits`` at every block and position
   against transformers' ``output_router_logits``) and *ban* (a routing steer banning two experts at two
   blocks; graph tokens against the eager step's, and ``experts_chosen`` never holding a banned expert).
   Every decode step the graph engines run eagerly is counted, by reason (the target is none).
2. Speed, bf16, on a Qwen3-30B-A3B-shaped model (hidden 2048, 32/4 heads of 128, 128 experts, top-8,
   expert width 768, ``norm_topk_prob``, untied, the default tokenizer's vocabulary; ``--moe-layers``
   blocks, 8 by default so that transformers fits beside it): tapllm (graphs) and transformers
   ``generate`` output tokens/s at batch 1, 16, 64 (gpu.py's sizes: prompt 128, 64 new, best of 2 with
   fresh prompts), the ratios, and the batch-1 decode step against the *active* weights' streaming time
   (attention, routers, norms, the LM head and ``top_k`` experts per block) at gpu.py's bandwidth.

Results go under ``report["moe"]``; the targets are in gpu.py's ``targets()`` (:func:`moe_targets`).
"""

from __future__ import annotations

import dataclasses
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from gpu import (VOCAB, Bench, compare_to_transformers, decode_step_ms, free, hf_generate, hf_model, hf_rate,
                 model_folder, parity_error, peak_memory_gb, policy_counts, policy_delta, prompts, rel_error,
                 reset_peak, tapllm_rate, timed)

PARITY_FAMILIES = ("mixtral", "qwen3_moe")
BANNED_EXPERTS = [0, 1]
MOE_SPEED_MAX_BATCH = 64  # transformers' largest batch, and the ratios' (b16, b64)


def parity_config(family: str, smoke: bool) -> Any:
    """A small float32 parity model of ``family``: gpu.py's parity Llama's shape with 8 experts, top-2."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    if smoke:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128)
    else:
        shape = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=512)
    common = dict(vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=2048, initializer_range=0.2,
                  num_experts_per_tok=2, **shape)
    if family == "mixtral":
        config = MixtralConfig(num_local_experts=8, **common)
        config.architectures = ["MixtralForCausalLM"]
    else:
        config = Qwen3MoeConfig(num_experts=8, moe_intermediate_size=shape["intermediate_size"], norm_topk_prob=True,
                                head_dim=shape["hidden_size"] // shape["num_attention_heads"], decoder_sparse_step=1,
                                mlp_only_layers=[], **common)
        config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def speed_config(layers: int, smoke: bool) -> Any:
    """Qwen3-30B-A3B's block, ``layers`` of them (tiny on the smoke run)."""
    from transformers import Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, num_hidden_layers=layers, tie_word_embeddings=False, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if smoke:
        config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                intermediate_size=128, **common)
    else:
        config = Qwen3MoeConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                intermediate_size=6144, **common)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def active_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes a batch-1 decode step must read: every parameter but the embedding table (one row of it) and
    the ``num_experts - top_k`` experts per block not chosen."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    total -= config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * expert
    return total * torch.empty((), dtype=dtype).element_size()


@contextmanager
def decode_paths(llm: Any) -> Iterator[dict[str, Any]]:
    """Counts the decode-only steps ``llm`` runs in a graph and eagerly (by reason) while open.

    The policy's own counters mix decode and prefill steps; this wraps its ``choose``. An engine without a
    graph step never asks the policy: every step is eager then, for the reason ``graphs_off`` gives."""
    runner = llm.engine.runner
    counts: dict[str, Any] = {"graph": 0, "eager": Counter(), "graphs_off": None}
    if runner.graph_step is None:
        counts["graphs_off"] = runner.policy.off or getattr(runner.model, "graphs_off", None) or "no graph step"
        yield counts
        return
    policy = runner.policy
    choose = policy.choose

    def counted(shape: Any) -> Any:
        key, reason = choose(shape)
        if shape.decode_only:
            if key is None:
                counts["eager"][reason] += 1
            else:
                counts["graph"] += 1
        return key, reason

    policy.choose = counted  # an instance attribute: the runner's calls find it first
    try:
        yield counts
    finally:
        del policy.choose


def _logprobs_of(out: Any) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])


def _requests(config: Any, new: int) -> dict[str, Any]:
    """path -> its ``SamplingParams``: plain (logprobs), router (captured), ban (a routing steer)."""
    from tapllm import HiddenStatesSpec, SamplingParams, Steer

    layers = sorted({0, config.num_hidden_layers - 1})
    base = dict(max_tokens=new, temperature=0, ignore_eos=True)
    return {
        "plain": SamplingParams(**base, logprobs=0),
        "router": SamplingParams(**base, hidden_states=HiddenStatesSpec(layers="all", points=["router_logits"],
                                                                        positions="all")),
        "ban": SamplingParams(**base, steering=[Steer(point="router_logits", op="ban", experts=BANNED_EXPERTS,
                                                      layers=layers)],
                              hidden_states=HiddenStatesSpec(layers=layers, points=["experts_chosen"],
                                                             positions="all")),
    }


def parity_family(b: Bench, family: str) -> dict[str, Any]:
    """One family's parity rows: the graph and eager engines run every path, then transformers checks them."""
    from transformers import AutoModelForCausalLM

    from tapllm import LLM

    s, device, ms = b.sizes, b.device, b.moe_sizes
    config = parity_config(family, b.args.smoke)
    torch.manual_seed(0)
    folder = model_folder(b.root, f"moe-parity-{family}", config, b.tokenizer)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    ps = [prompts(1, n, f"moe-parity-{family}-{i}-{n}")[0] for i, n in enumerate(ms.parity_prompts)]
    requests = _requests(config, s.parity_new)
    engine = dict(dtype="float32", device=str(device), max_num_seqs=8, max_num_batched_tokens=ms.parity_step_tokens,
                  max_model_len=max(ms.parity_prompts) + s.parity_new + 16, enable_prefix_caching=False)
    outs: dict[str, dict[str, list[Any]]] = {"graph": {}, "eager": {}}
    steps: dict[str, dict[str, Any]] = {}
    fused = None
    for kind in ("graph", "eager"):
        options = {"enforce_eager": True} if kind == "eager" else {"backend": "cuda", **s.graph_options}
        llm = LLM(folder, **engine, **options)
        if kind == "graph":
            fused = "fused kernels" in llm.describe()
        for path, params in requests.items():
            before = policy_counts(llm)
            with decode_paths(llm) if kind == "graph" else _nothing() as decodes:
                outs[kind][path] = llm.generate(ps, params, use_tqdm=False)
            if kind == "graph":
                steps[path] = {**policy_delta(llm, before), "decode_graph_steps": decodes["graph"],
                               "eager_decode_steps": dict(decodes["eager"]), "graphs_off": decodes["graphs_off"]}
        del llm
        free(device)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    n = len(ps)
    rows: dict[str, Any] = {"model": f"{config.num_hidden_layers} blocks, hidden {config.hidden_size}, "
                                     f"8 experts, top-2", "fused_kernels": fused}
    tokens = {kind: {path: [o.outputs[0].token_ids for o in outs[kind][path]] for path in requests}
              for kind in outs}
    # plain: tokens against transformers' generate and the eager step, chosen tokens' logprobs
    want = [hf_generate(hf, p, s.parity_new, None, device) for p in ps]
    plain = tokens["graph"]["plain"]
    rows["plain"] = {
        "tokens_equal": f"{sum(a == w for a, w in zip(plain, want))}/{n}",
        "tokens_vs_eager": f"{sum(a == e for a, e in zip(plain, tokens['eager']['plain']))}/{n}",
        "eager_tokens_equal": f"{sum(e == w for e, w in zip(tokens['eager']['plain'], want))}/{n}",
        "max_rel_error": max(parity_error(hf, p, o, "plain", None, device)
                             for p, o in zip(ps, outs["graph"]["plain"])),
        "eager_max_rel_error": max(parity_error(hf, p, o, "plain", None, device)
                                   for p, o in zip(ps, outs["eager"]["plain"])),
        "vs_eager_max_rel_error": max((rel_error(_logprobs_of(g), _logprobs_of(e)) for g, e, a, c in
                                       zip(outs["graph"]["plain"], outs["eager"]["plain"], plain,
                                           tokens["eager"]["plain"]) if a == c), default=None),
        **steps["plain"]}
    # router: router_logits at every block and position against transformers' output_router_logits
    errors = {"graph": 0.0, "eager": 0.0}
    for kind in errors:
        for p, o in zip(ps, outs[kind]["router"]):
            seq = (p + o.outputs[0].token_ids)[:-1]  # the last sampled token is never run
            with torch.inference_mode():
                ref = hf(input_ids=torch.tensor([seq], device=device), output_router_logits=True).router_logits
            errors[kind] = max(errors[kind], rel_error(o.hidden_states["router_logits"],
                                                       torch.stack([r.reshape(len(seq), -1) for r in ref], 1)))
    router = tokens["graph"]["router"]
    rows["router"] = {
        "tokens_equal": f"{sum(a == w for a, w in zip(router, want))}/{n}",
        "tokens_vs_eager": f"{sum(a == e for a, e in zip(router, tokens['eager']['router']))}/{n}",
        "max_rel_error": errors["graph"], "eager_max_rel_error": errors["eager"], **steps["router"]}
    # ban: a routing steer, the graph path against the eager step (transformers has no such steer)
    ban = tokens["graph"]["ban"]
    held = all(not bool(o.hidden_states["experts_chosen"][..., BANNED_EXPERTS].any())
               for kind in outs for o in outs[kind]["ban"])
    rows["ban"] = {
        "tokens_vs_eager": f"{sum(a == e for a, e in zip(ban, tokens['eager']['ban']))}/{n}",
        "ban_held": held, "changed_vs_plain": f"{sum(a != p for a, p in zip(ban, plain))}/{n}",
        "steer": f"ban experts {BANNED_EXPERTS} at blocks {sorted({0, config.num_hidden_layers - 1})}",
        **steps["ban"]}
    del hf
    free(device)
    return rows


@contextmanager
def _nothing() -> Iterator[dict[str, Any]]:
    yield {"graph": 0, "eager": Counter(), "graphs_off": None}


def speed(b: Bench, result: dict[str, Any]) -> None:
    """The Qwen3-MoE shape: tapllm's graph engine, then transformers, at batch 1, 16, 64; into ``result``
    (filled as it goes: a part that fails keeps what came before)."""
    from tapllm import LLM

    s, device, ms = b.sizes, b.device, b.moe_sizes
    dtype = getattr(torch, b.args.dtype)
    config = speed_config(ms.layers, b.args.smoke)
    name = f"qwen3-moe-{ms.layers}"
    folder = model_folder(b.root, name, config, b.tokenizer)
    batches = [x for x in s.batches if x <= MOE_SPEED_MAX_BATCH]
    rows: dict[str, Any] = {}
    shape = (f"{config.num_hidden_layers} blocks, hidden {config.hidden_size}, {config.num_attention_heads}/"
             f"{config.num_key_value_heads} heads of {config.head_dim}, {config.num_experts} experts top-"
             f"{config.num_experts_per_tok} of {config.moe_intermediate_size}, vocab {config.vocab_size}")
    result.update(model=name, shape=shape, batches=batches, rows=rows)
    reset_peak(device)
    start, llm = timed(device, lambda: LLM(folder, **{**b.options(max(batches), eager=False), "backend": "cuda"}))
    graphs = llm.engine.runner.graph_step.graphs if llm.engine.runner.graph_step is not None else None
    row: dict[str, Any] = {"startup_s": round(start, 2), "describe": llm.describe(),
                           "fused_kernels": "fused kernels" in llm.describe(),
                           "graph_capture_s": round(graphs.capture_seconds, 2) if graphs is not None else None}
    rows["tapllm"] = row
    print(f"\ntapllm on {name} ({result['shape']}), started in {start:.1f}s:\n{llm.describe()}", flush=True)
    before = policy_counts(llm)
    with decode_paths(llm) as decodes:
        tapllm_rate(llm, device, min(4, max(batches)), min(4, s.new_tokens), s.prompt_len, f"{name}-warm", 1)
        for batch in batches:
            if b.over():
                row[f"b{batch}"] = "skipped: time budget"
                continue
            row[f"b{batch}"] = round(tapllm_rate(llm, device, batch, s.new_tokens, s.prompt_len, f"{name}-tapllm",
                                                 s.runs), 1)
        if b.over():
            row["step_ms"] = "skipped: time budget"
        else:
            step = decode_step_ms(llm, device, s.prompt_len, f"{name}-tapllm", s.step_tokens, s.step_runs)
            nbytes = active_bytes(config, dtype)
            bound = nbytes / (b.bandwidth * 1e9) * 1e3
            row.update(step_ms=round(step, 3), bound_ms=round(bound, 3), step_over_bound=round(step / bound, 2),
                       active_gb=round(nbytes / 1e9, 3))
    row.update(policy_delta(llm, before), decode_graph_steps=decodes["graph"],
               eager_decode_steps=dict(decodes["eager"]), graphs_off=decodes["graphs_off"],
               peak_gpu_gb=peak_memory_gb(device))
    del llm
    free(device)
    if not b.args.skip_hf and not b.over():
        reset_peak(device)
        torch.manual_seed(0)
        model = hf_model(config, device, dtype)
        hf: dict[str, Any] = {"experts_implementation": getattr(model.config, "_experts_implementation", None)}
        rows["transformers"] = hf
        for batch in [x for x in batches if x <= s.hf_max_batch]:
            if b.over():
                hf[f"b{batch}"] = "skipped: time budget"
                continue
            try:
                hf[f"b{batch}"] = round(hf_rate(model, device, batch, s.new_tokens, s.prompt_len, name, s.runs), 1)
            except torch.cuda.OutOfMemoryError as exc:  # the larger batches may not fit: the smaller still count
                hf[f"b{batch}"] = f"failed: {type(exc).__name__}"
                free(device)
        hf["peak_gpu_gb"] = peak_memory_gb(device)
        del model
        free(device)
    compare_to_transformers(rows, batches)


@dataclasses.dataclass
class MoESizes:
    """The section's own sizes (the others come from gpu.py's ``Sizes``)."""

    layers: int = 8
    parity_prompts: list[int] = dataclasses.field(default_factory=lambda: [40, 40, 300])
    parity_step_tokens: int = 256

    @classmethod
    def of(cls, smoke: bool, layers: int | None) -> MoESizes:
        """The GPU run's sizes, or the smoke run's (one prompt longer than a step's tokens: chunked)."""
        sizes = cls(layers=1, parity_prompts=[3, 5, 20], parity_step_tokens=16) if smoke else cls()
        if layers is not None:
            sizes.layers = layers
        return sizes


def moe(b: Bench) -> None:
    """The section: parity of both families, then speed; into ``b.report["moe"]``, printed."""
    s = b.sizes
    b.drop_graph_engine()  # the 1B engine's weights and KV cache: transformers must fit beside ours
    result: dict[str, Any] = {"parity_prompts": b.moe_sizes.parity_prompts, "parity_new": s.parity_new,
                              "parity": {}}
    b.report["moe"] = result
    # Each part on its own: a failure is reported (under the run's errors) and the next part still runs.
    for family in PARITY_FAMILIES:
        if b.over():
            result["parity"][family] = "skipped: time budget"
            continue
        try:
            result["parity"][family] = parity_family(b, family)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            result["parity"][family] = b.report["errors"][f"moe-parity-{family}"] = f"{type(exc).__name__}: {exc}"
        free(b.device)
    print_parity(result)
    if b.over():
        result["speed"] = "skipped: time budget"
        return
    result["speed"] = {}
    try:
        speed(b, result["speed"])
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        result["speed"]["error"] = b.report["errors"]["moe-speed"] = f"{type(exc).__name__}: {exc}"
    free(b.device)
    if "rows" in result["speed"]:
        print_speed(result["speed"], s.prompt_len, s.new_tokens)


def print_parity(result: dict[str, Any]) -> None:
    print(f"\n== mixture-of-experts parity, float32, {len(result['parity_prompts'])} prompts "
          f"({result['parity_prompts']} tokens), {result['parity_new']} greedy tokens: graph path against "
          "transformers and the eager step")
    for family, rows in result["parity"].items():
        if not isinstance(rows, dict):
            print(f"  {family}: {rows}")
            continue
        print(f"  {family} ({rows['model']}; fused kernels: {rows['fused_kernels']})")
        for path in ("plain", "router", "ban"):
            r = rows[path]
            vs_hf = f"tokens {r['tokens_equal']}, " if "tokens_equal" in r else ""
            err = f", error {r['max_rel_error']:.1e} (eager {r['eager_max_rel_error']:.1e})" \
                if "max_rel_error" in r else ""
            extra = f", ban held {r['ban_held']}, changed {r['changed_vs_plain']} vs plain" if path == "ban" else ""
            eager = r["eager_decode_steps"] or (r["graphs_off"] and f"all ({r['graphs_off']})") or 0
            print(f"    {path:7s}{vs_hf}vs eager {r['tokens_vs_eager']}{err}{extra}; decode steps in graphs "
                  f"{r['decode_graph_steps']}, eager {eager}; eager steps (all) {r['eager_steps'] or 0}")


def print_speed(result: dict[str, Any], prompt_len: int, new: int) -> None:
    print(f"\n== {result['model']} ({result['shape']}): output tokens/s (prompt {prompt_len}, {new} new, greedy), "
          "and vs transformers")
    for engine, row in result["rows"].items():
        cells = []
        for batch in result["batches"]:
            v, r = row.get(f"b{batch}"), row.get(f"b{batch}_vs_transformers")
            if isinstance(v, float):
                cells.append(f"b{batch} {v:,.0f}" + (f" ({r:.2f}x)" if r else ""))
        line = f"  {engine:13s}" + ", ".join(cells)
        if isinstance(row.get("step_ms"), float):
            line += (f"; batch-1 step {row['step_ms']:.2f} ms, {row['step_over_bound']:.2f}x the active weights' "
                     f"{row['active_gb']:.2f} GB at the measured bandwidth")
        if "eager_decode_steps" in row:
            line += f"; eager decode steps {row['eager_decode_steps'] or 0}"
        print(line)


# ---- targets ------------------------------------------------------------------------------------
def eager_decode_total(moe_report: dict[str, Any]) -> int | str | None:
    """Decode steps the section's graph engines ran eagerly (a reason instead where one had no graphs)."""
    rows = [r for fam in moe_report.get("parity", {}).values() if isinstance(fam, dict)
            for r in (fam.get(p) for p in ("plain", "router", "ban")) if isinstance(r, dict)]
    speed_row = moe_report.get("speed", {}).get("rows", {}).get("tapllm") \
        if isinstance(moe_report.get("speed"), dict) else None
    if speed_row:
        rows.append(speed_row)
    if not rows:
        return None
    off = [r["graphs_off"] for r in rows if r.get("graphs_off")]
    if off:
        return f"no graphs: {off[0]}"
    return sum(sum(r.get("eager_decode_steps", {}).values()) for r in rows)


def moe_targets(report: dict[str, Any], add: Callable[[str, str, Any, str, Callable[[Any], bool]], None]) -> None:
    """The section's targets, through gpu.py's ``add(id, label, value, want, ok)``."""
    m = report.get("moe", {})
    parity = [fam for fam in m.get("parity", {}).values() if isinstance(fam, dict)]
    missing = [name for name, fam in m.get("parity", {}).items() if not isinstance(fam, dict)]
    equal = total = 0
    errors: list[float] = []
    for fam in parity:
        for path in ("plain", "router", "ban"):
            for key in ("tokens_equal", "tokens_vs_eager"):
                if key in fam[path]:
                    a, n = fam[path][key].split("/")
                    equal, total = equal + int(a), total + int(n)
            if "max_rel_error" in fam[path]:
                errors.append(fam[path]["max_rel_error"])
        equal, total = equal + bool(fam["ban"]["ban_held"]), total + 1  # no banned expert chosen: one check more
    value = f"{equal}/{total}" + (f", not measured: {', '.join(missing)}" if missing else "") if total else None
    add("moe.parity.tokens", "moe parity float32, every path: greedy tokens equal", value, "all equal",
        lambda v: "," not in v and v.split("/")[0] == v.split("/")[1])
    add("moe.parity.error", "moe parity float32: largest relative error (logprobs, router)",
        max(errors) if errors else None, "<= 1e-4", lambda v: v <= 1e-4)
    add("moe.eager_decode_steps", "moe: decode steps run eagerly (graph engines)", eager_decode_total(m), "0",
        lambda v: v == 0)
    speed_rows = m.get("speed", {}).get("rows", {}) if isinstance(m.get("speed"), dict) else {}
    for batch in (16, 64):
        value = speed_rows.get("tapllm", {}).get(f"b{batch}_vs_transformers")
        add(f"moe.b{batch}_vs_transformers", f"moe (Qwen3-MoE shape): batch {batch} vs transformers",
            value if isinstance(value, (int, float)) else None, ">= 3x", lambda v: v >= 3.0)
