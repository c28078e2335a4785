"""What the graph step holds on the device: the capture buffer's size, the steering tables' capacity, and
the bytes all of it takes from the KV cache's budget."""

from __future__ import annotations

from tapllm.backends.policy import GraphSizes

POOL_ROWS_PER_SEQ = 8  # steering pool rows per slot, on average (a request may use more while others use less)
OPS_PER_SEQ = 32
CAPTURE_POINTS_PER_TOKEN = 8  # the capture buffer holds this many hidden-size rows per token of the largest step


def capture_numbers(hidden: int, rows: int, decode_rows: int, num_layers: int) -> int:
    """The capture buffer's size: ``CAPTURE_POINTS_PER_TOKEN`` hidden-size rows per token of the largest
    step, and at least one point at every block (and ``final``) for every row of the largest decode step,
    so a decode batch that all captures a residual point at every block still replays its graph."""
    return hidden * max(CAPTURE_POINTS_PER_TOKEN * rows, (num_layers + 1) * decode_rows)


def graph_step_bytes(sizes: GraphSizes, hidden: int, vocab: int, slots: int, act_bytes: int, num_layers: int
                     ) -> int:
    """About what a graph step holds on the device besides a step's activations (counted out of the KV
    cache's budget): the capture buffer, the steering pool, the sampled rows' logits, every graph's kept
    hidden rows, and a drawing step's sort of its logits."""
    rows = max(max(sizes.mixed, default=0), max(sizes.decode, default=0))
    sampled = max(max(sizes.decode, default=0), min(rows, sizes.max_seqs))
    capture = capture_numbers(hidden, rows, max(sizes.decode, default=0), num_layers) * act_bytes
    pool = POOL_ROWS_PER_SEQ * slots * 4 * hidden * 4  # rows as wide as the widest point (about 4x hidden)
    graphs_hidden = 2 * sum(s for s in (*sizes.decode, *sizes.mixed)) * hidden * act_bytes
    return capture + pool + sampled * vocab * (act_bytes + 24) + graphs_hidden
