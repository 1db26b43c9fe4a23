// Decode attention on a CPU, called from the jitted step through XLA's FFI
// (jpaged/kernels/ragged_attention.py): the XLA path's list of single-token work items, each
// a (page, token) pair, folded into every token's softmax stats (running max, sum of exp,
// sum of p * v) as `_walk` does, but reading each page where it lies in the pool, a key
// and a value row at a time, instead of gathering chunks of padded pages through memory.
//
// float32 pools only; head_dim a multiple of the machine's vector width.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 16;  // the most query heads a KV head may serve here
constexpr int64_t kBlock = 64;  // the largest page (tokens)
constexpr float kMask = -0.7f * 3.4028234663852886e38f;  // jpaged.kernels.common.MASK_VALUE

using jpaged::F, jpaged::kWidth, jpaged::Load, jpaged::Parallel, jpaged::Store;

struct Problem {
  const float* q;          // [T, Hkv, G, D]
  const float* k;          // [blocks, Hkv, bs, D]
  const float* v;          // [blocks, Hkv, bs, D]
  const int32_t* work;     // [3, P]: (block, token, first key position) per item
  const int32_t* positions;  // [T]
  int64_t width, live;  // the list's items, and how many at its head are live
  int64_t tokens, heads, group, block_size, dim, window;
  float scale, cap;
  float *m, *denom, *acc;  // [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
};

// Token t's KV head h: every live item of t, in the list's order.
void Head(const Problem& p, int64_t t, int64_t h) {
  const int64_t G = p.group, D = p.dim, bs = p.block_size, P = p.width;
  const int64_t pos = p.positions[t];
  const float* q = p.q + (t * p.heads + h) * G * D;
  float m[kGroup], denom[kGroup], s[kGroup * kBlock];
  std::vector<float> acc(G * D, 0.0f);
  std::fill(m, m + G, kMask);
  std::fill(denom, denom + G, 0.0f);
  for (int64_t i = 0; i < p.live; ++i) {
    if (p.work[P + i] != t) continue;
    const int64_t block = p.work[i], key0 = p.work[2 * P + i];
    const float* keys = p.k + (block * p.heads + h) * bs * D;
    const float* values = p.v + (block * p.heads + h) * bs * D;
    // the page's scores, a row of bs keys per query head (hidden keys at the mask value)
    for (int64_t j = 0; j < bs; ++j) {
      const int64_t key = key0 + j;
      const bool seen = key <= pos && key > pos - p.window;
      const float* kj = keys + j * D;
      for (int64_t g = 0; g < G; ++g) {
        if (!seen) {
          s[g * kBlock + j] = kMask;
          continue;
        }
        F dot = {};
        for (int64_t d = 0; d < D; d += kWidth) dot += Load(q + g * D + d) * Load(kj + d);
        float sum = 0;
        for (int64_t l = 0; l < kWidth; ++l) sum += dot[l];
        sum *= p.scale;
        s[g * kBlock + j] = p.cap > 0 ? p.cap * std::tanh(sum / p.cap) : sum;
      }
    }
    for (int64_t g = 0; g < G; ++g) {  // folded into the running stats, as `_walk` does
      const float* sg = s + g * kBlock;
      const float m_new = std::max(m[g], *std::max_element(sg, sg + bs));
      const float correction = std::exp(m[g] - m_new);
      float* a = acc.data() + g * D;
      for (int64_t d = 0; d < D; d += kWidth) Store(a + d, correction * Load(a + d));
      float sum = 0;
      for (int64_t j = 0; j < bs; ++j) {
        if (sg[j] == kMask) continue;
        const float weight = std::exp(sg[j] - m_new);
        sum += weight;
        const float* vj = values + j * D;
        for (int64_t d = 0; d < D; d += kWidth) Store(a + d, Load(a + d) + weight * Load(vj + d));
      }
      denom[g] = correction * denom[g] + sum;
      m[g] = m_new;
    }
  }
  const int64_t at = (t * p.heads + h) * G;
  std::copy(m, m + G, p.m + at);
  std::copy(denom, denom + G, p.denom + at);
  std::copy(acc.begin(), acc.end(), p.acc + at * D);
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> work,
                  ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> positions,
                  ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> m,
                  ffi::ResultBuffer<ffi::F32> denom, ffi::ResultBuffer<ffi::F32> acc,
                  float scale, float cap) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t tokens = qd[0], heads = qd[1], group = qd[2], dim = qd[3];
  const int64_t block_size = kd[kd.size() - 2];
  if (dim % kWidth || group > kGroup || block_size > kBlock || kd[kd.size() - 1] != dim ||
      kd[kd.size() - 3] != heads) {
    return ffi::Error::InvalidArgument("attention: unsupported shape");
  }
  const int64_t width = work.dimensions()[1];
  const Problem p{q.typed_data(), k.typed_data(), v.typed_data(), work.typed_data(),
                  positions.typed_data(), width,
                  std::min<int64_t>(count.typed_data()[0], width), tokens, heads, group,
                  block_size, dim, window.typed_data()[0], scale, cap,
                  m->typed_data(), denom->typed_data(), acc->typed_data()};
  Parallel(pool, tokens * heads, [&p](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) Head(p, u / p.heads, u % p.heads);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_attend_single, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // work
                                  .Arg<ffi::Buffer<ffi::S32>>()  // count
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()  // running max
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum of exp
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum of p * v
                                  .Attr<float>("scale")
                                  .Attr<float>("cap"));
