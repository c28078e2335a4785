// Every op of tapllm's CPU kernels, by family: the functions bindings.cpp registers as
// torch.ops.tapllm_<variant>.<name> and the decoder runner calls directly. Their plain-PyTorch
// definitions (what each must compute) are in tapllm/kernels/reference.py.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace tapllm {

// ---- norms.cpp: RMSNorm of rows [T, N] in the order `mode` names (constants.py's RMS_*) ----------
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t mode);
// x += r (rounded to x's dtype), then rms_norm of the sum; x is updated in place.
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& r, const at::Tensor& w, double eps, int64_t mode);

// ---- activation.cpp: act(gate) * up of rows [T, 2I] (gate first), act per constants.py's ACT_* ---
at::Tensor gated_act(const at::Tensor& gate_up, int64_t mode);

// ---- rotary_kv.cpp ---------------------------------------------------------------------------
// Rotate-half rotary on the first cos.size(1) dims of every head of q, k [T, heads, D], in place.
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
// Rows of k, v [T, Hkv, D] into the caches [Hkv, blocks, block_size, D] at flat slots (V made finite).
void kv_write(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots);

// ---- decode_attention.cpp: one query per sequence over its cached keys, read in place ------------
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window,
                            double softcap);

// ---- prefill_attention.cpp: causal attention of prefill chunks over the paged cache ---------------
// tiles: bfloat16 products may run on AMX tiles (where amx_supported()); false keeps the AVX512 task,
// whose arithmetic row_attention repeats for one row (batch_invariant).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& contexts,
                             const at::Tensor& block_tables, double scale, int64_t window, double softcap,
                             bool tiles);

// ---- row_attention.cpp: one query per sequence in the prefill kernel's arithmetic (batch_invariant) ---
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window,
                         double softcap);

// ---- packed_gemv.cpp: y = x W^T + b on a oneDNN-prepacked weight (decode sizes; any with batch_invariant) ----
// A plain tensor over the packed weight's bytes, read in place (no copy).
at::Tensor packed_view(const at::Tensor& packed);
// w is the weight's packed_view; x is bfloat16 or float32, as the weight.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// Whether this build and CPU run packed_linear on bfloat16 (AVX512-BF16) or float32 (AVX512) weights.
bool packed_gemv_supported();
// ---- moe_experts.cpp: a mixture-of-experts block's experts over packed_linear weights, in one call ----
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t act);
// amx_attention.cpp: whether this process may run AMX bfloat16 tiles (CPU, OS permission, TAPLLM_AMX)
bool amx_supported();
bool packed_gemv_f32_supported();

// ---- quant.cpp, quant_a8.cpp: weights in quantized blocks, uint8 [N, blocks, bytes per block] ----
// y = x W^T + b; act_bits 8: the activations are rounded to int8 per run of 32 inputs first.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t act_bits = 0);
at::Tensor quant_linear_a8(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// The float weight [N, k] of dtype that the blocks w stand for.
at::Tensor quant_dequantize(const at::Tensor& w, int64_t k, at::ScalarType dtype);
// x as quant_linear's act_bits 8 sees it: rounded to int8 per run of 32 values, times the run's step.
at::Tensor round_activations(const at::Tensor& x);

// ---- decoder.cpp: a run of pre-norm decoder blocks for a step of decodes, x [T, hidden] in place ---
// params: per layer the constants.py DECODER_SLOTS, in that order; windows: per layer (0: none);
// invariant: batch_invariant's kernels; region, rank, size, wait_s, state: a tensor-parallel rank's
// row-parallel o and down, all-reduced in shared memory (see decoder.cpp).
at::Tensor decoder_layers(at::Tensor x, const c10::List<std::optional<at::Tensor>>& params, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_tables,
                          const at::Tensor& lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          double eps, double scale, at::IntArrayRef windows, int64_t act, bool packed,
                          int64_t act_bits, bool invariant, const std::optional<at::Tensor>& region, int64_t rank,
                          int64_t size, double wait_s, const std::optional<at::Tensor>& state);

// ---- shm_collectives.cpp: the tensor-parallel ranks of one machine meeting in shared memory -------
// Round `seq` of an all-reduce (x summed over the ranks in place, in rank order) or an all-gather (x
// into out[rank, offset:]) through `region`; false: not every rank arrived within wait_s (call again:
// the same call is idempotent until it returns true).
bool shm_all_reduce(at::Tensor x, const at::Tensor& region, int64_t rank, int64_t size, int64_t seq, double wait_s);
// shm_all_reduce in two halves: x into this rank's slot, round `seq` published; then the wait and the sum
// (idempotent until it returns true).
void shm_publish(const at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t size, int64_t seq);
bool shm_finish_all_reduce(at::Tensor x, const at::Tensor& region, int64_t rank, int64_t size, int64_t seq,
                           double wait_s);
bool shm_all_gather(const at::Tensor& x, at::Tensor out, int64_t offset, const at::Tensor& region, int64_t rank,
                    int64_t size, int64_t seq, double wait_s);

}  // namespace tapllm
