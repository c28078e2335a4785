// The prefill attention task of bfloat16 rows with AMX tiles: Q.K^T and P.V as tile products
// (tdpbf16ps: a 16 x 32 bfloat16 tile times a 32 x 16 one into 16 x 16 float32 sums), the online
// softmax in AVX512 over the stored scores. Only the AVX512 build compiles it; it runs where
// amx_supported() (below) says the CPU and the OS let this process use tiles.
//
// Lanes run over 16 query positions of one head, as in the AVX512 tasks (prefill_attention.h's row
// vectors and online softmax, unchanged); the tiles hold the transposed products:
//  - S^T[key][rows] = K Q^T: A is 16 cache rows of keys (32 dimensions), B the queries' dimension
//    pairs over the 16 rows (qt[e][rows], the AVX512-BF16 task's layout);
//  - O^T[dim][rows] += V^T P^T: A is 16 dimensions of V^T (32 keys), B the probabilities' key
//    pairs over the rows (pp[jp][rows], as softmax_bf16 writes them).
// K, V^T and Q^T are laid out once per key tile (K, V^T) or task (Q^T) and shared by every row
// vector of the task. Scores, softmax and sums are float32; the probabilities are rounded to
// bfloat16 before P.V, as PyTorch's bf16 attention (and the AVX512-BF16 task) rounds them. Key tiles
// start where first_tile says, so a row meets the same tiles in any chunk, and a row's sums come
// from its own scores alone: its result does not depend on which rows share its tiles.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "prefill_attention.h"
#include "vec_math.h"

// A compiler without AMX intrinsics (GCC before 11) builds the forwarding stubs at the end instead.
#if defined(CPU_CAPABILITY_AVX512) && __has_include(<amxtileintrin.h>)
#define TAPLLM_AMX_BUILD 1
#endif

#if defined(TAPLLM_AMX_BUILD)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TAPLLM_TARGET_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif

namespace tapllm {

bool amx_supported() {
#if defined(TAPLLM_AMX_BUILD)
  static const bool ok = [] {
    const char* env = std::getenv("TAPLLM_AMX");
    if ((env != nullptr && std::string(env) == "0") || !bf16_dot_supported()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    // Linux hands out the tile data state (XTILEDATA, feature 18) to a process that asks first;
    // a tile instruction before that faults. The permission is the whole process's.
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

#if defined(TAPLLM_AMX_BUILD)
namespace prefill {
namespace {

static_assert(KT == 64 && W == 16, "a key tile is four blocks of 16 keys; a row vector fills a tile's 16 lanes");

// Every tile 16 rows of 64 bytes: sums of 16 float32, or 32 bfloat16 (16 pairs) of A or B. A static
// object: GCC treats ldtilecfg as reading only the palette byte and drops stores to a local config.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
const TileConfig kTileConfig;

// s[key][rows] = S^T for the tile's 64 keys: tiles 0-3 one block of 16 keys each, tile 4 the rows'
// chunk of 16 dimension pairs, tiles 6 and 7 the key blocks' rows in turn.
TAPLLM_TARGET_AMX
inline void tile_scores(const uint32_t* qt, const uint16_t* kt, int64_t d, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = d * 2;
  for (int64_t dk = 0; dk < d / 32; ++dk) {
    const uint16_t* k = kt + dk * 32;
    _tile_loadd(4, qt + dk * 256, 64);
    _tile_loadd(6, k, stride);
    _tile_dpbf16ps(0, 6, 4);
    _tile_loadd(7, k + 16 * d, stride);
    _tile_dpbf16ps(1, 7, 4);
    _tile_loadd(6, k + 32 * d, stride);
    _tile_dpbf16ps(2, 6, 4);
    _tile_loadd(7, k + 48 * d, stride);
    _tile_dpbf16ps(3, 7, 4);
  }
  _tile_stored(0, s, 64);
  _tile_stored(1, s + 256, 64);
  _tile_stored(2, s + 512, 64);
  _tile_stored(3, s + 768, 64);
}

// ot[i][rows] += V^T P^T for nb <= 4 blocks of 16 dimensions from i0 (ot already rescaled): tiles 0-3
// the sums, 4 and 5 the probabilities of keys 0-31 and 32-63, 6 and 7 V^T's rows in turn.
TAPLLM_TARGET_AMX
inline void tile_values(const uint32_t* pp, const uint32_t* vtt, int64_t i0, int nb, float* ot) {
  float* o = ot + i0 * 256;  // ot[e][rows]: a block of 16 dimensions is 256 floats
  const uint32_t* v = vtt + i0 * 16 * (KT / 2);  // row e: KT / 2 key pairs
  constexpr int64_t stride = KT * 2;
  _tile_loadd(4, pp, 64);
  _tile_loadd(5, pp + 256, 64);
// Dimension block T (a tile number: the instructions take it as a literal) against both key halves.
#define TAPLLM_VALUE_BLOCK(T)                   \
  do {                                          \
    _tile_loadd(T, o + (T) * 256, 64);          \
    _tile_loadd(6, v + (T) * 512, stride);      \
    _tile_dpbf16ps(T, 6, 4);                    \
    _tile_loadd(7, v + (T) * 512 + 16, stride); \
    _tile_dpbf16ps(T, 7, 5);                    \
  } while (0)
  TAPLLM_VALUE_BLOCK(0);
  if (nb > 1) TAPLLM_VALUE_BLOCK(1);
  if (nb > 2) TAPLLM_VALUE_BLOCK(2);
  if (nb > 3) TAPLLM_VALUE_BLOCK(3);
#undef TAPLLM_VALUE_BLOCK
  _tile_stored(0, o, 64);
  if (nb > 1) _tile_stored(1, o + 256, 64);
  if (nb > 2) _tile_stored(2, o + 512, 64);
  if (nb > 3) _tile_stored(3, o + 768, 64);
}

// The key tile's A operands: kt (the 64 keys' cache rows) and vtt (V^T as key pairs: row e holds
// (V[2jp][e], V[2jp + 1][e]) for jp < 32); keys past nk are zeros.
TAPLLM_TARGET_AMX
void key_tile(const uint16_t* kh, const uint16_t* vh, const int64_t* table, int64_t block_size, int64_t k0,
              int64_t nk, int64_t d, uint16_t* kt, uint32_t* vp, uint32_t* vtt) {
  const uint16_t* vrows[KT];
  for (int64_t j = 0; j < KT; ++j) {
    if (j < nk) {
      const int64_t p = k0 + j;
      const int64_t slot = paged_slot(table, p, block_size);
      std::memcpy(kt + j * d, kh + slot * d, d * 2);
      vrows[j] = vh + slot * d;
    } else {
      std::memset(kt + j * d, 0, d * 2);
      vrows[j] = nullptr;
    }
  }
  // value pairs vp[jp][e], then vtt = vp^T
  for (int64_t jp = 0; jp < KT / 2; ++jp) pair_value_rows(vrows[2 * jp], vrows[2 * jp + 1], vp + jp * d, d);
  for (int64_t jb = 0; jb < KT / 2; jb += 16) {
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(vp + (jb + i) * d + e0));
      transpose16(r);  // r[e] lane i: pair jb + i of dimension e0 + e
      for (int e = 0; e < 16; ++e) _mm512_storeu_ps(reinterpret_cast<float*>(vtt + (e0 + e) * (KT / 2) + jb), r[e]);
    }
  }
}

}  // namespace

TAPLLM_TARGET_AMX
void amx_task(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out, const int64_t* table,
              int64_t qstart, const Rows& rows, int64_t heads, int64_t hk, int64_t d, int64_t block_size,
              int64_t q_row, int64_t q_head, float scale, int64_t window, float softcap, Scratch& b,
              std::vector<uint32_t>& qt, std::vector<uint32_t>& kt, std::vector<uint32_t>& vt) {
  const int64_t group = rows.group, nrv = (rows.n + W - 1) / W * group, dh = d / 2;
  qt.assign(nrv * dh * W, 0u);
  kt.resize(KT * dh);
  vt.resize(2 * KT / 2 * d);  // value pairs, then their transpose
  uint32_t* vp = vt.data();
  uint32_t* vtt = vt.data() + KT / 2 * d;
  b.ot.assign(nrv * d * W, 0.f);
  b.m.assign(nrv * W, -std::numeric_limits<float>::infinity());
  b.l.assign(nrv * W, 0.f);
  b.s.resize(KT * W);
  b.pp.resize(KT / 2 * W);
  b.alpha.resize(W);
  for (int64_t rv = 0; rv < nrv; ++rv)  // pairs of bfloat16 moved as float32 bits
    rows_to_lanes(reinterpret_cast<const float*>(q + (qstart + rows.first + rv / group * W) * q_row +
                                                 (hk * group + rv % group) * q_head),
                  q_row / 2, rows.count(rv), dh, reinterpret_cast<float*>(qt.data()) + rv * dh * W);
  const int64_t last_pos = rows.ctx + rows.first + rows.n - 1;
  const int64_t first_key = first_tile(rows.ctx + rows.first, window);
  TileRows tr;
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += KT) {
    const int64_t nk = std::min(KT, last_pos + 1 - k0);
    key_tile(kh, vh, table, block_size, k0, nk, d, reinterpret_cast<uint16_t*>(kt.data()), vp, vtt);
    for (int64_t rv = 0; rv < nrv; ++rv) {
      int64_t js, je;
      tile_rows(tr, rows, rv, 1, k0, nk, window, scale, softcap, b.m.data(), js, je);
      if (je <= js) continue;
      float* s = b.s.data();
      tile_scores(qt.data() + rv * dh * W, reinterpret_cast<const uint16_t*>(kt.data()), d, s);
      Vec mx = Vec::loadu(tr.mx[0]);
      for (int64_t j = js; j < je; ++j) {
        const Vec x = score(Vec::loadu(s + j * W), tr, 0, j);
        x.store(s + j * W);
        mx = at::vec::maximum(mx, x);
      }
      mx.store(tr.mx[0]);
      uint32_t* pp = b.pp.data();
      if (tr.masked) {
        softmax_bf16<true>(s, pp, 1, rv, tr, js, je, b.m.data(), b.l.data(), b.alpha.data());
      } else {
        softmax_bf16<false>(s, pp, 1, rv, tr, js, je, b.m.data(), b.l.data(), b.alpha.data());
      }
      std::fill(pp, pp + js / 2 * W, 0u);  // keys outside [js, je) add nothing
      std::fill(pp + je / 2 * W, pp + KT / 2 * W, 0u);
      float* ot = b.ot.data() + rv * d * W;
      const Vec alpha = Vec::loadu(b.alpha.data());
      for (int64_t e = 0; e < d; ++e) (Vec::loadu(ot + e * W) * alpha).store(ot + e * W);
      for (int64_t i0 = 0; i0 < d / 16; i0 += 4)
        tile_values(pp, vtt, i0, static_cast<int>(std::min<int64_t>(4, d / 16 - i0)), ot);
    }
  }
  for (int64_t rv = 0; rv < nrv; ++rv)
    lanes_to_rows<at::BFloat16>(
        b.ot.data() + rv * d * W, b.l.data() + rv * W, rows.count(rv), d,
        reinterpret_cast<at::BFloat16*>(out) + ((qstart + rows.first + rv / group * W) * heads + hk * group + rv % group) * d,
        heads * d);
}

TAPLLM_TARGET_AMX
void amx_begin() {
  _tile_loadconfig(&kTileConfig);
}

TAPLLM_TARGET_AMX
void amx_end() {
  _tile_release();
}

}  // namespace prefill
#elif defined(CPU_CAPABILITY_AVX512)
namespace prefill {  // never called: amx_supported() is false in this build

void amx_task(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out, const int64_t* table,
              int64_t qstart, const Rows& rows, int64_t heads, int64_t hk, int64_t d, int64_t block_size,
              int64_t q_row, int64_t q_head, float scale, int64_t window, float softcap, Scratch& b,
              std::vector<uint32_t>& qt, std::vector<uint32_t>& kt, std::vector<uint32_t>& vt) {
  bf16_dot_task(q, kh, vh, out, table, qstart, rows, heads, hk, d, block_size, q_row, q_head, scale, window, softcap,
                b, qt, kt, vt);
}
void amx_begin() {}
void amx_end() {}

}  // namespace prefill
#endif

}  // namespace tapllm
