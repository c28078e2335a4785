"""Random schedules on the graph path: each request equals the same request run alone, eagerly.

Each seed draws a KV cache small enough to preempt and requests submitted over the steps of an
engine on the graph path (``backend="cuda"``: on a CPU, Triton kernels in the interpreter and
graphs emulated; on a GPU, with ``-m cuda``, real CUDA graphs), with prefix caching on, a small
token budget, and for odd seeds the host a step ahead of the device (``async_scheduling``).

Decks dealt across a seed's requests make each seed hold every capture point, position selection,
reducer, and steering op at every steerable point (with heads, neurons, explicit positions,
several at one point), besides layer picks, projections, head selections, the logit lens and
result dtypes; SAE features and an SAE steer; ``n > 1`` and seeded sampling; logprobs and prompt
logprobs; structured output (choice, regex, JSON). The first request's prompt runs in chunks,
prompts share prefixes, and the last request finds its prompt's first block in the prefix cache.
One request captures attention patterns and one edits SAE features, which no graph holds: the
steps holding them run eagerly, as do those whose steering operands or captures overflow the
graph's tables.

Every request's tokens, states, features, lens and logprobs must equal those of the same request
run alone on the eager reference (``enforce_eager=True``, no prefix cache); the graph engine must
capture no graph after start-up, and run eagerly only the steps that hold such a request or
overflow, saying why. ``TAPLLM_PROPERTY_SEEDS=0-19,40`` (seeds and ranges) runs other seeds than
the default ones; a failure names its seed (to replay it) and the request as drawn.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from conftest import TINY, random_prompts, save_tiny_model
from tapllm import LLM, SAE, HiddenStatesSpec, SamplingParams, Steer, StructuredOutputsParams
from tapllm.kernels import triton_tap
from tapllm.sae.sae_config import SAEConfig
from tapllm.steering.spec import OPS
from tapllm.tap.points import BY_NAME, DENSE_POINTS, HIDDEN_POINTS, LENS_POINTS, RESIDUAL_POINTS, STEER_POINTS

# The graph path on the CPU (Triton's interpreter, graphs emulated), and with real graphs on a GPU (``-m cuda``).
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not triton_tap.available(torch.device("cpu")),
                                                        reason="needs Triton's interpreter (TRITON_INTERPRET=1)")),
           pytest.param("cuda", marks=pytest.mark.cuda)]
# About a minute each on a 2-core machine; one runs a step at a time, one a step ahead; one preempts.
DEFAULT_SEEDS = (7, 10)


def _seeds() -> list[int]:
    """``TAPLLM_PROPERTY_SEEDS``: seeds and ranges, e.g. ``7,10`` (the default) or ``0-19,40``."""
    seeds: list[int] = []
    for part in os.environ.get("TAPLLM_PROPERTY_SEEDS", ",".join(map(str, DEFAULT_SEEDS))).split(","):
        first, _, last = part.strip().partition("-")
        seeds += range(int(first), int(last or first) + 1)
    return seeds


DECODE = [1, 2, 4, 8]
MIXED = [4, 8, 16]  # small buckets: the interpreter's cost grows with a graph's rows
BLOCK = 8
BUDGET = 16  # tokens a step runs: the first request's prompt is longer, so it runs in chunks
LAST = 10**6  # the step the last requests arrive at (when everything else has finished: see run_schedule)
PATTERNS = "attention patterns are captured"
SAE_EDIT = "a steer edits SAE features"
# What overflows the graph's tables (shared by every slot) runs eagerly too, by design: each reason, and the
# kinds of request that fill the table it names.
OVERFLOWS = {"its steering operands exceed the graph's steering tables": {"steered"},
             "a request's captured record exceeds the capture buffer": {"states", "features"},
             "the step's captures exceed the capture buffer": {"states", "features"}}
CAPTURE_POINTS = tuple(p for p in DENSE_POINTS if p != "attn_pattern")  # attention patterns: one request of their own
POSITIONS = ("all", "prompt", "generated", "last", "last_prompt", "window")
REDUCERS = (None, "mean", "sum", "max", "min", "first", "last")
CHOICES = ["yes", "no", "maybe later"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n"]}


@dataclass(frozen=True, slots=True)
class Dims:
    """The model's sizes the draws need."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    d_mlp: int

    def row(self, point: str) -> tuple[int, ...]:
        """The shape of one position's ``point`` in one block."""
        return tuple(getattr(self, dim) for dim in BY_NAME[point].shape)


@dataclass(slots=True)
class Drawn:
    """One request of a schedule: submitted before step ``arrival``."""

    prompt: list[int]
    params: SamplingParams
    arrival: int
    eager: str | None  # why its steps cannot run in a graph (None: they can)
    kinds: frozenset[str]  # what it holds: its flags, its kind of capture, "steered"
    what: str  # how it was drawn, for failure messages


class Deck:
    """Cards dealt in shuffled rounds, every card once before any card twice (so a seed's requests
    hold every card once enough are dealt); ``fits`` skips cards a request cannot take."""

    def __init__(self, cards: list, rng: random.Random) -> None:
        self.cards, self.rng = list(cards), rng
        self.left: list = []
        self.unseen = set(self.cards)

    def deal(self, fits=lambda card: True):
        """The next card of the round that ``fits``; a new round is shuffled in when none is left that does."""
        for _ in range(2):
            for i, card in enumerate(self.left):
                if fits(card):
                    self.unseen.discard(card)
                    return self.left.pop(i)
            self.left += self.rng.sample(self.cards, len(self.cards))
        raise AssertionError(f"no card of {self.cards} fits")


@dataclass(slots=True)
class Plan:
    """A request being drawn: its prompt and length, then what the decks deal it."""

    prompt: list[int]
    max_tokens: int
    flags: set[str]
    capture: str | None = None  # "states", "features" or "patterns"
    points: list[str] | None = None
    positions: str | tuple[int, int] | None = None
    reduce: str | None = None
    steers: list[tuple[str, str]] | None = None  # (op, point)

    @property
    def constrained(self) -> bool:
        """Structured output: the request may stop after its first token."""
        return bool(self.flags & {"choice", "regex", "json"})


# Each seed's requests hold each of these at least once; the first group's items exclude one another.
SAMPLING_FLAGS = [("n2", "seeded", "choice", "regex", "json"), ("logprobs", "prompt_logprobs")]
CAPTURE_FLAGS = ("project", "heads", "lens", "bfloat16", "float16")


class Draw:
    """Draws a seed's requests from one RNG (``random`` for choices, a torch generator for tensors)."""

    def __init__(self, seed: int, dims: Dims, sae_features: SAE, sae_edit: SAE, room: int) -> None:
        self.rng = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.dims = dims
        self.sae_features, self.sae_edit = sae_features, sae_edit
        self.room = room  # the most tokens (prompt and generated) a request may hold
        self.prefixes = [random_prompts([n], seed=seed * 100 + k)[0] for k, n in enumerate((BLOCK + 3, 2 * BLOCK))]
        rng = self.rng
        self.decks = {"points": Deck(list(CAPTURE_POINTS), rng), "positions": Deck(list(POSITIONS), rng),
                      "reduce": Deck(list(REDUCERS), rng),
                      "steers": Deck([(op, point) for op in OPS for point in STEER_POINTS if point in DENSE_POINTS],
                                     rng)}

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        """A random tensor from the seed's generator."""
        return torch.randn(*shape, generator=self.g) * scale

    def requests(self, count: int) -> list[Drawn]:
        """``count`` requests arriving at step 0 (the first six) or over the next twelve steps."""
        rng = self.rng
        plans = [self._plan(self.prefixes[1] if i == 0 else None) for i in range(count)]
        self._deal_flags(plans)
        capturing = [pl for pl in plans if pl.capture is not None]
        for pl in capturing:
            self._deal_capture(pl)
        states = [pl for pl in capturing if pl.capture == "states"]
        points = self.decks["points"]
        while points.unseen:  # top up until every point is captured somewhere
            pl = rng.choice([pl for pl in states if any(self._takes_point(pl, pt) for pt in points.unseen)])
            pl.points.append(points.deal(lambda pt, pl=pl: self._takes_point(pl, pt)))
        steered = [pl for pl in plans if pl.steers is not None and "sae_edit" not in pl.flags]
        while self.decks["steers"].unseen:  # every op at every point, spread evenly
            min(rng.sample(steered, len(steered)), key=lambda pl: len(pl.steers)).steers.append(
                self.decks["steers"].deal())
        return [self._drawn(pl, 0 if i < 6 else rng.randint(1, 12)) for i, pl in enumerate(plans)]

    def _plan(self, prefix: list[int] | None) -> Plan:
        """A request's prompt and length; a shared ``prefix`` (else one of the prefixes, 30% of the time)."""
        rng = self.rng
        flags: set[str] = set()
        if prefix is None and rng.random() < 0.3:
            prefix = rng.choice(self.prefixes)
        if prefix is not None:  # a prefix-cache hit once its blocks are computed
            prompt = prefix + random_prompts([rng.randint(1, 3)], seed=rng.randrange(10**6))[0]
            flags.add("shared prefix")
        else:
            prompt = random_prompts([rng.randint(2, 8)], seed=rng.randrange(10**6))[0]
        return Plan(prompt, rng.randint(1, min(3, self.room - len(prompt))), flags)

    def _deal_flags(self, plans: list[Plan]) -> None:
        """Sampling, capture and steering kinds: each to some request, the exclusive ones to different ones."""
        rng = self.rng
        for group in SAMPLING_FLAGS:
            for flag, pl in zip(group, rng.sample(plans, len(group))):
                pl.flags.add(flag)
        for pl in plans:
            if not pl.flags & {"n2", "seeded"} and rng.random() < 0.1:
                pl.flags.add("seeded")
            for flag, rate in (("logprobs", 0.15), ("prompt_logprobs", 0.1)):
                if rng.random() < rate:
                    pl.flags.add(flag)
        capturing = rng.sample(plans, 2 + len(REDUCERS))  # every reducer, patterns, features
        for pl, kind in zip(capturing, ["patterns", "features"] + ["states"] * len(plans)):
            pl.capture = kind
        states = [pl for pl in capturing if pl.capture == "states"]
        for flag, pl in zip(CAPTURE_FLAGS, rng.sample(states, len(CAPTURE_FLAGS))):
            pl.flags.add(flag)
        steered = rng.sample(plans, rng.randint(7, 8))
        for pl in steered:
            pl.steers = []
        edit, add = [pl for pl in steered if pl.capture != "patterns"][:2]  # each eager kind on its own
        edit.flags.add("sae_edit")
        add.flags.add("sae_add")
        for pl in plans:
            if pl.constrained:  # it may stop after one token: room for its stop
                pl.max_tokens = min(self.room - len(pl.prompt), 6)

    # ---- hidden states ---------------------------------------------------------------------
    def _fits_point(self, pl: Plan, point: str) -> bool:
        """A projection reads hidden-size rows; the logit lens reads the residual stream."""
        if "lens" in pl.flags:
            return point in LENS_POINTS
        return "project" not in pl.flags or point in HIDDEN_POINTS

    def _takes_point(self, pl: Plan, point: str) -> bool:
        """Whether ``point`` may join the points ``pl`` captures."""
        return point not in pl.points and self._fits_point(pl, point)

    def _fits_positions(self, pl: Plan, positions: str) -> bool:
        """A selection that holds a position however early a constrained request stops."""
        return positions != "generated" or not pl.constrained

    def _deal_capture(self, pl: Plan) -> None:
        """A capturing request's positions; a states request's first point and its reducer too."""
        rng = self.rng
        kind = self.decks["positions"].deal(lambda pos: self._fits_positions(pl, pos))
        if kind == "generated":  # the first generated position runs with the second token
            pl.max_tokens = max(pl.max_tokens, 2)
        if kind == "window":
            end = len(pl.prompt) if pl.constrained else len(pl.prompt) + pl.max_tokens - 1
            a = rng.randrange(end)
            pl.positions = (a, rng.randint(a + 1, end))
        else:
            pl.positions = kind
        if pl.capture == "states":
            pl.points = [self.decks["points"].deal(lambda pt: self._fits_point(pl, pt))]
            pl.reduce = self.decks["reduce"].deal()
            if "heads" in pl.flags and not {"q", "z"} & set(pl.points):
                pl.points.append(rng.choice(["q", "z"]))

    def _capture(self, pl: Plan) -> tuple[HiddenStatesSpec, str | None]:
        """The request's capture, and why its steps run eagerly (None: they can replay graphs)."""
        rng, d = self.rng, self.dims
        dtype = next((f for f in ("bfloat16", "float16") if f in pl.flags), rng.choice([None, None, "float32"]))
        if pl.capture == "features":
            return HiddenStatesSpec(sae=self.sae_features, features="topk:4", positions=pl.positions, dtype=dtype,
                                    points=["resid_post"] if rng.random() < 0.5 else None,
                                    layers=[rng.randrange(d.layers)]), None
        if pl.capture == "patterns":
            return HiddenStatesSpec(layers=[rng.randrange(d.layers)], points=["attn_pattern", "z"],
                                    positions=pl.positions, heads=[rng.randrange(d.heads)]), PATTERNS
        layers = rng.choice(["all", [rng.randrange(d.layers)], sorted(rng.sample(range(d.layers), 2)), [-1]])
        project = self.randn(rng.randint(1, 3), d.hidden) if "project" in pl.flags else None
        heads = rng.sample(range(d.heads), rng.randint(1, 2)) if "heads" in pl.flags else None
        lens = targets = None
        if "lens" in pl.flags:
            lens = rng.choice([1, 3])
            targets = rng.sample(range(100, 1000), 2) if rng.random() < 0.5 else None
        return HiddenStatesSpec(layers=layers, points=pl.points, positions=pl.positions, reduce=pl.reduce,
                                project=project, heads=heads, lens=lens, lens_targets=targets, dtype=dtype), None

    # ---- steering --------------------------------------------------------------------------
    def _steers(self, pl: Plan) -> list[Steer]:
        """The request's steers: its dealt (op, point) cards, or an edit of SAE features on its own."""
        rng = self.rng
        if "sae_edit" in pl.flags:
            op = rng.choice(["clamp", "ablate", "set"])
            features = [3, 11] if op == "ablate" else {3: 4.0, 11: 0.0}
            return [Steer(op=op, sae=self.sae_edit, features=features, positions=rng.choice(["all", "prompt"]))]
        steers = []
        for op, point in pl.steers:
            steers.append(self._steer(op, point, pl))
            if rng.random() < 0.2:  # several steers at one point and block: they compose in order
                steers.append(self._steer(rng.choice(OPS), point, pl, layers=steers[-1].layers))
        if "sae_add" in pl.flags:
            steers.append(Steer(op="add", sae=self.sae_features, features={5: 2.0, 9: -1.5}, scale=1.5,
                                positions=rng.choice(["all", "generated"])))
        return steers

    def _steer(self, op: str, point: str, pl: Plan, layers: list[int] | None = None) -> Steer:
        """``op`` at ``point``: random blocks (else ``layers``), positions, heads or neurons, and operands."""
        rng, d = self.rng, self.dims
        if layers is None:
            layers = rng.choice([[rng.randrange(d.layers)], sorted(rng.sample(range(d.layers), 2)), [-1]])
        run = len(pl.prompt) + pl.max_tokens - 1  # positions the model runs
        if op == "set" or rng.random() < 0.25:
            positions: str | list[int] = sorted(rng.sample(range(run), rng.randint(1, min(3, run))))
        else:
            positions = rng.choice(["all", "prompt", "generated"])
        row = list(d.row(point))
        heads = neurons = None
        if point in ("q", "k", "v", "z") and rng.random() < 0.5:
            heads = rng.sample(range(row[0]), rng.randint(1, row[0] - 1))
            row[0] = len(heads)
        elif point == "mlp_post" and rng.random() < 0.5:
            neurons = rng.sample(range(row[0]), rng.randint(1, 6))
            row[0] = len(neurons)
        size = 3.0 if point in RESIDUAL_POINTS else 1.5
        if op == "scale":
            return Steer(layers=layers, point=point, op=op, scale=rng.choice([-1.0, 0.5, 1.7]), positions=positions,
                         heads=heads, neurons=neurons)
        if op == "set":
            shape = (len(positions), len(layers), *row) if rng.random() < 0.5 else (len(positions), *row)
            return Steer(layers=layers, point=point, op=op, positions=positions, values=self.randn(*shape, scale=size),
                         heads=heads, neurons=neurons)
        width = row if point != "mlp_post" and rng.random() < 0.4 else row[-1:]
        vector: torch.Tensor | dict = self.randn(*width, scale=size)
        if rng.random() < 0.2:
            vector = {layer: self.randn(*width, scale=size) for layer in layers}
        return Steer(layers=layers, point=point, op=op, vector=vector, scale=rng.choice([0.5, 1.0, 2.0]),
                     value=rng.choice([0.0, 2.5, -4.0]), positions=positions, heads=heads, neurons=neurons)

    # ---- the request -----------------------------------------------------------------------
    def _drawn(self, pl: Plan, arrival: int) -> Drawn:
        """The request ``pl`` describes: its sampling parameters, capture and steers."""
        rng = self.rng
        kw: dict = dict(max_tokens=pl.max_tokens, ignore_eos=True, temperature=0)
        # Top-k: drawn by inverse CDF from this random model's nearly flat distribution, a token of
        # probability 1e-5 flips to its neighbour when the logits move by 1e-6 (another kernel's rounding).
        if "n2" in pl.flags:
            kw.update(n=2, temperature=0.8, top_k=8, seed=rng.randrange(2**31))
        elif "seeded" in pl.flags:
            kw.update(temperature=1.0, top_k=rng.choice([5, 20]), seed=rng.randrange(2**31))
        for kind in ("choice", "regex", "json"):
            if kind in pl.flags:
                kw.update(ignore_eos=False, structured_outputs={
                    "choice": StructuredOutputsParams(choice=CHOICES),
                    "regex": StructuredOutputsParams(regex=r"[0-9]{1,3}-[a-z]{1,2}"),
                    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)}[kind])
        if "logprobs" in pl.flags:
            kw["logprobs"] = rng.choice([0, 1, 3])
        if "prompt_logprobs" in pl.flags:
            kw["prompt_logprobs"] = rng.choice([0, 2])
        eager = None
        what = sorted(pl.flags)
        if pl.capture is not None:
            kw["hidden_states"], eager = self._capture(pl)
            what.append(f"capture {kw['hidden_states'].to_dict()}")
        if pl.steers is not None:
            kw["steering"] = self._steers(pl)
            eager = eager or (SAE_EDIT if "sae_edit" in pl.flags else None)
            what.append("steers " + "; ".join(f"{s.op}@{s.point}{s.layers} {s.positions}"
                                              f"{' heads' if s.heads else ''}{' neurons' if s.neurons else ''}"
                                              for s in kw["steering"]))
        kinds = pl.flags | {pl.capture} - {None} | ({"steered"} if pl.steers is not None else set())
        return Drawn(pl.prompt, SamplingParams(**kw), arrival, eager, frozenset(kinds),
                     f"prompt {len(pl.prompt)}, " + ", ".join(what))


def _sae(dims: Dims, point: str, layer: int, seed: int) -> SAE:
    """A random 32-feature SAE reading ``point`` of block ``layer``."""
    g = torch.Generator().manual_seed(seed)
    d_sae = 32
    return SAE(SAEConfig("standard", dims.hidden, d_sae, point=point, layer=layer),
               torch.randn(dims.hidden, d_sae, generator=g) * 0.3, torch.randn(d_sae, generator=g) * 0.1,
               torch.randn(d_sae, dims.hidden, generator=g) * 0.5, torch.zeros(dims.hidden))


# ---- comparing results -------------------------------------------------------------------------
# A float32 result's tolerance, relative to its scale: the Triton kernels sum in another order than the
# reference's; on a GPU, cuBLAS also picks its GEMM kernels by batch size.
RELATIVE = {"cpu": 1e-5, "cuda": 1e-4}


def _tol(t: torch.Tensor, rel: float, gain: float = 1.0) -> float:
    """``rel`` of the tensor's scale, plus one unit in the last place of a half-precision result (a
    rounding may then land on the other side). ``gain``: what a projection multiplies the states'
    differences by (its directions' norm)."""
    if not t.numel():
        return 0.0
    scale = max(1.0, float(t.float().abs().max()))
    return scale * gain * (rel + (torch.finfo(t.dtype).eps if t.dtype != torch.float32 else 0.0))


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float, gain: float = 1.0) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if want.numel():
        err, tol = float((got.float() - want.float()).abs().max()), _tol(want, rel, gain)
        assert err <= tol, f"{what}: differs by {err:.3g} (tolerance {tol:.3g})"


def _same_top(got: dict[int, float], want: dict[int, float], tol: float, what: str) -> None:
    """Two top-k maps (id -> value): equal values for the ids both hold; an id only one holds is a tie
    at the boundary (its value within ``tol`` of that map's smallest)."""
    both = got.keys() & want.keys()
    for i in both:  # equal: both -inf (a token the grammar forbids)
        assert got[i] == want[i] or abs(got[i] - want[i]) <= tol, f"{what}: id {i}: {got[i]} != {want[i]}"
    for m in (got, want):
        low = min(m.values())
        for i in m.keys() - both:
            assert m[i] == low or m[i] - low <= tol, f"{what}: {sorted(got)} != {sorted(want)}"


def _same_logprobs(got: list | None, want: list | None, what: str, rel: float) -> None:
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), (what, i)
        if b is not None:
            tol = rel * max(1.0, max(abs(v.logprob) for v in b.values()))
            _same_top({t: v.logprob for t, v in a.items()}, {t: v.logprob for t, v in b.items()}, tol,
                      f"{what} [{i}]")


def _same_states(got, want, what: str, rel: float, gain: float) -> None:
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert got.points == want.points and got.layers == want.layers and got.reduce == want.reduce, what
    assert got.positions.tolist() == want.positions.tolist(), what
    for point in want.points:
        _close(got[point], want[point], f"{what}: {point}", rel, gain)
    assert (got.lens is None) == (want.lens is None), what
    if want.lens is not None:
        assert set(got.lens) == set(want.lens) and got.lens.targets == want.lens.targets, what
        for point, b in want.lens.items():
            a = got.lens[point]
            tol = _tol(b.logprobs, rel)
            for r, (ids, lps) in enumerate(zip(b.token_ids.flatten(0, -2), b.logprobs.flatten(0, -2))):
                _same_top(dict(zip(a.token_ids.flatten(0, -2)[r].tolist(), a.logprobs.flatten(0, -2)[r].tolist())),
                          dict(zip(ids.tolist(), lps.tolist())), tol, f"{what}: lens {point} [{r}]")
            if b.target_logprobs is not None:
                _close(a.target_logprobs, b.target_logprobs, f"{what}: lens {point} targets", rel)
    assert (got.features is None) == (want.features is None), what
    if want.features is not None:
        a, b = got.features, want.features
        assert a.positions.tolist() == b.positions.tolist(), what
        _close(a.error_norm, b.error_norm, f"{what}: SAE error norm", rel)
        tol = _tol(b.values, rel)
        for r in range(b.ids.shape[0]):
            _same_top(dict(zip(a.ids[r].tolist(), a.values[r].float().tolist())),
                      dict(zip(b.ids[r].tolist(), b.values[r].float().tolist())), tol, f"{what}: features [{r}]")


def _same(got, want, params: SamplingParams, what: str, rel: float) -> None:
    """``got`` (a request's output from the schedule) equals ``want`` (the same request run alone)."""
    assert got.error is None and want.error is None, (what, got.error, want.error)
    project = params.hidden_states.project if params.hidden_states is not None else None
    gain = max(1.0, float(project.norm(dim=1).max())) if project is not None else 1.0
    assert len(got.outputs) == len(want.outputs), what
    for k, (a, b) in enumerate(zip(got.outputs, want.outputs)):
        where = f"{what}, completion {k}"
        assert a.token_ids == b.token_ids, f"{where}: tokens {a.token_ids} != {b.token_ids}"
        assert a.finish_reason == b.finish_reason, where
        _same_logprobs(a.logprobs, b.logprobs, f"{where}: logprobs", rel)
        _same_states(a.hidden_states, b.hidden_states, f"{where}: states", rel, gain)
    _same_logprobs(got.prompt_logprobs, want.prompt_logprobs, f"{what}: prompt logprobs", rel)


# ---- the run -----------------------------------------------------------------------------------
@dataclass(slots=True)
class Schedule:
    """One seed's KV cache size, whether the host runs a step ahead, its requests, and the cards its
    decks never dealt (none, by design)."""

    kv_cache_blocks: int
    ahead: bool
    requests: list[Drawn]
    undealt: dict[str, set]


def draw_schedule(seed: int, dims: Dims) -> Schedule:
    """The KV cache and requests of ``seed``, and the host a step ahead of the device for odd seeds: a
    first wave at step 0, the rest arriving over the next steps, and last two plain requests once
    everything else has finished, the second two steps after the first (whose prompt's first block is
    in the prefix cache by then, even with the host a step ahead); any tapped request makes a step
    tapped: these replay the plain graphs."""
    rng = random.Random(seed)
    blocks = rng.choice([5, 6])
    features = _sae(dims, "resid_post", 1, seed)
    edit = _sae(dims, rng.choice(RESIDUAL_POINTS), dims.layers - 1, seed + 1)
    draw = Draw(seed, dims, features, edit, room=min(blocks * BLOCK, 24))
    requests = draw.requests(rng.randint(11, 12))
    prefix = draw.prefixes[0]
    for arrival in (LAST, LAST + 2):
        prompt = prefix + random_prompts([rng.randint(1, 2)], seed=rng.randrange(10**6))[0]
        requests.append(Drawn(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                              arrival, None, frozenset({"shared prefix"}),
                              f"prompt {len(prompt)}, plain, shared prefix, last"))
    return Schedule(blocks, seed % 2 == 1, requests, {name: deck.unseen for name, deck in draw.decks.items()})


def _engine(folder, schedule: Schedule, device: str, **kw) -> LLM:
    """An engine with ``schedule``'s KV cache, a small token budget and prefix caching."""
    return LLM(folder, dtype="float32", device=device, max_num_seqs=DECODE[-1], block_size=BLOCK,
               kv_cache_blocks=schedule.kv_cache_blocks, max_num_batched_tokens=BUDGET, enable_prefix_caching=True,
               **kw)


def _dims(folder) -> Dims:
    """The sizes of the checkpoint in ``folder``."""
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return Dims(cfg["hidden_size"], cfg["num_hidden_layers"], heads, cfg["num_key_value_heads"],
                cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["intermediate_size"])


class StepLog:
    """Each forward's requests, whether it ran part of a prompt, and its path (graph, or eager and why)."""

    @dataclass(slots=True)
    class Step:
        ids: set[str]
        chunked: bool
        graphed: bool = False
        reason: str | None = None

    def __init__(self, runner) -> None:
        self.steps: list[StepLog.Step] = []
        launch, choose = runner.launch, runner.policy.choose

        def logged_launch(items):
            self.steps.append(self.Step({it.request.request_id.split("#")[0] for it in items},
                                        any(it.start + it.num_tokens < it.request.num_prompt_tokens for it in items)))
            return launch(items)

        def logged_choose(shape):
            key, reason = choose(shape)
            self.steps[-1].graphed, self.steps[-1].reason = key is not None, reason
            return key, reason

        runner.launch, runner.policy.choose = logged_launch, logged_choose


def run_schedule(llm: LLM, requests: list[Drawn]) -> tuple[dict[str, object], dict[str, Drawn]]:
    """Submit each of ``requests`` before the step it arrives at (when nothing runs, the next arrival's
    step comes at once); every output by request id, and the drawn request of each id."""
    engine = llm.engine
    pending = sorted(requests, key=lambda d: d.arrival)
    outputs: dict[str, object] = {}
    by_id: dict[str, Drawn] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests():
            step = max(step, pending[0].arrival)
        while pending and pending[0].arrival <= step:
            d = pending.pop(0)
            by_id[engine.add(engine.input_processor.prepare(d.prompt, d.params)).request_id] = d
        for req in engine.step():
            outputs[req.request_id] = engine.make_output(req)
        step += 1
    assert len(outputs) == len(requests)
    return outputs, by_id


def _situations(llm: LLM, log: StepLog) -> Counter:
    """What a run went through: preemptions, prompt tokens found in the prefix cache, steps with a prompt's chunk."""
    engine = llm.engine
    return Counter({"preemptions": engine.scheduler.num_preemptions, "prefix-cache hits": engine.blocks.hit_tokens,
                    "chunked prompts": sum(step.chunked for step in log.steps)})


SITUATIONS: dict[int, Counter] = {}  # what each seed's graph run went through (read by the last test)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, default_model_folder):
    """The tiny Llama of ``conftest`` with two blocks, not three (the interpreter's time is per block)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, **{**TINY, "num_hidden_layers": 2})
    return save_tiny_model(tmp_path_factory.mktemp("llama2"), config, default_model_folder)


@pytest.mark.parametrize("seed", _seeds())
@pytest.mark.parametrize("device", DEVICES)
def test_random_schedule_on_graphs_equals_each_request_alone(llama, device, seed):
    """See the module docstring."""
    replay = f"TAPLLM_PROPERTY_SEEDS={seed} on {device}"  # what a failure message starts with
    schedule = draw_schedule(seed, _dims(llama))
    assert not any(schedule.undealt.values()), (replay, schedule.undealt)
    held = frozenset().union(*(d.kinds for d in schedule.requests))
    kinds = {*SAMPLING_FLAGS[0], *SAMPLING_FLAGS[1], *CAPTURE_FLAGS, "sae_edit", "sae_add", "shared prefix",
             "states", "features", "patterns", "steered"}
    assert kinds <= held, (replay, kinds - held)
    solo = LLM(llama, dtype="float32", device=device, enforce_eager=True, enable_prefix_caching=False)
    graphed = _engine(llama, schedule, device, backend="cuda", cuda_graph_sizes=DECODE,
                      cuda_graph_token_sizes=MIXED, async_scheduling=schedule.ahead)
    runner = graphed.engine.runner
    log = StepLog(runner)

    outputs, by_id = run_schedule(graphed, schedule.requests)

    for rid, d in by_id.items():
        want = solo.generate([d.prompt], d.params, use_tqdm=False)[0]
        _same(outputs[rid], want, d.params, f"{replay}, request {rid} ({d.what})", RELATIVE[device])
    graphs = runner.graph_step.graphs
    assert graphs.captures_after_warmup == 0, replay
    # A step holding a request no graph can run runs eagerly and says why; any other step replays a graph
    # unless what it steers or captures overflows the graph's tables.
    for step in log.steps:
        in_step = [by_id[i] for i in step.ids]
        why = {d.eager for d in in_step} - {None}
        step_kinds = frozenset().union(*(d.kinds for d in in_step))
        overflows = {reason for reason, filled_by in OVERFLOWS.items() if filled_by & step_kinds}
        assert not (step.graphed and why), (replay, step, why)
        assert step.graphed or step.reason in why | overflows, (replay, step, why)
    reasons = [step.reason for step in log.steps if not step.graphed]
    assert dict(runner.policy.eager_steps) == {r: reasons.count(r) for r in set(reasons)}, replay
    assert reasons, replay
    replayed = {(key.kind, key.tapped) for key in graphs.replays}
    assert replayed == {("decode", False), ("decode", True), ("mixed", False), ("mixed", True)}, (replay, replayed)
    SITUATIONS[seed] = _situations(graphed, log)


def test_the_default_seeds_preempt_hit_the_prefix_cache_and_chunk_prompts(llama):
    """Together, the default seeds' runs go through preemption, prefix-cache hits and chunked prefill.

    Their graph runs recorded what they went through; a seed whose graph run did not take place in
    this session is run on the eager CPU engine with the same KV cache and token budget instead (a
    step at a time, as the graph run of an even seed schedules it).
    """
    total: Counter = Counter()
    for seed in DEFAULT_SEEDS:
        if seed not in SITUATIONS:
            schedule = draw_schedule(seed, _dims(llama))
            llm = _engine(llama, schedule, "cpu", enforce_eager=True)
            log = StepLog(llm.engine.runner)
            outputs, _ = run_schedule(llm, schedule.requests)
            assert all(out.error is None for out in outputs.values())
            SITUATIONS[seed] = _situations(llm, log)
        total.update(SITUATIONS[seed])
    assert set(total) == {"preemptions", "prefix-cache hits", "chunked prompts"} and all(total.values()), total
