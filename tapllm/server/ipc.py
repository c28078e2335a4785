"""The messages between API server processes and the engine-core process, and how they are framed.

Control messages are msgspec structs in MessagePack (small, typed, fast to decode). Two kinds of
payload are Python objects with tensors in them: a request as the API server prepared it
(``EngineCoreRequest``: its ``SamplingParams`` with steering vectors, probe directions, plugin
reducers' options and SAEs, and the steers and spec resolved against the model) and a finished
request's ``RequestOutput`` (hidden states, logprobs). Describing every such type again as a
msgspec schema would duplicate the public dataclasses, so these travel as pickle protocol 5 with
every tensor taken *out of band*: the pickle holds only its dtype and shape, and its bytes go as a
ZMQ frame of their own (sent without copying), or, from :data:`SHM_MIN_BYTES` up, through a
POSIX shared-memory segment whose name is in the frame instead, so a large state tensor is
never copied through the socket. Both ends are the same program on one machine, so pickle's
trust model (never unpickle from a stranger) holds: the sockets are IPC files in a private
folder (mode 0700).

A multipart message is ``[header, payload, *buffers]``: ``header`` one of the structs below,
``payload`` the pickle (empty when there is none) and ``buffers`` its out-of-band tensors.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import msgspec
import numpy as np
import torch

from tapllm.engine.llm_engine import EngineStats
from tapllm.server.records import FinishedRecord

# Tensors this large go through shared memory, smaller ones as frames ($TAPLLM_SHM_MIN_BYTES: the tests lower it).
SHM_MIN_BYTES = int(os.environ.get("TAPLLM_SHM_MIN_BYTES", 1 << 20))
SHM_PREFIX = "tapllm-"


# ---- API server -> core -------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    """Schedule a request: the payload is its ``EngineCoreRequest``, prepared by the API server."""

    request_id: str


class Abort(msgspec.Struct, tag=True):
    """Abort these requests (their client left)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    """Stop the core (sent once every API server has finished)."""


class Hello(msgspec.Struct, tag=True):
    """An API server's first message: the core answers with :class:`Ready`."""


# ---- core -> API server -------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    """The engine is loaded (its ``ModelConfig``, as capped to the KV cache, is the payload)."""

    num_kv_blocks: int
    context_limited_by_cache: bool
    point_shapes: dict[str, list[int]]


class UpdateMsg(msgspec.Struct):
    """One ``Update`` of a request (its logprobs and final output are in the payload, by position)."""

    request_id: str
    text: str
    token_ids: list[int]
    index: int = 0
    finished: bool = False
    error: str | None = None
    error_type: str | None = None
    has_payload: bool = False  # logprobs or an output are in the payload under this update's position


class Observed(msgspec.Struct):
    """What the latency metrics were told while this batch was made."""

    steps: list[int] = []  # tokens of each step
    inter_token: list[tuple[float, int]] = []
    finished: list[FinishedRecord] = []


class Outputs(msgspec.Struct, tag=True):
    """Every update one step made for one API server, and the engine's figures after it."""

    updates: list[UpdateMsg]
    stats: EngineStats
    step_errors: int
    observed: Observed | None = None


class Fatal(msgspec.Struct, tag=True):
    """The engine died for good (a broken tensor-parallel group): the core exits after sending this."""

    reason: str


Inbound = AddRequest | Abort | Shutdown | Hello
Outbound = Ready | Outputs | Fatal

_encoder = msgspec.msgpack.Encoder()
_in_decoder = msgspec.msgpack.Decoder(Inbound)
_out_decoder = msgspec.msgpack.Decoder(Outbound)


def decode_inbound(header: bytes | memoryview) -> Inbound:
    """An API server's message to the core."""
    return _in_decoder.decode(header)


def decode_outbound(header: bytes | memoryview) -> Outbound:
    """The core's message to an API server."""
    return _out_decoder.decode(header)


# ---- payloads: pickle 5 with tensors out of band --------------------------------------------
def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    kind = getattr(torch, dtype)
    raw = bytearray(buf) if not isinstance(buf, bytearray) else buf
    if not raw:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(raw, dtype=torch.uint8).view(kind).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles tensors as (dtype, shape, raw bytes out of band)."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach().to("cpu").contiguous()
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        dtype = str(t.dtype).removeprefix("torch.")
        return _rebuild_tensor, (pickle.PickleBuffer(flat.numpy()), dtype, tuple(t.shape))


def pack(header: msgspec.Struct, payload: Any = None) -> list[Any]:
    """The frames of a message: its header, the payload pickled, and the payload's tensor buffers.

    A buffer of :data:`SHM_MIN_BYTES` or more is written to a new shared-memory segment; its
    frame is then ``b"shm:" + name``, and the receiver unlinks the segment after reading it.
    """
    if payload is None:
        return [_encoder.encode(header), b""]
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(payload)
    frames: list[Any] = [_encoder.encode(header), out.getvalue()]
    for b in buffers:
        view = b.raw()
        frames.append(_to_shm(view) if view.nbytes >= SHM_MIN_BYTES else view)
    return frames


def unpack_payload(frames: list[Any]) -> Any:
    """The payload of a received message (``frames`` as from ``recv_multipart``), or None."""
    if len(frames) < 2 or not len(_bytes(frames[1])):
        return None
    buffers = []
    for f in frames[2:]:
        data = _bytes(f)
        buffers.append(_from_shm(bytes(data[4:]).decode()) if data[:4] == b"shm:" else bytearray(data))
    return pickle.loads(_bytes(frames[1]), buffers=buffers)


def _bytes(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def _to_shm(view: memoryview) -> bytes:
    name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=view.nbytes)
    try:
        np.frombuffer(shm.buf, dtype=np.uint8, count=view.nbytes)[:] = np.frombuffer(view, dtype=np.uint8)
    finally:
        shm.close()
    # The receiver unlinks it: Python 3.11's tracker would unlink it when this process exits.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return b"shm:" + name.encode()


def _from_shm(name: str) -> bytearray:
    shm = shared_memory.SharedMemory(name=name)
    try:
        out = bytearray(shm.size)
        out[:] = shm.buf[: shm.size]
    finally:
        shm.close()
        shm.unlink()  # also forgets it in this process's tracker (attaching registered it, on 3.11)
    return out


def unlink_leftovers(pid: int) -> int:
    """Unlink segments process ``pid`` made that nobody read (its receiver died); how many."""
    prefix = f"{SHM_PREFIX}{pid}-"
    n = 0
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join("/dev/shm", name))
                n += 1
            except OSError:
                pass
    return n
