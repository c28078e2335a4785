"""One part of an EAGLE-3 collection on one engine: groups of conversations into shards and the
layouts' files (see :mod:`tapllm.collect.eagle3`).

Groups are cut as ``tapllm collect`` cuts them, from the input alone: a group ends at the
first conversation where its estimated rows reach ``--shard-tokens`` (its tokens; with
``regenerate``, the turns kept plus ``max_new_tokens`` for each reply to write). Each group is
run by itself: the earlier replies of its conversations in waves (every conversation's first
reply to regenerate, then every second one, ...), then one capturing request per
conversation. So a resumed run writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm import tqdm

from tapllm.collect import specforge_format, speculators_format
from tapllm.collect.chat import Conversation, Render, Tokens, render_fn, tokens_with_mask, turns_to_generate
from tapllm.collect.eagle3 import Eagle3Settings
from tapllm.collect.group_files import GroupFiles
from tapllm.collect.part import CollectConfig
from tapllm.collect.sources import ItemSource
from tapllm.collect.writer import Manifest, ShardEntry, ShardWriter
from tapllm.utils.dtypes import dtype_from_name
from tapllm.engine.llm_engine import LLMEngine
from tapllm.outputs import RequestOutput
from tapllm.sampling_params import SamplingParams

_SEED_MOD = 2**63


def run_part(engine: LLMEngine, cfg: CollectConfig, source: ItemSource, part: int, show_progress: bool = True
             ) -> list[ShardEntry]:
    """Collect the conversations ``source.items`` (``[source.start, source.end)``) as part
    ``part``, resuming after its last complete shard."""
    s: Eagle3Settings = cfg.recipe
    manifest = Manifest(cfg.out, part)
    done = manifest.load()
    manifest.reset_to(done)
    resume = done[-1].requests[1] if done else source.start
    end = source.end if source.end is not None else source.start
    render = render_fn(engine.input_processor.render_chat, engine.tokenizer)
    store = dtype_from_name(cfg.store_dtype)
    writer = ShardWriter(manifest, len(done), cfg.fmt, before=LayoutWriter(cfg, s))
    bar = tqdm(total=end - source.start, initial=resume - source.start, unit="conv", disable=not show_progress,
               desc=f"eagle3 part {part}" if cfg.workers > 1 else "eagle3", dynamic_ncols=True)
    t0, rows = time.perf_counter(), 0
    try:
        for g0, g1 in plan_groups(source, resume, end, cfg.shard_tokens, lambda c: estimate(c, s, render)):
            if engine.has_unfinished_requests():
                raise RuntimeError("the engine still holds requests at a group boundary")
            convs = [source.items[i - source.start] for i in range(g0, g1)]
            records = conversation_records(engine, convs, s, render, cfg.spec(), store, first=g0)
            rows += sum(len(r["position"]) for r in records)
            bar.update(g1 - g0)
            bar.set_postfix_str(f"{rows / max(time.perf_counter() - t0, 1e-9):.0f} rows/s", refresh=False)
            writer.put(g0, g1, records)
        entries = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return done + entries


def estimate(conv: Conversation, s: Eagle3Settings, render: Render) -> int:
    """The rows a conversation counts for cutting groups, from the input alone."""
    if not s.regenerate:
        return len(render(conv, False))
    kept = [t for t in conv if t["role"] != "assistant"]
    return len(render(kept, True)) + s.max_new_tokens * max(1, len(turns_to_generate(conv)))


def plan_groups(source: ItemSource, first: int, end: int, shard_tokens: int, rows_of: Any
                ) -> Iterator[tuple[int, int]]:
    """``[g0, g1)`` ranges of conversations from ``first`` on (see the module docstring)."""
    g0, rows = first, 0
    for i in range(first, end):
        rows += rows_of(source.items[i - source.start])
        if rows >= shard_tokens:
            yield g0, i + 1
            g0, rows = i + 1, 0
    if g0 < end:
        yield g0, end


def conversation_records(engine: LLMEngine, convs: Sequence[Conversation], s: Eagle3Settings, render: Render,
                         spec: Any, store: torch.dtype | None, first: int = 0) -> list[dict[str, torch.Tensor]]:
    """Each conversation's rows: ``token_id``, ``request_index`` (``first`` + its index),
    ``position``, ``loss_mask`` and the captured states (``resid_post`` ``[rows, 4, hidden]``,
    and ``final`` ``[rows, 1, hidden]`` when captured), in the store dtype."""
    window = 2 * engine.config.max_num_seqs
    limit = engine.model_config.max_model_len
    if s.regenerate:
        histories = regenerate_history(engine, convs, s, render, first, window)
        prompts = [tokens_with_mask(h, render, generation_prompt=True) if last else tokens_with_mask(h, render)
                   for h, last in histories]
        params = [_params(s, spec, first + k, len(turns_to_generate(c)) - 1) if last else None
                  for k, ((_, last), c) in enumerate(zip(histories, convs))]
    else:
        prompts = [tokens_with_mask(c, render) for c in convs]
        prompts = [Tokens(t.ids[:limit], t.mask[:limit]) for t in prompts]
        params = [None] * len(convs)
    encode = SamplingParams(max_tokens=1, temperature=0, hidden_states=spec)
    reqs = []
    for k, (tok, p) in enumerate(zip(prompts, params)):
        try:
            reqs.append(engine.input_processor.prepare(tok.ids, p or encode, encode=p is None, request_id=f"eagle3-{first + k}"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"conversation {first + k}: {exc}") from None
    outs = run_requests(engine, reqs, window, first)
    return [_record(out, tok, first + k, store) for k, (out, tok) in enumerate(zip(outs, prompts))]


def regenerate_history(engine: LLMEngine, convs: Sequence[Conversation], s: Eagle3Settings, render: Render,
                       first: int, window: int) -> list[tuple[Conversation, bool]]:
    """Each conversation up to its last reply, the replies before it written by the model, and
    whether a last reply is to be generated (no: it has no assistant turn and does not end
    with a user turn; it is then taken as it is)."""
    plans: list[list[dict[str, str] | None]] = []
    for conv in convs:
        plan: list[dict[str, str] | None] = [None if t["role"] == "assistant" else t for t in conv]
        if conv[-1]["role"] == "user":
            plan.append(None)
        plans.append(plan)
    slots = [[j for j, t in enumerate(p) if t is None] for p in plans]
    wave = 0
    while True:
        todo = [k for k in range(len(convs)) if len(slots[k]) > wave + 1]
        if not todo:
            break
        reqs = []
        for k in todo:
            history = [t for t in plans[k][: slots[k][wave]] if t is not None]
            ids = render(history, True)
            try:
                reqs.append(engine.input_processor.prepare(ids, _params(s, None, first + k, wave), request_id=f"eagle3-{first + k}-{wave}"))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"conversation {first + k}, reply {wave}: {exc}") from None
        for k, out in zip(todo, run_requests(engine, reqs, window, first)):
            plans[k][slots[k][wave]] = {"role": "assistant", "content": out.outputs[0].text}
        wave += 1
    out_h = []
    for plan, sl, conv in zip(plans, slots, convs):
        if not sl:
            out_h.append((list(conv), False))
        else:
            out_h.append(([t for t in plan[: sl[-1]] if t is not None], True))
    return out_h


def _params(s: Eagle3Settings, spec: Any, index: int, turn: int) -> SamplingParams:
    seed = None if s.temperature == 0 else (s.seed * 1_000_003 + index * 131 + turn) % _SEED_MOD
    return SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=seed,
                          hidden_states=spec)


def run_requests(engine: LLMEngine, reqs: list[Any], window: int, first: int = 0) -> list[RequestOutput]:
    """Run prepared requests to the end (at most ``window`` in flight); outputs in order."""
    outs: list[RequestOutput | None] = [None] * len(reqs)
    where = {r.request_id: k for k, r in enumerate(reqs)}
    in_flight: set[str] = set()
    k = 0
    try:
        while k < len(reqs) or in_flight:
            while k < len(reqs) and len(in_flight) < window:
                engine.add(reqs[k])
                in_flight.add(reqs[k].request_id)
                k += 1
            for req in engine.step():
                in_flight.discard(req.request_id)
                out = engine.make_output(req)
                if getattr(out, "error", None):
                    raise RuntimeError(f"conversation {first + where[req.request_id]}: {out.error}")
                outs[where[req.request_id]] = out
    except BaseException:
        for rid in in_flight:
            engine.abort(rid)
        raise
    return outs  # type: ignore[return-value]


def _record(out: RequestOutput, tok: Tokens, index: int, store: torch.dtype | None) -> dict[str, torch.Tensor]:
    hs = out.hidden_states
    if hs is None:
        raise RuntimeError(f"conversation {index}: no hidden states were captured")
    generated = list(out.outputs[0].token_ids) if out.outputs else []
    seq = torch.tensor(tok.ids + generated, dtype=torch.long)
    mask = torch.tensor(tok.mask + [1] * len(generated), dtype=torch.uint8)
    pos = hs.positions
    cols = {"token_id": seq[pos], "request_index": torch.full((len(pos),), index, dtype=torch.long),
            "position": pos.clone(), "loss_mask": mask[pos]}
    cols.update({p: hs[p] if store is None else hs[p].to(store) for p in hs.points})
    return cols


class LayoutWriter:
    """The writer thread's hook: each conversation of a group into the layouts asked for; the
    group's shard keeps the states only for the ``tapllm`` layout."""

    def __init__(self, cfg: CollectConfig, s: Eagle3Settings) -> None:
        self.out = cfg.out
        self.formats = s.formats

    def __call__(self, first: int, end: int, records: list[dict[str, torch.Tensor]]
                 ) -> list[dict[str, torch.Tensor]]:
        files = GroupFiles()
        for r in records:
            i = int(r["request_index"][0]) if len(r["request_index"]) else None
            if i is None:
                continue
            states = r["resid_post"]
            if "speculators" in self.formats:
                speculators_format.write_states(self.out, i, r["token_id"], states, files.write)
            if "specforge" in self.formats:
                specforge_format.write_sample(self.out, i, r["token_id"], r["loss_mask"], states[:, :3],
                                              r["final"][:, 0], files.write)
        files.commit()  # durable before the group's shard and manifest line
        if "tapllm" in self.formats:
            return records
        return [{k: v for k, v in r.items() if k not in ("resid_post", "final")} for r in records]


def conversation_states(llm: Any, conversations: Sequence[Any], settings: Eagle3Settings | None = None
                        ) -> list[dict[str, torch.Tensor]]:
    """The recipe in memory, from an ``LLM``: each conversation's rows (see
    :func:`conversation_records`) for records in any layout of :mod:`tapllm.collect.chat` (or
    lists of ``{"role", "content"}`` messages), with ``settings`` (default: EAGLE-3's layers,
    both layouts' states, no regeneration)."""
    from pathlib import Path

    from tapllm.collect.chat import normalize

    s = settings or Eagle3Settings()
    engine = llm.engine
    cfg = s.configure(CollectConfig(out=Path("."), input=Path(".")), engine.model_config.num_layers)
    convs = [normalize(c if isinstance(c, dict) else {"messages": c}, f"conversations[{k}]")
             for k, c in enumerate(conversations)]
    return conversation_records(engine, convs, s, render_fn(engine.input_processor.render_chat, engine.tokenizer), cfg.spec(), None)
