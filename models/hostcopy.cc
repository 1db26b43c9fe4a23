// A strided 2-D copy a tile at a time, for the loaders (models/hostcopy.py). A
// checkpoint's [out, in] rows become the module's [in, out] kernels: a transpose, where an
// element-by-element copy reads or writes one byte a cache line. Tiles of 64 x 64 keep
// both sides' lines in cache while they are used; the rows are split over the cores.

#include <algorithm>
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

struct BlockType {
  int64_t type_size, code_at, code_bytes, scale_at, offset_at;  // offset_at < 0: none
};

// Rows [r0, r1) of a matrix of GGUF blocks (`per_row` a row) into the module's transposed
// arrays: byte k of block j's codes to codes[j * code_bytes + k][r], its float16 scale (and
// offset) to scale[j][r], as they are. 64 rows at a time, so the tile's source lines are
// reused by every block; codes move 8 x 8 bytes in registers (`Block8`).
void BlocksRows(const uint8_t* src, int64_t per_row, BlockType t, uint8_t* codes,
                int64_t codes_ld, uint16_t* scale, uint16_t* offset, int64_t scale_ld,
                int64_t r0, int64_t r1) {
  const int64_t row_bytes = per_row * t.type_size;
  for (int64_t rt = r0; rt < r1; rt += kTile) {
    const int64_t re = std::min(rt + kTile, r1);
    for (int64_t j = 0; j < per_row; ++j) {
      const uint8_t* block = src + j * t.type_size;
      uint8_t* out = codes + j * t.code_bytes * codes_ld;
      int64_t r = rt;
      for (; r + 8 <= re && t.code_bytes % 8 == 0; r += 8) {
        for (int64_t k = 0; k < t.code_bytes; k += 8) {
          Block8(block + r * row_bytes + t.code_at + k, row_bytes, out + k * codes_ld + r,
                 codes_ld);
        }
      }
      for (; r < re; ++r) {
        for (int64_t k = 0; k < t.code_bytes; ++k) {
          out[k * codes_ld + r] = block[r * row_bytes + t.code_at + k];
        }
      }
      for (r = rt; r < re; ++r) {
        std::memcpy(scale + j * scale_ld + r, block + r * row_bytes + t.scale_at, 2);
        if (offset != nullptr) {
          std::memcpy(offset + j * scale_ld + r, block + r * row_bytes + t.offset_at, 2);
        }
      }
    }
  }
}


// GGML's ids (ggml.h) of the K-quants `jpaged_kquants` decodes: 256 values a block
enum : int64_t { kQ4K = 12, kQ5K = 13, kQ6K = 14 };

// One block of 256 values' codes as models/gguf_blocks.py holds them (Q4_K's two a byte,
// byte i of each 16 values i and i + 16 of a sub-block of 32; Q5_K's 0..31 and Q6_K's
// -32..31 one a byte). The file's 32 bytes j
// hold sub-block 2j's values in their low nibbles, 2j + 1's in their high ones (Q5_K's fifth
// bits in bits 2j, 2j + 1 of `qh`); Q6_K's halves of 128 values, 64 bytes of low nibbles and
// 32 of 2-bit pairs each, as llama.cpp reads them.
void KBlock(int64_t type, const uint8_t* b, uint8_t* codes) {
  if (type == kQ4K) {
    for (int j = 0; j < 4; ++j) {
      const uint8_t* q = b + 16 + 32 * j;
      uint8_t *lo = codes + 32 * j, *hi = lo + 16;
      for (int i = 0; i < 16; ++i) {
        lo[i] = (q[i] & 15) | (q[i + 16] << 4);
        hi[i] = (q[i] >> 4) | (q[i + 16] & 0xF0);
      }
    }
  } else if (type == kQ5K) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t q = qs[32 * j + l];
        codes[64 * j + l] = (q & 15) | (((qh[l] >> (2 * j)) & 1) << 4);
        codes[64 * j + 32 + l] = (q >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
      }
    }
  } else {
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
  }
}

}  // namespace

// A GGUF matrix of `rows` x `per_row` blocks (Q8_0, Q4_0, Q4_1: codes kept as they lie, one
// float16 scale and maybe an offset a block) straight into its transposed codes
// [per_row * code_bytes][codes_ld] and float16 scales (and offsets) [per_row][scale_ld]:
// one pass over the file's bytes where unpacking, then transposing, took three.
extern "C" void jpaged_blocks_t(const uint8_t* src, int64_t rows, int64_t per_row,
                                int64_t type_size, int64_t code_at, int64_t code_bytes,
                                int64_t scale_at, int64_t offset_at, uint8_t* codes,
                                int64_t codes_ld, uint16_t* scale, uint16_t* offset,
                                int64_t scale_ld) {
  const BlockType t{type_size, code_at, code_bytes, scale_at, offset_at};
  OverCores(rows, [=](int64_t r0, int64_t r1) {
    BlocksRows(src, per_row, t, codes, codes_ld, scale, offset, scale_ld, r0, r1);
  });
}

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

// One block's two levels of scales: Q4_K's and Q5_K's 12 bytes at 4 as 8 six-bit sub-scales
// and 8 sub-minimums (llama.cpp's get_scale_min_k4: the first four in bytes 0-3 / 4-7, the
// last four from bytes 8-11's nibbles and the top two bits of bytes 0-3 / 4-7), the float16
// scale at 0 and the minimum at 2 negated (the offset is -(dmin x min)); Q6_K's 16 int8
// sub-scales at 192 and its float16 scale at 208.
void KScales(int64_t type, const uint8_t* b, int8_t* scales, int8_t* mins, uint16_t* d,
             uint16_t* dmin) {
  if (type == kQ6K) {
    std::memcpy(scales, b + 192, 16);
    std::memcpy(d, b + 208, 2);
    return;
  }
  const uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    scales[j] = s[j] & 63;
    mins[j] = s[j + 4] & 63;
    scales[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mins[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
  std::memcpy(d, b, 2);
  std::memcpy(dmin, b + 2, 2);
  *dmin ^= 0x8000;
}

// `blocks` K-quant blocks of GGML type `type` (Q4_K, Q5_K or Q6_K), in the file's order, into
// codes, sub-scales [blocks][8] (Q6_K's [blocks][16]), sub-minimums [blocks][8] and the float16
// scales and negated minimums [blocks] (`KScales`; Q6_K: no minimums), in the same order, over
// the cores: NumPy made ~10 temporaries of each tensor's codes, and its strided passes over the
// scales' 12 bytes took longer than the codes here (6 of an 8B Q4_K_M's 23 s of load).
// Returns 0, or -1 for another type.
extern "C" int jpaged_kquants(const uint8_t* src, int64_t blocks, int64_t type, uint8_t* codes,
                              int8_t* scales, int8_t* mins, uint16_t* d, uint16_t* dmin) {
  int64_t size, code_bytes;
  switch (type) {
    case kQ4K: size = 144, code_bytes = 128; break;
    case kQ5K: size = 176, code_bytes = 256; break;
    case kQ6K: size = 210, code_bytes = 256; break;
    default: return -1;
  }
  const int64_t subs = type == kQ6K ? 16 : 8;
  OverCores(blocks, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* block = src + b * size;
      KBlock(type, block, codes + b * code_bytes);
      KScales(type, block, scales + b * subs, type == kQ6K ? nullptr : mins + b * 8, d + b,
              type == kQ6K ? nullptr : dmin + b);
    }
  });
  return 0;
}

// `runs` runs of codes, each `rows` rows of `out` bytes (16 packed, 32 int8), put in place in
// the order the int8 kernels read them (models/qdot.py's `tile`: 8 columns at a time, a
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
