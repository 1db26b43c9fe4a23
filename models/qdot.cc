// Quantized matmuls for a few tokens on a CPU, called from the jitted step through XLA's FFI
// (models/qdot.py builds and registers them). XLA:CPU runs the step's small dots on one
// thread and dequantizes through memory; these read each code once, dequantize in registers
// and split the output columns over XLA's intra-op threads.
//
// A weight is `value = code * scale + offset`, one scale (and offset) per sub-block of
// `block` values along the contraction axis (models/quant.py). Codes are int8, or uint8 two a
// byte ("packed": byte j of each 16 holds values j and j + 16 of a run of 32; symmetric ones
// centred on 8). A sub-block's dot is taken on the codes as they are, then scaled; the
// offsets' (and a symmetric centre's) share is the sub-block's sum of x times the offset.
//
// Written with GCC's vector extensions, the widest vectors the machine has, and intrinsics
// only where GCC's generic code is slow (widening bytes: it goes lane by lane there).

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"  // jpaged/kernels/cpu.h
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;   // output columns come in multiples of (models/qdot.py: TILE)
constexpr int64_t kChunk = 8;    // tokens whose sums stay in registers at once
constexpr int64_t kTileBytes = 128 << 10;  // codes of a tile of columns (in a core's L2)
using jpaged::F, jpaged::I32, jpaged::kWidth, jpaged::Load, jpaged::Parallel, jpaged::Store;

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

struct Problem {
  const float* x;       // [tokens, in]
  const float* sums;    // [tokens, in / block]: x's sum over each sub-block
  const void* codes;    // [rows, out]: rows = in (int8) or in / 2 (packed)
  const float* scale;   // [in / block, out]
  const float* offset;  // [in / block, out] (read when `affine`)
  float* total;         // [tokens, out]: y, summed into sub-block by sub-block
  int64_t tokens, in, out, block;
  bool affine;
};

// Sub-block b's share of y for tokens [t0, t0 + N), columns [c, c + G * kWidth): each of
// its rows of codes read once (G vectors of it), dotted with the tokens' inputs in registers,
// then scaled into `total`. Going column group by column group within a sub-block, not down
// all sub-blocks of a column group, reads the codes a row segment after another, which the
// prefetcher follows (the other order ran 1.5x slower).
template <typename T, int N, int G>
inline void Part(const Problem& p, int64_t b, int64_t t0, int64_t c) {
  constexpr bool kPacked = std::is_same_v<T, uint8_t>;
  const int64_t rows = kPacked ? p.block / 2 : p.block;
  const T* codes = static_cast<const T*>(p.codes) + b * rows * p.out + c;
  const float* x = p.x + t0 * p.in + b * p.block;
  F acc[N][G] = {};
  for (int64_t r = 0; r < rows; ++r) {
    // the (low) value row r holds; packed, its high value lies 16 after
    const int64_t v = kPacked ? 32 * (r / 16) + r % 16 : r;
    for (int g = 0; g < G; ++g) {
      // the next sub-block's row r: the prefetcher alone leaves a thread at ~2/3 of the
      // memory's speed here (a hint: past the last row it reads nothing and cannot fault)
      __builtin_prefetch(codes + (r + rows) * p.out + g * kWidth);
      const I32 q = Widen(codes + r * p.out + g * kWidth);
      const F lo = __builtin_convertvector(kPacked ? q & 15 : q, F);
      for (int t = 0; t < N; ++t) acc[t][g] += x[t * p.in + v] * lo;
      if constexpr (kPacked) {
        const F hi = __builtin_convertvector(q >> 4, F);
        for (int t = 0; t < N; ++t) acc[t][g] += x[t * p.in + v + 16] * hi;
      }
    }
  }
  const float center = kPacked && !p.affine ? 8.0f : 0.0f;
  const int64_t blocks = p.in / p.block;
  for (int g = 0; g < G; ++g) {
    const F s = Load(p.scale + b * p.out + c + g * kWidth);
    const F o = p.affine ? Load(p.offset + b * p.out + c + g * kWidth) : F{};
    for (int t = 0; t < N; ++t) {
      const float sum = p.sums[(t0 + t) * blocks + b];
      float* y = p.total + (t0 + t) * p.out + c + g * kWidth;
      Store(y, Load(y) + s * (acc[t][g] - center * sum) + sum * o);
    }
  }
}

// Columns [c0, c1) for tokens [t0, t0 + N), sub-block by sub-block: at one token four
// vectors of columns at once (four independent chains of sums), at two two, past that one.
template <typename T, int N>
void Tokens(const Problem& p, int64_t t0, int64_t c0, int64_t c1) {
  constexpr int G = N == 1 ? 4 : N == 2 ? 2 : 1;
  for (int64_t b = 0; b < p.in / p.block; ++b) {
    int64_t c = c0;
    for (; c + G * kWidth <= c1; c += G * kWidth) Part<T, N, G>(p, b, t0, c);
    for (; c < c1; c += kWidth) Part<T, N, 1>(p, b, t0, c);
  }
}

// `run(n, t0)` on the tokens in chunks of at most kChunk from t0: n the chunk's size as a
// compile-time constant (`decltype(n)::value`), the sums a chunk keeps in registers.
template <typename Run>
void Chunks(int64_t tokens, const Run& run) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kChunk) {
    switch (std::min(tokens - t0, kChunk)) {
      case 1: run(std::integral_constant<int, 1>{}, t0); break;
      case 2: run(std::integral_constant<int, 2>{}, t0); break;
      case 3: run(std::integral_constant<int, 3>{}, t0); break;
      case 4: run(std::integral_constant<int, 4>{}, t0); break;
      case 5: run(std::integral_constant<int, 5>{}, t0); break;
      case 6: run(std::integral_constant<int, 6>{}, t0); break;
      case 7: run(std::integral_constant<int, 7>{}, t0); break;
      default: run(std::integral_constant<int, 8>{}, t0); break;
    }
  }
}

// Columns [c0, c1). Past kChunk tokens, in tiles whose codes fit a core's L2 cache: each
// tile is read once from memory and again from the cache for every further chunk of tokens.
// Within one chunk, whole: the longer a row's run of codes, the better the prefetcher does.
template <typename T>
void Columns(const Problem& p, int64_t c0, int64_t c1) {
  for (int64_t t = 0; t < p.tokens; ++t) {
    std::fill(p.total + t * p.out + c0, p.total + t * p.out + c1, 0.0f);
  }
  const int64_t row_bytes = (std::is_same_v<T, uint8_t> ? p.in / 2 : p.in) * sizeof(T);
  const int64_t tile = p.tokens <= kChunk
                           ? c1 - c0
                           : std::max<int64_t>(kLanes, kTileBytes / row_bytes / kLanes * kLanes);
  for (int64_t c = c0; c < c1; c += tile) {
    const int64_t end = std::min(c + tile, c1);
    Chunks(p.tokens, [&](auto n, int64_t t0) { Tokens<T, decltype(n)::value>(p, t0, c, end); });
  }
}

// Scores y [tokens, rows] = x [tokens, in] @ w.T of a table w [rows, in] (a tied LM head:
// the embedding table), sub-blocks along `in`, so a row's codes lie side by side: each row
// is dotted a vector at a time with every token's inputs, scaled per sub-block into one
// vector a token, summed across lanes at the row's end.
struct Table {
  const float* x;       // [tokens, in]
  const float* sums;    // [tokens, in / block]
  const void* codes;    // [rows, in] (packed: [rows, in / 2])
  const float* scale;   // [rows, in / block]
  const float* offset;  // [rows, in / block] (read when `affine`)
  float* y;             // [tokens, rows]
  int64_t tokens, rows, in, block;
  bool affine;
};

inline float Lanes(F v) {
  float sum = 0;
  for (int64_t i = 0; i < kWidth; ++i) sum += v[i];
  return sum;
}

template <typename T, int N>
void TableRows(const Table& p, int64_t t0, int64_t r0, int64_t r1) {
  constexpr bool kPacked = std::is_same_v<T, uint8_t>;
  const int64_t blocks = p.in / p.block, held = kPacked ? p.in / 2 : p.in;
  const int64_t vectors = (kPacked ? p.block / 2 : p.block) / kWidth;  // a sub-block's
  const float center = kPacked && !p.affine ? 8.0f : 0.0f;
  const float* x = p.x + t0 * p.in;
  for (int64_t r = r0; r < r1; ++r) {
    const T* codes = static_cast<const T*>(p.codes) + r * held;
    __builtin_prefetch(codes + 4 * held);  // a few rows ahead (a row is ~one page or less)
    F acc[N] = {};
    float shift[N] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      F part[N] = {};
      for (int64_t k = 0; k < vectors; ++k) {
        // packed: byte j of a run of 32 values holds j and j + 16
        const I32 q = Widen(codes + b * (kPacked ? p.block / 2 : p.block) + k * kWidth);
        const F lo = __builtin_convertvector(kPacked ? q & 15 : q, F);
        const int64_t v = b * p.block + (kPacked ? 32 * (k * kWidth / 16) + k * kWidth % 16 : k * kWidth);
        for (int t = 0; t < N; ++t) part[t] += Load(x + t * p.in + v) * lo;
        if constexpr (kPacked) {
          const F hi = __builtin_convertvector(q >> 4, F);
          for (int t = 0; t < N; ++t) part[t] += Load(x + t * p.in + v + 16) * hi;
        }
      }
      const float s = p.scale[r * blocks + b];
      const float o = p.affine ? p.offset[r * blocks + b] : 0.0f;
      for (int t = 0; t < N; ++t) {
        acc[t] += s * part[t];
        shift[t] += (o - center * s) * p.sums[(t0 + t) * blocks + b];
      }
    }
    for (int t = 0; t < N; ++t) p.y[(t0 + t) * p.rows + r] = Lanes(acc[t]) + shift[t];
  }
}

template <typename T>
void TableColumns(const Table& p, int64_t r0, int64_t r1) {
  Chunks(p.tokens, [&](auto n, int64_t t0) { TableRows<T, decltype(n)::value>(p, t0, r0, r1); });
}

// Each token's sum of x over each sub-block: the offsets' (and a symmetric centre's) share.
std::vector<float> Sums(const float* x, int64_t tokens, int64_t in, int64_t block) {
  const int64_t blocks = in / block;
  std::vector<float> sums(tokens * blocks);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      float s = 0;
      for (int64_t i = 0; i < block; ++i) s += x[t * in + b * block + i];
      sums[t * blocks + b] = s;
    }
  }
  return sums;
}

// y [tokens, out] = x [tokens, in] @ layer `layer` of a stack of weights: codes [layers,
// rows, out], scale and offset [layers, in / block, out] (a layer read where it lies: a
// slice XLA cut out of the stack would be a copy of it).
template <typename T>
ffi::Error Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
               ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
               ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool affine) {
  constexpr bool kPacked = std::is_same_v<T, uint8_t>;
  const int64_t tokens = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t layers = codes.dimensions()[0], rows = codes.dimensions()[1];
  const int64_t out = codes.dimensions()[2], blocks = scale.dimensions()[1];
  const int64_t block = in / blocks, l = layer.typed_data()[0];
  if (out % kLanes || in % blocks || rows != (kPacked ? in / 2 : in) ||
      (kPacked && block % 32) || l < 0 || l >= layers) {
    return ffi::Error::InvalidArgument("qdot: unsupported shape or layer");
  }
  const std::vector<float> sums = Sums(x.typed_data(), tokens, in, block);
  const Problem p{x.typed_data(),
                  sums.data(),
                  static_cast<const T*>(codes.untyped_data()) + l * rows * out,
                  scale.typed_data() + l * blocks * out,
                  offset.typed_data() + (affine ? l * blocks * out : 0),
                  y->typed_data(),
                  tokens, in, out, block, affine};
  Parallel(pool, out / kLanes, [&](int64_t u0, int64_t u1) {
    Columns<T>(p, u0 * kLanes, u1 * kLanes);
  });
  return ffi::Error::Success();
}

// Scores y [tokens, rows] = x [tokens, in] @ w.T, w [rows, in] as codes [rows, in] (packed:
// in / 2), scale and offset [rows, in / block].
template <typename T>
ffi::Error DotT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                ffi::ResultBuffer<ffi::F32> y, bool affine) {
  constexpr bool kPacked = std::is_same_v<T, uint8_t>;
  const int64_t tokens = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t rows = codes.dimensions()[0], blocks = scale.dimensions()[1];
  const int64_t block = in / blocks;
  if (in % blocks || codes.dimensions()[1] != (kPacked ? in / 2 : in) ||
      (kPacked ? block % 32 : block % kWidth)) {
    return ffi::Error::InvalidArgument("qdot: unsupported shape");
  }
  const std::vector<float> sums = Sums(x.typed_data(), tokens, in, block);
  const Table p{x.typed_data(),      sums.data(),  codes.untyped_data(), scale.typed_data(),
                offset.typed_data(), y->typed_data(), tokens, rows, in, block, affine};
  Parallel(pool, rows, [&](int64_t r0, int64_t r1) { TableColumns<T>(p, r0, r1); });
  return ffi::Error::Success();
}

}  // namespace

#define JPAGED_BIND(...)                      \
  ffi::Ffi::Bind()                            \
      .Ctx<ffi::ThreadPool>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Arg<ffi::Buffer<ffi::F32>>() __VA_ARGS__ \
      .Ret<ffi::Buffer<ffi::F32>>()           \
      .Attr<bool>("affine")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_int8, Dot<int8_t>,
                              JPAGED_BIND(.Arg<ffi::Buffer<ffi::S32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_packed, Dot<uint8_t>,
                              JPAGED_BIND(.Arg<ffi::Buffer<ffi::S32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_t_int8, DotT<int8_t>, JPAGED_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_t_packed, DotT<uint8_t>, JPAGED_BIND());
