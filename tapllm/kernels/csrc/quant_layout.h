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

enum Kind : int { kInt8 = 0, kInt4 = 1, kQ40 = 2, kQ4K = 3, kQ6K = 4 };

// GGUF's K-quants: super-blocks of 256 inputs with a scale per run of 32 (Q4_K, plus a min) or 16 (Q6_K).
inline bool is_k(Kind kind) { return kind >= kQ4K; }
constexpr int64_t kSuper = 256;

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
  else if (bytes == 144 && g == kSuper) kind = kQ4K;
  else if (bytes == 210 && g == kSuper) kind = kQ6K;
  else TORCH_CHECK(false, "quant: blocks of ", bytes, " bytes for ", g, " inputs match no known layout");
  return Layout{kind, w.size(0), groups, g, bytes, k};
}

// Inputs per sum of x that a kind's min terms need (each 4-bit block's, each Q4_K run's).
inline int64_t sum_run(const Layout& l) { return is_k(l.kind) ? 32 : l.group; }

// Q4_K super-block: float16 d, float16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles (bytes 32c..32c+31 hold run 2c in the low nibbles, run 2c+1 in the high ones);
// w = d * sc[t] * q - dmin * m[t] for run t. Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits,
// 16 int8 scales (one per 16 inputs), float16 d last; w = d * sc[i / 16] * (q - 32).

// A K-quant super-block's float scales. Q4_K: d[t] scales run t, m[t] is added to its weights;
// Q6_K: d[i] scales inputs 16i..16i+15 (two per run), m is 0.
struct KScales {
  float d[16];
  float m[8];
};

// The scale of half h (0: inputs 0-15, 1: 16-31) of run t.
inline float k_scale(Kind kind, const KScales& s, int t, int h) { return kind == kQ4K ? s.d[t] : s.d[2 * t + h]; }

// Q4_K's 12 bytes of 6-bit scales and mins as 8 scale bytes then 8 min bytes: bytes 0-3 hold
// scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11 the low 4 bits of scales 4-7 (low nibble)
// and of mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 and 4-7.
inline void q4k_unpack_scales(const uint8_t* p, uint8_t* out) {
  uint32_t u[3], v[4];
  std::memcpy(u, p, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  v[0] = u[0] & six;                                        // scales 0-3
  v[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);       // scales 4-7
  v[2] = u[1] & six;                                        // mins 0-3
  v[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);  // mins 4-7
  std::memcpy(out, v, 16);
}

inline void k_scales(Kind kind, const uint8_t* blk, KScales& s) {
  if (kind == kQ4K) {
    uint8_t sm[16];
    q4k_unpack_scales(blk + 4, sm);
    const float d = half_at(blk), dmin = half_at(blk + 2);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sm));
    _mm256_storeu_ps(s.d, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
    _mm256_storeu_ps(s.m, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(dmin), mn)));
#else
    for (int t = 0; t < 8; ++t) {
      s.d[t] = d * static_cast<float>(sm[t]);
      s.m[t] = -(dmin * static_cast<float>(sm[8 + t]));
    }
#endif
  } else {
    const float d = half_at(blk + 208);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    _mm256_storeu_ps(s.d, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
    _mm256_storeu_ps(s.d + 8,
                     _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))));
#else
    for (int i = 0; i < 16; ++i) s.d[i] = d * static_cast<float>(static_cast<int8_t>(blk[192 + i]));
#endif
    for (int t = 0; t < 8; ++t) s.m[t] = 0.f;
  }
}

// Run t of a K-quant super-block as integers q[32]: w[i] = s.d[2t + i / 16] * q[i] + s.m[t].
inline void k_run(Kind kind, const uint8_t* blk, int t, int8_t* q) {
  if (kind == kQ4K) {
    const uint8_t* qs = blk + 16 + (t >> 1) * 32;
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(t & 1 ? qs[i] >> 4 : qs[i] & 15);
  } else {
    const int h = t >> 2, i4 = t & 3;
    const uint8_t* ql = blk + 64 * h + (i4 & 1) * 32;
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int i = 0; i < 32; ++i)
      q[i] = static_cast<int8_t>((((i4 >> 1) ? ql[i] >> 4 : ql[i] & 15) | (((qh[i] >> (2 * i4)) & 3) << 4)) - 32);
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Runs 2p and 2p + 1 of a K-quant super-block as 32 bytes each (unsigned 0..15 for Q4_K, signed
// -32..31 for Q6_K); P a compile-time constant, so the shifts are immediates.
template <int KIND, int P>
inline void k_pair_bytes(const uint8_t* blk, __m256i& a, __m256i& b) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (KIND == kQ4K) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + P * 32));
    a = _mm256_and_si256(raw, low);
    b = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  } else {  // runs 4h + i4: i4 = 0, 1 take ql's two halves' low nibbles, 2, 3 their high ones
    constexpr int h = P >> 1, hi_nibble = P & 1;
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    const __m256i l0 = _mm256_and_si256(hi_nibble ? _mm256_srli_epi16(ql0, 4) : ql0, low);
    const __m256i l1 = _mm256_and_si256(hi_nibble ? _mm256_srli_epi16(ql1, 4) : ql1, low);
    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * hi_nibble), three);
    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * hi_nibble + 2), three);
    a = _mm256_sub_epi8(_mm256_or_si256(l0, _mm256_slli_epi16(h0, 4)), bias);
    b = _mm256_sub_epi8(_mm256_or_si256(l1, _mm256_slli_epi16(h1, 4)), bias);
  }
}

// The columns after a tile's follow it in memory: they are requested ~4 KB ahead at the tile's
// pace (its rows are a few hundred bytes each, too short for the hardware prefetcher to find).
// touch(b) as the tile reaches block b.
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

// A tile's NC columns: where each one's blocks start, and the prefetcher of the columns after them.
template <int NC>
struct TileCols {
  const uint8_t* col[NC];
  Ahead ahead;

  TileCols(const Layout& l, const uint8_t* w, int64_t n) : ahead(l, w, n, NC) {
    for (int c = 0; c < NC; ++c) col[c] = w + (n + c) * l.groups * l.bytes;
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
    else if (l.kind == kQ40) tile(R{}, C{}, std::integral_constant<int, kQ40>{}, r0, n);
    else if (l.kind == kQ4K) tile(R{}, C{}, std::integral_constant<int, kQ4K>{}, r0, n);
    else tile(R{}, C{}, std::integral_constant<int, kQ6K>{}, r0, n);
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
