// Linears of a few rows (decode steps) on oneDNN-prepacked bfloat16 or float32 weights, read in place.
//
// oneDNN's own call on a prepacked weight costs 20-40 us at the default model's decode shapes
// (a 576x576 GEMV: 22 us, ~30 GB/s out of L2), so a batch-1 step's 121 linears ran at about
// half the memory bandwidth. The weight stays the one oneDNN packed (no second copy): on
// AVX512-BF16 CPUs it is laid out in blocks of 64 outputs, each block K/2 pairs of inputs of
// 64 outputs x 2 bf16 (oneDNN's VNNI layout; N padded to 64, K to 32). That is exactly the
// operand of vdpbf16ps: one 512-bit load is 16 outputs x 2 inputs, the input pair is broadcast.
// packed_view() checks the byte count; tapllm/kernels/gemv.py checks the layout by running this
// kernel against oneDNN before any model uses it, so another layout keeps oneDNN's call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels.h"

#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tapllm {
namespace {

constexpr int64_t kBlockN = 64;  // outputs per block
constexpr int64_t kBlockK = 32;  // K is padded to a multiple of this (bf16)
constexpr int64_t kBlockKF32 = 16;  // float32: blocks of 64 outputs x K, one input at a time, K padded to 16
int64_t block_k(at::ScalarType t) { return t == at::kFloat ? kBlockKF32 : kBlockK; }
constexpr int64_t kRowsPerPass = 4;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int64_t int_op(const char* name, const at::Tensor& t) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  std::vector<c10::IValue> stack{t};
  op.callBoxed(&stack);
  return stack[0].toInt();
}

bool supported() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// float32 needs only AVX512F, which this build's dispatch (torch's AVX512 capability) implies.
bool supported_f32() {
#if defined(CPU_CAPABILITY_AVX512)
  return true;
#else
  return false;
#endif
}

// A plain bf16 tensor over a prepacked weight's bytes (no copy; it keeps the packed tensor alive).
// Sizes [N, Kpad] name the weight's true outputs and padded inputs; the memory is the blocked
// layout above, which only packed_linear reads.
at::Tensor packed_view(const at::Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn() && packed.dim() == 2 &&
                  (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kFloat),
              "packed_view: a 2-D bfloat16 or float32 oneDNN-packed weight expected");
  const int64_t n = packed.size(0), k = packed.size(1), esize = packed.element_size();
  const int64_t kpad = round_up(k, block_k(packed.scalar_type())), npad = round_up(n, kBlockN);
  const int64_t nbytes = int_op("mkldnn::_nbytes", packed);
  TORCH_CHECK(nbytes == npad * kpad * esize, "packed_view: ", nbytes, " bytes, not the ", npad * kpad * esize,
              " of a [", npad, ", ", kpad, "] blocked layout");
  void* ptr = reinterpret_cast<void*>(int_op("mkldnn::data_ptr", packed));
  at::Tensor keep = packed;
  return at::from_blob(ptr, {n, kpad}, {kpad, 1}, [keep](void*) mutable {},
                       at::TensorOptions().dtype(packed.scalar_type()));
}

#if defined(CPU_CAPABILITY_AVX512)
#define TAPLLM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// The input pair (x[2p], x[2p+1]) of a row, broadcast; the pair past an odd K is (x[K-1], 0).
TAPLLM_BF16_TARGET inline __m512bh pair(const uint16_t* x, int64_t p, int64_t k) {
  uint32_t bits;
  if (2 * p + 1 < k) {
    std::memcpy(&bits, x + 2 * p, 4);
  } else {
    bits = x[2 * p];
  }
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// Lines of the next block to request while a later pass of rows works on this one from cache: the
// first pass streams a block from memory, the others are compute, so without this the memory
// sits idle for (passes - 1) / passes of the time at 8+ rows. Lines [first, end) of next, `each`
// per input pair.
struct Ahead {
  const char* next = nullptr;
  int64_t first = 0, end = 0;
  int each = 0;
  bool streaming = true;  // this thread's first pass over the block: it comes from memory
};

// Each step reads 256 bytes (4 lines). The pass that streams a block from memory requests all 4
// lines of the step 64 ahead (16 KB). Before, one line 16 steps ahead (the hardware prefetcher
// left the rest): paired runs on one VM, batch-1 decode step fp32 21.2 -> 16.6 ms, bf16 14.5 ->
// 10.9 ms (best of 4). Later passes read the block from L2, and one line 16 steps ahead does.
// A request past the block's end is harmless (prefetches do not fault) and mostly useful: the
// next block is usually this thread's.
constexpr int64_t kStepBytes = 256;  // one input (pair) of a block's 64 outputs
inline void stream_ahead(const char* step, bool streaming) {
  if (streaming) {
    const char* far = step + 64 * kStepBytes;
    _mm_prefetch(far, _MM_HINT_T0);
    _mm_prefetch(far + 64, _MM_HINT_T0);
    _mm_prefetch(far + 128, _MM_HINT_T0);
    _mm_prefetch(far + 192, _MM_HINT_T0);
  } else {
    _mm_prefetch(step + 16 * kStepBytes, _MM_HINT_T0);
  }
}

// Rows [0, M) of x times one block of 64 outputs; out gets float32 sums [M][64].
template <int M>
TAPLLM_BF16_TARGET void block_rows(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t k, float* out,
                                   const Ahead& ahead) {
  __m512 acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + p * 2 * kBlockN;  // pairs of a block follow each other (16 x 128 = 2048)
    stream_ahead(reinterpret_cast<const char*>(wp), ahead.streaming);
    if (ahead.next != nullptr) {
      for (int q = 0; q < ahead.each; ++q) {
        const int64_t line = ahead.first + p * ahead.each + q;
        if (line < ahead.end) _mm_prefetch(ahead.next + line * 64, _MM_HINT_T1);
      }
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    for (int r = 0; r < M; ++r) {
      const __m512bh xb = pair(x + r * ldx, p, k);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xb);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xb);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kBlockN + 16 * j, acc[r][j]);
}

TAPLLM_BF16_TARGET void run_rows(int m, const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t k, float* out,
                                 const Ahead& ahead) {
  switch (m) {
    case 1: return block_rows<1>(w, x, ldx, k, out, ahead);
    case 2: return block_rows<2>(w, x, ldx, k, out, ahead);
    case 3: return block_rows<3>(w, x, ldx, k, out, ahead);
    default: return block_rows<4>(w, x, ldx, k, out, ahead);
  }
}

// float32 sums (+ bias) rounded to bf16 (to nearest even, as oneDNN's output) for outputs [n0, n0 + count).
TAPLLM_BF16_TARGET void store_row(const float* sums, const uint16_t* bias, uint16_t* y, int64_t n0, int64_t count) {
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 mask = count - j >= 16 ? static_cast<__mmask16>(0xffff)
                                           : static_cast<__mmask16>((1u << (count - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(mask, sums + j);
    if (bias != nullptr) {
      const __m256i b = _mm256_maskz_loadu_epi16(mask, bias + n0 + j);
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(y + n0 + j, mask, r);
  }
}

// float32: per input, 64 outputs follow each other (the same 256 bytes per step as a bf16 pair).
template <int M>
void block_rows_f32(const float* w, const float* x, int64_t ldx, int64_t k, float* out, const Ahead& ahead) {
  __m512 acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const float* wp = w + p * kBlockN;
    stream_ahead(reinterpret_cast<const char*>(wp), ahead.streaming);
    if (ahead.next != nullptr) {
      for (int q = 0; q < ahead.each; ++q) {
        const int64_t line = ahead.first + p * ahead.each + q;
        if (line < ahead.end) _mm_prefetch(ahead.next + line * 64, _MM_HINT_T1);
      }
    }
    const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
    const __m512 w2 = _mm512_loadu_ps(wp + 32), w3 = _mm512_loadu_ps(wp + 48);
    for (int r = 0; r < M; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + p]);
      acc[r][0] = _mm512_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, xb, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(w2, xb, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(w3, xb, acc[r][3]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kBlockN + 16 * j, acc[r][j]);
}

void run_rows_f32(int m, const float* w, const float* x, int64_t ldx, int64_t k, float* out, const Ahead& ahead) {
  switch (m) {
    case 1: return block_rows_f32<1>(w, x, ldx, k, out, ahead);
    case 2: return block_rows_f32<2>(w, x, ldx, k, out, ahead);
    case 3: return block_rows_f32<3>(w, x, ldx, k, out, ahead);
    default: return block_rows_f32<4>(w, x, ldx, k, out, ahead);
  }
}

void store_row_f32(const float* sums, const float* bias, float* y, int64_t n0, int64_t count) {
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 mask = count - j >= 16 ? static_cast<__mmask16>(0xffff)
                                           : static_cast<__mmask16>((1u << (count - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(mask, sums + j);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0 + j));
    _mm512_mask_storeu_ps(y + n0 + j, mask, v);
  }
}

// Rows of x over the blocks of outputs, 4 rows per pass (see packed_linear): run(rows, block, r0,
// sums, ahead) computes, store(sums of a row, row, n0, count) writes.
template <typename Run, typename Store>
void drive(int64_t m, int64_t n, int64_t steps, int64_t block_bytes, const char* wbase, Run run, Store store) {
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
  const int64_t passes = (m + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t block_lines = block_bytes / 64;
  // The next block's lines spread over this block's later passes (4 lines per step in all).
  const int each = passes > 1 ? static_cast<int>((block_lines / steps + passes - 2) / (passes - 1)) : 0;
  // With 2+ passes a work unit is half of a block's passes, so an odd block count (the default
  // model's 576 outputs are 9 blocks) still splits evenly over threads; an even one gives each
  // thread whole blocks, as before.
  const int64_t halves = passes > 1 ? 2 : 1, mid = (passes + 1) / 2;
  at::parallel_for(0, blocks * halves, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRowsPerPass * kBlockN];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / halves, n0 = b * kBlockN, count = std::min(kBlockN, n - n0);
      const int64_t pass_lo = halves == 1 || u % 2 == 0 ? 0 : mid, pass_hi = halves == 1 || u % 2 == 1 ? passes : mid;
      const bool next_here = (b + 1) * halves < end;  // this thread runs the next block too
      for (int64_t pass = pass_lo; pass < pass_hi; ++pass) {  // later passes read the block from cache
        const int64_t r0 = pass * kRowsPerPass;
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, m - r0));
        Ahead ahead;
        ahead.streaming = pass == pass_lo;  // this thread's first touch of the block
        if (pass > 0 && next_here) {
          ahead.next = wbase + (b + 1) * block_bytes;
          ahead.first = (pass - 1) * steps * each;
          ahead.end = block_lines;
          ahead.each = each;
        }
        run(rows, b, r0, sums, ahead);
        for (int r = 0; r < rows; ++r) store(sums + r * kBlockN, r0 + r, n0, count);
      }
    }
  });
}
#endif

}  // namespace

// y = x W^T + b for a few rows x [m, K] (bf16 or float32) and a packed_view W of that dtype; y [m, N].
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 ? supported_f32() : supported(), "packed_linear: this build or CPU lacks ",
              f32 ? "AVX512" : "AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && (f32 || x.scalar_type() == at::kBFloat16) && w.scalar_type() == x.scalar_type() &&
                  w.dim() == 2,
              "packed_linear: bfloat16 or float32 x [m, K] and a packed_view weight of its dtype expected");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), kpad = w.size(1);
  TORCH_CHECK(round_up(k, block_k(x.scalar_type())) == kpad, "packed_linear: x has ", k, " inputs, the weight ", kpad,
              " (padded)");
  const at::Tensor xc = x.contiguous();
  std::optional<at::Tensor> bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == x.scalar_type(), "packed_linear: bias must be [N] of x's dtype");
    bc = bias->contiguous();
  }
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(CPU_CAPABILITY_AVX512)
  const char* wbase = reinterpret_cast<const char*>(w.data_ptr());
  const int64_t block_bytes = kpad * kBlockN * static_cast<int64_t>(x.element_size());
  if (f32) {
    const auto* wp = reinterpret_cast<const float*>(wbase);
    const auto* xp = xc.data_ptr<float>();
    const float* bp = bc.has_value() ? bc->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    drive(m, n, k, block_bytes, wbase,
          [&](int rows, int64_t b, int64_t r0, float* sums, const Ahead& ahead) {
            run_rows_f32(rows, wp + b * kpad * kBlockN, xp + r0 * k, k, k, sums, ahead);
          },
          [&](const float* sums, int64_t row, int64_t n0, int64_t count) { store_row_f32(sums, bp, yp + row * n, n0, count); });
  } else {
    const auto* wp = reinterpret_cast<const uint16_t*>(wbase);
    const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    const auto* bp = bc.has_value() ? reinterpret_cast<const uint16_t*>(bc->data_ptr()) : nullptr;
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
    drive(m, n, (k + 1) / 2, block_bytes, wbase,
          [&](int rows, int64_t b, int64_t r0, float* sums, const Ahead& ahead) {
            run_rows(rows, wp + b * kpad * kBlockN, xp + r0 * k, k, k, sums, ahead);
          },
          [&](const float* sums, int64_t row, int64_t n0, int64_t count) { store_row(sums, bp, yp + row * n, n0, count); });
  }
#endif
  return y;
}

namespace {
bool packed_gemv_supported() { return supported(); }
bool packed_gemv_f32_supported() { return supported_f32(); }
}  // namespace

}  // namespace tapllm

#define TAPLLM_GEMV_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TAPLLM_GEMV_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TAPLLM_GEMV_FRAGMENT(TAPLLM_NS, m) {
  m.def("packed_view(Tensor packed) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("packed_gemv_supported() -> bool", &tapllm::packed_gemv_supported);
  m.def("packed_gemv_f32_supported() -> bool", &tapllm::packed_gemv_f32_supported);
}

TAPLLM_GEMV_IMPL(TAPLLM_NS, MkldnnCPU, m) { m.impl("packed_view", &tapllm::packed_view); }
TAPLLM_GEMV_IMPL(TAPLLM_NS, CPU, m) {
  m.impl("packed_linear", &tapllm::packed_linear);
  m.impl("packed_view", &tapllm::packed_view);  // a plain tensor: refused with a message
}
