// A run of pre-norm decoder blocks (Llama, Mistral, Qwen2, Phi-3) for a step of decodes, in
// one call: the blocks of a step that no request captures or steers run here, so the ~15
// operator calls of each block cost no Python dispatch. The math is the eager block's, op
// by op (tapllm/models/llama.py), with the same fused kernels the Python path uses.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels.h"

namespace tapllm {
namespace {

constexpr int64_t kParamsPerLayer = 16;
constexpr int64_t kGemvRows = 64;  // tapllm/kernels/gemv.py MAX_ROWS

// y = x W^T + b: oneDNN's op on a weight tapllm prepacked at load time (the Python path calls
// the same op), else at::linear. The packed op is private: the Python side only packs after
// its probe ran it (tapllm/platform.py), and only then passes packed=true.
// gemv: the packed weight's packed_view where the Python side probed the in-place GEMV (gemv.py).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& gemv,
                  const std::optional<at::Tensor>& b, bool packed, int64_t act_bits) {
  if (w.scalar_type() == at::kByte) return quant_linear(x, w, b, act_bits);  // a quantized weight (quant.cpp)
  if (gemv.has_value() && x.size(0) <= kGemvRows && x.scalar_type() == gemv->scalar_type()) return packed_linear(x, *gemv, b);
  if (!packed) return at::linear(x, w, b);
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  c10::List<std::optional<at::Scalar>> scalars;
  scalars.push_back(std::nullopt);
  std::vector<c10::IValue> stack{x, w, b.has_value() ? c10::IValue(*b) : c10::IValue(), c10::IValue("none"),
                                 c10::IValue(scalars), c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

std::optional<at::Tensor> opt(const c10::List<std::optional<at::Tensor>>& params, int64_t i) {
  std::optional<at::Tensor> t = params.get(i);
  return t.has_value() && t->defined() ? t : std::nullopt;
}

at::Tensor req(const c10::List<std::optional<at::Tensor>>& params, int64_t i) {
  std::optional<at::Tensor> t = params.get(i);
  TORCH_CHECK(t.has_value() && t->defined(), "decoder_layers: parameter ", i, " is missing");
  return *t;
}

// params: per layer [input norm, qkv, qkv bias?, o, o bias?, post norm, gate_up, gate_up bias?, down,
// down bias?, k_cache, v_cache, then the packed_view (or None) of qkv, o, gate_up, down]; windows: per
// layer (0: none); act_bits: the quantized linears' activation rounding (0: none, 8: int8). x [T, hidden]
// is updated in place.
at::Tensor decoder_layers(at::Tensor x, const c10::List<std::optional<at::Tensor>>& params, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_tables,
                          const at::Tensor& lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          double eps, double scale, at::IntArrayRef windows, int64_t act, bool packed,
                          int64_t act_bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layers: x must be a contiguous [T, hidden] tensor");
  TORCH_CHECK(static_cast<int64_t>(params.size()) == kParamsPerLayer * static_cast<int64_t>(windows.size()),
              "decoder_layers: ", kParamsPerLayer, " parameters per layer expected");
  const int64_t t = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  for (size_t layer = 0; layer < windows.size(); ++layer) {
    const int64_t p = kParamsPerLayer * static_cast<int64_t>(layer);
    at::Tensor h = rms_norm(x, req(params, p), eps, 0);
    at::Tensor qkv = linear(h, req(params, p + 1), opt(params, p + 12), opt(params, p + 2), packed, act_bits);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    rotary_(q, k, cos, sin);
    at::Tensor k_cache = req(params, p + 10), v_cache = req(params, p + 11);
    kv_write(k, v, k_cache, v_cache, slots);
    at::Tensor z = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, windows[layer], 0.0);
    at::Tensor a = linear(z.view({t, q_size}), req(params, p + 3), opt(params, p + 13), opt(params, p + 4), packed, act_bits);
    h = add_rms_norm_(x, a, req(params, p + 5), eps, 0);
    at::Tensor gate_up = linear(h, req(params, p + 6), opt(params, p + 14), opt(params, p + 7), packed, act_bits);
    at::Tensor m = linear(gated_act(gate_up, act), req(params, p + 8), opt(params, p + 15), opt(params, p + 9), packed, act_bits);
    x.add_(m);
  }
  return x;
}

}  // namespace
}  // namespace tapllm

#define TAPLLM_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TAPLLM_FRAGMENT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TAPLLM_FRAGMENT(TAPLLM_NS, m) {
  m.def("decoder_layers(Tensor(a!) x, Tensor?[] params, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor lens, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int[] windows, int act, "
        "bool packed, int act_bits=0) -> Tensor(a!)");
}

// Prepacked weights are oneDNN tensors: the op must also answer the MkldnnCPU dispatch key.
TAPLLM_FRAGMENT_IMPL(TAPLLM_NS, CPU, m) { m.impl("decoder_layers", &tapllm::decoder_layers); }
TAPLLM_FRAGMENT_IMPL(TAPLLM_NS, MkldnnCPU, m) { m.impl("decoder_layers", &tapllm::decoder_layers); }
