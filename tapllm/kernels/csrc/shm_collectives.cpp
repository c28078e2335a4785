// All-reduce and all-gather among the tensor-parallel ranks of one machine through a shared memory
// region (tapllm/parallel/shm.py maps it in every rank). gloo's loopback TCP costs 0.3-0.8 ms a call;
// a step of a split model makes two calls per block, so on one machine the ranks meet in memory.
//
// The region: one 64-byte line per rank holding the last round it published, then two banks of one
// slot per rank. Round `seq` uses bank seq & 1: a rank copies its part into its slot, publishes seq
// (release) and waits until every rank has published it (acquire). A rank can start round seq + 2,
// which writes the same bank, only after every rank published seq + 1, i.e. finished reading seq.
// Every rank sums the slots in rank order, so every rank's result is the same to the bit.
#include <ATen/ATen.h>
#include <sched.h>

#include <chrono>
#include <cstring>

#include "checks.h"
#include "kernels.h"

namespace tapllm {
namespace {

constexpr int64_t kLine = 64;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Region {
  uint8_t* base;
  int64_t size;
  int64_t slot_bytes;

  int64_t* flag(int64_t rank) const { return reinterpret_cast<int64_t*>(base + rank * kLine); }
  uint8_t* slot(int64_t seq, int64_t rank) const {
    return base + size * kLine + ((seq & 1) * size + rank) * slot_bytes;
  }
};

Region region_of(const at::Tensor& region, int64_t rank, int64_t size) {
  TORCH_CHECK(region.scalar_type() == at::kByte && region.dim() == 1 && region.is_contiguous(),
              "region must be a contiguous uint8 vector");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "rank ", rank, " is not one of ", size, " ranks");
  int64_t header = size * kLine;
  TORCH_CHECK(region.numel() > header + 2 * size * kLine, "region of ", region.numel(), " bytes is too small");
  int64_t slot = ((region.numel() - header) / (2 * size)) & ~(kLine - 1);
  return {region.data_ptr<uint8_t>(), size, slot};
}

// Wait up to `wait_s` for every rank to publish round `seq`; false: someone has not yet.
bool meet(const Region& r, int64_t rank, int64_t seq, double wait_s) {
  auto start = std::chrono::steady_clock::now();
  for (int64_t other = 0; other < r.size; ++other) {
    int64_t spins = 0;
    while (__atomic_load_n(r.flag(other), __ATOMIC_ACQUIRE) < seq) {
      if (++spins < 4096) {
        relax();
        continue;
      }
      sched_yield();  // more ranks than free cores: let the one we wait for run
      if ((spins & 127) == 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > wait_s) {
        return false;
      }
    }
  }
  return true;
}

void check_part(const at::Tensor& x, const Region& r) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(x.nbytes() <= static_cast<size_t>(r.slot_bytes), "x has ", x.nbytes(), " bytes, a slot ",
              r.slot_bytes);
}

}  // namespace

void shm_publish(const at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t size, int64_t seq) {
  Region r = region_of(region, rank, size);
  check_part(x, r);
  std::memcpy(r.slot(seq, rank), x.data_ptr(), x.nbytes());
  __atomic_store_n(r.flag(rank), seq, __ATOMIC_RELEASE);
}

bool shm_finish_all_reduce(at::Tensor x, const at::Tensor& region, int64_t rank, int64_t size, int64_t seq,
                           double wait_s) {
  Region r = region_of(region, rank, size);
  check_part(x, r);
  if (!meet(r, rank, seq, wait_s)) return false;
  int64_t n = x.numel();
  TAPLLM_DISPATCH(x.scalar_type(), "shm_all_reduce", [&] {
    scalar_t* out = x.data_ptr<scalar_t>();
    const scalar_t* first = reinterpret_cast<const scalar_t*>(r.slot(seq, 0));
    if constexpr (std::is_same_v<scalar_t, float>) {
      std::memcpy(out, first, n * sizeof(float));
      for (int64_t k = 1; k < size; ++k) {
        const float* part = reinterpret_cast<const float*>(r.slot(seq, k));
        for (int64_t i = 0; i < n; ++i) out[i] += part[i];
      }
    } else {  // 16-bit types: the sum in float32, rounded once
      for (int64_t i = 0; i < n; ++i) {
        float acc = static_cast<float>(first[i]);
        for (int64_t k = 1; k < size; ++k) acc += static_cast<float>(reinterpret_cast<const scalar_t*>(r.slot(seq, k))[i]);
        out[i] = static_cast<scalar_t>(acc);
      }
    }
  });
  return true;
}

bool shm_all_reduce(at::Tensor x, const at::Tensor& region, int64_t rank, int64_t size, int64_t seq, double wait_s) {
  shm_publish(x, region, rank, size, seq);
  return shm_finish_all_reduce(x, region, rank, size, seq, wait_s);
}

bool shm_all_gather(const at::Tensor& x, at::Tensor out, int64_t offset, const at::Tensor& region, int64_t rank,
                    int64_t size, int64_t seq, double wait_s) {
  Region r = region_of(region, rank, size);
  check_part(x, r);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == size && out.scalar_type() == x.scalar_type(),
              "out must be a contiguous [ranks, n] tensor of x's dtype");
  TORCH_CHECK(offset >= 0 && offset + x.numel() <= out.size(1), "offset ", offset, " + ", x.numel(),
              " elements is past out's ", out.size(1));
  shm_publish(x, region, rank, size, seq);
  if (!meet(r, rank, seq, wait_s)) return false;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  int64_t row = out.size(1) * out.element_size();
  for (int64_t k = 0; k < size; ++k) {
    std::memcpy(dst + k * row + offset * out.element_size(), r.slot(seq, k), x.nbytes());
  }
  return true;
}

}  // namespace tapllm
