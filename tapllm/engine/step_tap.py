"""The step's tap: the one hook the model calls at every named point.

``tap(point, layer, x) -> x`` first steers the planned rows of ``x`` in place (so everything
after, captured states included, sees the steered value), then records the planned rows for
capture. It is built from the step's row spans, one per scheduled chunk of a request that
captures or steers: ``RowSpan(row, start, num_tokens)`` says that the chunk's positions
``[start, start + num_tokens)`` sit at batch rows ``[row, row + num_tokens)``; each span comes
with what its plan needs of the request (its capture and block table, or its steering). A
step where no request captures or steers builds no tap, and the model then calls
``tapllm.tap.no_tap``, which does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tapllm.hidden_states.capture import RequestCapture
from tapllm.hidden_states.plan import CapturePlan, Target, record_at
from tapllm.hidden_states.sink import CopySink
from tapllm.layers.attention import AttentionOptions
from tapllm.steering.plan import SteeringPlan, SteerOp
from tapllm.steering.resolved import RequestSteering
from tapllm.tap import RowSpan

CaptureSpan = tuple[RowSpan, RequestCapture, list[int]]  # a chunk, its request's capture and KV block table
SteerSpan = tuple[RowSpan, RequestSteering]  # a chunk and its request's steering


class StepTap:
    """Steering, then capture, at each (point, layer) some request of the step wants."""

    def __init__(self, steering: SteeringPlan | None, capture: CapturePlan | None) -> None:
        self.capture = capture
        self.steering = steering
        targets: dict[tuple[str, int], tuple[list[SteerOp], Target | None]] = {}
        for key, ops in (steering.ops if steering else {}).items():
            targets[key] = (ops, None)
        for key, target in (capture.targets if capture else {}).items():
            targets[key] = (targets.get(key, ([], None))[0], target)
        self.targets = targets
        self.layers = {layer for _, layer in targets}

    @classmethod
    def build(cls, captures: Sequence[CaptureSpan], steers: Sequence[SteerSpan], device: torch.device,
              sink: CopySink, *, sae_kernel: bool = False) -> StepTap | None:
        """The tap of a step, or None when no span captures or steers anything this step (``sae_kernel``:
        SAE features may use the fused Triton kernel, as on the CUDA backend)."""
        if not captures and not steers:
            return None
        capture = CapturePlan(captures, device, sink, sae_kernel=sae_kernel)
        steering = SteeringPlan(steers, device)
        if not capture and not steering:
            return None
        return cls(steering if steering else None, capture if capture else None)

    def __call__(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        entry = self.targets.get((point, layer))
        if entry is None:
            return x
        ops, target = entry
        for op in ops:
            op.apply(x)
        if target is not None:
            record_at(target, x)
        return x

    def touches(self, layer: int) -> bool:
        """True when some request of the step steers or captures anything in block ``layer``."""
        return layer in self.layers or self.wants_pattern(layer)

    def wants(self, point: str, layer: int) -> bool:
        """True when some request of the step steers or captures ``point`` of block ``layer``."""
        return (point, layer) in self.targets

    def steers(self, point: str, layer: int) -> bool:
        """True when some request of the step steers ``point`` of block ``layer``."""
        entry = self.targets.get((point, layer))
        return entry is not None and bool(entry[0])

    def wants_pattern(self, layer: int) -> bool:
        """True when some request of the step captures block ``layer``'s attention pattern."""
        return self.capture is not None and self.capture.wants_pattern(layer)

    def pattern(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, opts: AttentionOptions) -> None:
        """Compute the attention patterns of block ``layer`` for the requests that asked."""
        self.capture.pattern(layer, q, k_cache, opts)

    def finish(self) -> dict[RequestCapture, str]:
        """Deliver the captured rows to their requests; returns the captures that failed alone."""
        return self.capture.finish() if self.capture is not None else {}
