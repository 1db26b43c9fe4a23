// Quantized matmuls for a few tokens on a CPU, called from the jitted step through XLA's FFI
// (models/qdot.py builds and registers them). XLA:CPU runs the step's small dots on one
// thread and dequantizes through memory; these read each code once, dequantize in registers
// and split the output columns over XLA's intra-op threads.
//
// A weight is `value = code * scale + offset`, one scale (and offset) per sub-block of
// `block` values along the contraction axis (models/quant.py). Codes are int8, or uint8 two a
// byte ("packed": byte j of each 16 holds values j and j + 16 of a run of 32; symmetric ones
// centred on 8). The offsets' share of a dot is the sub-block's sum of x times the offset.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTokens = 16;  // the most tokens a call takes (models/qdot.py: TOKENS)

// Rows of codes r .. r + 3 (`stride` apart), columns [0, n), times their inputs (the codes as
// they are: a symmetric centre is taken off per sub-block), added into
// `acc` (`tokens` rows of `n`). `x` holds row r's inputs, a token's each, then the next
// row's; packed, the high nibbles' inputs lie 16 rows after the low ones'.
constexpr int64_t kRows = 4, kLanes = 16;

template <typename T>
inline float Low(T q) {
  return static_cast<float>(sizeof(T) == 1 && static_cast<T>(-1) > 0 ? (q & 15) : q);
}

inline float High(uint8_t q) { return static_cast<float>(q >> 4); }

template <typename T>
inline void Add(const T* __restrict__ row, int64_t stride, int64_t n, const float* x,
                int64_t tokens, float* __restrict__ acc) {
  constexpr bool kPacked = static_cast<T>(-1) > 0;
  constexpr int64_t kValues = kPacked ? 2 * kRows : kRows;  // inputs a column takes
  const T *r0 = row, *r1 = row + stride, *r2 = row + 2 * stride, *r3 = row + 3 * stride;
  if (tokens == 1) {  // one pass over `acc`, the codes converted in registers
    const float x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    if constexpr (kPacked) {
      const float h0 = x[16], h1 = x[17], h2 = x[18], h3 = x[19];
      for (int64_t c = 0; c < n; ++c) {
        acc[c] += x0 * Low(r0[c]) + h0 * High(r0[c]) + x1 * Low(r1[c]) + h1 * High(r1[c]) +
                  x2 * Low(r2[c]) + h2 * High(r2[c]) + x3 * Low(r3[c]) + h3 * High(r3[c]);
      }
    } else {
      for (int64_t c = 0; c < n; ++c) {
        acc[c] += x0 * Low(r0[c]) + x1 * Low(r1[c]) + x2 * Low(r2[c]) + x3 * Low(r3[c]);
      }
    }
    return;
  }
  for (int64_t c0 = 0; c0 < n; c0 += kLanes) {  // each code converted once for every token
    float w[kValues][kLanes];
    for (int64_t k = 0; k < kRows; ++k) {
      const T* r = row + k * stride + c0;
      for (int64_t c = 0; c < kLanes; ++c) {
        w[k][c] = Low(r[c]);
        if constexpr (kPacked) w[kRows + k][c] = High(r[c]);
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {
      float xv[kValues];
      for (int64_t k = 0; k < kRows; ++k) {
        xv[k] = x[k * tokens + t];
        if constexpr (kPacked) xv[kRows + k] = x[(16 + k) * tokens + t];
      }
      float* a = acc + t * n + c0;
      for (int64_t c = 0; c < kLanes; ++c) {
        float sum = a[c];
        for (int64_t k = 0; k < kValues; ++k) sum += xv[k] * w[k][c];
        a[c] = sum;
      }
    }
  }
}

// Output columns [c0, c1) of y [tokens, out] = x [tokens, in] @ w [in, out], `xs` as
// [in, tokens]: codes [in (packed: in / 2), out], scale and
// offset [in / block, out] (offsets read when `affine`).
template <typename T>
void Columns(const float* xs, const T* q, const float* s, const float* off, float* ys,
             int64_t tokens, int64_t in, int64_t out, int64_t block, bool affine, int64_t c0,
             int64_t c1) {
  constexpr bool kPacked = static_cast<T>(-1) > 0;
  const int64_t n = c1 - c0, rows = kPacked ? block / 2 : block, blocks = in / block;
  const float center = kPacked && !affine ? 8.0f : 0.0f;
  std::vector<float> total(tokens * n, 0.0f), part(tokens * n);
  for (int64_t b = 0; b < blocks; ++b) {
    std::fill(part.begin(), part.end(), 0.0f);
    const float* xb = xs + b * block * tokens;
    for (int64_t r = 0; r < rows; r += kRows) {
      const int64_t v = kPacked ? 32 * (r / 16) + r % 16 : r;  // the (low) value row r holds
      Add(q + (b * rows + r) * out + c0, out, n, xb + v * tokens, tokens, part.data());
    }
    const float* sb = s + b * out + c0;
    const float* ob = off + b * out + c0;
    for (int64_t t = 0; t < tokens; ++t) {
      float* tt = &total[t * n];
      const float* pt = &part[t * n];
      if (!affine && center == 0) {
        for (int64_t c = 0; c < n; ++c) tt[c] += sb[c] * pt[c];
        continue;
      }
      // the codes' centre and the offsets: shares of the sub-block's sum of x
      float sum = 0;
      for (int64_t r = 0; r < block; ++r) sum += xb[r * tokens + t];
      const float shift = center * sum;
      for (int64_t c = 0; c < n; ++c) tt[c] += sb[c] * (pt[c] - shift);
      if (affine) {
        for (int64_t c = 0; c < n; ++c) tt[c] += sum * ob[c];
      }
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(ys + t * out + c0, &total[t * n], n * sizeof(float));
  }
}

// The columns split in `parts` ranges that whoever runs takes one at a time: the caller and
// tasks on XLA's intra-op pool. The caller waits only for ranges another thread has taken
// (so a task the pool starts late, or never while busy, cannot hold it up).
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

template <typename T>
ffi::Error Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
               ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
               ffi::ResultBuffer<ffi::F32> y, bool affine) {
  constexpr bool kPacked = static_cast<T>(-1) > 0;
  const int64_t tokens = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t out = codes.dimensions()[1], blocks = scale.dimensions()[0];
  const int64_t block = in / blocks, rows = kPacked ? block / 2 : block;
  if (tokens > kTokens || out % kLanes || in % blocks || rows % kRows ||
      (kPacked && block % 32)) {
    return ffi::Error::InvalidArgument("qdot: unsupported shape");
  }
  // x transposed, [in, tokens]: the inputs a row of codes takes side by side (and kTokens
  // zeros after: GCC vectorised an earlier loop over the tokens to read ahead of them)
  auto xs = std::make_shared<std::vector<float>>(in * tokens + kTokens, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < in; ++i) (*xs)[i * tokens + t] = x.typed_data()[t * in + i];
  }
  const T* q = reinterpret_cast<const T*>(codes.untyped_data());
  const float* s = scale.typed_data();
  const float* off = offset.typed_data();
  float* ys = y->typed_data();
  const int64_t units = out / kLanes;
  auto split = std::make_shared<Split>();
  split->parts = std::max<int64_t>(1, std::min(units, pool.num_threads()));
  const int64_t parts = split->parts;
  split->run = [=](int64_t i) {
    Columns(xs->data(), q, s, off, ys, tokens, in, out, block, affine, units * i / parts * kLanes,
            units * (i + 1) / parts * kLanes);
  };
  for (int64_t i = 1; i < parts; ++i) pool.Schedule([split] { split->Work(); });
  split->Work();
  while (split->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

#define JPAGED_DOT(name, impl)                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,               \
                                ffi::Ffi::Bind()          \
                                    .Ctx<ffi::ThreadPool>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::AnyBuffer>()        \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<bool>("affine"));

JPAGED_DOT(jpaged_qdot_int8, Dot<int8_t>)
JPAGED_DOT(jpaged_qdot_packed, Dot<uint8_t>)
