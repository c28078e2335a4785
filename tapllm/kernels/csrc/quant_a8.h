// The int8-activation side of the quantized linears (quant_a8.cpp), shared with its GEMM.
#pragma once
#include <cstdint>

#include "quant_layout.h"

namespace tapllm {
namespace quant {

constexpr int64_t kRun = 32;  // inputs per activation scale

// Rows of x rounded: q [m, K] int8, dx [m, K/32], s [m, K/sum_run] = per sum group, sum of dx * sum(q).
struct QRows {
  const int8_t* q;
  const float* dx;
  const float* s;
};

// Whether a8_gemm takes blocks of this kind in this build (the 4-bit kinds int4, Q4_0, Q4_K, with AVX2).
bool a8_gemm_kind(Kind kind);

// out[m, N] = rows x times the blocks w as a GEMM over per-call packed panels of the weights'
// integers (quant_a8_gemm.cpp); a kind a8_gemm_kind refuses is a caller's error.
void a8_gemm(const Layout& l, const QRows& x, int64_t m, const uint8_t* w, float* out);

}  // namespace quant
}  // namespace tapllm
