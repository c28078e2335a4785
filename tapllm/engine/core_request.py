"""A request prepared once: what the input processor makes of a prompt and its parameters.

``InputProcessor.prepare`` tokenizes, checks and resolves a request against the model and the
instance's policy, and returns an :class:`EngineCoreRequest` (vLLM's name): plain data, that is
numbers, strings, lists and tensors on no particular device, nothing compiled and no engine
state. It is what an API server process sends the engine core. ``LLMEngine.add`` turns it into
a ``Request`` with :meth:`EngineCoreRequest.to_request`: tensors and SAEs onto the engine's
device, a grammar matcher from the checked grammar, the model's part of the prefix-cache salt;
nothing is checked or resolved again there.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from tapllm.engine.logits_processors import LogitsControls
from tapllm.engine.request import Request
from tapllm.hidden_states.resolved import Selection
from tapllm.sae.features import DeviceSAEs
from tapllm.sampling_params import SamplingParams
from tapllm.steering.resolved import RequestSteering, ResolvedSteer
from tapllm.structured.compiler import Grammar, GrammarCompiler


@dataclass(slots=True)
class EngineCoreRequest:
    """One request, tokenized, checked and resolved; see the module docstring.

    ``params`` are validated (``logprobs=-1`` made the vocabulary size); ``max_tokens`` is
    resolved (the rest of the context when ``params.max_tokens`` is None); ``salt`` is the
    request's own part of its prefix-cache salt (the model's part is the engine's to add);
    ``selection``, ``steers`` and ``controls`` are the spec, the steers and the logits controls
    resolved against the model; ``grammar`` the structured-output constraint, checked to compile.
    ``arrival`` is when its caller received it (``time.monotonic()``; the server's HTTP arrival).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    encode_only: bool = False
    max_tokens: int = 1
    salt: bytes = b""
    depth: int | None = None  # prompt-only: blocks its forward needs (None: all)
    selection: Selection | None = None
    steers: list[ResolvedSteer] | None = None
    steering_digest: bytes = b""
    controls: LogitsControls | None = None
    grammar: Grammar | None = None
    track_cumulative: bool = False  # sum chosen-token logprobs even without logprobs (best_of > n)
    arrival: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def max_hidden_states_bytes(self) -> int:
        """Upper bound on the bytes of hidden states this request (all its samples) can return (0: none asked)."""
        return self.selection.max_bytes * self.params.num_samples if self.selection is not None else 0

    def to_request(self, device: torch.device, saes: DeviceSAEs, grammars: GrammarCompiler,
                   prompt_salt: bytes) -> Request:
        """The engine's ``Request``: its tensors and SAEs on ``device`` (``saes``, one copy per SAE),
        a matcher of its grammar, and ``prompt_salt`` (the model's) in front of its own salt."""
        n = self.num_prompt_tokens
        req = Request(self.request_id, -1, self.prompt, self.prompt_token_ids, self.params, None,
                      encode_only=self.encode_only, max_tokens=self.max_tokens, cache_salt=prompt_salt + self.salt,
                      depth=self.depth, controls=self.controls, track_cumulative=self.track_cumulative)
        req.times.arrival = self.arrival
        if self.selection is not None:
            req.selection = self.selection.on_device(saes)
        if self.steers is not None:
            req.steering = RequestSteering([s.on_device(device, saes) for s in self.steers], self.steering_digest, n)
        if self.grammar is not None:
            req.grammar = grammars.matcher(self.grammar)
        return req
