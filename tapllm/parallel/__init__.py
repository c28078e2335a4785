"""Tensor and pipeline parallelism: one model over several processes (ranks), each holding a shard.

``layout`` (how dimensions and blocks split), ``group`` (collectives with timeouts), ``layers``
(row-parallel and vocabulary-parallel layers), ``sharding`` (a rank's model and checkpoint slices),
``shard_tap`` (taps that keep each point's meaning), ``messages`` (what rank 0 announces),
``pipeline`` (stages: a stage's blocks, the residual's sends), ``relay`` (later stages' taps at rank 0),
``ranks`` (a rank's place and its part of a step), ``worker`` (ranks 1..N-1), ``ray_workers`` (those
ranks as Ray actors), ``driver`` (rank 0: starts and drives the others), ``driver_model`` (rank 0's
model as the runner sees it), ``plan`` (a split's bytes per rank, planned on the meta device). See
docs/parallel.md.
"""

from tapllm.parallel.driver import TensorParallel
from tapllm.parallel.driver_model import DriverModel, start_tensor_parallel
from tapllm.parallel.group import TensorParallelError
from tapllm.parallel.layout import ShardLayout, divisibility_problems
from tapllm.parallel.plan import RankPlan, SplitPlan, plan_split

__all__ = ["DriverModel", "RankPlan", "ShardLayout", "SplitPlan", "TensorParallel", "TensorParallelError",
           "divisibility_problems", "plan_split", "start_tensor_parallel"]
