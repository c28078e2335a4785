// Every op of tapllm's CPU kernels as a torch.library op: its schema and which function each
// dispatch key runs. The namespace is TAPLLM_NS (build.py defines it, tapllm_<variant>), so each
// instruction-set variant loads as its own torch.ops.tapllm_<variant>. The functions are
// declared in kernels.h and defined in the file of their family.
//
// TORCH_LIBRARY pastes its namespace argument without expanding it; TORCH_LIBRARY_FRAGMENT hands
// it to a second macro first, which expands TAPLLM_NS, so the schemas are one fragment here.
#include <torch/library.h>

#include "kernels.h"

TORCH_LIBRARY_FRAGMENT(TAPLLM_NS, m) {
  // norms.cpp, activation.cpp
  m.def("rms_norm(Tensor x, Tensor w, float eps, int mode) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor w, float eps, int mode) -> Tensor");
  m.def("gated_act(Tensor gate_up, int mode) -> Tensor");
  // rotary_kv.cpp
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("kv_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  // decode_attention.cpp, prefill_attention.cpp
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lens, float scale, "
        "int window, float softcap) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor starts, Tensor lens, Tensor contexts, "
        "Tensor block_tables, float scale, int window, float softcap, bool tiles=True) -> Tensor");
  // row_attention.cpp
  m.def("row_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lens, float scale, "
        "int window, float softcap) -> Tensor");
  // packed_gemv.cpp (the two queries run on no tensor: one kernel for every dispatch key)
  m.def("packed_view(Tensor packed) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("packed_gemv_supported() -> bool", &tapllm::packed_gemv_supported);
  m.def("packed_gemv_f32_supported() -> bool", &tapllm::packed_gemv_f32_supported);
  // moe_experts.cpp
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, int act) -> Tensor");
  // amx_attention.cpp
  m.def("amx_supported() -> bool", &tapllm::amx_supported);
  // quant.cpp, quant_a8.cpp
  m.def("quant_linear(Tensor x, Tensor w, Tensor? bias, int act_bits=0) -> Tensor");
  m.def("quant_dequantize(Tensor w, int k, ScalarType dtype) -> Tensor");
  m.def("round_activations(Tensor x) -> Tensor");
  // shm_collectives.cpp
  m.def("shm_all_reduce(Tensor(a!) x, Tensor region, int rank, int size, int seq, float wait_s) -> bool");
  m.def("shm_all_gather(Tensor x, Tensor(a!) out, int offset, Tensor region, int rank, int size, int seq, "
        "float wait_s) -> bool");
  // decoder.cpp
  m.def("decoder_layers(Tensor(a!) x, Tensor?[] params, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor lens, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int[] windows, int act, "
        "bool packed, int act_bits=0, bool invariant=False, Tensor? region=None, int rank=0, int size=1, "
        "float wait_s=0.0, Tensor(b!)? state=None) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(TAPLLM_NS, CPU, m) {
  m.impl("rms_norm", &tapllm::rms_norm);
  m.impl("add_rms_norm_", &tapllm::add_rms_norm_);
  m.impl("gated_act", &tapllm::gated_act);
  m.impl("rotary_", &tapllm::rotary_);
  m.impl("kv_write", &tapllm::kv_write);
  m.impl("decode_attention", &tapllm::decode_attention);
  m.impl("prefill_attention", &tapllm::prefill_attention);
  m.impl("row_attention", &tapllm::row_attention);
  m.impl("packed_view", &tapllm::packed_view);  // a plain tensor: refused with a message
  m.impl("packed_linear", &tapllm::packed_linear);
  m.impl("moe_experts", &tapllm::moe_experts);
  m.impl("quant_linear", &tapllm::quant_linear);
  m.impl("quant_dequantize", &tapllm::quant_dequantize);
  m.impl("round_activations", &tapllm::round_activations);
  m.impl("decoder_layers", &tapllm::decoder_layers);
  m.impl("shm_all_reduce", &tapllm::shm_all_reduce);
  m.impl("shm_all_gather", &tapllm::shm_all_gather);
}

// oneDNN-packed weights are tensors of the MkldnnCPU key: the ops that take one answer it too.
TORCH_LIBRARY_IMPL(TAPLLM_NS, MkldnnCPU, m) {
  m.impl("packed_view", &tapllm::packed_view);
  m.impl("decoder_layers", &tapllm::decoder_layers);
}
