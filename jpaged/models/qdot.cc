// Quantized matmuls for a few tokens on a CPU, called from the jitted step through XLA's FFI
// (jpaged/models/qdot.py builds and registers them). XLA:CPU runs the step's small dots on one
// thread and dequantizes through memory; these read each code once, dequantize in registers
// and split the output columns over XLA's intra-op threads.
//
// A weight is `value = code * scale + offset`, one scale (and offset) per sub-block of
// `block` values along the contraction axis (jpaged/models/quant.py). Codes are int8, or uint8 two a
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu.h"  // jpaged/kernels/cpu.h
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;   // output columns come in multiples of (jpaged/models/qdot.py: TILE)
constexpr int64_t kChunk = 8;    // tokens whose sums stay in registers at once
constexpr int64_t kTileBytes = 128 << 10;  // codes of a tile of columns (in a core's L2)
constexpr int64_t kYBytes = 16 << 10;  // a few tokens' sums over a tile of columns (in L1)
using jpaged::F, jpaged::I32, jpaged::kWidth, jpaged::Lanes, jpaged::LaneSums, jpaged::Load,
    jpaged::Parallel, jpaged::Store, jpaged::Widen, jpaged::Half;

// Sums of a token's float products kept apart, N tokens at a time, so that multiply-adds in
// flight cover the FMA pipes' latency (one chain a token waited on each of a run's 32 in
// turn); eight registers at most, within AVX2's 16.
constexpr int FloatChains(int n) { return n == 1 ? 4 : n <= 4 ? 2 : 1; }

// float16 values from `h` as float32: kWidth of them, or (AVX2) 8.
inline F HalfVec(const uint16_t* h) {
#if defined(__AVX512F__)
  return (F)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
#elif defined(__F16C__)
  return (F)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
#else
  F v;
  for (int64_t k = 0; k < kWidth; ++k) v[k] = Half(h[k]);
  return v;
#endif
}
#if defined(__AVX2__)
inline __m256 Half8(const uint16_t* h) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
#else
  float v[8];
  for (int k = 0; k < 8; ++k) v[k] = Half(h[k]);
  return _mm256_loadu_ps(v);
#endif
}
#endif

// Scales (or offsets) `[rows, stride]` as a weight holds them: float32; float16 (a GGUF
// type's own, for those that keep one a block: a 4-bit step then reads 18 bytes for 32
// weights, not 20); or int8 times a float16 `super [rows >> shift, stride >> cshift]` (a
// K-quant's two levels: 4.625 bits a Q4_K weight, not 6 with float32 scales and offsets; a
// kernel's supers group its rows, a table's its columns). Read at (row, column): the
// products are exact in float32, as the one-level float32 ones are.
struct Scales {
  enum Kind { kF32, kF16, kI8 };
  const void* data;
  Kind kind;
  int64_t stride;
  const uint16_t* super = nullptr;
  int shift = 0;
  int cshift = 0;  // a table's (the vector readers below are a kernel's: cshift 0)

  // Layer l of a stack of `rows` rows a layer.
  Scales Layer(int64_t l, int64_t rows) const {
    Scales s = *this;
    const int64_t size = kind == kF32 ? 4 : kind == kF16 ? 2 : 1;
    s.data = static_cast<const char*>(data) + l * rows * stride * size;
    if (super != nullptr) s.super = super + l * (rows >> shift) * stride;
    return s;
  }
  float At(int64_t r, int64_t c) const {
    const int64_t i = r * stride + c;
    switch (kind) {
      case kF32: return static_cast<const float*>(data)[i];
      case kF16: return Half(static_cast<const uint16_t*>(data)[i]);
      default: {
        const int64_t u = (r >> shift) * (stride >> cshift) + (c >> cshift);
        return static_cast<const int8_t*>(data)[i] * Half(super[u]);
      }
    }
  }
  // A table's row r of them as float32: where they lie, or converted into `buf` (`stride`
  // of them; a loop of its own, not a conversion a sub-block in the dot's)
  const float* Row(int64_t r, float* buf) const {
    const int64_t i = r * stride;
    if (kind == kF32) return static_cast<const float*>(data) + i;
    int64_t c = 0;
    if (kind == kF16) {
      const auto* h = static_cast<const uint16_t*>(data) + i;
      for (; c + kWidth <= stride; c += kWidth) Store(buf + c, HalfVec(h + c));
      for (; c < stride; ++c) buf[c] = Half(h[c]);
      return buf;
    }
    const auto* sub = static_cast<const int8_t*>(data) + i;
    const uint16_t* u = super + r * (stride >> cshift);
    if (((int64_t(1) << cshift) % kWidth) == 0) {  // a vector's within one group
      for (; c < stride; c += kWidth) {
        Store(buf + c, __builtin_convertvector(Widen(sub + c), F) * Half(u[c >> cshift]));
      }
    }
    for (; c < stride; ++c) buf[c] = sub[c] * Half(u[c >> cshift]);
    return buf;
  }
  F Vec(int64_t r, int64_t c) const {  // kWidth of them, from column c
    const int64_t i = r * stride + c;
    switch (kind) {
      case kF32: return Load(static_cast<const float*>(data) + i);
      case kF16: return HalfVec(static_cast<const uint16_t*>(data) + i);
      default:
        return __builtin_convertvector(Widen(static_cast<const int8_t*>(data) + i), F) *
               HalfVec(super + (r >> shift) * stride + c);
    }
  }
#if defined(__AVX2__)
  __m256 Vec8(int64_t r, int64_t c) const {  // 8 of them, from column c
    const int64_t i = r * stride + c;
    switch (kind) {
      case kF32: return _mm256_loadu_ps(static_cast<const float*>(data) + i);
      case kF16: return Half8(static_cast<const uint16_t*>(data) + i);
      default: {
        const auto* sub = static_cast<const int8_t*>(data) + i;
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                             Half8(super + (r >> shift) * stride + c));
      }
    }
  }
  // int8 sub-scales of 8 columns from c, each as both 16-bit halves of its column's word
  // (a `vpmaddwd` operand), and their float16 super-scales: a kI8 kind's two levels apart.
  __m256i Sub16(int64_t r, int64_t c) const {
    const auto* sub = static_cast<const int8_t*>(data) + r * stride + c;
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b));
  }
  // int8 sub-scales of 8 columns from c as 32-bit words
  __m256i Sub32(int64_t r, int64_t c) const {
    const auto* sub = static_cast<const int8_t*>(data) + r * stride + c;
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub)));
  }
  __m256 Super8(int64_t r, int64_t c) const { return Half8(super + (r >> shift) * stride + c); }
#endif
};

struct Problem {
  const float* x;       // [tokens, in]
  const float* sums;    // [tokens, in / block]: x's sum over each sub-block
  const void* codes;    // [rows, out]: rows = in (int8) or in / 2 (packed)
  Scales scale;         // [in / block, out]
  Scales offset;        // [in / block, out] (read when `affine`)
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
      // memory's speed here (a hint: past the last row it reads nothing and cannot fault),
      // once a cache line
      if (g * kWidth % 64 == 0) __builtin_prefetch(codes + (r + rows) * p.out + g * kWidth);
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
    const F s = p.scale.Vec(b, c + g * kWidth);
    const F o = p.affine ? p.offset.Vec(b, c + g * kWidth) : F{};
    for (int t = 0; t < N; ++t) {
      const float sum = p.sums[(t0 + t) * blocks + b];
      float* y = p.total + (t0 + t) * p.out + c + g * kWidth;
      Store(y, Load(y) + s * (acc[t][g] - center * sum) + sum * o);
    }
  }
}

// Columns [c0, c1) for tokens [t0, t0 + N), sub-blocks [b0, b1) one by one: at one token
// four vectors of columns at once (four independent chains of sums), at two two, past that
// one.
template <typename T, int N>
void Tokens(const Problem& p, int64_t t0, int64_t c0, int64_t c1, int64_t b0, int64_t b1) {
  constexpr int G = N == 1 ? 4 : N == 2 ? 2 : 1;
  for (int64_t b = b0; b < b1; ++b) {
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

// Columns [c0, c1), the sums over sub-blocks [b0, b1). Past kChunk tokens, in tiles whose
// codes fit a core's L2 cache: each tile is read once from memory and again from the cache
// for every further chunk of tokens. Within one chunk, in tiles of kYBytes of sums: rows'
// runs of codes long enough for the prefetcher (4096 columns at one token), the sums in L1.
template <typename T>
void Columns(const Problem& p, int64_t c0, int64_t c1, int64_t b0, int64_t b1) {
  for (int64_t t = 0; t < p.tokens; ++t) {
    std::fill(p.total + t * p.out + c0, p.total + t * p.out + c1, 0.0f);
  }
  const int64_t row_bytes = (std::is_same_v<T, uint8_t> ? p.in / 2 : p.in) * sizeof(T);
  // a few tokens: tiles whose sums (y) stay in L1 while the sub-blocks go by (a 128256-row
  // head's, whole, re-read from L3 for each ran at half the other matrices' rate)
  const int64_t tile =
      p.tokens <= kChunk
          ? std::max<int64_t>(4 * kLanes, kYBytes / (4 * p.tokens) / (4 * kLanes) * (4 * kLanes))
          : std::max<int64_t>(kLanes, kTileBytes / row_bytes / kLanes * kLanes);
  for (int64_t c = c0; c < c1; c += tile) {
    const int64_t end = std::min(c + tile, c1);
    Chunks(p.tokens, [&](auto n, int64_t t0) {
      Tokens<T, decltype(n)::value>(p, t0, c, end, b0, b1);
    });
  }
}

// With int8 activations (`Dot`'s `int8`, packed codes, AVX2): each token's inputs rounded to
// int8 per run of 32 with a float scale (llama.cpp's Q8 activations), dotted with the codes
// in integer multiply-adds (`Dot4`: VNNI's `vpdpbusd`, 32 products and their sums an
// instruction, or AVX2's `vpmaddubsw`, 32 products into 16-bit pair sums, where a float
// multiply-add makes 8), a run's sums turned to float once and scaled by both scales.
//
// The codes lie in the kernel's own order (`jpaged/models/qdot.py`'s `tile`, a permutation of the
// packed `[in / 2, out]`): run by run, 8 columns at a time, each column's 16 bytes of a
// run (byte j: values j and j + 16, as a GGUF block holds them) four at a time, so that a
// 32-byte load is 8 columns x 4 bytes: its low nibbles 8 columns' values 4i..4i + 3 and its
// high ones 4i + 16..4i + 19, a word a column, which meet 4 inputs broadcast as a word, and
// a thread reads its runs' codes from one stretch of memory end to end. (In the packed
// order a run's 16 rows lie `out` bytes apart: 16 streams at once, 2 bytes a column
// unpacked to words; at one token it ran 1.4x slower on 2 cores, 1.8x on one.)

// a column's bytes a run of 32 codes of `bits` (narrow ones: `Run8`)
constexpr int64_t NarrowBytes(int bits) { return 4 * bits; }

#if defined(__AVX2__)
constexpr int64_t kRun = 32;     // inputs an activation scale covers: a packed run
constexpr int64_t kGroup = 32;   // output columns a step holds: a vector of codes
constexpr int64_t kWords = kRun / 4;  // a run's words of inputs (4 a column each)
constexpr int64_t kFew = 4;  // tokens that take each run as it is unpacked
// Packed codes with int8 inputs go the few-token way (`QFew`) up to kFewPacked tokens, kChunk
// at a time, each chunk reading the codes again: at 512 bits an 8-token `FewRun` still keeps
// its sums in registers, where `QColumns`' 256-bit strips ran 5 tokens 2.6x slower than 4
// (the 8B's matmuls from memory, 2 cores: 5 tokens 244 -> 97 ms, 8 305 -> 161, 16 479 ->
// 322, 64 1511 -> 1335; 128 3-6% faster, 512 up to 10% slower: on prompts the strips' codes,
// unpacked once and read again from L1 for every chunk, win). AVX2's 16 registers spill at
// 8 tokens (its strips 1.2-2x faster there): the strips from kFew on.
#if defined(__AVX512F__)
constexpr int64_t kFewPacked = 64;
#else
constexpr int64_t kFewPacked = kFew;
#endif

struct Quantized {
  const int32_t* words;  // [tokens, in / 4]: the inputs as int8, four to a word
  const float* step;     // [tokens, in / kRun]: a run's scale
  const int32_t* halves;  // [tokens, in / 16]: the int8 inputs' sums over each half run
                          // (what `Run8` reads; packed codes' none)
};

// Each token's inputs as int8, a scale per run of 32. `sums` [tokens, in / block]: the
// rounded inputs' sums over each sub-block, for the offsets' share, so that every weight,
// offset and all, meets the same rounded inputs (exact sums beside rounded products made
// SmolLM2's logits' KL 9x larger). `halves` (null: not wanted): `Quantized::halves`.
void Quantize(const float* x, int64_t tokens, int64_t in, int64_t block,
              std::vector<int32_t>& words, std::vector<float>& step, std::vector<float>& sums,
              std::vector<int32_t>* halves) {
  const int64_t runs = in / kRun;
  words.resize(tokens * in / 4);
  step.resize(tokens * runs);
  sums.assign(tokens * (in / block), 0.0f);
  if (halves != nullptr) halves->resize(tokens * in / 16);
  auto* q = reinterpret_cast<int8_t*>(words.data());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < runs; ++k) {
      const float* v = x + t * in + k * kRun;
      int8_t* r = q + t * in + k * kRun;
      float most = 0;
      for (int64_t i = 0; i < kRun; ++i) most = std::max(most, std::abs(v[i]));
      const float d = most / 127, inv = most > 0 ? 127 / most : 0;
      const int64_t span = std::min(block, kRun);  // a sub-block's inputs in this run
      for (int64_t i0 = 0; i0 < kRun; i0 += span) {
        int32_t total = 0;
        for (int64_t i = i0; i < i0 + span; ++i) {
          r[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
          total += r[i];
        }
        sums[t * (in / block) + (k * kRun + i0) / block] += d * static_cast<float>(total);
      }
      step[t * runs + k] = d;
      for (int64_t h = 0; halves != nullptr && h < 2; ++h) {
        int32_t total = 0;
        for (int64_t i = 0; i < kRun / 2; ++i) total += r[h * kRun / 2 + i];
        (*halves)[(t * in + k * kRun) / 16 + h] = total;
      }
    }
  }
}

// Run k's codes of columns [c, c + 8): 128 bytes, word i of the run's 8 (4 low nibbles,
// then 4 high) in the i % 4-th 32 bytes.
inline const uint8_t* Tile(const Problem& p, int64_t k, int64_t c) {
  return static_cast<const uint8_t*>(p.codes) + k * (kRun / 2) * p.out + c * (kRun / 2);
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define JPAGED_VNNI 1  // either encoding of `vpdpbusd`
#else
#define JPAGED_VNNI 0
#endif

// `sums` plus each word's 4 codes (unsigned) times its 4 inputs (signed): with VNNI one
// instruction into 32-bit sums; with AVX2 alone pairs of products into 16-bit sums
// (`Widened` adds the pairs up at the end).
inline __m256i Dot4(__m256i sums, __m256i codes, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(sums, codes, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sums, codes, x);
#else
  return _mm256_add_epi16(sums, _mm256_maddubs_epi16(codes, x));
#endif
}

inline __m256i Widened(__m256i sums) {
#if JPAGED_VNNI
  return sums;
#else
  return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
#endif
}

// Columns [c, c + 32) of run k's sub-block's scales, then its offsets (a symmetric type's
// centre: -8 x its scale), as float32 in `so` [64]: converted once (float16 ones) for all
// the tokens that meet them.
inline void RunScales(const Problem& p, int64_t k, int64_t c, float* so) {
  const int64_t b = k / (p.block / kRun);
  for (int i = 0; i < 4; ++i) {
    const __m256 scale = p.scale.Vec8(b, c + 8 * i);
    _mm256_storeu_ps(so + 8 * i, scale);
    _mm256_storeu_ps(so + kGroup + 8 * i, p.affine ? p.offset.Vec8(b, c + 8 * i)
                                                   : _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f)));
  }
}

// Run k's share of y [t, c, c + 32) added to `acc`, from its codes `w` unpacked (8 words x
// 4 vectors of 8 columns): dotted by `Dot4` (without VNNI in 16-bit sums: a pair of
// products at most 2 * 15 * 127, a run's 8 words' 30480, no overflow), widened, scaled
// by both scales; at a sub-block's first run its offsets' (or its centre's) share, the
// rounded inputs' sum over it times each offset. `so`: the run's scales and offsets
// (`RunScales`).
template <int N = 1>
inline void QRun(const Problem& p, const Quantized& q, const __m256i* w, const float* so,
                 int64_t t, int64_t k, __m256 (*acc)[4]) {
  const int64_t runs = p.in / kRun, per_block = p.block / kRun, b = k / per_block;
  __m256i sums[N][4];
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < 4; ++i) sums[n][i] = _mm256_setzero_si256();
  for (int64_t word = 0; word < kWords; ++word) {
    __m256i xb[N];
    for (int n = 0; n < N; ++n) xb[n] = _mm256_set1_epi32(q.words[(t + n) * p.in / 4 + k * kWords + word]);
    for (int i = 0; i < 4; ++i) {
      const __m256i codes = w[word * 4 + i];
      for (int n = 0; n < N; ++n) sums[n][i] = Dot4(sums[n][i], codes, xb[n]);
    }
  }
  for (int n = 0; n < N; ++n) {
    const __m256 d = _mm256_set1_ps(q.step[(t + n) * runs + k]);
    for (int i = 0; i < 4; ++i) {
      const __m256 sum = _mm256_cvtepi32_ps(Widened(sums[n][i]));
      acc[n][i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(so + 8 * i), d), sum, acc[n][i]);
    }
    if (k % per_block == 0) {
      const __m256 x = _mm256_set1_ps(p.sums[(t + n) * (p.in / p.block) + b]);
      for (int i = 0; i < 4; ++i) {
        acc[n][i] = _mm256_fmadd_ps(_mm256_loadu_ps(so + kGroup + 8 * i), x, acc[n][i]);
      }
    }
  }
}

// Run k's codes of columns [c, c + 32) unpacked into `w` (`QRun`'s order); the next run's
// prefetched.
inline void UnpackRun(const Problem& p, int64_t k, int64_t c, __m256i* w) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int i = 0; i < 4; ++i) {
    const uint8_t* tile = Tile(p, k, c + 8 * i);
    __builtin_prefetch(tile + (kRun / 2) * p.out);
    __builtin_prefetch(tile + (kRun / 2) * p.out + 64);
    for (int j = 0; j < 4; ++j) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j));
      w[j * 4 + i] = _mm256_and_si256(a, low);
      w[(j + 4) * 4 + i] = _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
    }
  }
}

// Up to kFew tokens (`QFew`): each 32 bytes of codes dotted as they are loaded, never
// stored: its low and high nibbles meet their words of inputs (broadcast once a run, for
// all its columns) in a `Dot4` each, a run's 4 loads of 8 columns summed in 32 bits (VNNI)
// or 16 (at most 4 * 2 * 2 * 15 * 127 = 30480), widened once; with AVX-512 16 columns at
// once (`FewRun`). (A 2048 x 2048 Q4_K in cache, four tokens, 2-core AVX-512 + VNNI EPYC:
// 39 Gweights/s with AVX2's 16-bit sums, 57 with VNNI's, 76 at 512 bits, 2026-11-29.)
// Columns go in tiles (`FewTile`) whose sums (y) stay in L2 while all the runs go by: a
// 128256-row head's y (513 KB a token) re-read and rewritten from L3 for every run ran the head at half the rate of the
// other matrices; tiles of 2048 columns cut a 1B FFN's gate_up (16384 columns) into 8, a
// thread's runs then read as 32 KB stretches 256 KB apart, not one stretch end to end
// (6-20% slower on 2 AVX2 cores, gate_up and qkv; benchmarks/RESULTS.md, 2026-11-28).
constexpr int64_t kFewYBytes = 128 << 10;
template <int N>
int64_t FewTile() {
  return std::max<int64_t>(2048, kFewYBytes / (4 * N) / kGroup * kGroup);
}

// N tokens' y zeroed, then summed over runs [k0, k1) tile by tile: `run(k, c0, c1)`, run k's
// share of columns [c0, c1).
template <int N, typename Run>
void FewWalk(const Problem& p, int64_t k0, int64_t k1, const Run& run) {
  for (int t = 0; t < N; ++t) std::fill(p.total + t * p.out, p.total + (t + 1) * p.out, 0.0f);
  for (int64_t c0 = 0; c0 < p.out; c0 += FewTile<N>()) {
    const int64_t c1 = std::min(c0 + FewTile<N>(), p.out);
    for (int64_t k = k0; k < k1; ++k) run(k, c0, c1);
  }
}

// `FewRun`'s registers: kWidth lanes (8 with AVX2, 16 with AVX-512) of 4 bytes, a lane a
// column. `FewCodes`: word j of kWidth columns' codes, from tiles of 8 columns 128 bytes
// apart; `FewDot`, `FewWidened`: `Dot4`, `Widened` at that width.
#if defined(__AVX512F__)
inline I32 FewCodes(const uint8_t* tile, int j) {
  const auto* at = reinterpret_cast<const __m256i*>(tile + 32 * j);
  return (I32)_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(at)),
                                 _mm256_loadu_si256(at + 4), 1);
}
inline I32 FewDot(I32 sums, I32 codes, I32 x) {
#if defined(__AVX512VNNI__)
  return (I32)_mm512_dpbusd_epi32((__m512i)sums, (__m512i)codes, (__m512i)x);
#else
  return (I32)_mm512_add_epi16((__m512i)sums, _mm512_maddubs_epi16((__m512i)codes, (__m512i)x));
#endif
}
inline I32 FewWidened(I32 sums) {
#if defined(__AVX512VNNI__)
  return sums;
#else
  return (I32)_mm512_madd_epi16((__m512i)sums, _mm512_set1_epi16(1));
#endif
}
#else
inline I32 FewCodes(const uint8_t* tile, int j) {
  return (I32)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j));
}
inline I32 FewDot(I32 sums, I32 codes, I32 x) {
  return (I32)Dot4((__m256i)sums, (__m256i)codes, (__m256i)x);
}
inline I32 FewWidened(I32 sums) { return (I32)Widened((__m256i)sums); }
#endif

// Run k's share of columns [c0, c1) of N tokens' y (`QFew`'s step), kWidth columns at a
// time: with AVX-512 two tiles' codes side by side meet the same word of inputs, half the
// instructions of two 256-bit steps but for the loads.
template <int N>
inline void FewRun(const Problem& p, const Quantized& q, int64_t k, int64_t c0, int64_t c1) {
  const int64_t runs = p.in / kRun, per_block = p.block / kRun, b = k / per_block;
  const bool first = k % per_block == 0;
  I32 x[N][kWords];
  F d[N], xsum[N];
  for (int n = 0; n < N; ++n) {
    for (int i = 0; i < kWords; ++i) x[n][i] = I32{} + q.words[n * p.in / 4 + k * kWords + i];
    d[n] = F{} + q.step[n * runs + k];
    xsum[n] = F{} + p.sums[n * (p.in / p.block) + b];
  }
  for (int64_t c = c0; c < c1; c += kWidth) {
    const uint8_t* tile = Tile(p, k, c);
    for (int64_t line = 0; line < kWidth * kRun / 2; line += 64) {  // the next run's
      __builtin_prefetch(tile + (kRun / 2) * p.out + line);
    }
    I32 acc[N] = {};
    for (int j = 0; j < 4; ++j) {
      const I32 a = FewCodes(tile, j), lo = a & 0x0f0f0f0f, hi = (a >> 4) & 0x0f0f0f0f;
      for (int n = 0; n < N; ++n) acc[n] = FewDot(FewDot(acc[n], lo, x[n][j]), hi, x[n][j + 4]);
    }
    const F s = p.scale.Vec(b, c);
    const F o = !first ? F{} : p.affine ? p.offset.Vec(b, c) : s * -8.0f;
    for (int n = 0; n < N; ++n) {
      float* y = p.total + n * p.out + c;
      Store(y, Load(y) + s * d[n] * __builtin_convertvector(FewWidened(acc[n]), F) + o * xsum[n]);
    }
  }
}

template <int N>
void QFew(const Problem& p, const Quantized& q, int64_t k0, int64_t k1) {
  FewWalk<N>(p, k0, k1, [&](int64_t k, int64_t c0, int64_t c1) { FewRun<N>(p, q, k, c0, c1); });
}

// Columns [c0, c1) (multiples of 32) of y with int8 activations, summed over runs [k0, k1),
// 32 columns at a time. For a few tokens (more threads than `Shares` takes) run by run, all
// columns of a run before the next (its codes read as they lie), each run unpacked and
// dotted with them at once; for more, strip by strip, each strip's runs unpacked once (into
// L1 or L2), then every token down them with its float sums in registers. (Strip by strip a
// few tokens ran 1.5x slower: a strip's runs are far apart in memory.)
void QColumns(const Problem& p, const Quantized& q, int64_t c0, int64_t c1, int64_t k0,
              int64_t k1) {
  const int64_t runs = p.in / kRun, vectors = kWords * 4;  // a run's unpacked
  const bool few = p.tokens <= kFew;
  std::vector<__m256i> strip((few ? 1 : runs) * vectors);
  std::vector<float> so((few ? 1 : runs) * 2 * kGroup);  // each run's scales and offsets
  if (few) {
    for (int64_t t = 0; t < p.tokens; ++t) {
      std::fill(p.total + t * p.out + c0, p.total + t * p.out + c1, 0.0f);
    }
    for (int64_t k = k0; k < k1; ++k) {
      for (int64_t c = c0; c < c1; c += kGroup) {
        UnpackRun(p, k, c, strip.data());
        RunScales(p, k, c, so.data());
        for (int64_t t = 0; t < p.tokens; ++t) {
          float* y = p.total + t * p.out + c;
          __m256 acc[4];
          for (int i = 0; i < 4; ++i) acc[i] = _mm256_loadu_ps(y + 8 * i);
          QRun(p, q, strip.data(), so.data(), t, k, &acc);
          for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, acc[i]);
        }
      }
    }
    return;
  }
  for (int64_t c = c0; c < c1; c += kGroup) {
    for (int64_t k = k0; k < k1; ++k) {
      UnpackRun(p, k, c, strip.data() + k * vectors);
      RunScales(p, k, c, so.data() + k * 2 * kGroup);
    }
    int64_t t = 0;
    for (; t + 2 <= p.tokens; t += 2) {
      __m256 acc[2][4];
      for (auto& a : acc)
        for (auto& v : a) v = _mm256_setzero_ps();
      for (int64_t k = k0; k < k1; ++k) {
        QRun<2>(p, q, strip.data() + k * vectors, so.data() + k * 2 * kGroup, t, k, acc);
      }
      for (int n = 0; n < 2; ++n)
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(p.total + (t + n) * p.out + c + 8 * i, acc[n][i]);
    }
    for (; t < p.tokens; ++t) {
      __m256 acc[1][4];
      for (auto& v : acc[0]) v = _mm256_setzero_ps();
      for (int64_t k = k0; k < k1; ++k) {
        QRun<1>(p, q, strip.data() + k * vectors, so.data() + k * 2 * kGroup, t, k, acc);
      }
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(p.total + t * p.out + c + 8 * i, acc[0][i]);
    }
  }
}

// With int8 codes (Q6_K's, Q8_0's, Q5_*'s, per-channel int8's): a run's 32 rows in `tile`'s
// order too, 8 columns x 32 values in 8 loads of 32 bytes, load j 8 columns' words j
// (values 4j..4j + 3). Without VNNI (`Run8` says how with it: a cached Q6_K at four tokens
// 26 -> 42 Gweights/s on a 2-core AVX-512 + VNNI EPYC, 2026-11-29), signed codes meet
// signed inputs as llama.cpp's do: |code| (unsigned)
// times the input given the code's sign (`vpsignb`), pairs of products in 16 bits (at most
// 2 * 128 * 127: no overflow at any code), each load's widened to 32 bits by a `vpmaddwd`
// with its sub-block's int8 sub-scales (a K-quant's two levels: the sub-scales applied in
// integers, so that a Q6_K run of two sub-blocks of 16 is one sum, turned to float once,
// times its super-scale) or with ones (float scales: one sub-block a run at most).
//
// Narrow codes (a K-quant's or Q5's at their file's bits, `jpaged/models/qdot.py`'s `narrow`: Q6_K's
// six, Q5_*'s five) lie in the same order with a run's 32 codes of a column in 4 x bits
// bytes: 8 columns' 128 bytes of their low 4 bits as packed codes' tile holds them (`Tile`),
// then 32 x (bits - 4) of the rest: word m of bits - 4 holds words m, m + e, .. (e = bits -
// 4) of codes at bits 0, e, 2e, ..; unsigned, a symmetric weight's 2^(bits - 1) above the
// value. Each load of low bits becomes two words of codes by two masks and shifts of the rest:
// 5 or 6 bits read a weight, not 8, for a few more instructions a load.

// The two words of narrow codes held in `low` (low nibbles: its rows; high: rows 16 on)
// and `top` (their top bits at bits 0 and 4 of each byte, others clear): each byte's low
// 4 bits from one, the rest from the other (`vpternlogd` with AVX-512; bits shifted in
// from a neighbouring byte land where the other is taken).
inline void NarrowWords(__m256i low, __m256i top, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const auto join = [&](__m256i a, __m256i b) {
    return _mm256_or_si256(_mm256_and_si256(nibble, a), _mm256_andnot_si256(nibble, b));
  };
  lo = join(low, _mm256_slli_epi32(top, 4));
  hi = join(_mm256_srli_epi32(low, 4), top);
}

// A run of 8 columns' narrow codes at `at` as words of unsigned codes: `use(i, lo, hi)`,
// words i and i + 4 of the run, for i = 0..3.
template <int kBits, typename F>
inline void NarrowRun(const __m256i* at, F&& use) {
  constexpr int e = kBits - 4;  // top bits a code; words m, m + e, .. share top word m
  const __m256i mask = _mm256_set1_epi8(((1 << e) - 1) * 0x11);
  for (int m = 0; m < e; ++m) {
    const __m256i top = _mm256_loadu_si256(at + 4 + m);
    for (int s = 0; s < 4 / e; ++s) {  // words i and i + 4: top bits at e * s and 4 + e * s
      __m256i lo, hi;
      NarrowWords(_mm256_loadu_si256(at + m + e * s),
                  _mm256_and_si256(_mm256_srli_epi32(top, e * s), mask), lo, hi);
      use(m + e * s, lo, hi);
    }
  }
}

// `Dot4` into 32-bit sums at any code below 64 (AVX2's 16-bit pair sums widened a load at a
// time: four loads of six-bit pairs, 4 * 2 * 63 * 127, would overflow them).
inline __m256i Dot4Wide(__m256i sums, __m256i codes, __m256i x) {
#if JPAGED_VNNI
  return Dot4(sums, codes, x);
#else
  return _mm256_add_epi32(sums, Widened(Dot4(_mm256_setzero_si256(), codes, x)));
#endif
}

// Run k's share of y for N tokens, columns [c, c + 8), added to acc: `x` each token's words
// of inputs of the run (broadcast), `d` their scale, `xsum` their sums over the run's first
// sub-block (read at a sub-block's first run of an affine weight, for its offsets' share),
// `bias` each half run's centre's share (`RunInputs`). `kBits`: 8 (int8 codes), or narrow
// ones' bits.
template <int N, int kBits>
inline void Run8(const Problem& p, int64_t k, int64_t c, const __m256i (*x)[kWords],
                 const __m256i (*bias)[2], const float* d, const float* xsum, __m256* acc) {
  constexpr int64_t bytes = NarrowBytes(kBits);  // a column's a run
  const auto* tile = static_cast<const int8_t*>(p.codes) + k * bytes * p.out + c * bytes;
  for (int64_t line = 0; line < 8 * bytes; line += 64) {  // the next run's
    __builtin_prefetch(tile + bytes * p.out + line);
  }
  const bool two = p.scale.kind == Scales::kI8;
  const int64_t b = k * kRun / p.block, span = std::min(p.block, kRun) / 4;  // words a sub-block
  __m256i sums[N][2];  // each half run's (the smallest sub-block), from its centre's share
  for (int n = 0; n < N; ++n) sums[n][0] = bias[n][0], sums[n][1] = bias[n][1];
  if constexpr (kBits < 8) {
    NarrowRun<kBits>(reinterpret_cast<const __m256i*>(tile), [&](int i, __m256i lo, __m256i hi) {
      for (int n = 0; n < N; ++n) {
        sums[n][0] = Dot4Wide(sums[n][0], lo, x[n][i]);
        sums[n][1] = Dot4Wide(sums[n][1], hi, x[n][i + 4]);
      }
    });
  }
#if JPAGED_VNNI
  // With VNNI each int8 code is read 128 above itself, unsigned (its top bit flipped), and
  // meets the signed inputs in `vpdpbusd`: one instruction a load a token, not four. The
  // sums of each half run start at -128 x their inputs' sum (`bias`), and the sub-scales
  // multiply them once a run.
  const __m256i flip = _mm256_set1_epi8(-128);
  for (int h = 0; kBits == 8 && h < 2; ++h) {
    for (int64_t j = h * kWords / 2; j < (h + 1) * kWords / 2; ++j) {
      const __m256i a = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j)), flip);
      for (int n = 0; n < N; ++n) sums[n][h] = Dot4(sums[n][h], a, x[n][j]);
    }
  }
#endif
  constexpr bool kHalves = kBits < 8 || JPAGED_VNNI;  // sums by half run, the sub-scales after
  for (int n = 0; kHalves && n < N; ++n) {
    if (!two) {
      sums[n][0] = _mm256_add_epi32(sums[n][0], sums[n][1]);
      continue;
    }
    const __m256i sub = p.scale.Sub32(b, c), next = span < kWords ? p.scale.Sub32(b + 1, c) : sub;
    sums[n][0] = _mm256_add_epi32(_mm256_mullo_epi32(sums[n][0], sub),
                                  _mm256_mullo_epi32(sums[n][1], next));
  }
#if !JPAGED_VNNI
  __m256i sub[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
  if (two && kBits == 8) {
    sub[0] = p.scale.Sub16(b, c);
    sub[1] = span < kWords ? p.scale.Sub16(b + 1, c) : sub[0];
  }
  for (int n = 0; kBits == 8 && n < N; ++n) sums[n][0] = _mm256_setzero_si256();
  for (int64_t j = 0; kBits == 8 && j < kWords; ++j) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j));
    const __m256i size = _mm256_abs_epi8(a), s = sub[j / span];
    for (int n = 0; n < N; ++n) {
      const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(x[n][j], a));
      sums[n][0] = _mm256_add_epi32(sums[n][0], _mm256_madd_epi16(pairs, s));
    }
  }
#endif
  const __m256 scale = two ? p.scale.Super8(b, c) : p.scale.Vec8(b, c);
  const bool offsets = p.affine && k * kRun % p.block == 0;
  const __m256 o = offsets ? p.offset.Vec8(b, c) : _mm256_setzero_ps();
  for (int n = 0; n < N; ++n) {
    acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[n][0]),
                             _mm256_mul_ps(scale, _mm256_set1_ps(d[n])), acc[n]);
    if (offsets) acc[n] = _mm256_fmadd_ps(o, _mm256_set1_ps(xsum[n]), acc[n]);
  }
}

// What the codes of `kBits` read with int8 inputs hold above their values: 128 (int8 codes
// read unsigned, with VNNI), 2^(bits - 1) (a symmetric weight's narrow ones), else 0.
template <int kBits>
inline int32_t Centre(const Problem& p) {
  return kBits == 8 ? (JPAGED_VNNI ? 128 : 0) : p.affine ? 0 : 1 << (kBits - 1);
}

// Tokens [t, t + N)'s inputs of run k as `Run8<N, kBits>` takes them: `bias`, its codes'
// `Centre` times the inputs' sum over each half run, negated.
template <int N, int kBits>
inline void RunInputs(const Problem& p, const Quantized& q, int64_t t, int64_t k,
                      __m256i (*x)[kWords], __m256i (*bias)[2], float* d, float* xsum) {
  const int32_t centre = Centre<kBits>(p);
  const int64_t runs = p.in / kRun, blocks = p.in / p.block;
  for (int n = 0; n < N; ++n) {
    for (int64_t j = 0; j < kWords; ++j) {
      x[n][j] = _mm256_set1_epi32(q.words[(t + n) * p.in / 4 + k * kWords + j]);
    }
    for (int h = 0; h < 2; ++h) {
      bias[n][h] = _mm256_set1_epi32(-centre * q.halves[((t + n) * p.in + k * kRun) / 16 + h]);
    }
    d[n] = q.step[(t + n) * runs + k];
    xsum[n] = p.sums[(t + n) * blocks + k * kRun / p.block];
  }
}

// Up to kFew tokens' y over runs [k0, k1): each run's inputs set up once for all its
// columns, the columns in tiles whose y stays in L2 (`FewTile`, as `QFew`'s).
template <int N, int kBits>
void Q8Few(const Problem& p, const Quantized& q, int64_t k0, int64_t k1) {
  __m256i x[N][kWords], bias[N][2];
  float d[N], xsum[N];
  FewWalk<N>(p, k0, k1, [&](int64_t k, int64_t c0, int64_t c1) {
    RunInputs<N, kBits>(p, q, 0, k, x, bias, d, xsum);
    for (int64_t c = c0; c < c1; c += 8) {
      __m256 acc[N];
      for (int n = 0; n < N; ++n) acc[n] = _mm256_loadu_ps(p.total + n * p.out + c);
      Run8<N, kBits>(p, k, c, x, bias, d, xsum, acc);
      for (int n = 0; n < N; ++n) _mm256_storeu_ps(p.total + n * p.out + c, acc[n]);
    }
  });
}

// Tokens t .. t + N - 1 against 8 columns from c (int8 codes).
template <int N>
void Q8Strip(const Problem& p, const Quantized& q, int64_t t, int64_t c) {
  __m256 acc[N];
  for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
  __m256i x[N][kWords], bias[N][2];
  float d[N], xsum[N];
  for (int64_t k = 0; k < p.in / kRun; ++k) {
    RunInputs<N, 8>(p, q, t, k, x, bias, d, xsum);
    Run8<N, 8>(p, k, c, x, bias, d, xsum, acc);
  }
  for (int n = 0; n < N; ++n) _mm256_storeu_ps(p.total + (t + n) * p.out + c, acc[n]);
}

// Columns [c0, c1) (multiples of 8) for any number of tokens, int8 codes where `Q8Strips`
// does not take them (without VNNI's unsigned-by-signed sums): 8 columns at a time, every
// pair of tokens down all their runs (the column's codes, `in` x 8 bytes, read from memory
// once and from L2 after), the sums in registers.
void Q8Columns(const Problem& p, const Quantized& q, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += 8) {
    int64_t t = 0;
    for (; t + 2 <= p.tokens; t += 2) Q8Strip<2>(p, q, t, c);
    if (t < p.tokens) Q8Strip<1>(p, q, t, c);
  }
}

// `Dot4` at the register's width into 32-bit sums at any code below 64, or (VNNI) any
// unsigned one; `kWideVnni`: whether it takes any.
#if defined(__AVX512F__) ? defined(__AVX512VNNI__) : JPAGED_VNNI
constexpr bool kWideVnni = true;
inline I32 WideDot(I32 sums, I32 codes, I32 x) { return FewDot(sums, codes, x); }
#else
constexpr bool kWideVnni = false;
inline I32 WideDot(I32 sums, I32 codes, I32 x) {
  return sums + FewWidened(FewDot(I32{}, codes, x));
}
#endif
constexpr int64_t kWide = kGroup / kWidth;  // a strip's vectors of columns

// Past kFew tokens, narrow codes and (with VNNI) int8 ones as `Q8Columns` would take them,
// kGroup columns at a time: each run's codes unpacked once into unsigned bytes (`QRun`'s
// order: word j of 8 columns g at j * 4 + g) and its scales into floats, then a few tokens
// at a time down the strip, each word of inputs broadcast once for 32 columns, kWidth a
// register (`Q8Strip` broadcasts a run's inputs again for every 8: 512 tokens through an 8B
// FFN down of Q6_K codes took 220 ms, now 71 on a 2-core AVX-512 EPYC; Q4_K's packed ones
// through `QColumns` 88).

template <int kBits>
void Q8Unpack(const Problem& p, int64_t k, int64_t c, I32* strip, float* so) {
  constexpr int64_t bytes = NarrowBytes(kBits);
  auto* w = reinterpret_cast<__m256i*>(strip);  // word j of columns c + 8g at j * 4 + g
  const int64_t b = k * kRun / p.block, next = p.block < kRun ? b + 1 : b;
  const bool offsets = p.affine && k * kRun % p.block == 0;
  for (int g = 0; g < 4; ++g) {
    const int64_t col = c + 8 * g;
    const auto* tile = static_cast<const uint8_t*>(p.codes) + (k * p.out + col) * bytes;
    const auto* at = reinterpret_cast<const __m256i*>(tile);
    if constexpr (kBits < 8) {
      NarrowRun<kBits>(at, [&](int i, __m256i lo, __m256i hi) {
        _mm256_storeu_si256(w + i * 4 + g, lo);
        _mm256_storeu_si256(w + (i + 4) * 4 + g, hi);
      });
    } else {
      for (int j = 0; j < kWords; ++j) {
        const __m256i a = _mm256_xor_si256(_mm256_loadu_si256(at + j), _mm256_set1_epi8(-128));
        _mm256_storeu_si256(w + j * 4 + g, a);
      }
    }
    // each half run's scale (its sub-block's), then the offsets' (zeros where not read)
    _mm256_storeu_ps(so + 8 * g, p.scale.Vec8(b, col));
    _mm256_storeu_ps(so + kGroup + 8 * g, p.scale.Vec8(next, col));
    _mm256_storeu_ps(so + 2 * kGroup + 8 * g,
                     offsets ? p.offset.Vec8(b, col) : _mm256_setzero_ps());
  }
}

// Tokens t .. t + N - 1 against kGroup columns from c, their runs unpacked (`Q8Unpack`),
// kWidth columns a vector.
template <int N, int kBits>
void Q8Wide(const Problem& p, const Quantized& q, const I32* strip, const float* so, int64_t t,
            int64_t c) {
  const int32_t centre = Centre<kBits>(p);  // (int8 codes come here with VNNI only)
  const int64_t runs = p.in / kRun, blocks = p.in / p.block;
  F acc[N][kWide] = {};
  for (int64_t k = 0; k < runs; ++k) {
    const I32* w = strip + k * kWords * kWide;
    const float* s = so + k * 3 * kGroup;
    for (int h = 0; h < 2; ++h) {  // each half run's sums (the smallest sub-block) apart
      I32 sums[N][kWide];
      for (int n = 0; n < N; ++n) {
        const int32_t half = q.halves[((t + n) * p.in + k * kRun) / 16 + h];
        for (auto& v : sums[n]) v = I32{} - centre * half;
      }
      for (int j = 4 * h; j < 4 * h + 4; ++j) {
        I32 x[N];
        for (int n = 0; n < N; ++n) x[n] = I32{} + q.words[(t + n) * p.in / 4 + k * kWords + j];
        for (int g = 0; g < kWide; ++g) {
          for (int n = 0; n < N; ++n) sums[n][g] = WideDot(sums[n][g], w[j * kWide + g], x[n]);
        }
      }
      for (int n = 0; n < N; ++n) {
        const float d = q.step[(t + n) * runs + k];
        for (int g = 0; g < kWide; ++g) {
          const F scale = Load(s + h * kGroup + g * kWidth) * d;
          acc[n][g] += __builtin_convertvector(sums[n][g], F) * scale;
        }
      }
    }
    if (p.affine && k * kRun % p.block == 0) {
      for (int n = 0; n < N; ++n) {
        const float xsum = p.sums[(t + n) * blocks + k * kRun / p.block];
        for (int g = 0; g < kWide; ++g) acc[n][g] += Load(s + 2 * kGroup + g * kWidth) * xsum;
      }
    }
  }
  for (int n = 0; n < N; ++n)
    for (int g = 0; g < kWide; ++g) Store(p.total + (t + n) * p.out + c + g * kWidth, acc[n][g]);
}

// Columns [c0, c1) a strip of kGroup at a time: its runs unpacked once (`Q8Unpack`), then
// `pass(n, t, c, strip, so)` for tokens t .. t + n - 1 down it, n a compile-time constant.
template <int kBits, typename Pass>
void Strips(const Problem& p, int64_t c0, int64_t c1, const Pass& pass) {
  // tokens a pass: the sums and accumulators of 4 fit AVX-512's 32 registers, of 2 AVX2's 16
  constexpr int kPass = kWide == 2 ? 4 : 2;
  const int64_t runs = p.in / kRun;
  std::vector<I32> strip(runs * kWords * kWide);
  std::vector<float> so(runs * 3 * kGroup);
  for (int64_t c = c0; c < c1; c += kGroup) {
    for (int64_t k = 0; k < runs; ++k) {
      Q8Unpack<kBits>(p, k, c, strip.data() + k * kWords * kWide, so.data() + k * 3 * kGroup);
    }
    int64_t t = 0;
    for (; t + kPass <= p.tokens; t += kPass) {
      pass(std::integral_constant<int, kPass>{}, t, c, strip.data(), so.data());
    }
    for (; t + 2 <= p.tokens; t += 2) {
      pass(std::integral_constant<int, 2>{}, t, c, strip.data(), so.data());
    }
    if (t < p.tokens) pass(std::integral_constant<int, 1>{}, t, c, strip.data(), so.data());
  }
}

template <int kBits>
void Q8Strips(const Problem& p, const Quantized& q, int64_t c0, int64_t c1) {
  Strips<kBits>(p, c0, c1, [&](auto n, int64_t t, int64_t c, const I32* strip, const float* so) {
    Q8Wide<decltype(n)::value, kBits>(p, q, strip, so, t, c);
  });
}

// Narrow codes with float inputs (`Dot`'s `int8` off): each run of a strip of kGroup columns
// unpacked as `Q8Unpack` does (unsigned bytes, 4 rows of a column a lane), each byte
// widened to a float and multiplied by its row's input, a half run's sums less the codes'
// centre's share then scaled once. The codes are read as the int8 path reads them: at their
// own bits, a thread's run after run.

// Run k's share of y for N tokens against the unpacked strip `w` (scales `s`): `x` each
// token's inputs of the run, `halves` their sums over each half run, `xsum` over the run's
// sub-block (read where its offsets are).
template <int N, int kBits>
inline void F8Run(const Problem& p, int64_t k, const I32* w, const float* s,
                  const float* const* x, const float (*halves)[2], const float* xsum,
                  F (*acc)[kWide]) {
  const float centre = static_cast<float>(Centre<kBits>(p));
  // sums kept apart for few tokens, as `F4Run`'s
  constexpr int kChains = N * kWide >= 4 ? 1 : 4 / (N * kWide);
  for (int h = 0; h < 2; ++h) {
    F part[kChains][N][kWide] = {};
    for (int j = 4 * h; j < 4 * h + 4; ++j) {
      for (int g = 0; g < kWide; ++g) {
        const I32 v = w[j * kWide + g];  // a lane: rows 4j .. 4j + 3 of a column
        for (int r = 0; r < 4; ++r) {
          const F code = __builtin_convertvector((v >> (8 * r)) & 255, F);
          for (int n = 0; n < N; ++n) part[r % kChains][n][g] += x[n][4 * j + r] * code;
        }
      }
    }
    for (int n = 0; n < N; ++n) {
      for (int g = 0; g < kWide; ++g) {
        F dot = part[0][n][g];
        for (int i = 1; i < kChains; ++i) dot += part[i][n][g];
        const F scale = Load(s + h * kGroup + g * kWidth);
        acc[n][g] += (dot - centre * halves[n][h]) * scale;
      }
    }
  }
  if (p.affine && k * kRun % p.block == 0) {
    for (int n = 0; n < N; ++n)
      for (int g = 0; g < kWide; ++g) acc[n][g] += Load(s + 2 * kGroup + g * kWidth) * xsum[n];
  }
}

// Token t + n's inputs of run k, their half runs' sums and the sub-block's sum, for `F8Run`.
template <int N>
inline void F8Inputs(const Problem& p, const float* halves, int64_t t, int64_t k,
                     const float** x, float (*half)[2], float* xsum) {
  const int64_t blocks = p.in / p.block;
  for (int n = 0; n < N; ++n) {
    x[n] = p.x + (t + n) * p.in + k * kRun;
    half[n][0] = halves[((t + n) * p.in + k * kRun) / 16];
    half[n][1] = halves[((t + n) * p.in + k * kRun) / 16 + 1];
    xsum[n] = p.sums[(t + n) * blocks + k * kRun / p.block];
  }
}

// Up to kFew tokens over runs [k0, k1), as `Q8Few` goes: tiles of columns whose y stays in
// L2, each run's strips unpacked and taken at once (AVX2; AVX-512 takes `FNarrowFew`).
template <int N, int kBits>
void F8Few(const Problem& p, const float* halves, int64_t k0, int64_t k1) {
  alignas(64) I32 strip[kWords * kWide];
  alignas(64) float so[3 * kGroup];
  const float* x[N];
  float half[N][2], xsum[N];
  FewWalk<N>(p, k0, k1, [&](int64_t k, int64_t c0, int64_t c1) {
    F8Inputs<N>(p, halves, 0, k, x, half, xsum);
    for (int64_t c = c0; c < c1; c += kGroup) {
      Q8Unpack<kBits>(p, k, c, strip, so);
      F acc[N][kWide];
      for (int n = 0; n < N; ++n)
        for (int g = 0; g < kWide; ++g) acc[n][g] = Load(p.total + n * p.out + c + g * kWidth);
      F8Run<N, kBits>(p, k, strip, so, x, half, xsum, acc);
      for (int n = 0; n < N; ++n)
        for (int g = 0; g < kWide; ++g) Store(p.total + n * p.out + c + g * kWidth, acc[n][g]);
    }
  });
}

// With AVX-512, up to kFew tokens: each load of narrow codes met as it comes, never stored
// (`F8Few`: `Q8Unpack` stores a strip of bytes and `F8Run` reads it again, shifts, masks and
// converts each; the unpacking alone took a third of its time). Each pair of low and top
// words is joined into two words of whole codes as the int8 path joins them
// (`NarrowWords`), then each row's code goes by one masked `vpshufb` into byte 2 of its
// lane, under byte 3's exponent of 1/2: 1/2 + code / 256, a float, no conversion. (Moving a
// code's low nibble and top bits to the top of the mantissa for each row instead took two
// shifts and two `vpternlogd`s a row, the kernel's instruction rate 47 GB/s from cache on
// 2 cores, under what the memory gives.)
#if defined(__AVX512F__)

// fn(std::integral_constant<int, I>{}) for I = 0 .. kCount - 1, each I a constant.
template <typename Fn, int... I>
inline void Unrolled(const Fn& fn, std::integer_sequence<int, I...>) {
  (fn(std::integral_constant<int, I>{}), ...);
}
template <int kCount, typename Fn>
inline void Unrolled(const Fn& fn) {
  Unrolled(fn, std::make_integer_sequence<int, kCount>{});
}

// Row kR of a word of whole codes (byte kR of each lane) as 1/2 + code / 256.
template <int kR>
inline F Halves(I32 codes) {
  // byte 2 of lane j of each 16-byte lane from its byte 4 j + kR; bytes 0, 1 and 3 kept
  const __m512i from = _mm512_broadcast_i32x4(
      _mm_setr_epi32(kR << 16, (4 + kR) << 16, (8 + kR) << 16, (12 + kR) << 16));
  const __m512i half = _mm512_set1_epi32(0x3F000000);
  return (F)_mm512_mask_shuffle_epi8(half, 0x4444444444444444ull, (__m512i)codes, from);
}

// Word j of a run's narrow codes for 16 columns from `group` (8 columns' words, the next
// 8's 32 * kBits bytes on).
template <int kBits>
inline I32 NarrowWord(const uint8_t* group, int j) {
  const auto* at = reinterpret_cast<const __m256i*>(group + 32 * j);
  return (I32)_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(at)),
                                 _mm256_loadu_si256(at + kBits), 1);
}

// Run k's share of columns [c0, c1) of N tokens' y; `halves` each token's inputs' sums over
// half runs (a half run: rows 16h .. 16h + 15, the smallest sub-block).
template <int N, int kBits>
inline void FNarrowRun(const Problem& p, const float* halves, int64_t k, int64_t c0,
                       int64_t c1) {
  constexpr int e = kBits - 4;  // top bits a code; words m, m + e, .. share top word m
  // chains a half run: its two halves' sums are 8 chains at four tokens already (with two
  // each, 16 sums, the 3B's head read from memory 15-20% slower at four tokens)
  constexpr int kChains = N >= 4 ? 1 : FloatChains(N);
  // 256 x (1/2 + code / 256) is the code plus 128
  const float centre = 128.0f + static_cast<float>(Centre<kBits>(p));
  const int64_t b = k * kRun / p.block, next = p.block < kRun ? b + 1 : b;
  const bool offsets = p.affine && k * kRun % p.block == 0;
  const float* x[N];
  float half[N][2], xsum[N];
  F8Inputs<N>(p, halves, 0, k, x, half, xsum);
  const auto* codes = static_cast<const uint8_t*>(p.codes);
  const I32 nibble = (I32)_mm512_set1_epi8(0x0f);
  const I32 tops = (I32)_mm512_set1_epi8(((1 << e) - 1) * 0x11);
  for (int64_t c = c0; c < c1; c += kWidth) {
    const uint8_t* group = codes + (k * p.out + c) * NarrowBytes(kBits);
    for (int64_t line = 0; line < kWidth * NarrowBytes(kBits); line += 64) {  // the next run's
      __builtin_prefetch(group + p.out * NarrowBytes(kBits) + line);
    }
    F dot[2][kChains][N] = {};
    Unrolled<e>([&](auto m) {
      const I32 top = NarrowWord<kBits>(group, 4 + m);
      Unrolled<4 / e>([&](auto s) {  // words W and W + 4: top bits at e * s and 4 + e * s
        constexpr int W = decltype(m)::value + e * decltype(s)::value;
        const I32 low = NarrowWord<kBits>(group, W);
        const I32 t = (top >> (e * decltype(s)::value)) & tops;
        const I32 words[2] = {(low & nibble) | ((t << 4) & ~nibble),
                              ((low >> 4) & nibble) | (t & ~nibble)};
        Unrolled<4>([&](auto r) {
          constexpr int R = decltype(r)::value;
          for (int h = 0; h < 2; ++h) {
            const F v = Halves<R>(words[h]);
            F* sums = dot[h][(W * 4 + R) % kChains];
            for (int n = 0; n < N; ++n) sums[n] += x[n][16 * h + 4 * W + R] * v;
          }
        });
      });
    });
    const F s[2] = {p.scale.Vec(b, c), p.scale.Vec(next, c)};
    const F o = offsets ? p.offset.Vec(b, c) : F{};
    for (int n = 0; n < N; ++n) {
      F out = o * xsum[n];
      for (int h = 0; h < 2; ++h) {
        F sum = dot[h][0][n];
        for (int i = 1; i < kChains; ++i) sum += dot[h][i][n];
        out += (256.0f * sum - centre * half[n][h]) * s[h];
      }
      float* y = p.total + n * p.out + c;
      Store(y, Load(y) + out);
    }
  }
}

// Up to kFew tokens over runs [k0, k1), as `F4Few` goes.
template <int N, int kBits>
void FNarrowFew(const Problem& p, const float* halves, int64_t k0, int64_t k1) {
  FewWalk<N>(p, k0, k1, [&](int64_t k, int64_t c0, int64_t c1) {
    FNarrowRun<N, kBits>(p, halves, k, c0, c1);
  });
}
#endif

// Past kFew tokens: a strip at a time (`Strips`), a few tokens at a time down it.
template <int kBits>
void F8Strips(const Problem& p, const float* halves, int64_t c0, int64_t c1) {
  const int64_t runs = p.in / kRun;
  Strips<kBits>(p, c0, c1, [&](auto n, int64_t t, int64_t c, const I32* strip, const float* so) {
    constexpr int N = decltype(n)::value;
    F acc[N][kWide] = {};
    const float* x[N];
    float half[N][2], xsum[N];
    for (int64_t k = 0; k < runs; ++k) {
      F8Inputs<N>(p, halves, t, k, x, half, xsum);
      F8Run<N, kBits>(p, k, strip + k * kWords * kWide, so + k * 3 * kGroup, x, half, xsum, acc);
    }
    for (int i = 0; i < N; ++i)
      for (int g = 0; g < kWide; ++g) Store(p.total + (t + i) * p.out + c + g * kWidth, acc[i][g]);
  });
}

// Packed codes in `Tile`'s order with float inputs (`Dot`'s `tiled`): up to kFew tokens
// `FewRun`'s walk (`F4Few`), past that tiles of columns (`F4Columns`), each load's codes
// meeting the inputs as floats without a conversion. A code's 4 bits moved to the top
// of a float's mantissa under 1.0's exponent read as 1 + code / 16 (a shift and a
// `vpternlogd` a vector, where widening and converting take three), so a run's sum is its
// inputs' sum plus its dot with the codes / 16, the first taken off once a run with the
// centre's (and the offsets') share. In the packed order a thread's codes came as 16
// streams `out` bytes apart (`Part`): an 8B FFN's read from memory at 24-27 GB/s on 2
// cores, where one stretch end to end is read at the int8 path's 35-45.

// The codes at bits [kBit, kBit + 4) of each lane as 1 + code / 16.
template <int kBit>
inline F Sixteenths(I32 a) {
  I32 top;
  if constexpr (kBit <= 19) top = a << (19 - kBit);
  else top = a >> (kBit - 19);  // bits shifted in from the sign lie outside the mask
  return (F)((top & 0x00780000) | 0x3F800000);
}

// Code kBit of `a`'s lanes times input i of each token, into acc.
template <int N, int kBit>
inline void F4Meet(I32 a, const float* const* x, int i, F* acc) {
  const F v = Sixteenths<kBit>(a);
  for (int n = 0; n < N; ++n) acc[n] += x[n][i] * v;
}

// Run k's share of columns [c0, c1) of N tokens' y; `halves` each token's inputs' sums over
// half runs.
template <int N>
inline void F4Run(const Problem& p, const float* halves, int64_t k, int64_t c0, int64_t c1) {
  const int64_t b = k * kRun / p.block;
  const float centre = p.affine ? 0.0f : 8.0f;
  const float* x[N];
  float sum[N];
  for (int n = 0; n < N; ++n) {
    x[n] = p.x + n * p.in + k * kRun;
    sum[n] = halves[(n * p.in + k * kRun) / 16] + halves[(n * p.in + k * kRun) / 16 + 1];
  }
  for (int64_t c = c0; c < c1; c += kWidth) {
    const uint8_t* tile = Tile(p, k, c);
    for (int64_t line = 0; line < kWidth * kRun / 2; line += 64) {  // the next run's
      __builtin_prefetch(tile + (kRun / 2) * p.out + line);
    }
    constexpr int kChains = FloatChains(N);
    F acc[kChains][N] = {};
    for (int j = 0; j < 4; ++j) {  // word j: rows 4j.. in low nibbles, 16 + 4j.. in high
      const I32 a = FewCodes(tile, j);
      F* low = acc[2 * j % kChains];
      F* high = acc[(2 * j + 1) % kChains];
      F4Meet<N, 0>(a, x, 4 * j, low);
      F4Meet<N, 8>(a, x, 4 * j + 1, low);
      F4Meet<N, 16>(a, x, 4 * j + 2, low);
      F4Meet<N, 24>(a, x, 4 * j + 3, low);
      F4Meet<N, 4>(a, x, 16 + 4 * j, high);
      F4Meet<N, 12>(a, x, 17 + 4 * j, high);
      F4Meet<N, 20>(a, x, 18 + 4 * j, high);
      F4Meet<N, 28>(a, x, 19 + 4 * j, high);
    }
    const F s = p.scale.Vec(b, c);
    const F base = (p.affine ? p.offset.Vec(b, c) : F{}) - s * (16.0f + centre);
    for (int n = 0; n < N; ++n) {
      F dot = acc[0][n];
      for (int i = 1; i < kChains; ++i) dot += acc[i][n];
      float* y = p.total + n * p.out + c;
      Store(y, Load(y) + s * 16.0f * dot + base * sum[n]);
    }
  }
}

template <int N>
void F4Few(const Problem& p, const float* halves, int64_t k0, int64_t k1) {
  FewWalk<N>(p, k0, k1, [&](int64_t k, int64_t c0, int64_t c1) { F4Run<N>(p, halves, k, c0, c1); });
}

// Columns [c0, c1) for any number of tokens: tiles of columns whose codes fit a core's L2
// (`Columns`' kTileBytes), each read from memory once and from the cache for every further
// chunk of kChunk tokens, a chunk's y a run at a time. (The narrow strips at 4 bits, each
// code widened to a float once for four tokens, ran SmolLM2's 8 and 16 tokens 15-18% slower
// than the packed order's chunks of 8.)
void F4Columns(const Problem& p, const float* halves, int64_t c0, int64_t c1) {
  const int64_t tile = std::max<int64_t>(kGroup, kTileBytes / (p.in / 2) / kGroup * kGroup);
  for (int64_t c = c0; c < c1; c += tile) {
    const int64_t end = std::min(c + tile, c1);
    Chunks(p.tokens, [&](auto n, int64_t t0) {
      Problem chunk = p;
      chunk.x += t0 * p.in;
      chunk.total += t0 * p.out;
      for (int t = 0; t < decltype(n)::value; ++t) {
        std::fill(chunk.total + t * p.out + c, chunk.total + t * p.out + end, 0.0f);
      }
      for (int64_t k = 0; k < p.in / kRun; ++k) {
        F4Run<decltype(n)::value>(chunk, halves + t0 * p.in / 16, k, c, end);
      }
    });
  }
}
#endif

// Scores y [tokens, rows] = x [tokens, in] @ w.T of a table w [rows, in] (a tied LM head:
// the embedding table), sub-blocks along `in`, so a row's codes lie side by side: each row
// is dotted a vector at a time with every token's inputs, scaled per sub-block into one
// vector a token; a vector's worth of rows' vectors are summed across lanes together.
struct Table {
  const float* x;       // [tokens, in]
  const float* sums;    // [tokens, in / block]
  const void* codes;    // [rows, in] (packed: [rows, in / 2])
  Scales scale;         // [rows, in / block]
  Scales offset;        // [rows, in / block] (read when `affine`)
  float* y;             // [tokens, rows]
  int64_t tokens, rows, in, block;
  bool affine;
};

// Each vector of codes is scaled once for all the tokens that meet it: a Q8_0 sub-block costs
// 2N multiply-adds and 2 multiplies, where a dot of the codes scaled once a sub-block a token
// took 3N (at a few tokens a table's float products are bound by the FMA pipes: SmolLM2's
// 49152-row head at 8 tokens, a speculative step verifying 7 drafts, 8.3 -> 7.8 ms of CPU,
// 2-core AVX-512 EPYC). The sums go in FloatChains(N) chains, sub-block after sub-block.
template <typename T, int N>
void TableRows(const Table& p, int64_t t0, int64_t r0, int64_t r1) {
  constexpr bool kPacked = std::is_same_v<T, uint8_t>;
  constexpr int kChains = FloatChains(N);
  const int64_t blocks = p.in / p.block, held = kPacked ? p.in / 2 : p.in;
  const int64_t vectors = (kPacked ? p.block / 2 : p.block) / kWidth;  // a sub-block's
  const float center = kPacked && !p.affine ? 8.0f : 0.0f;
  const bool shifted = p.affine || center != 0;  // else the sub-blocks' sums are not read
  const float* x = p.x + t0 * p.in;
  // a vector of rows' sums, summed across lanes together (`LaneSums`), a token's at a time
  F rows[N][kWidth];
  alignas(64) float shifts[N][kWidth] = {};
  std::vector<float> buffers(2 * blocks);  // a row's scales and offsets, if not float32
  for (int64_t r = r0; r < r1; ++r) {
    const float* scale = p.scale.Row(r, buffers.data());
    const float* offset = p.affine ? p.offset.Row(r, buffers.data() + blocks) : nullptr;
    const T* codes = static_cast<const T*>(p.codes) + r * held;
    __builtin_prefetch(codes + 4 * held);  // a few rows ahead (a row is ~one page or less)
    const int64_t lane = (r - r0) % kWidth;
    // sub-block b's products added to `acc` (one chain's N sums)
    const auto block = [&](int64_t b, F* acc) __attribute__((always_inline)) {
      const F s = F{} + scale[b];
      for (int64_t k = 0; k < vectors; ++k) {
        // packed: byte j of a run of 32 values holds j and j + 16
        const I32 q = Widen(codes + b * (kPacked ? p.block / 2 : p.block) + k * kWidth);
        const F lo = __builtin_convertvector(kPacked ? q & 15 : q, F) * s;
        const int64_t v = b * p.block + (kPacked ? 32 * (k * kWidth / 16) + k * kWidth % 16 : k * kWidth);
        for (int t = 0; t < N; ++t) acc[t] += Load(x + t * p.in + v) * lo;
        if constexpr (kPacked) {
          const F hi = __builtin_convertvector(q >> 4, F) * s;
          for (int t = 0; t < N; ++t) acc[t] += Load(x + t * p.in + v + 16) * hi;
        }
      }
      if (shifted) {
        const float shift = (p.affine ? offset[b] : 0.0f) - center * scale[b];
        for (int t = 0; t < N; ++t) shifts[t][lane] += shift * p.sums[(t0 + t) * blocks + b];
      }
    };
    F acc[kChains][N] = {};
    int64_t b = 0;
    for (; b + kChains <= blocks; b += kChains) {
      // unrolled, each chain's sums stay in registers (left a loop, GCC kept them in memory:
      // 1 and 4 tokens 1.6-2x slower)
#pragma GCC unroll 4
      for (int c = 0; c < kChains; ++c) block(b + c, acc[c]);
    }
    for (; b < blocks; ++b) block(b, acc[0]);
    for (int t = 0; t < N; ++t) {
      F sum = acc[0][t];
      for (int c = 1; c < kChains; ++c) sum += acc[c][t];
      rows[t][lane] = sum;
    }
    if (lane == kWidth - 1) {
      for (int t = 0; t < N; ++t) {
        Store(p.y + (t0 + t) * p.rows + r - lane, LaneSums(rows[t]) + Load(shifts[t]));
        std::fill(shifts[t], shifts[t] + kWidth, 0.0f);
      }
    } else if (r == r1 - 1) {
      for (int t = 0; t < N; ++t) {
        for (int64_t l = 0; l <= lane; ++l) {
          p.y[(t0 + t) * p.rows + r - lane + l] = Lanes(rows[t][l]) + shifts[t][l];
        }
      }
    }
  }
}

template <typename T>
void TableColumns(const Table& p, int64_t r0, int64_t r1) {
  Chunks(p.tokens, [&](auto n, int64_t t0) { TableRows<T, decltype(n)::value>(p, t0, r0, r1); });
}

#if defined(__AVX2__)
// Scores with int8 inputs against a table of int8 codes (a tied Q6_K or Q8_0 head): a row's
// run of 32 codes is one load, dotted with a token's 32 rounded inputs as they lie in memory
// (`vpsignb`, `vpmaddubsw` as `Run8`'s), the pairs widened in fours (`vpmaddwd`): lanes 0-3
// the run's first 16 inputs, 4-7 its last 16, each half scaled by its sub-block's scale (sub-
// blocks of 16, or of whole runs), summed across lanes once a row. Symmetric codes only: no
// sums of the inputs are read. `kTwo`: Q6_K's two levels as the file holds them (an int8 a
// 16, a float16 a 256: 8.56 bits a weight, not 10 with a float32 a 16), the int8 sub-scales
// multiplied in by `vpmaddwd` itself, the float16 once a super-block of 8 runs.
inline float LaneSum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

constexpr int64_t kSupers = 16;  // sub-scales a super-scale of a two-level table's (Q6_K's)
// `vpshufb` masks: run j's two sub-scales (2j, 2j + 1 of the 16 in both lanes) as the high
// bytes of 16-bit words, 2j's in the low lane's words and 2j + 1's in the high lane's, the
// low bytes zero (an arithmetic shift by 8 then widens them with their sign)
struct Picks {
  alignas(32) int8_t mask[kSupers / 2][32];
  Picks() {
    for (int j = 0; j < kSupers / 2; ++j) {
      for (int b = 0; b < 32; ++b) mask[j][b] = b % 2 ? int8_t(2 * j + b / 16) : int8_t(-128);
    }
  }
};
const Picks kPicks;

template <int N, bool kTwo>
void TableInt8Rows(const Table& p, const Quantized& q, int64_t t0, int64_t r0, int64_t r1) {
  const int64_t runs = p.in / kRun;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = r0; r < r1; ++r) {
    const auto* codes = static_cast<const int8_t*>(p.codes) + r * p.in;
    __builtin_prefetch(codes + 4 * p.in);  // a few rows ahead (as `TableRows`)
    __m256 acc[N];
    for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
    // a run's products, as `vpmaddubsw` pairs them, into token n's float sums
    const auto dot = [&](int64_t k, __m256i a, __m256i scale16, __m256 scale, __m256* sums) {
      const __m256i size = _mm256_abs_epi8(a);
      for (int n = 0; n < N; ++n) {
        const auto* x = q.words + (t0 + n) * p.in / 4 + k * kWords;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(xv, a));
        const __m256 d = _mm256_mul_ps(scale, _mm256_set1_ps(q.step[(t0 + n) * runs + k]));
        sums[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale16)), d,
                                  sums[n]);
      }
    };
    const auto load = [&](int64_t k) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + kRun * k));
    };
    if constexpr (kTwo) {
      const auto* sub = static_cast<const int8_t*>(p.scale.data) + r * p.scale.stride;
      const uint16_t* super = p.scale.super + r * (p.scale.stride / kSupers);
      const __m256 one = _mm256_set1_ps(1.0f);
      for (int64_t g = 0; g < runs / (kSupers / 2); ++g) {
        const __m256i subs = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kSupers * g)));
        __m256 part[N];
        for (int n = 0; n < N; ++n) part[n] = _mm256_setzero_ps();
        for (int64_t j = 0; j < kSupers / 2; ++j) {
          const __m256i pick = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPicks.mask[j]));
          const __m256i scale16 = _mm256_srai_epi16(_mm256_shuffle_epi8(subs, pick), 8);
          dot(g * (kSupers / 2) + j, load(g * (kSupers / 2) + j), scale16, one, part);
        }
        const __m256 u = _mm256_set1_ps(Half(super[g]));
        for (int n = 0; n < N; ++n) acc[n] = _mm256_fmadd_ps(part[n], u, acc[n]);
      }
    } else {
      for (int64_t k = 0; k < runs; ++k) {
        const int64_t b = k * kRun / p.block;
        const __m256 scale =
            p.block < kRun ? _mm256_setr_m128(_mm_set1_ps(p.scale.At(r, b)),
                                              _mm_set1_ps(p.scale.At(r, b + 1)))
                           : _mm256_set1_ps(p.scale.At(r, b));
        dot(k, load(k), ones, scale, acc);
      }
    }
    for (int n = 0; n < N; ++n) p.y[(t0 + n) * p.rows + r] = LaneSum8(acc[n]);
  }
}
#endif

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

// A few tokens' y: the contraction's `units` (sub-blocks, or runs) split over the threads,
// `run(share, u0, u1)` summing units [u0, u1) into share.total (y, or a buffer of its own,
// added to y after), so that each thread reads one stretch of the codes end to end. (Split
// by columns, the threads' halves of every row interleave: a one-token stack ran 1.15x
// slower.) Up to kShareThreads threads: past that the shares' sum (on one thread) grows,
// and the columns keep every thread busy as they are.
constexpr int64_t kShareThreads = 4;
template <typename Run>
void Shares(ffi::ThreadPool& pool, const Problem& p, int64_t units, const Run& run) {
  const int64_t parts = std::min<int64_t>(pool.num_threads(), units), size = p.tokens * p.out;
  std::vector<float> shares((parts - 1) * size);
  Parallel(pool, parts, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      Problem share = p;
      if (i > 0) share.total = shares.data() + (i - 1) * size;
      run(share, units * i / parts, units * (i + 1) / parts);
    }
  });
  for (int64_t i = 1; i < parts; ++i) {
    for (int64_t e = 0; e < size; ++e) p.total[e] += shares[(i - 1) * size + e];
  }
}

// `p` with its sub-blocks cut into finer ones of at most kFineRows rows (whole runs of 32
// inputs, packed codes' unit), at least `threads` of them, their scales and offsets repeated
// (held in `finer`). Per-channel weights hold one sub-block of every row: a column group's
// `Part` then walks all rows down a stride of `out` bytes (at 2048 x 8192 int8, 1 token:
// 32 ms where 32-row sub-blocks take 4; 7x at 16 and 64 tokens), and `Shares` could give the
// contraction to one thread only. The same products, summed in more parts.
constexpr int64_t kFineRows = 32;
struct Finer {
  std::vector<float> scale, offset;
};
Problem Refine(const Problem& p, int64_t threads, Finer& finer) {
  const int64_t blocks = p.in / p.block;
  int64_t f = std::max<int64_t>((threads + blocks - 1) / blocks, p.block / kFineRows);
  while (f > 1 && p.block % (f * 32)) --f;
  if (f == 1) return p;
  const auto repeat = [&](Scales from, std::vector<float>& to) {
    to.resize(blocks * f * p.out);
    for (int64_t b = 0; b < blocks * f; ++b) {
      for (int64_t c = 0; c < p.out; ++c) to[b * p.out + c] = from.At(b / f, c);
    }
    return Scales{to.data(), Scales::kF32, p.out};
  };
  Problem fine = p;
  fine.block = p.block / f;
  fine.scale = repeat(p.scale, finer.scale);
  if (p.affine) fine.offset = repeat(p.offset, finer.offset);
  return fine;
}

// The scale and offset buffers `[..., rows, stride]` as `Scales`: both float32, both float16,
// or both int8 times `supers` (scale's and offset's: float16 `[..., rows / group, stride]`, a
// group a power of 2; a table's, `columns`: `[rows, stride / group]`).
constexpr const char* kScaleTypes =
    "qdot: scales and offsets must both be float32, float16, or int8 beside float16 "
    "super-scales a power of 2 of sub-blocks each";
bool Held(const ffi::AnyBuffer& scale, const ffi::AnyBuffer& offset,
          const ffi::AnyBuffer* supers, int64_t stride, bool columns, Scales& s, Scales& o) {
  using T = ffi::DataType;
  const auto type = scale.element_type();
  if (offset.element_type() != type) return false;
  if (type == T::F32 || type == T::F16) {
    const auto kind = type == T::F32 ? Scales::kF32 : Scales::kF16;
    s = {scale.untyped_data(), kind, stride};
    o = {offset.untyped_data(), kind, stride};
    return true;
  }
  if (type != T::S8 || supers == nullptr || supers[0].element_type() != T::F16 ||
      supers[1].element_type() != T::F16) {
    return false;
  }
  const auto d = scale.dimensions(), u = supers[0].dimensions();
  const size_t along = columns ? 1 : 2;  // the axis the groups run along, from the end
  const int64_t subs = d[d.size() - along], groups = u[u.size() - along];
  if (groups == 0 || subs % groups || (subs / groups) & (subs / groups - 1)) return false;
  for (int i = 0; i < 2; ++i) {  // each as many as its sub-scales' groups
    const auto& sub = i == 0 ? scale : offset;
    if (supers[i].element_count() * (subs / groups) != sub.element_count()) return false;
  }
  const int shift = __builtin_ctzll(subs / groups);
  const int rshift = columns ? 0 : shift, cshift = columns ? shift : 0;
  const auto half = [](const ffi::AnyBuffer& b) {
    return static_cast<const uint16_t*>(b.untyped_data());
  };
  s = {scale.untyped_data(), Scales::kI8, stride, half(supers[0]), rshift, cshift};
  o = {offset.untyped_data(), Scales::kI8, stride, half(supers[1]), rshift, cshift};
  return true;
}

// A stack's codes in the order its kernels read them (`Dot`, `DotId`: the kernels' own with
// int8 inputs and narrow codes, packed ones either way), and its scales and offsets as
// `Scales` in `s` and `o`.
template <typename T, int kBits>
ffi::Error StackScales(bool int8, bool tiled, const ffi::AnyBuffer& scale,
                       const ffi::AnyBuffer& offset, const ffi::AnyBuffer& scale_super,
                       const ffi::AnyBuffer& offset_super, int64_t out, Scales& s, Scales& o) {
  constexpr bool kNarrow = kBits < 8;
  constexpr bool kPacked = std::is_same_v<T, uint8_t> && !kNarrow;
  if (tiled != (int8 || kNarrow) && !(kPacked && tiled)) {
    return ffi::Error::InvalidArgument(
        "qdot: codes lie in the kernels' order with int8 inputs, narrow or packed");
  }
  const ffi::AnyBuffer supers[2] = {scale_super, offset_super};
  if (!Held(scale, offset, supers, out, false, s, o)) {
    return ffi::Error::InvalidArgument(kScaleTypes);
  }
  return ffi::Error::Success();
}

// y [tokens, out] = x [tokens, in] @ layer `layer` of a stack of weights: codes [layers,
// rows, out], scale and offset [layers, in / block, out] (int8 ones: times scale_super and
// offset_super [layers, in / block / group, out]; float ones: those unread) (a layer read
// where it lies: a slice XLA cut out of the stack would be a copy of it). `kBits` below 8:
// narrow codes [layers, in / 32 * 4 * kBits, out] (uint8, `Run8`'s order). `tiled`: the
// codes lie in `Tile`'s order (`Run8`'s for int8 ones): always with int8 inputs and narrow
// codes, packed ones with float inputs too where the loader laid them so.
template <typename T, int kBits = 8>
ffi::Error Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
               ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer scale_super,
               ffi::AnyBuffer offset_super, ffi::Buffer<ffi::S32> layer,
               ffi::ResultBuffer<ffi::F32> y, bool affine, bool int8, bool tiled) {
  constexpr bool kNarrow = kBits < 8;
  constexpr bool kPacked = std::is_same_v<T, uint8_t> && !kNarrow;
  const int64_t tokens = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t layers = codes.dimensions()[0], rows = codes.dimensions()[1];
  const int64_t out = codes.dimensions()[2], blocks = scale.dimensions()[1];
  const int64_t block = in / blocks, l = layer.typed_data()[0];
  const int64_t held = kNarrow ? in / 32 * NarrowBytes(kBits) : kPacked ? in / 2 : in;
  if (out % kLanes || in % blocks || rows != held || (kPacked && block % 32) ||
      ((kNarrow || tiled) && (in % 32 || out % 32)) || l < 0 || l >= layers) {
    return ffi::Error::InvalidArgument("qdot: unsupported shape or layer");
  }
  Scales s, o;
  if (auto e = StackScales<T, kBits>(int8, tiled, scale, offset, scale_super, offset_super,
                                     out, s, o);
      e.failure()) {
    return e;
  }
  Problem p{x.typed_data(),
            nullptr,
            static_cast<const T*>(codes.untyped_data()) + l * rows * out,
            s.Layer(l, blocks),
            o.Layer(affine ? l : 0, blocks),
            y->typed_data(),
            tokens, in, out, block, affine};
  std::vector<float> sums;
  if (int8) {
#if defined(__AVX2__)
    // int8 codes: sub-blocks of whole runs, or (two-level, symmetric: Q6_K's) of half ones
    const bool runs_whole = block % kRun == 0 || (!kPacked && block == kRun / 2 &&
                                                  s.kind == Scales::kI8 && !affine);
    if (out % kGroup || !runs_whole) {
      return ffi::Error::InvalidArgument("qdot: int8 inputs need whole groups and runs");
    }
    std::vector<int32_t> words, halves;
    std::vector<float> step;
    Quantize(x.typed_data(), tokens, in, block, words, step, sums, kPacked ? nullptr : &halves);
    const Quantized q{words.data(), step.data(), halves.data()};
    p.sums = sums.data();
    if (tokens <= (kPacked ? kFewPacked : kFew) && pool.num_threads() <= kShareThreads) {
      Chunks(tokens, [&](auto n, int64_t t0) {
        constexpr int N = decltype(n)::value;
        Problem g = p;
        g.tokens = N;
        g.x += t0 * in;
        g.sums += t0 * (in / block);
        g.total += t0 * out;
        const Quantized qg{q.words + t0 * (in / 4), q.step + t0 * (in / kRun),
                           kPacked ? nullptr : q.halves + t0 * (in / 16)};
        Shares(pool, g, in / kRun, [&](const Problem& share, int64_t k0, int64_t k1) {
          if constexpr (kPacked) QFew<N>(share, qg, k0, k1);
          else if constexpr (N <= kFew) Q8Few<N, kBits>(share, qg, k0, k1);
        });
      });
      return ffi::Error::Success();
    }
    if (kNarrow || (!kPacked && kWideVnni)) {
      Parallel(pool, out / kGroup, [&](int64_t u0, int64_t u1) {
        Q8Strips<kBits>(p, q, u0 * kGroup, u1 * kGroup);
      });
      return ffi::Error::Success();
    }
    if (!kPacked) {
      Parallel(pool, out / 8,
               [&](int64_t u0, int64_t u1) { Q8Columns(p, q, u0 * 8, u1 * 8); });
      return ffi::Error::Success();
    }
    Parallel(pool, out / kGroup, [&](int64_t u0, int64_t u1) {
      QColumns(p, q, u0 * kGroup, u1 * kGroup, 0, in / kRun);
    });
    return ffi::Error::Success();
#else
    return ffi::Error::InvalidArgument("qdot: int8 inputs need AVX2");
#endif
  }
  if constexpr (kNarrow || kPacked) {
    if (tiled) {
#if defined(__AVX2__)
      if constexpr (kNarrow) {  // the offsets' share by sub-block (`F4Run` takes it by run)
        sums = Sums(x.typed_data(), tokens, in, block);
        p.sums = sums.data();
      }
      const std::vector<float> halves = Sums(x.typed_data(), tokens, in, kRun / 2);
      if (tokens <= kFew && pool.num_threads() <= kShareThreads) {
        Shares(pool, p, in / kRun, [&](const Problem& share, int64_t k0, int64_t k1) {
          Chunks(tokens, [&](auto n, int64_t) {  // one chunk: at most kFew tokens
            if constexpr (decltype(n)::value <= kFew) {
              if constexpr (kPacked) F4Few<decltype(n)::value>(share, halves.data(), k0, k1);
#if defined(__AVX512F__)
              else FNarrowFew<decltype(n)::value, kBits>(share, halves.data(), k0, k1);
#else
              else F8Few<decltype(n)::value, kBits>(share, halves.data(), k0, k1);
#endif
            }
          });
        });
        return ffi::Error::Success();
      }
      Parallel(pool, out / kGroup, [&](int64_t u0, int64_t u1) {
        if constexpr (kPacked) F4Columns(p, halves.data(), u0 * kGroup, u1 * kGroup);
        else F8Strips<kBits>(p, halves.data(), u0 * kGroup, u1 * kGroup);
      });
      return ffi::Error::Success();
#else
      return ffi::Error::InvalidArgument("qdot: codes in the kernels' order need AVX2");
#endif
    }
  }
  Finer finer;
  Problem fine = Refine(p, pool.num_threads(), finer);
  sums = Sums(x.typed_data(), tokens, in, fine.block);
  fine.sums = sums.data();
  if (tokens <= kChunk && pool.num_threads() <= kShareThreads) {
    Shares(pool, fine, in / fine.block, [&](const Problem& share, int64_t b0, int64_t b1) {
      Columns<T>(share, 0, out, b0, b1);
    });
    return ffi::Error::Success();
  }
  Parallel(pool, out / kLanes, [&](int64_t u0, int64_t u1) {
    Columns<T>(fine, u0 * kLanes, u1 * kLanes, 0, in / fine.block);
  });
  return ffi::Error::Success();
}

// Scores y [tokens, rows] = x [tokens, in] @ w.T, w [rows, in] as codes [rows, in] (packed:
// in / 2), scale and offset [rows, in / block] (int8 ones: times scale_super and offset_super
// [rows, in / block / group]; float ones: those unread).
template <typename T>
ffi::Error DotT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer scale_super,
                ffi::AnyBuffer offset_super, ffi::ResultBuffer<ffi::F32> y, bool affine,
                bool int8) {
  constexpr bool kPacked = std::is_same_v<T, uint8_t>;
  const int64_t tokens = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t rows = codes.dimensions()[0], blocks = scale.dimensions()[1];
  const int64_t block = in / blocks;
  if (in % blocks || codes.dimensions()[1] != (kPacked ? in / 2 : in) ||
      (kPacked ? block % 32 : block % kWidth)) {
    return ffi::Error::InvalidArgument("qdot: unsupported shape");
  }
  Scales s, o;
  const ffi::AnyBuffer supers[2] = {scale_super, offset_super};
  if (!Held(scale, offset, supers, blocks, true, s, o)) {
    return ffi::Error::InvalidArgument(kScaleTypes);
  }
  if (int8) {
#if defined(__AVX2__)
    const bool two = s.kind == Scales::kI8;
    if (kPacked || affine || (block % kRun && block != kRun / 2) ||
        (two && (block != kRun / 2 || (1 << s.cshift) != kSupers))) {
      return ffi::Error::InvalidArgument(
          "qdot: int8 inputs need a table of symmetric int8 codes (two-level: Q6_K's)");
    }
    std::vector<int32_t> words;
    std::vector<float> step, sums;
    Quantize(x.typed_data(), tokens, in, block, words, step, sums, nullptr);
    const Quantized q{words.data(), step.data(), nullptr};
    const Table p{x.typed_data(), sums.data(),     codes.untyped_data(), s, o,
                  y->typed_data(), tokens, rows, in, block, affine};
    Parallel(pool, rows, [&](int64_t r0, int64_t r1) {
      Chunks(tokens, [&](auto n, int64_t t0) {
        if (two) TableInt8Rows<decltype(n)::value, true>(p, q, t0, r0, r1);
        else TableInt8Rows<decltype(n)::value, false>(p, q, t0, r0, r1);
      });
    });
    return ffi::Error::Success();
#else
    return ffi::Error::InvalidArgument("qdot: int8 inputs need AVX2");
#endif
  }
  const std::vector<float> sums = Sums(x.typed_data(), tokens, in, block);
  const Table p{x.typed_data(), sums.data(),     codes.untyped_data(), s, o,
                y->typed_data(), tokens, rows, in, block, affine};
  Parallel(pool, rows, [&](int64_t r0, int64_t r1) { TableColumns<T>(p, r0, r1); });
  return ffi::Error::Success();
}

// `Dot` over narrow codes, their bits (5 or 6) told by their rows.
ffi::Error DotNarrow(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                     ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer scale_super,
                     ffi::AnyBuffer offset_super, ffi::Buffer<ffi::S32> layer,
                     ffi::ResultBuffer<ffi::F32> y, bool affine, bool int8, bool tiled) {
  const bool five = codes.dimensions()[1] * 32 == x.dimensions()[1] * NarrowBytes(5);
  return (five ? Dot<uint8_t, 5> : Dot<uint8_t, 6>)(pool, x, codes, scale, offset, scale_super,
                                                    offset_super, layer, y, affine, int8, tiled);
}

// --- Routed experts (llama.cpp's `mul_mat_id`) --------------------------------------------
// A mixture's few-token step: each (token, expert) pair's input against its expert's matrix
// in stacks [layers, experts, ...] read where they lie, only the routed pairs' products. The
// pairs sorted by expert, each expert's rows meet its codes together (read once for all of
// them, in chunks of the few-token readers' tokens), and the work (expert, stretch of the
// contraction) goes to XLA's threads as they come free: one call a projection of a layer,
// where tiles of 16 rows, one expert's each, went one after another through `Dot`.

// `run(n, t0)` on the tokens in chunks of at most 4 (the readers that take each run as it
// is unpacked: `Q8Few`, `F4Few`, `F8Few`, `FNarrowFew`), as `Chunks` goes.
template <typename Run>
void FewChunks(int64_t tokens, const Run& run) {
  for (int64_t t0 = 0; t0 < tokens; t0 += 4) {
    switch (std::min<int64_t>(tokens - t0, 4)) {
      case 1: run(std::integral_constant<int, 1>{}, t0); break;
      case 2: run(std::integral_constant<int, 2>{}, t0); break;
      case 3: run(std::integral_constant<int, 3>{}, t0); break;
      default: run(std::integral_constant<int, 4>{}, t0); break;
    }
  }
}

// The pairs' inputs in expert order, as the readers take them: `x` [pairs, in] and per
// path its rounded words (int8 inputs) or sums.
struct IdInputs {
  std::vector<float> x, sums, halves, step;
  std::vector<int32_t> words, int_halves;
};

// `p` (an expert's weights, its tokens [0, n) at `p.x`'s row 0) from row t0, n rows
Problem IdRows(Problem p, int64_t t0, int64_t n) {
  p.x += t0 * p.in;
  if (p.sums != nullptr) p.sums += t0 * (p.in / p.block);
  p.total += t0 * p.out;
  p.tokens = n;
  return p;
}

// An expert's rows [r0, r0 + n) of the sorted pairs, units [u0, u1) of the contraction
// (runs of 32 with int8 inputs or tiled codes, sub-blocks otherwise), summed into `total`
// [n, out].
template <typename T, int kBits>
void IdPart(Problem p, const IdInputs& in, int64_t r0, int64_t n, int64_t u0, int64_t u1,
            float* total, bool int8, bool tiled) {
  constexpr bool kNarrow = kBits < 8;
  constexpr bool kPacked = std::is_same_v<T, uint8_t> && !kNarrow;
  const int64_t blocks = p.in / p.block;
  p.x = in.x.data() + r0 * p.in;
  p.sums = in.sums.empty() ? nullptr : in.sums.data() + r0 * blocks;
  p.total = total;
  p.tokens = n;
#if defined(__AVX2__)
  if (int8) {
    const auto rows = [&](int64_t t0) {  // the rounded inputs from row t0
      const int64_t t = r0 + t0;
      return Quantized{in.words.data() + t * p.in / 4, in.step.data() + t * (p.in / kRun),
                       kPacked ? nullptr : in.int_halves.data() + t * p.in / 16};
    };
    if constexpr (kPacked && kFewPacked > kFew) {  // 8 tokens' sums in AVX-512's registers
      Chunks(n, [&](auto c, int64_t t0) {
        constexpr int N = decltype(c)::value;
        QFew<N>(IdRows(p, t0, N), rows(t0), u0, u1);
      });
    } else {
      FewChunks(n, [&](auto c, int64_t t0) {
        constexpr int N = decltype(c)::value;
        if constexpr (kPacked) QFew<N>(IdRows(p, t0, N), rows(t0), u0, u1);
        else Q8Few<N, kBits>(IdRows(p, t0, N), rows(t0), u0, u1);
      });
    }
    return;
  }
  if constexpr (kNarrow || kPacked) {
    if (tiled) {
      FewChunks(n, [&](auto c, int64_t t0) {
        constexpr int N = decltype(c)::value;
        const float* halves = in.halves.data() + (r0 + t0) * p.in / 16;
        if constexpr (kPacked) F4Few<N>(IdRows(p, t0, N), halves, u0, u1);
#if defined(__AVX512F__)
        else FNarrowFew<N, kBits>(IdRows(p, t0, N), halves, u0, u1);
#else
        else F8Few<N, kBits>(IdRows(p, t0, N), halves, u0, u1);
#endif
      });
      return;
    }
  }
#endif
  Columns<T>(p, 0, p.out, u0, u1);
}

// y [tokens * k, out]: pair (t, j)'s row of x [tokens, in] (each token's for all its
// experts) or [tokens * k, in] (a pair's own) @ expert ids[t, j]'s matrix of layer `layer`
// of the stacks: codes [layers, experts, rows, out], scale and offset [layers, experts, in
// / block, out] (int8 ones: times the super-scales [.., in / block / group, out]), as `Dot`
// takes a stack's layer. An expert no pair chose is never read.
template <typename T, int kBits = 8>
ffi::Error DotId(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                 ffi::AnyBuffer codes, ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                 ffi::AnyBuffer scale_super, ffi::AnyBuffer offset_super,
                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool affine,
                 bool int8, bool tiled) {
  constexpr bool kNarrow = kBits < 8;
  constexpr bool kPacked = std::is_same_v<T, uint8_t> && !kNarrow;
  const auto cd = codes.dimensions();
  if (cd.size() != 4 || scale.dimensions().size() != 4 || ids.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("qdot: stacks [layers, experts, ...], ids [tokens, k]");
  }
  const int64_t given = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t tokens = ids.dimensions()[0], k = ids.dimensions()[1], pairs = tokens * k;
  const int64_t layers = cd[0], experts = cd[1], rows = cd[2], out = cd[3];
  const int64_t blocks = scale.dimensions()[2], l = layer.typed_data()[0];
  const int64_t block = blocks > 0 ? in / blocks : 0;
  const int64_t held = kNarrow ? in / 32 * NarrowBytes(kBits) : kPacked ? in / 2 : in;
  if (blocks == 0 || out % kLanes || in % blocks || rows != held || (kPacked && block % 32) ||
      ((kNarrow || tiled || int8) && (in % 32 || out % 32)) || l < 0 || l >= layers ||
      (given != tokens && given != pairs)) {
    return ffi::Error::InvalidArgument("qdot: unsupported shape or layer");
  }
  Scales s, o;
  if (auto e = StackScales<T, kBits>(int8, tiled, scale, offset, scale_super, offset_super,
                                     out, s, o);
      e.failure()) {
    return e;
  }
#if defined(__AVX2__)
  if (int8 && block % kRun &&
      (kPacked || block != kRun / 2 || s.kind != Scales::kI8 || affine)) {
    return ffi::Error::InvalidArgument("qdot: int8 inputs need whole groups and runs");
  }
#else
  if (int8 || tiled) {
    return ffi::Error::InvalidArgument("qdot: int8 inputs or tiled codes need AVX2");
  }
#endif
  if (pairs == 0) return ffi::Error::Success();
  // the pairs sorted by expert (counting sort): `first[e]` expert e's first place
  const int32_t* id = ids.typed_data();
  std::vector<int64_t> first(experts + 1, 0), order(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    if (id[i] < 0 || id[i] >= experts) return ffi::Error::InvalidArgument("qdot: expert id");
    ++first[id[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) first[e + 1] += first[e];
  {
    std::vector<int64_t> at(first.begin(), first.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) order[at[id[i]]++] = i;
  }
  IdInputs inputs;
  inputs.x.resize(pairs * in);
  for (int64_t r = 0; r < pairs; ++r) {
    const float* from = x.typed_data() + (given == pairs ? order[r] : order[r] / k) * in;
    std::copy(from, from + in, inputs.x.data() + r * in);
  }
  if (int8) {
#if defined(__AVX2__)
    Quantize(inputs.x.data(), pairs, in, block, inputs.words, inputs.step, inputs.sums,
             kPacked ? nullptr : &inputs.int_halves);
#endif
  } else {
    if (tiled) inputs.halves = Sums(inputs.x.data(), pairs, in, 16);
    if (!tiled || kNarrow) inputs.sums = Sums(inputs.x.data(), pairs, in, block);
  }
  std::vector<int64_t> groups;  // the experts chosen
  for (int64_t e = 0; e < experts; ++e) {
    if (first[e + 1] > first[e]) groups.push_back(e);
  }
  // each expert's contraction in `splits` stretches: enough work for every thread when few
  // experts are chosen (the stretches' sums added after), whole otherwise
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t units = int8 || tiled ? in / 32 : blocks, chosen = groups.size();
  const int64_t splits = std::clamp<int64_t>((2 * threads + chosen - 1) / chosen, 1,
                                             std::max<int64_t>(1, units / 4));
  std::vector<float> sorted(pairs * out), extra((splits - 1) * pairs * out);
  const int64_t items = chosen * splits;
  std::atomic<int64_t> next{0};
  Parallel(pool, threads, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      const int64_t e = groups[i / splits], part = i % splits, idx = l * experts + e;
      const int64_t r0 = first[e], n = first[e + 1] - r0;
      float* total = (part == 0 ? sorted.data() : extra.data() + (part - 1) * pairs * out);
      const Problem p{nullptr,
                      nullptr,
                      static_cast<const T*>(codes.untyped_data()) + idx * rows * out,
                      s.Layer(idx, blocks),
                      o.Layer(affine ? idx : 0, blocks),
                      nullptr,
                      n, in, out, block, affine};
      IdPart<T, kBits>(p, inputs, r0, n, units * part / splits, units * (part + 1) / splits,
                       total + r0 * out, int8, tiled);
    }
  });
  float* result = y->typed_data();
  for (int64_t r = 0; r < pairs; ++r) {
    float* to = result + order[r] * out;
    std::copy(sorted.data() + r * out, sorted.data() + (r + 1) * out, to);
    for (int64_t part = 1; part < splits; ++part) {
      const float* from = extra.data() + (part - 1) * pairs * out + r * out;
      for (int64_t c = 0; c < out; ++c) to[c] += from[c];
    }
  }
  return ffi::Error::Success();
}

// `DotId` over narrow codes, their bits (5 or 6) told by their rows.
ffi::Error DotIdNarrow(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                       ffi::AnyBuffer codes, ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                       ffi::AnyBuffer scale_super, ffi::AnyBuffer offset_super,
                       ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool affine,
                       bool int8, bool tiled) {
  const bool five = codes.dimensions()[2] * 32 == x.dimensions()[1] * NarrowBytes(5);
  return (five ? DotId<uint8_t, 5> : DotId<uint8_t, 6>)(pool, x, ids, codes, scale, offset,
                                                        scale_super, offset_super, layer, y,
                                                        affine, int8, tiled);
}
// --- end of the routed experts --------------------------------------------------------------

}  // namespace

#define JPAGED_BIND(...)                      \
  ffi::Ffi::Bind()                            \
      .Ctx<ffi::ThreadPool>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>() __VA_ARGS__      \
      .Ret<ffi::Buffer<ffi::F32>>()           \
      .Attr<bool>("affine")

#define JPAGED_SUPERS .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
#define JPAGED_DOT_ARGS JPAGED_SUPERS.Arg<ffi::Buffer<ffi::S32>>()
#define JPAGED_DOT_ATTRS .Attr<bool>("int8").Attr<bool>("tiled")
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_int8, Dot<int8_t>,
                              JPAGED_BIND(JPAGED_DOT_ARGS) JPAGED_DOT_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_packed, Dot<uint8_t>,
                              JPAGED_BIND(JPAGED_DOT_ARGS) JPAGED_DOT_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_narrow, DotNarrow,
                              JPAGED_BIND(JPAGED_DOT_ARGS) JPAGED_DOT_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_t_int8, DotT<int8_t>,
                              JPAGED_BIND(JPAGED_SUPERS).Attr<bool>("int8"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_t_packed, DotT<uint8_t>,
                              JPAGED_BIND(JPAGED_SUPERS).Attr<bool>("int8"));

#define JPAGED_BIND_ID                        \
  ffi::Ffi::Bind()                            \
      .Ctx<ffi::ThreadPool>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Arg<ffi::Buffer<ffi::S32>>()           \
      .Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>() JPAGED_DOT_ARGS  \
      .Ret<ffi::Buffer<ffi::F32>>()           \
      .Attr<bool>("affine") JPAGED_DOT_ATTRS
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_id_int8, DotId<int8_t>, JPAGED_BIND_ID);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_id_packed, DotId<uint8_t>, JPAGED_BIND_ID);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jpaged_qdot_id_narrow, DotIdNarrow, JPAGED_BIND_ID);
