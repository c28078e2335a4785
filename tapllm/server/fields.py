"""Which request-body fields the server refuses, and how: nothing sent is ignored silently.

A body's fields are those of its pydantic model (``schema``). Any other key is refused
with a 400 naming it, before the body is validated:

- a field of the OpenAI or vLLM API that tapllm does not implement (``UNSUPPORTED``): "X is
  not supported", unless it holds the value that means "not used" (``tools: []``,
  ``store: false``, ``priority: 0``, ...), which is accepted because it asks for nothing;
- anything else: "unknown field X".

``user`` (OpenAI's end-user id) is a model field that is accepted and not used: OpenAI
defines it as metadata for abuse monitoring, with no effect on the output.
"""

from __future__ import annotations

from typing import Any

import pydantic

from tapllm.server.errors import APIError

# field -> the values that mean "not used" (accepted as if absent). Sources: the OpenAI API
# reference (completions, chat completions, embeddings) and vLLM's protocol models.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "suffix": (None, ""),
    # vLLM structured-output options tapllm does not implement (it has one backend, llguidance)
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # meaningless without tools, which are refused
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    # vLLM
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "logprob_token_ids": (None,),
    "truncation_side": (None,),
    "watermarking": (None, False),
    "prompt_embeds": (None,),
    "priority": (None, 0),
    "request_id": (None,),
    "session_id": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "return_token_offsets": (None, False),
    "return_mm_kwargs": (None, True),
    "return_prompt_text": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None,),
    "logits_processors": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None,),
    "stream_interval": (None,),
    "routed_experts_prompt_start": (None, 0),
    "documents": (None,),
    "chat_template": (None,),  # per request; the server's template is --chat-template FILE
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "include_reasoning": (None, True),
    "echo": (None, False),  # on chat (vLLM's: prefix the reply with the last message); completions support it
    "messages": (None,),  # on /v1/embeddings (vLLM's chat embeddings)
    "embed_dtype": (None, "float32"),
    "endianness": (None, "native", "little"),
    "use_activation": (None,),
    # inside stream_options
    "continuous_usage_stats": (None, False),
    "include_obfuscation": (None, False),
    # inside a chat message
    "tool_calls": (None, []),
    "tool_call_id": (None,),
    "refusal": (None,),
    "reasoning": (None,),
    "reasoning_content": (None,),
}


# Nested objects checked the same way: body field -> its model (one object, or each item of a list).
NESTED: dict[str, str] = {"stream_options": "object", "messages": "list"}


def check_fields(data: Any, model: type[pydantic.BaseModel]) -> Any:
    """``data`` (a parsed JSON body) with the accepted "not used" fields removed; 400 for the rest.

    Nested ``stream_options`` and chat ``messages`` are checked against their own models.
    """
    if not isinstance(data, dict):
        return data  # pydantic names the type error
    data = _check_object(data, model, "")
    for name, kind in NESTED.items():
        field = model.model_fields.get(name)
        value = data.get(name)
        inner = _inner_model(field.annotation) if field is not None else None
        if inner is None or value is None:
            continue
        if kind == "object" and isinstance(value, dict):
            data[name] = _check_object(value, inner, f"{name}.")
        elif kind == "list" and isinstance(value, list):
            data[name] = [_check_object(v, inner, f"{name}[{i}].") if isinstance(v, dict) else v
                          for i, v in enumerate(value)]
    return data


def _check_object(data: dict[str, Any], model: type[pydantic.BaseModel], where: str) -> dict[str, Any]:
    known = set(model.model_fields)
    out = {}
    for key, value in data.items():
        if key in known:
            out[key] = value
        elif key in UNSUPPORTED:
            if not _neutral(value, UNSUPPORTED[key]):
                raise APIError(400, f"{where}{key} is not supported by this server (got {_short(value)})",
                               param=f"{where}{key}")
        else:
            raise APIError(400, f"{where}{key}: unknown field; the fields accepted here are {', '.join(sorted(known))}",
                           param=f"{where}{key}")
    return out


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # 0 is not False and 1 is not True here; 1 and 1.0 are the same number
    return any(isinstance(value, bool) == isinstance(n, bool) and type(value) in (type(n), int, float)
               and value == n for n in neutral)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _inner_model(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The pydantic model inside ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None
