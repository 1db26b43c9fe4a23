// The loaders' copies (jpaged/models/hostcopy.py). A checkpoint's [out, in] rows become the
// module's [in, out] kernels: a transpose, where an element-by-element copy reads or writes
// one byte a cache line. Tiles of 64 x 64 keep both sides' lines in cache while they are
// used; the rows are split over the cores. A GGUF's quantized blocks are decoded the same
// way, straight into the module's arrays (`jpaged_blocks_into`).

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kTile = 64;

template <typename T>
void Rows(const T* src, int64_t s0, int64_t s1, T* dst, int64_t d0, int64_t d1, int64_t r0,
          int64_t r1, int64_t cols) {
  for (int64_t rt = r0; rt < r1; rt += kTile) {
    const int64_t re = std::min(rt + kTile, r1);
    for (int64_t ct = 0; ct < cols; ct += kTile) {
      const int64_t ce = std::min(ct + kTile, cols);
      for (int64_t r = rt; r < re; ++r) {
        for (int64_t c = ct; c < ce; ++c) dst[r * d0 + c * d1] = src[r * s0 + c * s1];
      }
    }
  }
}

// Bytes transposed 8 x 8 in registers: 8 loads and 8 stores of 8 bytes where a byte-wise
// copy makes 64 of each. `src` rows are the destination's columns: dst[r][c] = src[c][r].
inline uint64_t Load(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline void Block8(const uint8_t* src, int64_t s1, uint8_t* dst, int64_t d0) {
  uint64_t w[8], t[8], u[8];
  for (int k = 0; k < 8; ++k) w[k] = Load(src + k * s1);
  constexpr uint64_t m1 = 0x00FF00FF00FF00FFull, m2 = 0x0000FFFF0000FFFFull,
                     m4 = 0x00000000FFFFFFFFull;
  for (int k = 0; k < 8; k += 2) {  // byte pairs
    t[k] = (w[k] & m1) | ((w[k + 1] << 8) & ~m1);
    t[k + 1] = ((w[k] >> 8) & m1) | (w[k + 1] & ~m1);
  }
  for (int k : {0, 1, 4, 5}) {  // pairs of pairs
    u[k] = (t[k] & m2) | ((t[k + 2] << 16) & ~m2);
    u[k + 2] = ((t[k] >> 16) & m2) | (t[k + 2] & ~m2);
  }
  for (int k = 0; k < 4; ++k) {  // halves: word k is column k, word k + 4 column k + 4
    const uint64_t lo = (u[k] & m4) | (u[k + 4] << 32), hi = (u[k] >> 32) | (u[k + 4] & ~m4);
    std::memcpy(dst + k * d0, &lo, 8);
    std::memcpy(dst + (k + 4) * d0, &hi, 8);
  }
}

void TransposeRows(const uint8_t* src, int64_t s1, uint8_t* dst, int64_t d0, int64_t r0,
                   int64_t r1, int64_t cols) {
  for (int64_t rt = r0; rt < r1; rt += kTile) {
    const int64_t re = std::min(rt + kTile, r1);
    for (int64_t ct = 0; ct < cols; ct += kTile) {
      const int64_t ce = std::min(ct + kTile, cols);
      int64_t r = rt;
      for (; r + 8 <= re; r += 8) {
        int64_t c = ct;
        for (; c + 8 <= ce; c += 8) Block8(src + c * s1 + r, s1, dst + r * d0 + c, d0);
        for (int64_t i = r; i < r + 8; ++i) {
          for (int64_t j = c; j < ce; ++j) dst[i * d0 + j] = src[j * s1 + i];
        }
      }
      for (; r < re; ++r) {
        for (int64_t c = ct; c < ce; ++c) dst[r * d0 + c] = src[c * s1 + r];
      }
    }
  }
}

// fn(r0, r1) over runs of whole tiles of `rows`, one run a core.
template <typename F>
void OverCores(int64_t rows, F fn) {
  const int64_t tiles = (rows + kTile - 1) / kTile;
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), tiles));
  const int64_t per = (tiles + workers - 1) / workers * kTile;
  std::vector<std::thread> threads;
  for (int64_t r0 = per; r0 < rows; r0 += per) {
    threads.emplace_back(fn, r0, std::min(r0 + per, rows));
  }
  fn(0, std::min(per, rows));
  for (auto& t : threads) t.join();
}

template <typename T>
void Copy(const void* src, int64_t s0, int64_t s1, void* dst, int64_t d0, int64_t d1,
          int64_t rows, int64_t cols) {
  const T* s = static_cast<const T*>(src);
  T* d = static_cast<T*>(dst);
  OverCores(rows, [=](int64_t r0, int64_t r1) {
    if (s1 == 1 && d1 == 1) {  // rows lie whole on both sides
      for (int64_t r = r0; r < r1; ++r) std::memcpy(d + r * d0, s + r * s0, cols * sizeof(T));
      return;
    }
    if constexpr (sizeof(T) == 1) {
      if (s0 == 1 && d1 == 1) return TransposeRows(s, s1, d, d0, r0, r1, cols);
    }
    Rows<T>(s, s0, s1, d, d0, d1, r0, r1, cols);
  });
}

// GGML's ids (ggml.h) of the block types `jpaged_blocks_into` decodes
enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4K = 12, kQ5K = 13, kQ6K = 14
};

struct BlockType {
  int64_t size, code_bytes;  // bytes a block in the file, code bytes a block held
  int64_t subs;              // int8 sub-scales a block (the K-quants); 0: one float16 scale
  bool affine, packed;       // an offset; two 4-bit codes a byte
};

bool TypeOf(int64_t type, BlockType* t) {
  switch (type) {
    case kQ8_0: *t = {34, 32, 0, false, false}; return true;
    case kQ4_0: *t = {18, 16, 0, false, true}; return true;
    case kQ4_1: *t = {20, 16, 0, true, true}; return true;
    case kQ5_0: *t = {22, 32, 0, false, false}; return true;
    case kQ5_1: *t = {24, 32, 0, true, false}; return true;
    case kQ4K: *t = {144, 128, 8, true, true}; return true;
    case kQ5K: *t = {176, 256, 8, true, false}; return true;
    case kQ6K: *t = {210, 256, 16, false, false}; return true;
    default: return false;
  }
}

// A block's scales: the float16 scale `d` (and offset `m`) of the one-level types; the
// K-quants' int8 sub-scales (and sub-minimums) and float16 `d` (and negated minimum `m`).
struct Scales {
  int8_t sub[16], min[8];
  uint16_t d, m;
};

inline uint16_t Half(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One block's codes as jpaged/models/gguf_blocks.py holds them (Q4_0, Q4_1, Q8_0 as they lie: byte i
// of each 16 values i and i + 16 of 32; Q4_K repacked so; Q5_0's -16..15, Q5_1's and Q5_K's
// 0..31 and Q6_K's -32..31 one a byte) and its scales. Q5_0/Q5_1: the low nibbles of 16 bytes
// are values 0-15, the high ones 16-31, bit i of the 32-bit `qh` value i's fifth. Q4_K: the
// file's 32 bytes j hold sub-block 2j's values in their low nibbles, 2j + 1's in their high
// ones (Q5_K's fifth bits in bits 2j, 2j + 1 of `qh`); its sub-scales and sub-minimums are
// llama.cpp's get_scale_min_k4 of the 12 bytes at 4 (the first four in bytes 0-3 / 4-7, the
// last four from bytes 8-11's nibbles and the top two bits of bytes 0-3 / 4-7). Q6_K: halves
// of 128 values, 64 bytes of low nibbles and 32 of 2-bit pairs each, as llama.cpp reads them.
void Decode(int64_t type, const uint8_t* b, uint8_t* codes, Scales* s) {
  switch (type) {
    case kQ8_0: case kQ4_0: case kQ4_1: {
      const int64_t at = type == kQ4_1 ? 4 : 2;
      std::memcpy(codes, b + at, type == kQ8_0 ? 32 : 16);
      s->d = Half(b), s->m = Half(b + 2);
      return;
    }
    case kQ5_0: case kQ5_1: {
      const int64_t at = type == kQ5_1 ? 4 : 2;
      uint32_t qh;
      std::memcpy(&qh, b + at, 4);
      const uint8_t* qs = b + at + 4;
      const int bias = type == kQ5_0 ? 16 : 0;
      for (int i = 0; i < 16; ++i) {
        codes[i] = (qs[i] & 15) + (((qh >> i) & 1) << 4) - bias;
        codes[i + 16] = (qs[i] >> 4) + (((qh >> (i + 16)) & 1) << 4) - bias;
      }
      s->d = Half(b), s->m = Half(b + 2);
      return;
    }
    case kQ4K:
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = b + 16 + 32 * j;
        uint8_t *lo = codes + 32 * j, *hi = lo + 16;
        for (int i = 0; i < 16; ++i) {
          lo[i] = (q[i] & 15) | (q[i + 16] << 4);
          hi[i] = (q[i] >> 4) | (q[i + 16] & 0xF0);
        }
      }
      break;
    case kQ5K: {
      const uint8_t *qh = b + 16, *qs = b + 48;
      for (int j = 0; j < 4; ++j) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t q = qs[32 * j + l];
          codes[64 * j + l] = (q & 15) | (((qh[l] >> (2 * j)) & 1) << 4);
          codes[64 * j + 32 + l] = (q >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
        }
      }
      break;
    }
    default:  // kQ6K
      for (int h = 0; h < 2; ++h) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        int8_t* out = reinterpret_cast<int8_t*>(codes) + 128 * h;
        for (int l = 0; l < 32; ++l) {
          out[l] = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
          out[l + 32] = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
          out[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          out[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        }
      }
      std::memcpy(s->sub, b + 192, 16);
      s->d = Half(b + 208);
      return;
  }
  const uint8_t* k = b + 4;  // Q4_K, Q5_K
  for (int j = 0; j < 4; ++j) {
    s->sub[j] = k[j] & 63;
    s->min[j] = k[j + 4] & 63;
    s->sub[j + 4] = (k[j + 8] & 15) | ((k[j] >> 6) << 4);
    s->min[j + 4] = (k[j + 8] >> 4) | ((k[j + 4] >> 6) << 4);
  }
  s->d = Half(b), s->m = Half(b + 2) ^ 0x8000;
}

// Where `jpaged_blocks_into` writes: the module's arrays of one matrix, each [per_row * n]
// (codes: [per_row * code_bytes]) rows of `ld` elements, the file's rows their columns from
// `col0` (`order` 1, 2), or the file's rows as they are (`order` 0).
struct Into {
  int64_t order, ld, col0, run;  // run: rows of a run of 32 inputs (16 packed, 32)
  uint8_t* codes;
  void *scale, *offset, *scale_super, *offset_super;
};

template <typename T>
inline void Put(void* a, int64_t at, T v) {
  if (a != nullptr) static_cast<T*>(a)[at] = v;
}

// Block j of the file's rows [o, o + n) (n <= 8), decoded into `codes` [8][256] and `s` [8],
// written where `to` says.
void Write(const BlockType& t, const Into& to, int64_t per_row, int64_t j, int64_t o,
           int64_t n, const uint8_t (*codes)[256], const Scales* s) {
  const int64_t cb = t.code_bytes, subs = std::max<int64_t>(t.subs, 1);
  for (int64_t i = 0; i < n; ++i) {
    // where block j of the file's row o + i puts its first sub-scale, the next's step
    // and its super-scale: transposed, the row is a column
    const int64_t col = to.col0 + o + i;
    int64_t at = j * subs * to.ld + col, step = to.ld, super = j * to.ld + col;
    if (to.order == 0) {
      at = ((o + i) * per_row + j) * subs, step = 1, super = (o + i) * per_row + j;
    }
    if (t.subs) {
      for (int64_t k = 0; k < t.subs; ++k) Put<int8_t>(to.scale, at + k * step, s[i].sub[k]);
      for (int64_t k = 0; k < 8 && t.affine; ++k) {
        Put<int8_t>(to.offset, at + k * step, s[i].min[k]);
      }
      Put<uint16_t>(to.scale_super, super, s[i].d);
      if (t.affine) Put<uint16_t>(to.offset_super, super, s[i].m);
    } else {
      Put<uint16_t>(to.scale, at, s[i].d);
      if (t.affine) Put<uint16_t>(to.offset, at, s[i].m);
    }
  }
  if (to.order == 0) {
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(to.codes + ((o + i) * per_row + j) * cb, codes[i], cb);
    }
  } else if (to.order == 2) {  // jpaged/models/qdot.py's `tile`: 8 columns x 4 rows, 32 bytes
    const int64_t r = to.run, c = to.col0 + o;  // a multiple of 8, as n is 8
    for (int64_t q = 0; q < cb; q += 4) {
      const int64_t k = j * cb + q;
      uint8_t* dst = to.codes + (k / r) * r * to.ld + c * r + (k % r) / 4 * 32;
      for (int64_t i = 0; i < 8; ++i) std::memcpy(dst + 4 * i, codes[i] + q, 4);
    }
  } else {
    uint8_t* dst = to.codes + j * cb * to.ld + to.col0 + o;
    for (int64_t k = 0; k < cb; k += 8) {
      if (n == 8) {
        Block8(codes[0] + k, 256, dst + k * to.ld, to.ld);
        continue;
      }
      for (int64_t r = k; r < k + 8; ++r) {
        for (int64_t i = 0; i < n; ++i) dst[r * to.ld + i] = codes[i][r];
      }
    }
  }
}

}  // namespace

// Strides in elements of `itemsize` bytes (1, 2 or 4); returns 0, or -1 for another size.
extern "C" int jpaged_copy2d(const void* src, int64_t s0, int64_t s1, void* dst, int64_t d0,
                             int64_t d1, int64_t rows, int64_t cols, int64_t itemsize) {
  switch (itemsize) {
    case 1: Copy<uint8_t>(src, s0, s1, dst, d0, d1, rows, cols); return 0;
    case 2: Copy<uint16_t>(src, s0, s1, dst, d0, d1, rows, cols); return 0;
    case 4: Copy<uint32_t>(src, s0, s1, dst, d0, d1, rows, cols); return 0;
    default: return -1;
  }
}

// A GGUF matrix of `rows` x `per_row` blocks of GGML type `type` (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K, Q6_K) decoded straight into the module's arrays (`Decode`): codes, scales
// (float16 or, for the K-quants, int8 sub-scales) and offsets (sub-minimums), the K-quants'
// float16 super-scales and offsets; nullptr for arrays the type has not. `order` 0: as the
// file's rows lie; 1: transposed, the file's rows columns `col0`... of rows of `ld` elements;
// 2: transposed with the codes in the int8 kernels' order (`run` rows a run; `col0` and the
// rows multiples of 8). `heads` > 0: the file's rows are a Llama's Q or K rows of `heads`
// heads as llama.cpp writes them, each head's rotary halves interleaved (row 2b + a of a head
// is its half a's row b): the matrix's rows are read from there (`source`), put back in
// order. One pass over the file's bytes, 64 of its rows at a time, so each line written is
// filled while in cache; the rows over the cores. Returns 0, or -1 for another type.
extern "C" int jpaged_blocks_into(const uint8_t* src, int64_t rows, int64_t per_row,
                                  int64_t type, int64_t order, int64_t ld, int64_t col0,
                                  int64_t run, uint8_t* codes, void* scale, void* offset,
                                  void* scale_super, void* offset_super, int64_t heads) {
  BlockType t;
  if (!TypeOf(type, &t)) return -1;
  const Into to{order, ld, col0, run, codes, scale, offset, scale_super, offset_super};
  const int64_t per_head = heads ? rows / heads : rows, half = per_head / 2;
  const auto source = [=](int64_t r) {
    if (!heads) return r;
    const int64_t k = r % per_head;
    return r - k + k % half * 2 + k / half;
  };
  OverCores(rows, [=](int64_t r0, int64_t r1) {
    alignas(64) uint8_t buf[8][256];
    Scales s[8];
    const int64_t row_bytes = per_row * t.size;
    for (int64_t rt = r0; rt < r1; rt += kTile) {
      const int64_t re = std::min(rt + kTile, r1);
      // A tile reads its rows' blocks column by column: 64 strided streams, more than the
      // prefetcher follows, so each line came from memory on demand (two thirds of the time
      // went to waiting on those loads). The next tile's bytes (the file's rows between
      // the first and the last it reads) are fetched while this one is decoded, a share at
      // each step.
      int64_t first = rows, last = -1;
      for (int64_t r = re; r < std::min(re + kTile, r1); ++r) {
        first = std::min(first, source(r)), last = std::max(last, source(r));
      }
      const uint8_t* ahead = src + first * row_bytes;  // past the last tile: none
      const uint8_t* const ahead_end = src + (last + 1) * row_bytes;
      const int64_t steps = per_row * ((re - rt + 7) / 8);
      const int64_t share = std::max<int64_t>(ahead_end - ahead, 0) / steps + 64;
      for (int64_t j = 0; j < per_row; ++j) {
        for (int64_t o = rt; o < re; o += 8) {
          for (const uint8_t* e = std::min(ahead + share, ahead_end); ahead < e; ahead += 64) {
            __builtin_prefetch(ahead);
          }
          const int64_t n = std::min<int64_t>(8, re - o);
          for (int64_t i = 0; i < n; ++i) {
            Decode(type, src + (source(o + i) * per_row + j) * t.size, buf[i], &s[i]);
          }
          Write(t, to, per_row, j, o, n, buf, s);
        }
      }
    }
  });
  return 0;
}

// `runs` runs of codes, each `rows` rows of `out` bytes (16 packed, 32 int8), put in place in
// the order the int8 kernels read them (jpaged/models/qdot.py's `tile`: 8 columns at a time, a
// column's bytes four at a time), one run's copy a core aside.
extern "C" void jpaged_tile(uint8_t* codes, int64_t runs, int64_t rows, int64_t out) {
  OverCores(runs, [=](int64_t k0, int64_t k1) {
    std::vector<uint8_t> run(rows * out);
    for (int64_t k = k0; k < k1; ++k) {
      uint8_t* at = codes + k * rows * out;
      std::memcpy(run.data(), at, rows * out);
      for (int64_t c = 0; c < out; c += 8) {
        uint8_t* tile = at + c * rows;
        for (int64_t j = 0; j < rows; ++j) {
          for (int64_t i = 0; i < 8; ++i) tile[(j / 4) * 32 + i * 4 + j % 4] = run[j * out + c + i];
        }
      }
    }
  });
}

// int8 codes in the kernels' order, `runs` runs of 32 rows of `out` columns, as narrow ones
// of `bits` (5 or 6; jpaged/models/qdot.py's `narrow`: each 8 columns' 256 bytes of a run as 32 x
// bits, each code `centre` above itself) into `into`, over the cores; or, `into` being
// `codes`, in place, in the first bits / 8 of their bytes, the pages past them handed back
// to the system: a group's narrow bytes never reach past its own int8 ones, so one pass in
// order (one core) overwrites only what it has read. Whether any code lay outside what
// `bits` hold.
extern "C" int jpaged_narrow(int8_t* codes, uint8_t* into, int64_t runs, int64_t out, int bits,
                             int centre) {
  typedef uint8_t Bytes __attribute__((vector_size(32)));  // a word of 8 columns
  const int e = bits - 4;  // top bits a code: words m, m + e, .. in top word m
  const auto pack = [=](int64_t g0, int64_t g1) {
    Bytes seen = {};
    for (int64_t g = g0; g < g1; ++g) {
      Bytes u[8], to[6] = {};
      for (int j = 0; j < 8; ++j) {
        std::memcpy(&u[j], codes + g * 256 + j * 32, 32);
        u[j] += static_cast<uint8_t>(centre);
        seen |= u[j];
      }
      for (int i = 0; i < 4; ++i) to[i] = (u[i] & 15) | (u[i + 4] & 15) << 4;
      for (int j = 0; j < 8; ++j) to[4 + j % e] |= (u[j] >> 4) << (e * (j / e));
      std::memcpy(into + g * 32 * bits, to, 32 * bits);
    }
    bool past = false;
    for (int b = 0; b < 32; ++b) past |= (seen[b] >> bits) != 0;
    return past;
  };
  const int64_t groups = runs * (out / 8);
  if (static_cast<void*>(into) != static_cast<void*>(codes)) {
    std::atomic<bool> past{false};
    OverCores(groups, [&](int64_t g0, int64_t g1) {
      if (pack(g0, g1)) past = true;
    });
    return past;
  }
  const bool past = pack(0, groups);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto held = reinterpret_cast<uintptr_t>(codes + runs * 4 * bits * out);
  const uintptr_t begin = (held + page - 1) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(codes + runs * 32 * out) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  return past;
}
