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

template <typename T>
void Copy(const void* src, int64_t s0, int64_t s1, void* dst, int64_t d0, int64_t d1,
          int64_t rows, int64_t cols) {
  const T* s = static_cast<const T*>(src);
  T* d = static_cast<T*>(dst);
  const int64_t tiles = (rows + kTile - 1) / kTile;
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), tiles));
  const int64_t per = (tiles + workers - 1) / workers * kTile;
  auto part = [=](int64_t r0, int64_t r1) {
    if constexpr (sizeof(T) == 1) {
      if (s0 == 1 && d1 == 1) return TransposeRows(s, s1, d, d0, r0, r1, cols);
    }
    Rows<T>(s, s0, s1, d, d0, d1, r0, r1, cols);
  };
  std::vector<std::thread> threads;
  for (int64_t r0 = per; r0 < rows; r0 += per) {
    threads.emplace_back(part, r0, std::min(r0 + per, rows));
  }
  part(0, std::min(per, rows));
  for (auto& t : threads) t.join();
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
