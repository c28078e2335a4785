// The experts of a mixture-of-experts block in one call (tapllm/models/experts.py's combine, on the packed
// GEMV): a step's (token, choice) pairs sorted by expert (a stable counting sort on the host), each expert
// with rows one packed_linear over them, the gated activation, its down projection, then the weighted rows
// added back to their tokens. The same ops as the Python loop, in the same order, without a Python
// dispatch per expert (a batch-1 step's 8 experts x 4 blocks, a batch-16 step's ~90 x 4).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace tapllm {

// x [T, H]; weights, ids [T, k] (ids int64 in [0, E)); gate_up [E, 2I, Hpad] and down [E, H, Ipad]: each
// expert's slice a weight packed_linear reads (experts.py's blocked layout); act: gated_act's mode.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.scalar_type() == at::kLong && weights.sizes() == ids.sizes() &&
                  ids.size(0) == x.size(0) && gate_up.dim() == 3 && down.dim() == 3 && down.size(0) == gate_up.size(0),
              "moe_experts: x [T, H], weights and int64 ids [T, k], gate_up [E, 2I, Hpad], down [E, H, Ipad] expected");
  const int64_t k = ids.size(1), pairs = ids.numel(), experts = gate_up.size(0);
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "moe_experts: expert id ", id[p], " out of [0, ", experts, ")");
    ++start[id[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  at::Tensor order = at::empty({pairs}, ids.options());
  at::Tensor tokens = at::empty({pairs}, ids.options());
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    int64_t* o = order.data_ptr<int64_t>();
    int64_t* tk = tokens.data_ptr<int64_t>();
    for (int64_t p = 0; p < pairs; ++p) {  // stable: an expert's rows keep token order
      const int64_t at_ = next[id[p]]++;
      o[at_] = p;
      tk[at_] = p / k;
    }
  }
  const at::Tensor rows = x.index_select(0, tokens);
  at::Tensor out = at::empty_like(rows);
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < experts; ++e)
    if (start[e + 1] > start[e]) hit.push_back(e);
  const auto expert = [&](int64_t e) {
    const int64_t n = start[e + 1] - start[e];
    const at::Tensor h = packed_linear(rows.narrow(0, start[e], n), gate_up.select(0, e), std::nullopt);
    out.narrow(0, start[e], n).copy_(packed_linear(gated_act(h, act), down.select(0, e), std::nullopt));
  };
  const int64_t count = static_cast<int64_t>(hit.size());
  if (count >= 2 * at::get_num_threads()) {
    // Whole experts per thread: one parallel region for the block instead of two per expert (a decode
    // expert's GEMVs are a few MB, too small to amortise a region each). Nested in this region,
    // packed_linear and gated_act run on the calling thread, each expert's ops the same as below.
    const at::ThreadLocalState caller;  // inference mode and the rest of the caller's thread state
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      const at::ThreadLocalStateGuard guard(caller);
      for (int64_t j = begin; j < end; ++j) expert(hit[j]);
    });
  } else {
    for (const int64_t e : hit) expert(e);
  }
  const at::Tensor scaled = out.mul(weights.reshape({-1}).index_select(0, order).unsqueeze(1)).to(x.scalar_type());
  return at::zeros_like(x).index_add_(0, tokens, scaled);
}

}  // namespace tapllm
