"""Per-request steering: add or ablate directions in the residual stream during generation."""

from tapllm.steering.spec import Steer

__all__ = ["Steer"]
