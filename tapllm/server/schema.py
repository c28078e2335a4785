"""Request bodies of the OpenAI-compatible API, with the ``hidden_states`` extension (pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tapllm.hidden_states.json_codec import tensor_from_wire
from tapllm.hidden_states.spec import HiddenStatesSpec
from tapllm.sampling_params import SamplingParams
from tapllm.server.sae_extension import SaeFeaturesRequest, served_sae
from tapllm.steering.spec import Steer
from tapllm.structured.openai_fields import structured_outputs_from
from tapllm.structured.params import StructuredOutputsParams
from tapllm.utils.dtypes import DTYPES

PromptInput = str | list[int] | list[str | list[int]]
DtypeName = Literal[tuple(DTYPES)]  # type: ignore[valid-type]  # the names of tapllm.utils.dtypes


class WireTensor(BaseModel):
    """A tensor sent as ``{"shape", "dtype", "data"}`` (base64 or nested list)."""

    model_config = ConfigDict(extra="forbid")
    shape: list[int]
    dtype: str
    data: str | list[Any]


class HiddenStatesRequest(BaseModel):
    """The ``hidden_states`` extension: ``HiddenStatesSpec`` fields plus the wire ``encoding``."""

    model_config = ConfigDict(extra="forbid")
    layers: list[int] | Literal["all"] = "all"
    points: list[str] | str = Field(default_factory=lambda: ["resid_post"])
    positions: str | list[int] = "all"
    reduce: str | None = None
    project: list[list[float]] | WireTensor | None = None
    dtype: DtypeName | None = None
    lens: int | None = None
    lens_targets: list[int] | None = None
    heads: list[int] | None = None
    experts: list[int] | None = None
    encoding: Literal["base64", "list"] = "base64"

    def to_spec(self) -> HiddenStatesSpec:
        """The engine-side spec; ``ValueError`` names the field."""
        project: Any = self.project
        if isinstance(project, WireTensor):
            project = tensor_from_wire(project.model_dump(), "hidden_states.project")
        positions: Any = self.positions
        if isinstance(positions, list):
            if len(positions) != 2:
                raise ValueError(f"hidden_states.positions as a window must be [start, stop], got {positions}")
            positions = tuple(positions)
        return HiddenStatesSpec(
            layers=self.layers, points=self.points, positions=positions, reduce=self.reduce, project=project,
            dtype=self.dtype, lens=self.lens, lens_targets=self.lens_targets, heads=self.heads,
            experts=self.experts,
        )


class SteerRequest(BaseModel):
    """One entry of the ``steering`` extension (``Steer``'s fields); tensors as ``{"shape", "dtype", "data"}``
    or nested lists."""

    model_config = ConfigDict(extra="forbid")
    layers: list[int] | None = None
    point: str = "resid_post"
    op: str = "add"
    vector: WireTensor | list[float] | list[list[float]] | dict[str, WireTensor | list[float]] | None = None
    scale: float = 1.0
    positions: str | list[int] = "all"
    value: float = 0.0
    values: WireTensor | list[Any] | None = None
    heads: list[int] | None = None
    neurons: list[int] | None = None
    sae: str | None = None  # the name of an SAE the server serves (--sae NAME=PATH)
    features: dict[str, float] | list[int] | None = None
    experts: list[int] | None = None  # routing steers of a mixture-of-experts model (ban, force, scale, ablate)

    def to_steer(self) -> Steer:
        """The engine-side ``Steer``; ``ValueError`` names the field."""
        vector: Any = self.vector
        if isinstance(vector, WireTensor):
            vector = vector.model_dump()
        elif isinstance(vector, dict):
            vector = {k: v.model_dump() if isinstance(v, WireTensor) else v for k, v in vector.items()}
        values: Any = self.values
        if isinstance(values, WireTensor):
            values = tensor_from_wire(values.model_dump(), "steering.values")
        sae = served_sae(self.sae, "steering.sae") if self.sae is not None else None
        return Steer(layers=self.layers, point=self.point, op=self.op, vector=vector, scale=self.scale,
                     positions=self.positions, value=self.value, values=values, heads=self.heads,
                     neurons=self.neurons, sae=sae, features=self.features, experts=self.experts)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the output is JSON valid under ``schema``."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # tapllm always enforces the schema


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (unconstrained), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` extra_body field (``StructuredOutputsParams``)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True  # tapllm's default: closed objects, as vLLM's default backend


class StreamOptions(BaseModel):
    """``stream_options``: a usage chunk at the end of the stream."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat; any other field is refused (``fields.check_fields``)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: 1 (off)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as in OpenAI) -> bias
    min_tokens: int | None = None  # None: 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None  # OpenAI's end-user id: metadata, accepted and not used
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    hidden_states: HiddenStatesRequest | None = None
    sae_features: SaeFeaturesRequest | None = None
    steering: list[SteerRequest] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> str | None:
        """The first requested feature tapllm does not implement, as a message, or None."""
        if self.stream and self.best_of is not None and self.best_of != self.n:
            return "best_of: streaming needs best_of equal to n (the best samples are known only at the end)"
        return None

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def prompt_logprobs_wanted(self) -> int | None:
        """Top logprobs per prompt token asked for (vLLM's ``prompt_logprobs``; ``None``: none)."""
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Engine parameters; ``ValueError`` names the field."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs_wanted(),
            skip_special_tokens=self.skip_special_tokens, spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, n=self.n, best_of=self.best_of, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None, min_tokens=self.min_tokens or 0,
            bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            hidden_states=self.states_spec(),
            steering=[s.to_steer() for s in self.steering] if self.steering else None,
            structured_outputs=self.structured(),
        )

    def states_spec(self) -> HiddenStatesSpec | None:
        """The ``hidden_states`` spec, with the ``sae_features`` extension merged in."""
        spec = self.hidden_states.to_spec() if self.hidden_states is not None else None
        return self.sae_features.merge(spec) if self.sae_features is not None else spec

    def states_encoding(self) -> str | None:
        """How states (and features) go on the wire; None when the request asked for neither."""
        if self.hidden_states is not None:
            return self.hidden_states.encoding
        return self.sae_features.encoding if self.sae_features is not None else None

    def structured(self) -> StructuredOutputsParams | None:
        """The structured-output constraint of ``response_format``, ``structured_outputs`` or ``guided_*``."""
        rf = None
        if self.response_format is not None:
            rf = self.response_format.model_dump(by_alias=True)
        so = self.structured_outputs.model_dump(by_alias=True, exclude_none=True) if self.structured_outputs else None
        guided = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                         "guided_grammar")}
        return structured_outputs_from(rf, so, guided)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extension: per prompt token, its logprob and the top N
    add_special_tokens: bool = True  # vLLM's: BOS and the like, as the tokenizer adds them

    def num_logprobs(self) -> int | None:
        """Top log probabilities per token asked for (``None``: no logprobs)."""
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` and ``logprobs`` the prompt's share of the echoed logprobs."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def unsupported(self) -> str | None:
        if self.echo and self.stream and self.logprobs is not None:
            return ("echo with stream=true and logprobs is not supported: the prompt's logprobs are known only at "
                    "the end (use it without streaming)")
        if self.echo and self.stream and self.max_tokens == 0:
            return "echo with max_tokens=0 and stream=true is not supported (use it without streaming)"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true"
        return super().unsupported()


class ChatMessage(BaseModel):
    """One chat message; ``content`` may be a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # passed to the chat template, which may use it

    def text(self) -> str:
        """The message text (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last message instead of starting one
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    add_special_tokens: bool = False  # vLLM's default: the template already holds them
    prompt_logprobs: int | None = None  # vLLM's extension, returned beside the choices

    def num_logprobs(self) -> int | None:
        """Top log probabilities per token asked for (``None``: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_wanted(self) -> int | None:
        """vLLM's ``prompt_logprobs``: per prompt token, its logprob and the top N."""
        return self.prompt_logprobs

    def unsupported(self) -> str | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs=true"  # as OpenAI and vLLM answer
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true"
        return super().unsupported()


class HiddenStatesOnlyRequest(BaseModel):
    """``POST /v1/hidden_states``: prompt-only states, like ``LLM.encode``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: PromptInput
    hidden_states: HiddenStatesRequest = Field(default_factory=HiddenStatesRequest)
