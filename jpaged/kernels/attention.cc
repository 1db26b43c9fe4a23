// Attention on a CPU, called from the jitted step through XLA's FFI
// (jpaged/kernels/ragged_attention.py): the XLA path's two work lists folded into every
// token's softmax stats (running max, sum of exp, sum of p * v) as `_walk` does, but reading
// each page where it lies in the pool instead of gathering chunks of padded pages through
// memory. A decoding token's items (`Head`: a (page, token) item each) take a vector of keys
// at a time, each key's dot product summed across lanes in a tree (`LaneSums`); a prompt
// chunk's tiles (`Block`: a (page, tile of tokens) item each) hold their rows in vector
// lanes, so that one key element multiplies a vector of rows and the softmax runs down the
// lanes, as a matmul kernel would. Either way no page is transposed.
//
// float32 pools, or int8 ones with a float32 scale per token (4x fewer bytes from memory,
// where decoding is bound by them: a decoding token's codes are converted as they are read,
// the scales multiplying its scores and weights; a tile's page is dequantized into the
// thread's scratch first); head_dim a multiple of the machine's vector width, up to kDim.

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 16;  // the most query heads a KV head may serve here
constexpr int64_t kBlock = 64;  // the largest page (tokens)
constexpr int64_t kDim = 512;   // the largest head
constexpr float kMask = -0.7f * 3.4028234663852886e38f;  // jpaged.kernels.common.MASK_VALUE

// A block of a tile's rows (its tokens x a KV head's query heads): 32 of them, in 2 or 4
// vectors; `kPass` keys (or value columns) share a pass over them, for 8 sums in registers.
constexpr int64_t kRows = 32;
constexpr int64_t kRowVecs = kRows / jpaged::kWidth;
constexpr int64_t kPass = 8 / kRowVecs;
// Vector sums a decoding token's loops keep in registers at once (of 32 with AVX-512, 16
// with AVX2), shared among its query heads.
constexpr int64_t kSums = jpaged::kWidth == 16 ? 16 : 8;

using jpaged::F, jpaged::I32, jpaged::kWidth, jpaged::Lanes, jpaged::LaneSums, jpaged::Load,
    jpaged::Parallel, jpaged::Store, jpaged::Widen;

// A work list: (block, token, first key position) per item, the live ones at its head; a
// token's (a tile's) items lie together, as `plan` lays them out.
struct List {
  const int32_t* work;  // [3, width]
  int64_t width, live;
  int64_t block(int64_t i) const { return work[i]; }
  int64_t first(int64_t i) const { return work[width + i]; }
  int64_t key0(int64_t i) const { return work[2 * width + i]; }
};

struct Problem {
  const float* q;          // [T, Hkv, G, D]
  const void* k;           // [blocks, Hkv, bs, D]: float32, or int8 times ks
  const void* v;           // [blocks, Hkv, bs, D]: float32, or int8 times vs
  const float *ks, *vs;    // [blocks, Hkv, bs]: int8 pools' scales (else null)
  const int32_t* positions;  // [T]
  int64_t heads, group, block_size, dim, window;
  float scale, cap;
  float *m, *denom, *acc;  // [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
};

inline F Splat(float x) { return F{} + x; }

// e^x, x <= 0 (Cephes' expf: 2^n times a polynomial of the remainder), to ~1 ulp; below
// -87 it flushes to 2^-126-ish, so callers select what must be exactly zero.
inline F Exp(F x) {
  x = x < -87.0f ? Splat(-87.0f) : x;
  const I32 n = __builtin_convertvector(x * 1.44269504f - 0.5f, I32);  // round(x / ln 2)
  const F nf = __builtin_convertvector(n, F);
  const F r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  F y = Splat(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                        1.6666665459e-1f, 5.0000001201e-1f}) {
    y = y * r + c;
  }
  y = y * r * r + r + 1.0f;
  const I32 bits = (n + 127) << 23;
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

// Page `block`'s rows of KV head h as floats [bs][D]: a float pool's where they lie, an int8
// pool's (values times each token's scale) dequantized into `scratch`.
const float* Page(const Problem& p, const void* pool, const float* scales, int64_t block,
                  int64_t h, float* scratch) {
  const int64_t D = p.dim, at = (block * p.heads + h) * p.block_size;
  if (scales == nullptr) return static_cast<const float*>(pool) + at * D;
  const int8_t* codes = static_cast<const int8_t*>(pool) + at * D;
  for (int64_t j = 0; j < p.block_size; ++j) {
    for (int64_t d = 0; d < D; d += kWidth) {
      const F x = __builtin_convertvector(Widen(codes + j * D + d), F);
      Store(scratch + j * D + d, x * scales[at + j]);
    }
  }
  return scratch;
}

// Page `block` of KV head h asked of memory ahead of its use: pages lie anywhere in the
// pool, a few KB each, too short for the hardware prefetcher to run ahead of the reads.
// kAhead pages ahead: one page's work is shorter than memory's latency for its lines
// (48 decodes over 450 tokens: 2.5 ms a layer one page ahead, 2.1-2.2 four or eight).
constexpr int64_t kAhead = 4;
void Prefetch(const Problem& p, int64_t block, int64_t h) {
  const int64_t at = (block * p.heads + h) * p.block_size;
  const int64_t bytes = p.block_size * p.dim * (p.ks ? 1 : 4);
  for (const void* pool : {p.k, p.v}) {
    const char* page = static_cast<const char*>(pool) + at * p.dim * (p.ks ? 1 : 4);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(page + b);
  }
  if (p.ks) {
    for (const float* scales : {p.ks, p.vs}) __builtin_prefetch(scales + at);
  }
}

// Soft-capped scores (cap > 0; Gemma 2's): rare, so lane by lane.
inline F Cap(F x, float cap) {
  if (cap > 0) {
    for (int64_t l = 0; l < kWidth; ++l) x[l] = cap * std::tanh(x[l] / cap);
  }
  return x;
}

// Which of a vector of keys a query at `pos` sees: `back` = pos - key position.
inline I32 Seen(I32 back, int64_t window) {
  return (back >= 0) & (back < static_cast<int32_t>(std::min<int64_t>(window, INT32_MAX)));
}

// A vector of a page's keys (or values) as floats: a float pool's as they lie, an int8
// pool's codes converted (each token's scale multiplies its score, or its weight, instead).
inline F Elements(const float* p) { return Load(p); }
inline F Elements(const int8_t* p) { return __builtin_convertvector(Widen(p), F); }

// A vector of a page's per-token scales from token j0 (the last one repeated past `bs`).
inline F Scales(const float* scales, int64_t j0, int64_t bs) {
  if (j0 + kWidth <= bs) return Load(scales + j0);
  F x;
  for (int64_t l = 0; l < kWidth; ++l) x[l] = scales[std::min(j0 + l, bs - 1)];
  return x;
}

inline float MaxLanes(F v) {
  float top = v[0];
  for (int64_t l = 1; l < kWidth; ++l) top = std::max(top, v[l]);
  return top;
}

// The largest power of two <= n.
constexpr int64_t Floor2(int64_t n) { return n < 2 ? 1 : 2 * Floor2(n / 2); }

// A decoding token t's KV head h over its items [i0, i1), its G query heads together: each
// key (value) vector is read once and multiplied into all G heads' sums, kept in registers
// (about kSums of them). A vector of keys' scores at a time (each key's dot summed across
// lanes in a tree, `LaneSums`), their softmax, then the values weighted into G rows of D;
// the stats to `out_m`, `out_denom` [G] and `out_acc` [G, D]. T: the pool's element.
template <int64_t G, typename T>
void Head(const Problem& p, const List& list, int64_t i0, int64_t i1, int64_t t, int64_t h,
          float* out_m, float* out_denom, float* out_acc) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  constexpr int64_t kKeys = Floor2(std::clamp<int64_t>(kSums / G, 1, 4));  // keys a pass
  constexpr int64_t kVecs = Floor2(std::clamp<int64_t>(kSums / G, 1, 4));  // value vectors
  const int64_t D = p.dim, bs = p.block_size;
  const int32_t pos = p.positions[t];
  const float* q = p.q + (t * p.heads + h) * G * D;
  alignas(64) float s[G * kBlock];  // scores, then weights: G rows of kBlock
  alignas(64) float acc[G * kDim];
  float m[G], denom[G], correction[G];
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, kMask);
  std::fill(denom, denom + G, 0.0f);
  I32 lane;
  for (int64_t l = 0; l < kWidth; ++l) lane[l] = static_cast<int32_t>(l);
  for (int64_t i = i0; i < std::min(i0 + kAhead, i1); ++i) Prefetch(p, list.block(i), h);
  for (int64_t i = i0; i < i1; ++i) {
    if (i + kAhead < i1) Prefetch(p, list.block(i + kAhead), h);
    const int64_t at = (list.block(i) * p.heads + h) * bs;  // the page's first token
    const T* keys = static_cast<const T*>(p.k) + at * D;
    const T* values = static_cast<const T*>(p.v) + at * D;
    for (int64_t j0 = 0; j0 < bs; j0 += kWidth) {
      F dots[G][kWidth];
      for (int64_t u = 0; u < kWidth; u += kKeys) {
        const T* kj[kKeys];
        for (int64_t c = 0; c < kKeys; ++c) kj[c] = keys + std::min(j0 + u + c, bs - 1) * D;
        F dot[G][kKeys] = {};
        for (int64_t d = 0; d < D; d += kWidth) {
          F key[kKeys];
          for (int64_t c = 0; c < kKeys; ++c) key[c] = Elements(kj[c] + d);
          for (int64_t g = 0; g < G; ++g) {
            const F qd = Load(q + g * D + d);
            for (int64_t c = 0; c < kKeys; ++c) dot[g][c] += qd * key[c];
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t c = 0; c < kKeys; ++c) dots[g][u + c] = dot[g][c];
        }
      }
      const I32 j = static_cast<int32_t>(j0) + lane;  // the vector's keys in the page
      const I32 seen = Seen(pos - static_cast<int32_t>(list.key0(i)) - j, p.window) &
                       (j < static_cast<int32_t>(bs));
      const F scale = kInt8 ? Scales(p.ks + at, j0, bs) * p.scale : Splat(p.scale);
      for (int64_t g = 0; g < G; ++g) {
        const F x = Cap(LaneSums(dots[g]) * scale, p.cap);
        Store(s + g * kBlock + j0, seen ? x : Splat(kMask));
      }
    }
    for (int64_t g = 0; g < G; ++g) {  // folded into the running stats, as `_walk` does
      float* sg = s + g * kBlock;
      F top = Splat(m[g]);
      for (int64_t j0 = 0; j0 < bs; j0 += kWidth) top = top > Load(sg + j0) ? top : Load(sg + j0);
      const float m_new = MaxLanes(top);
      F total = {};
      for (int64_t j0 = 0; j0 < bs; j0 += kWidth) {
        const F x = Load(sg + j0);
        const F weight = x == kMask ? F{} : Exp(x - m_new);
        total += weight;
        Store(sg + j0, kInt8 ? weight * Scales(p.vs + at, j0, bs) : weight);
      }
      correction[g] = std::exp(m[g] - m_new);
      denom[g] = correction[g] * denom[g] + Lanes(total);
      m[g] = m_new;
    }
    const auto weigh = [&](auto vecs, int64_t d) {  // columns [d, d + vecs * kWidth)
      constexpr int64_t n = decltype(vecs)::value;
      F a[G][n];
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t c = 0; c < n; ++c) a[g][c] = correction[g] * Load(acc + g * D + d + c * kWidth);
      }
      for (int64_t j = 0; j < bs; ++j) {
        F value[n];
        for (int64_t c = 0; c < n; ++c) value[c] = Elements(values + j * D + d + c * kWidth);
        for (int64_t g = 0; g < G; ++g) {
          const F weight = Splat(s[g * kBlock + j]);
          for (int64_t c = 0; c < n; ++c) a[g][c] += weight * value[c];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t c = 0; c < n; ++c) Store(acc + g * D + d + c * kWidth, a[g][c]);
      }
    };
    int64_t d = 0;
    for (; d + kVecs * kWidth <= D; d += kVecs * kWidth) {
      weigh(std::integral_constant<int64_t, kVecs>{}, d);
    }
    for (; d < D; d += kWidth) weigh(std::integral_constant<int64_t, 1>{}, d);
  }
  std::copy(m, m + G, out_m);
  std::copy(denom, denom + G, out_denom);
  std::copy(acc, acc + G * D, out_acc);
}

using HeadFn = void (*)(const Problem&, const List&, int64_t, int64_t, int64_t, int64_t,
                        float*, float*, float*);

// Head for each group size 1..kGroup.
template <typename T, size_t... G>
constexpr std::array<HeadFn, sizeof...(G)> Heads(std::index_sequence<G...>) {
  return {&Head<static_cast<int64_t>(G) + 1, T>...};
}

// Rows [r0, r0 + kRows) of a tile (`own` tokens from `first`, row = token * G + query
// head) over its items [i0, i1) of the list, KV head h. Rows past the tile's tokens are
// zeros that see nothing. Queries [D][kRows], scores then weights [bs][kRows] and the
// weighted values [D][kRows] lie rows-in-lanes: every product is a key (or value) element
// broadcast times a vector of rows.
void Block(const Problem& p, const List& list, int64_t i0, int64_t i1, int64_t first,
           int64_t own, int64_t h, int64_t r0) {
  const int64_t G = p.group, D = p.dim, bs = p.block_size;
  std::vector<float> buf((2 * D + bs) * kRows + (p.ks ? 2 * bs * D : 0), 0.0f);
  float *qt = buf.data(), *acc = qt + D * kRows, *s = acc + D * kRows, *pages = s + bs * kRows;
  alignas(64) int32_t pos[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = r0 + r, t = first + row / G;
    pos[r] = row < own * G ? p.positions[t] : -1;  // key positions are >= 0
    if (pos[r] < 0) continue;
    const float* q = p.q + ((t * p.heads + h) * G + row % G) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = q[d] * p.scale;
  }
  F m[kRowVecs], denom[kRowVecs];
  I32 at[kRowVecs];
  for (int64_t v = 0; v < kRowVecs; ++v) {
    m[v] = Splat(kMask);
    denom[v] = F{};
    std::memcpy(&at[v], pos + v * kWidth, sizeof at[v]);
  }
  for (int64_t i = i0; i < std::min(i0 + kAhead, i1); ++i) Prefetch(p, list.block(i), h);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t key0 = list.key0(i);
    if (i + kAhead < i1) Prefetch(p, list.block(i + kAhead), h);
    const float* keys = Page(p, p.k, p.ks, list.block(i), h, pages);
    const float* values = Page(p, p.v, p.vs, list.block(i), h, pages + bs * D);
    for (int64_t j = 0; j < bs; j += kPass) {  // scores, masked
      F sum[kPass][kRowVecs] = {};
      const float* kj[kPass];
      for (int64_t u = 0; u < kPass; ++u) kj[u] = keys + std::min(j + u, bs - 1) * D;
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t v = 0; v < kRowVecs; ++v) {
          const F qv = Load(qt + d * kRows + v * kWidth);
          for (int64_t u = 0; u < kPass; ++u) sum[u][v] += kj[u][d] * qv;
        }
      }
      for (int64_t u = 0; u < kPass && j + u < bs; ++u) {
        const int32_t key = static_cast<int32_t>(key0 + j + u);
        for (int64_t v = 0; v < kRowVecs; ++v) {
          const F x = Cap(sum[u][v], p.cap);
          Store(s + (j + u) * kRows + v * kWidth, Seen(at[v] - key, p.window) ? x : Splat(kMask));
        }
      }
    }
    for (int64_t v = 0; v < kRowVecs; ++v) {  // folded into the running stats, lane-wise
      F m_new = m[v];
      for (int64_t j = 0; j < bs; ++j) {
        const F x = Load(s + j * kRows + v * kWidth);
        m_new = x > m_new ? x : m_new;
      }
      F total = {};
      for (int64_t j = 0; j < bs; ++j) {
        const F x = Load(s + j * kRows + v * kWidth);
        const F weight = x == kMask ? F{} : Exp(x - m_new);
        total += weight;
        Store(s + j * kRows + v * kWidth, weight);
      }
      const F correction = Exp(m[v] - m_new);
      denom[v] = correction * denom[v] + total;
      m[v] = m_new;
      for (int64_t d = 0; d < D; ++d) {
        float* a = acc + d * kRows + v * kWidth;
        Store(a, correction * Load(a));
      }
    }
    for (int64_t d = 0; d < D; d += kPass) {  // weighted values, kPass columns a pass
      F sum[kPass][kRowVecs];
      for (int64_t u = 0; u < kPass; ++u) {
        for (int64_t v = 0; v < kRowVecs; ++v) sum[u][v] = Load(acc + (d + u) * kRows + v * kWidth);
      }
      for (int64_t j = 0; j < bs; ++j) {
        const float* vj = values + j * D + d;
        for (int64_t v = 0; v < kRowVecs; ++v) {
          const F weight = Load(s + j * kRows + v * kWidth);
          for (int64_t u = 0; u < kPass; ++u) sum[u][v] += vj[u] * weight;
        }
      }
      for (int64_t u = 0; u < kPass; ++u) {
        for (int64_t v = 0; v < kRowVecs; ++v) Store(acc + (d + u) * kRows + v * kWidth, sum[u][v]);
      }
    }
  }
  alignas(64) float ms[kRows], denoms[kRows];
  for (int64_t v = 0; v < kRowVecs; ++v) {
    Store(ms + v * kWidth, m[v]);
    Store(denoms + v * kWidth, denom[v]);
  }
  for (int64_t r = 0; r < kRows && pos[r] >= 0; ++r) {
    const int64_t row = r0 + r;
    const int64_t at_row = ((first + row / G) * p.heads + h) * G + row % G;
    p.m[at_row] = ms[r];
    p.denom[at_row] = denoms[r];
    for (int64_t d = 0; d < D; ++d) p.acc[at_row * D + d] = acc[d * kRows + r];
  }
}

// One thread's piece of work: a run of a list's items (a decoding token's pages, or a
// tile's) for one KV head; a tile's in blocks of rows.
struct Unit {
  const List* list;
  int64_t i0, i1, first, own, h, r0;  // own, r0: a tile's tokens, and the block's first row
  bool tile;
  int64_t part;  // a split decoding token's: its stats' slot among the parts (else -1)
};

// A decoding token's pages split in parts when few tokens decode (one user: a KV head a
// thread, at most), each part's stats apart, merged after: at least this many units a thread.
constexpr int64_t kUnitsPerThread = 4;

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                  ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                  ffi::Buffer<ffi::S32> single,
                  ffi::Buffer<ffi::S32> tiled, ffi::Buffer<ffi::S32> counts,
                  ffi::Buffer<ffi::S32> seq_of, ffi::Buffer<ffi::S32> positions,
                  ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> m,
                  ffi::ResultBuffer<ffi::F32> denom, ffi::ResultBuffer<ffi::F32> acc,
                  float scale, float cap, int64_t tile) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t tokens = qd[0], heads = qd[1], group = qd[2], dim = qd[3];
  const int64_t block_size = kd[kd.size() - 2];
  int64_t blocks = 1;
  for (size_t i = 0; i + 3 < kd.size(); ++i) blocks *= kd[i];
  if (dim % kWidth || dim > kDim || group > kGroup || block_size > kBlock ||
      kd[kd.size() - 1] != dim || kd[kd.size() - 3] != heads) {
    return ffi::Error::InvalidArgument("attention: unsupported shape");
  }
  const bool int8 = k.element_type() == ffi::DataType::S8;
  const size_t tokens_stored = static_cast<size_t>(blocks * heads * block_size);
  if (v.element_type() != k.element_type() ||
      (!int8 && k.element_type() != ffi::DataType::F32) ||
      (int8 && (k_scale.element_count() != tokens_stored ||
                v_scale.element_count() != tokens_stored))) {
    return ffi::Error::InvalidArgument("attention: pools must be float32, or int8 with scales");
  }
  const Problem p{q.typed_data(), k.untyped_data(), v.untyped_data(),
                  int8 ? k_scale.typed_data() : nullptr, int8 ? v_scale.typed_data() : nullptr,
                  positions.typed_data(), heads, group, block_size, dim, window.typed_data()[0],
                  scale, cap, m->typed_data(), denom->typed_data(), acc->typed_data()};
  const int32_t* count = counts.typed_data();
  const List lists[2] = {
      {single.typed_data(), single.dimensions()[1],
       std::clamp<int64_t>(count[0], 0, single.dimensions()[1])},
      {tiled.typed_data(), tiled.dimensions()[1],
       std::clamp<int64_t>(count[1], 0, tiled.dimensions()[1])}};
  std::vector<Unit> units;
  std::vector<char> covered(tokens, 0);
  for (const List& list : lists) {
    const bool tiles = &list == &lists[1];
    for (int64_t i0 = 0, i1; i0 < list.live; i0 = i1) {
      const int64_t first = list.first(i0);
      for (i1 = i0; i1 < list.live && list.first(i1) == first; ++i1) {
        if (list.block(i1) < 0 || list.block(i1) >= blocks) {
          return ffi::Error::InvalidArgument("attention: a work item's block is out of the pool");
        }
      }
      if (first < 0 || first >= tokens || covered[first]) {
        return ffi::Error::InvalidArgument("attention: a token's items are not together");
      }
      const int32_t* seq = seq_of.typed_data();
      int64_t n = 1;  // the tile's tokens: up to `tile`, while in its sequence
      while (tiles && n < tile && first + n < tokens && seq[first + n] == seq[first]) ++n;
      std::fill(covered.begin() + first, covered.begin() + first + n, 1);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t r0 = 0; r0 < (tiles ? n * group : 1); r0 += kRows) {
          units.push_back({&list, i0, i1, first, n, h, r0, tiles, -1});
        }
      }
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {  // tokens with no items (padding) see nothing
    if (covered[t]) continue;
    std::fill(p.m + t * heads * group, p.m + (t + 1) * heads * group, kMask);
    std::fill(p.denom + t * heads * group, p.denom + (t + 1) * heads * group, 0.0f);
    std::fill(p.acc + t * heads * group * dim, p.acc + (t + 1) * heads * group * dim, 0.0f);
  }
  const int64_t threads = pool.num_threads();
  const int64_t decoding = std::count_if(units.begin(), units.end(), [](const Unit& u) {
    return !u.tile;
  });
  const int64_t split = decoding ? -(-kUnitsPerThread * threads / decoding) : 1;
  std::vector<Unit> whole;  // a split decoding unit: where its parts' stats merge
  int64_t parts = 0;
  if (split > 1) {
    std::vector<Unit> all;
    for (const Unit& u : units) {
      const int64_t pieces = std::min(split, u.i1 - u.i0);
      if (u.tile || pieces < 2) {
        all.push_back(u);
        continue;
      }
      whole.push_back(u);
      for (int64_t k = 0; k < pieces; ++k) {
        Unit piece = u;
        piece.i0 = u.i0 + (u.i1 - u.i0) * k / pieces;
        piece.i1 = u.i0 + (u.i1 - u.i0) * (k + 1) / pieces;
        piece.part = parts++;
        all.push_back(piece);
      }
      whole.back().part = parts;  // its parts end here
    }
    units = std::move(all);
  }
  std::vector<float> part_m(parts * group), part_denom(parts * group),
      part_acc(parts * group * dim);
  // dealt round-robin: thread i's range holds every threads-th unit from i (a prompt's
  // later tiles, a longer context's token, see more pages)
  const int64_t n = static_cast<int64_t>(units.size());
  std::vector<Unit> dealt;
  for (int64_t i = 0; i < threads; ++i) {
    for (int64_t u = i; u < n; u += threads) dealt.push_back(units[u]);
  }
  const HeadFn head = (int8 ? Heads<int8_t>(std::make_index_sequence<kGroup>())
                            : Heads<float>(std::make_index_sequence<kGroup>()))[group - 1];
  Parallel(pool, n, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const Unit& w = dealt[u];
      if (w.tile) {
        Block(p, *w.list, w.i0, w.i1, w.first, w.own, w.h, w.r0);
      } else if (w.part < 0) {
        const int64_t at = (w.first * heads + w.h) * group;
        head(p, *w.list, w.i0, w.i1, w.first, w.h, p.m + at, p.denom + at, p.acc + at * dim);
      } else {
        head(p, *w.list, w.i0, w.i1, w.first, w.h, &part_m[w.part * group],
             &part_denom[w.part * group], &part_acc[w.part * group * dim]);
      }
    }
  });
  for (int64_t w = 0, first_part = 0; w < static_cast<int64_t>(whole.size()); ++w) {
    const Unit& u = whole[w];  // its parts' stats, rescaled to their common max
    const int64_t at = (u.first * heads + u.h) * group;
    for (int64_t g = 0; g < group; ++g) {
      float top = kMask, sum = 0;
      for (int64_t k = first_part; k < u.part; ++k) top = std::max(top, part_m[k * group + g]);
      float* a = p.acc + (at + g) * dim;
      std::fill(a, a + dim, 0.0f);
      for (int64_t k = first_part; k < u.part; ++k) {
        const float weight = std::exp(part_m[k * group + g] - top);
        sum += weight * part_denom[k * group + g];
        const float* b = &part_acc[(k * group + g) * dim];
        for (int64_t d = 0; d < dim; ++d) a[d] += weight * b[d];
      }
      p.m[at + g] = top;
      p.denom[at + g] = sum;
    }
    first_part = u.part;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_attend, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k pool
                                  .Arg<ffi::AnyBuffer>()  // v pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales (int8 pools)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales (int8 pools)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // decode list
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tile list
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live items of each
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_of
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()  // running max
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum of exp
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum of p * v
                                  .Attr<float>("scale")
                                  .Attr<float>("cap")
                                  .Attr<int64_t>("tile"));
