"""Request bodies in, JSON responses out: parsing and validating off the event loop, and the
disconnect watch shared by every route."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import Response

from tapllm.server.errors import APIError, encode
from tapllm.server.fields import check_fields

Model = TypeVar("Model", bound=pydantic.BaseModel)
logger = logging.getLogger("tapllm")


async def until_disconnect(request: Request, work: Awaitable[Any], what: str) -> Any:
    """Await ``work``; cancel it (aborting its requests) if the client goes away, logged once at debug level
    naming ``what`` (the requests it aborts)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.debug("the client of %s disconnected: aborted", what)
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            # A cancelled gather ends with a CancelledError *exception* that asyncio would log, with a
            # traceback, as never retrieved: it is retrieved here.
            task.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def json_response(build: Callable[[], dict[str, Any]]) -> Response:
    # Large hidden states make big bodies: build and serialize off the event loop.
    data = await asyncio.to_thread(lambda: encode(build()))
    return Response(data, media_type="application/json")


async def parse(request: Request, model: type[Model] | Callable[[Any], type[Model]]) -> Model:
    """The request's JSON body as ``model``, parsed and validated in a worker thread.

    ``model`` may be a function of the parsed JSON that picks the model (a body with two shapes).
    """
    raw = await request.body()
    return await asyncio.to_thread(parse_body, raw, model)


def parse_body(raw: bytes, model: type[Model] | Callable[[Any], type[Model]]) -> Model:
    """``raw`` JSON validated as ``model``; every problem is a 400 ``APIError`` naming the field."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body at character {exc.pos}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise APIError(400, "malformed JSON body: it is not valid UTF-8") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
        model = model(data)
    try:
        return model.model_validate(check_fields(data, model))
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "request body nested too deeply") from None


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for pydantic's errors: the first, naming its field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = f"{loc}: {first['msg']}" if loc else first["msg"]
    return APIError(400, msg, param=loc or None)
