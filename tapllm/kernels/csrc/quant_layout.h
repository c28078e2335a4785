// The block layouts of tapllm's quantized weights (see quant.cpp), shared by its kernels.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tapllm {
namespace quant {

enum Kind : int { kInt8 = 0, kInt4 = 1, kQ40 = 2 };

struct Layout {
  Kind kind;
  int64_t n, groups, group, bytes, k;  // rows, blocks per row, inputs per block, bytes per block, inputs
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline Layout layout_of(const at::Tensor& w, int64_t k) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous(),
              "quant: the weight must be a contiguous uint8 [N, blocks, bytes] tensor");
  const int64_t groups = w.size(1), bytes = w.size(2);
  TORCH_CHECK(groups > 0 && k % groups == 0, "quant: ", groups, " blocks per row do not divide K=", k);
  const int64_t g = k / groups;
  Kind kind;
  if (bytes == 2 + g && g % 32 == 0) kind = kInt8;
  else if (bytes == 4 + g / 2 && g % 32 == 0) kind = kInt4;
  else if (bytes == 18 && g == 32) kind = kQ40;
  else TORCH_CHECK(false, "quant: blocks of ", bytes, " bytes for ", g, " inputs match no known layout");
  return Layout{kind, w.size(0), groups, g, bytes, k};
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The columns after a tile's follow it in memory: they are requested ~4 KB ahead at the tile's
// pace (its rows are a few hundred bytes each, too short for the hardware prefetcher; measured
// 1.3-1.6x on a batch-1 step of 4-bit and Q8_0 weights). touch(b) as the tile reaches block b.
struct Ahead {
  const char* next;
  const char* end;
  int64_t step;  // bytes of one block of every column of the tile

  Ahead(const Layout& l, const uint8_t* w, int64_t n, int nc) : step(nc * l.bytes) {
    const int64_t tile_bytes = nc * l.groups * l.bytes;
    next = reinterpret_cast<const char*>(w + n * l.groups * l.bytes) +
           tile_bytes * std::max<int64_t>(1, (4096 + tile_bytes - 1) / tile_bytes);
    end = reinterpret_cast<const char*>(w + l.n * l.groups * l.bytes);
  }
  void touch(int64_t b) const {
    for (const char* a = next + b * step; a < next + (b + 1) * step && a < end; a += 64) _mm_prefetch(a, _MM_HINT_T0);
  }
};
#endif

// The order both kernels walk out[m, N] in: columns in blocks of 16, in parallel (a block stays
// in L1 across the row passes); rows in passes of 8, 4, 2 and 1; within a pass, NC columns at a
// time by tile(MR, NC, KIND, r0, n) (compile-time constants as std::integral_constant; vector
// builds only), the columns left over one at a time by scalar(r, n).
template <int MR, typename Tile, typename Scalar>
inline void rows_pass(const Layout& l, int64_t r0, int64_t n0, int64_t n1, const Tile& tile, const Scalar& scalar) {
  constexpr int NC = MR == 1 ? 4 : (MR <= 4 ? 2 : 1);
  int64_t n = n0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  using R = std::integral_constant<int, MR>;
  using C = std::integral_constant<int, NC>;
  for (; n + NC <= n1; n += NC) {
    if (l.kind == kInt8) tile(R{}, C{}, std::integral_constant<int, kInt8>{}, r0, n);
    else if (l.kind == kInt4) tile(R{}, C{}, std::integral_constant<int, kInt4>{}, r0, n);
    else tile(R{}, C{}, std::integral_constant<int, kQ40>{}, r0, n);
  }
#endif
  for (; n < n1; ++n)
    for (int r = 0; r < MR; ++r) scalar(r0 + r, n);
}

template <typename Tile, typename Scalar>
void for_tiles(const Layout& l, int64_t m, const Tile& tile, const Scalar& scalar) {
  at::parallel_for(0, (l.n + 15) / 16, 4, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * 16, n1 = std::min(l.n, b1 * 16);
    for (int64_t nb = n0; nb < n1; nb += 16) {
      const int64_t ne = std::min(n1, nb + 16);
      int64_t r = 0;
      for (; r + 8 <= m; r += 8) rows_pass<8>(l, r, nb, ne, tile, scalar);
      for (; r + 4 <= m; r += 4) rows_pass<4>(l, r, nb, ne, tile, scalar);
      for (; r + 2 <= m; r += 2) rows_pass<2>(l, r, nb, ne, tile, scalar);
      for (; r < m; ++r) rows_pass<1>(l, r, nb, ne, tile, scalar);
    }
  });
}

}  // namespace quant
}  // namespace tapllm
