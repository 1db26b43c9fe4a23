// What the CPU kernels (jpaged/models/qdot.cc, jpaged/kernels/attention.cc) share: GCC's vectors
// at the machine's widest, and work split over XLA's intra-op threads.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

// What this library was built for, for Python to ask rather than guess from the CPU it
// runs on (`jpaged.kernels.cpu.isa`): bit 0 AVX2, 1 AVX-512F, 2 VNNI (either encoding).
extern "C" int jpaged_isa() {
  return 0
#if defined(__AVX2__)
         | 1
#endif
#if defined(__AVX512F__)
         | 2
#endif
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
         | 4
#endif
      ;
}

namespace jpaged {

// float16 bits as a float (exact): F16C's conversion where there is one.
inline float Half(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero and subnormals: man * 2^-24
    const float f = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

#ifdef __AVX512F__
constexpr int64_t kWidth = 16;  // floats a vector register holds
#else
constexpr int64_t kWidth = 8;
#endif

typedef float F __attribute__((vector_size(4 * kWidth)));
typedef int32_t I32 __attribute__((vector_size(4 * kWidth)));

inline F Load(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, F v) { std::memcpy(p, &v, sizeof v); }

// A vector's worth of codes as int32 lanes (uint8 zero-extended, int8 sign-extended): one
// instruction with the load, where GCC's generic conversion takes a lane at a time.
template <typename T>
inline I32 Widen(const T* p) {
  constexpr bool kUnsigned = std::is_same_v<T, uint8_t>;
#if defined(__AVX512F__)
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kUnsigned) return (I32)_mm512_cvtepu8_epi32(c);
  return (I32)_mm512_cvtepi8_epi32(c);
#elif defined(__AVX2__)
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (kUnsigned) return (I32)_mm256_cvtepu8_epi32(c);
  return (I32)_mm256_cvtepi8_epi32(c);
#else
  typedef T Bytes __attribute__((vector_size(kWidth)));
  Bytes c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, I32);
#endif
}

// The sum of a vector's lanes.
inline float Lanes(F v) {
  float sum = 0;
  for (int64_t i = 0; i < kWidth; ++i) sum += v[i];
  return sum;
}

// Lane l of the result: the sum of v[l]'s lanes (kWidth vectors in, one out).
inline F LaneSums(const F* v) {
#if defined(__AVX2__)
  // hadd pairs neighbours within each 128-bit half: after two rounds a half holds 4 vectors'
  // sums of that half; the halves' sums then add up
  const auto eight = [](const __m256* w) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(w[0], w[1]), _mm256_hadd_ps(w[2], w[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(w[4], w[5]), _mm256_hadd_ps(w[6], w[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  };
#if defined(__AVX512F__)
  __m256 half[16];  // each vector's two 256-bit halves added
  for (int i = 0; i < 16; ++i) {
    const __m512 x = (__m512)v[i];
    half[i] = _mm256_add_ps(_mm512_castps512_ps256(x),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  const __m256 lo = eight(half), hi = eight(half + 8);
  return (F)_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                               _mm256_castps_pd(hi), 1);
#else
  __m256 w[8];
  for (int i = 0; i < 8; ++i) w[i] = (__m256)v[i];
  return (F)eight(w);
#endif
#else
  F out;
  for (int64_t l = 0; l < kWidth; ++l) {
    float sum = 0;
    for (int64_t e = 0; e < kWidth; ++e) sum += v[l][e];
    out[l] = sum;
  }
  return out;
#endif
}

// `units` split in as many ranges as XLA has intra-op threads, `run(u0, u1)` on each: whoever
// runs takes a range at a time, the caller and tasks on XLA's pool. The caller waits only
// for ranges another thread has taken (so a task the pool starts late, or never while busy,
// cannot hold it up), hence everything `run` reads may live on the caller's stack.
struct Split {
  std::atomic<int64_t> next{0}, done{0};
  int64_t parts = 0;
  std::function<void(int64_t)> run;
  void Work() {
    for (int64_t i; (i = next.fetch_add(1)) < parts;) {
      run(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void Parallel(xla::ffi::ThreadPool& pool, int64_t units,
                     const std::function<void(int64_t, int64_t)>& run) {
  auto split = std::make_shared<Split>();
  const int64_t parts = split->parts = std::max<int64_t>(1, std::min(units, pool.num_threads()));
  split->run = [&run, units, parts](int64_t i) {
    run(units * i / parts, units * (i + 1) / parts);
  };
  for (int64_t i = 1; i < parts; ++i) pool.Schedule([split] { split->Work(); });
  split->Work();
  while (split->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

}  // namespace jpaged
