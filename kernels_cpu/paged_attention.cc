// Ragged paged attention for the CPU, an XLA FFI custom call (kernels_cpu/paged_attention.py).
//
// Each row b of the step holds counts[b] consecutive tokens of one sequence, starting at flat
// token starts[b], at positions cached[b] .. cached[b] + counts[b] - 1; its keys and values are
// in the pages tables[b, :] of the pools (this step's own already written). Every query attends
// to its sequence's keys at positions 0 .. its own, or with a sliding window W > 0 (a scalar
// operand: a layer's own) at positions pos - W + 1 .. pos only, whose pages alone are read (the
// ones before may already hold another sequence's keys); scores may be soft-capped as
// c·tanh(s / c) (Gemma 2). This is exactly the gather reference's semantics
// (jaxpipe.ops.attention.ragged_paged_attention), in one pass over the pages: the pages are read
// in place, never gathered into a copy, and a page's keys are transposed once into a small
// buffer shared by every query of a tile. A tile's query vectors (token x query head) run in
// blocks of kBlock: their scores and their weighted values are register blocks of kBlock
// vectors x 32 keys or channels, each key or value row loaded once for the block, over the union
// of the block's keys, a vector's weight set to exactly 0 at a key outside its own. Over a
// bfloat16 pool, a tile of queries that are all bfloat16 values scores as bfloat16 dot products
// of channel pairs (where the CPU has AVX512_BF16): a prefill's tiles from the transposed keys
// (`Bf16Scores`), decode's few vectors from the rows in place, 16 keys at a time
// (`Bf16KeyScores`). Where the CPU has AVX-512, 512-bit registers hold the weighted values of
// rows read in place (decode's, a float32 pool's prefill: `WeighValuesWide`, kWideGroup vectors
// at a time), a prefill's float32 scores (64 keys at a time, `WideScores`) and its keys'
// transposes (`TransposeKeys`), and the softmax of a block's vectors together
// (`SoftmaxBlock`). Work items are (row, KV head, tile of up to kTile tokens),
// taken in turn by the caller and the tasks it schedules on XLA's intra-op thread pool.
//
// Layouts (row-major): q [T, H, D], pools [G, P, S, D] of float32 or bfloat16, or of int8 with
// scales [G, P, S] (a key or value row is its int8 values times its slot's scale), tables [B, N],
// starts / counts / cached [B], out [T, H, D]; query head h reads KV head h / (H / G). Tokens of
// no row get zeros.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Tokens of one row per work item: kTile, or kShortTile where a call's kTile items would be
// fewer than kItemsPerThread a thread. Each item transposes its chunks' keys again (float32
// prefill of 1,024 tokens: 64-token items ran 1.17x as fast as 16-token ones, Ice Lake).
constexpr int64_t kTile = 64;
constexpr int64_t kShortTile = 16;
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kChunkKeys = 128;  // keys (whole pages) read and scored together
constexpr int64_t kTranspose = 8;   // a chunk's keys are transposed for this many queries or more
constexpr int64_t kBlock = 4;       // query vectors whose scores and softmax run together
// query vectors whose weighted values run together in 512-bit registers (4 x 16 channels each):
// each value row is read once for the 6 (1,024-token float32 prefill 1.02x against 4, Ice Lake)
constexpr int64_t kWideGroup = 6;

// Eight floats as one value: GCC's and Clang's vector extensions, one AVX register on x86, two
// NEON registers on Arm. The loops below hold their running sums in these.
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
constexpr int64_t kW = 8;  // floats an F8 holds; the head dim must be a multiple

typedef int8_t C8 __attribute__((vector_size(8)));
typedef uint16_t H8 __attribute__((vector_size(16)));
typedef uint32_t U8 __attribute__((vector_size(32)));

inline F8 Load(const float* x) {
  F8 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
inline F8 Load(const int8_t* x) {  // eight int8 values as floats
#if defined(__AVX2__)  // one sign-extending load and one conversion (GCC's generic path is scalar)
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(x))));
  F8 r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
#else
  C8 v;
  std::memcpy(&v, x, sizeof(v));
  return __builtin_convertvector(__builtin_convertvector(v, I8), F8);
#endif
}
inline F8 Load(const uint16_t* x) {  // eight bfloat16 values: each a float's upper 16 bits
#if defined(__AVX2__)  // one zero-extending load and a shift (GCC splits the generic one in halves)
  const __m256i bits = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16);
#else
  H8 h;
  std::memcpy(&h, x, sizeof(h));
  const U8 bits = __builtin_convertvector(h, U8) << 16;
#endif
  F8 r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}
inline void Store(float* x, F8 v) { std::memcpy(x, &v, sizeof(v)); }
inline F8 Splat(float x) { return F8{x, x, x, x, x, x, x, x}; }
inline float Sum(F8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// Lane u of the result: the sum of t[u]'s lanes (eight horizontal sums at once).
inline F8 Sums(const F8* t) {
#if defined(__AVX__)
  __m256 a[kW];
  std::memcpy(a, t, sizeof(a));
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  // each 128-bit half: the partial sums of t[0..3] (t[4..7]) over that half's lanes
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                    _mm256_permute2f128_ps(h0123, h4567, 0x31));
  F8 r;
  std::memcpy(&r, &sums, sizeof(r));
  return r;
#else
  F8 r;
  for (int64_t u = 0; u < kW; ++u) r[u] = Sum(t[u]);
  return r;
#endif
}

// 32 consecutive floats as four F8 sums, independent so that their multiply-adds overlap: the
// register block of both the scores (32 keys) and the weighted values (32 channels).
struct F32x4 {
  F8 v[4];

  template <typename T>
  static F32x4 Load(const T* x) {
    return {{::Load(x), ::Load(x + kW), ::Load(x + 2 * kW), ::Load(x + 3 * kW)}};
  }
  void Store(float* x) const {
    for (int e = 0; e < 4; ++e) ::Store(x + e * kW, v[e]);
  }
  void AddScaled(F8 w, const F32x4& x) {  // this += w * x
    for (int e = 0; e < 4; ++e) v[e] += w * x.v[e];
  }
  void Scale(F8 w) {
    for (int e = 0; e < 4; ++e) v[e] *= w;
  }
};

// exp(x) as 2^n exp(r), n = round(x / ln 2), |r| <= ln(2) / 2, with Cephes' expf polynomial
// (about 1 ulp). x is clamped to [-87, 88]: exp(-inf), a running max's first rescale, gives
// 2^-126 times a zero sum.
template <typename V, typename I>
inline V ExpOf(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}
inline F8 Exp(F8 x) { return ExpOf<F8, I8>(x); }

inline float Exp(float x) { return Exp(Splat(x))[0]; }

struct Item {
  int32_t row, head, first, last;  // tokens first .. last - 1 of the row, KV head `head`
};

struct Problem {
  const float* q;
  const void* k;  // float, bfloat16 (uint16 bits) or int8 pools
  const void* v;
  const float* k_scale;  // int8 pools: a scale per (head, page, slot); float pools: null
  const float* v_scale;
  const int32_t* tables;
  const int32_t* starts;
  const int32_t* cached;
  float* out;
  int64_t H, D, G, P, S, N, R;
  int64_t window;  // keys of the last `window` positions only; 0: every earlier key
  float scale, softcap;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
  std::atomic<bool> closed{false};
};

// Rows of the pools: float, or int8 times a float scale per (head, page, slot).
template <typename T>
struct Rows {
  std::vector<const T*> k, v;  // key j of the chunk: its K and V rows
  std::vector<float> k_scale, v_scale;
  std::vector<const float*> vf;     // V rows converted to floats (pools not float, many vectors)
  std::vector<float> v_float;       // [L, D] their storage
  std::vector<int64_t> begin, end;  // each query vector's keys in the chunk
  std::vector<uint32_t> q_pairs;    // [vecs, D / 2] the queries' channel pairs, bfloat16 bits
  std::vector<uint32_t> k_pairs;    // [D / 2, L] the chunk's keys' channel pairs, keys minor
};

// Items whose scores ran as bfloat16 dot products (`Bf16Scores`), for JaxpipeBf16ScoreItems.
std::atomic<int64_t> bf16_score_items{0};
// Work items the calls of this process made, for JaxpipeWorkItems.
std::atomic<int64_t> work_items{0};

// The union of n query vectors' keys (begin .. end - 1 each; empty ranges left out): (keys, 0)
// when every range is empty.
inline std::pair<int64_t, int64_t> BlockKeys(const int64_t* begin, const int64_t* end, int64_t n,
                                             int64_t keys) {
  int64_t lo = keys, hi = 0;
  for (int64_t u = 0; u < n; ++u) {
    if (begin[u] < end[u]) lo = std::min(lo, begin[u]), hi = std::max(hi, end[u]);
  }
  return {lo, hi};
}

// One block's weighted values: the kBlock vectors' running sums a0 [kBlock, D] times alpha, plus
// their weights w0 [kBlock, L] times the value rows v_rows[b_lo .. b_hi - 1] (floats, or the
// pool's rows converted as they load), 32 channels at a time, each row read once for the block.
// Not inlined, as WeighValuesWide: inlined into RunItem they slowed its other loops (a float32
// prefill's call 5-8% slower, measured alternated in one process).
template <typename U>
__attribute__((noinline)) void WeighValues(const U* const* v_rows, int64_t b_lo, int64_t b_hi,
                                           int64_t D, int64_t L, const float* w0,
                                           const float* alpha, float* a0) {
  int64_t d = 0;
  for (; d + 4 * kW <= D; d += 4 * kW) {
    F32x4 t[kBlock];
    for (int64_t u = 0; u < kBlock; ++u) {
      t[u] = F32x4::Load(a0 + u * D + d);
      t[u].Scale(Splat(alpha[u]));
    }
    for (int64_t j = b_lo; j < b_hi; ++j) {
      const F32x4 x = F32x4::Load(v_rows[j] + d);
      for (int64_t u = 0; u < kBlock; ++u) t[u].AddScaled(Splat(w0[u * L + j]), x);
    }
    for (int64_t u = 0; u < kBlock; ++u) t[u].Store(a0 + u * D + d);
  }
  for (; d < D; d += kW) {
    F8 t[kBlock];
    for (int64_t u = 0; u < kBlock; ++u) t[u] = Load(a0 + u * D + d) * Splat(alpha[u]);
    for (int64_t j = b_lo; j < b_hi; ++j) {
      const F8 x = Load(v_rows[j] + d);
      for (int64_t u = 0; u < kBlock; ++u) t[u] += Splat(w0[u * L + j]) * x;
    }
    for (int64_t u = 0; u < kBlock; ++u) Store(a0 + u * D + d, t[u]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kWide = true;

// 16 channels of a row as floats, those outside `in` zero.
inline __m512 Load16(__mmask16 in, const float* x) { return _mm512_maskz_loadu_ps(in, x); }
inline __m512 Load16(__mmask16 in, const uint16_t* x) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
inline __m512 Load16(__mmask16 in, const int8_t* x) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(in, x)));
}

// WeighValues for NB <= kWideGroup vectors in 512-bit registers: 64 channels at a time (a block's
// last quarters masked where D is not a multiple of 64), each row read once for the NB.
template <int NB, typename U>
__attribute__((noinline)) void WeighValuesWide(const U* const* v_rows, int64_t b_lo, int64_t b_hi,
                                               int64_t D, int64_t L, const float* w0,
                                               const float* alpha, float* a0) {
  for (int64_t d = 0; d < D; d += 64) {
    __mmask16 in[4];
    for (int q = 0; q < 4; ++q) {
      const int64_t n = std::clamp<int64_t>(D - d - 16 * q, 0, 16);
      in[q] = static_cast<__mmask16>((1u << n) - 1);
    }
    __m512 t[NB][4];
    for (int u = 0; u < NB; ++u) {
      const __m512 a = _mm512_set1_ps(alpha[u]);
      for (int q = 0; q < 4; ++q) {
        t[u][q] = _mm512_mul_ps(_mm512_maskz_loadu_ps(in[q], a0 + u * D + d + 16 * q), a);
      }
    }
    for (int64_t j = b_lo; j < b_hi; ++j) {
      __m512 x[4];
      for (int q = 0; q < 4; ++q) x[q] = Load16(in[q], v_rows[j] + d + 16 * q);
      for (int u = 0; u < NB; ++u) {
        const __m512 w = _mm512_set1_ps(w0[u * L + j]);
        for (int q = 0; q < 4; ++q) t[u][q] = _mm512_fmadd_ps(w, x[q], t[u][q]);
      }
    }
    for (int u = 0; u < NB; ++u) {
      for (int q = 0; q < 4; ++q) _mm512_mask_storeu_ps(a0 + u * D + d + 16 * q, in[q], t[u][q]);
    }
  }
}

inline __mmask16 First(int64_t n) {  // lanes 0 .. n - 1 of 16
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

// A block of kBlock query vectors' scores over the 32 * NJ keys j .. of the transposed chunk
// kt [D, L]: s [kBlock, L] = q0 [kBlock, D] . kt, 16 keys a register, each key column loaded
// once for the block's vectors (the 256-bit F32x4 loop's work in half the multiply-adds).
template <int NJ>
__attribute__((noinline)) void WideScores(const float* q0, const float* kt, int64_t D, int64_t L,
                                          int64_t j, float* s) {
  __m512 t[kBlock][2 * NJ];
  for (int u = 0; u < kBlock; ++u) {
    for (int i = 0; i < 2 * NJ; ++i) t[u][i] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[2 * NJ];
    for (int i = 0; i < 2 * NJ; ++i) k[i] = _mm512_loadu_ps(kt + d * L + j + 16 * i);
    for (int u = 0; u < kBlock; ++u) {
      const __m512 w = _mm512_set1_ps(q0[u * D + d]);
      for (int i = 0; i < 2 * NJ; ++i) t[u][i] = _mm512_fmadd_ps(w, k[i], t[u][i]);
    }
  }
  for (int u = 0; u < kBlock; ++u) {
    for (int i = 0; i < 2 * NJ; ++i) _mm512_storeu_ps(s + u * L + j + 16 * i, t[u][i]);
  }
}

// Sixteen floats: one AVX-512 register, for the softmax's exponentials.
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

inline __m512 Exp16(__m512 x) {  // `ExpOf` on a register's 16 lanes
  F16 v;
  std::memcpy(&v, &x, sizeof(v));
  v = ExpOf<F16, I16>(v);
  std::memcpy(&x, &v, sizeof(x));
  return x;
}

// The lanes of `at` (16 key indices) in lo .. hi - 1.
inline __mmask16 Within(__m512i at, __m512i lo, __m512i hi) {
  return _mm512_cmpge_epi32_mask(at, lo) & _mm512_cmplt_epi32_mask(at, hi);
}

// The online softmax's update for a block of kBlock query vectors over the keys lo .. hi - 1 of
// their scores s [kBlock, L] (vector u's own keys begin[u] .. end[u] - 1): each one's new max
// (into m), the factor alpha by which its running sums shrink, its scores replaced by their
// weights (0 outside its own keys, times v_sc where not null) and their sum added to l. The
// block's four vectors run in the same loops, 16 keys a register: one vector at a time, each
// step waited on the last (a max, its sum across lanes, the exponentials, their sum), the
// softmax took more of a prefill's call than the scores.
inline void SoftmaxBlock(float* s, int64_t L, const int64_t* begin, const int64_t* end,
                         int64_t lo, int64_t hi, const float* v_sc, float* m, float* l,
                         float* alpha) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 mx[kBlock];
  __m512i b[kBlock], e[kBlock];
  for (int u = 0; u < kBlock; ++u) {
    mx[u] = _mm512_set1_ps(m[u]);
    b[u] = _mm512_set1_epi32(static_cast<int32_t>(begin[u]));
    e[u] = _mm512_set1_epi32(static_cast<int32_t>(end[u]));
  }
  const int64_t first = lo / 16 * 16;
  for (int64_t j = first; j < hi; j += 16) {
    const __m512i at = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(j)));
    for (int u = 0; u < kBlock; ++u) {
      const __mmask16 in = Within(at, b[u], e[u]);
      mx[u] = _mm512_mask_max_ps(mx[u], in, mx[u], _mm512_maskz_loadu_ps(in, s + u * L + j));
    }
  }
  __m512 top[kBlock], sum[kBlock];
  float a[16] = {};
  for (int u = 0; u < kBlock; ++u) {
    const float new_m = _mm512_reduce_max_ps(mx[u]);
    a[u] = m[u] - new_m;
    m[u] = new_m;
    top[u] = _mm512_set1_ps(new_m);
    sum[u] = _mm512_setzero_ps();
  }
  _mm512_storeu_ps(a, Exp16(_mm512_loadu_ps(a)));
  const __m512i kept_lo = _mm512_set1_epi32(static_cast<int32_t>(lo));
  const __m512i kept_hi = _mm512_set1_epi32(static_cast<int32_t>(hi));
  for (int64_t j = first; j < hi; j += 16) {
    const __m512i at = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(j)));
    const __mmask16 kept = Within(at, kept_lo, kept_hi);
    const __m512 vs = v_sc != nullptr ? _mm512_maskz_loadu_ps(kept, v_sc + j) : _mm512_set1_ps(1);
    for (int u = 0; u < kBlock; ++u) {
      const __mmask16 in = Within(at, b[u], e[u]);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + u * L + j), top[u]);
      const __m512 w = _mm512_maskz_mov_ps(in, Exp16(x));
      sum[u] = _mm512_add_ps(sum[u], w);
      _mm512_mask_storeu_ps(s + u * L + j, kept, v_sc != nullptr ? _mm512_mul_ps(w, vs) : w);
    }
  }
  for (int u = 0; u < kBlock; ++u) {
    if (begin[u] >= end[u]) {  // no keys here: its sums stay (its max may still be -inf)
      alpha[u] = 1.0f;
      continue;
    }
    alpha[u] = a[u];
    l[u] = l[u] * a[u] + _mm512_reduce_add_ps(sum[u]);
  }
}

// r[c] = column c of the 16 x 16 floats r[0 .. 15] held (a transpose in registers).
inline void Transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i) {
    for (int q = 0; q < 4; ++q) {
      t[8 * i + q] = _mm512_shuffle_f32x4(r[8 * i + q], r[8 * i + q + 4], 0x88);
      t[8 * i + q + 4] = _mm512_shuffle_f32x4(r[8 * i + q], r[8 * i + q + 4], 0xDD);
    }
  }
  for (int q = 0; q < 8; ++q) {
    r[q] = _mm512_shuffle_f32x4(t[q], t[q + 8], 0x88);
    r[q + 8] = _mm512_shuffle_f32x4(t[q], t[q + 8], 0xDD);
  }
}

// The chunk's keys j .. as floats times their scales, keys minor: kt [D, L], 16 keys x 16
// channels a transpose, while 16 keys remain (D a multiple of 16). Returns the first key left.
template <typename T>
int64_t TransposeKeys(const T* const* k_rows, const float* k_sc, int64_t j, int64_t keys,
                      int64_t D, int64_t L, float* kt) {
  for (; j + 16 <= keys; j += 16) {
    for (int64_t d = 0; d < D; d += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_mul_ps(Load16(0xffff, k_rows[j + i] + d), _mm512_set1_ps(k_sc[j + i]));
      }
      Transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(kt + (d + c) * L + j, r[c]);
    }
  }
  return j;
}

#else
constexpr bool kWide = false;
template <int NB, typename U>
void WeighValuesWide(const U* const*, int64_t, int64_t, int64_t, int64_t, const float*,
                     const float*, float*) {}
template <int NJ>
void WideScores(const float*, const float*, int64_t, int64_t, int64_t, float*) {}
// The largest of x[0 .. n - 1] and mx, eight running maxima: one chain of dependent maxss per
// key was the loop's cost.
inline float MaxOf(const float* x, int64_t n, float mx) {
  F8 mx8 = Splat(mx);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const F8 v = Load(x + j);
    mx8 = v > mx8 ? v : mx8;
  }
  for (int64_t e = 0; e < kW; ++e) mx = std::max(mx, mx8[e]);
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
}

// x[j] = exp(x[j] - mx) for j < n, eight at a time; returns their sum.
inline float ExpSum(float* x, int64_t n, float mx) {
  F8 sum = Splat(0.0f);
  const F8 mx8 = Splat(mx);
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const F8 e = Exp(Load(x + j) - mx8);
    Store(x + j, e);
    sum += e;
  }
  float total = Sum(sum);
  for (; j < n; ++j) {
    x[j] = Exp(x[j] - mx);
    total += x[j];
  }
  return total;
}
// SoftmaxBlock (above) one vector at a time.
inline void SoftmaxBlock(float* s, int64_t L, const int64_t* begin, const int64_t* end,
                         int64_t lo, int64_t hi, const float* v_sc, float* m, float* l,
                         float* alpha) {
  for (int64_t u = 0; u < kBlock; ++u) {
    float* sr = s + u * L;
    const int64_t b0 = begin[u], e0 = end[u];
    if (b0 >= e0) {  // no keys here: its sums stay
      alpha[u] = 1.0f;
      std::fill(sr + lo, sr + hi, 0.0f);
      continue;
    }
    const float mx = MaxOf(sr + b0, e0 - b0, m[u]);
    alpha[u] = Exp(m[u] - mx);
    l[u] = l[u] * alpha[u] + ExpSum(sr + b0, e0 - b0, mx);
    m[u] = mx;
    if (v_sc != nullptr) {  // an int8 value row's scale
      for (int64_t j = b0; j < e0; ++j) sr[j] *= v_sc[j];
    }
    std::fill(sr + lo, sr + b0, 0.0f);
    std::fill(sr + e0, sr + hi, 0.0f);
  }
}
template <typename T>
int64_t TransposeKeys(const T* const*, const float*, int64_t j, int64_t, int64_t, int64_t, float*) {
  return j;
}
#endif

// The weighted values of nb vectors (kWideGroup at most where kWide, else the first nb of a
// block of kBlock, the others' weights all 0).
template <typename U>
void WeighBlock(int64_t nb, const U* const* v_rows, int64_t b_lo, int64_t b_hi, int64_t D,
                int64_t L, const float* w0, const float* alpha, float* a0) {
  if constexpr (kWide) {
    switch (nb) {
      case 1: return WeighValuesWide<1>(v_rows, b_lo, b_hi, D, L, w0, alpha, a0);
      case 2: return WeighValuesWide<2>(v_rows, b_lo, b_hi, D, L, w0, alpha, a0);
      case 3: return WeighValuesWide<3>(v_rows, b_lo, b_hi, D, L, w0, alpha, a0);
      case 4: return WeighValuesWide<4>(v_rows, b_lo, b_hi, D, L, w0, alpha, a0);
      case 5: return WeighValuesWide<5>(v_rows, b_lo, b_hi, D, L, w0, alpha, a0);
      default: return WeighValuesWide<kWideGroup>(v_rows, b_lo, b_hi, D, L, w0, alpha, a0);
    }
  }
  WeighValues(v_rows, b_lo, b_hi, D, L, w0, alpha, a0);
}

// The bytes at the start of a page that `Prefetch` asks for: the CPU's L2 streamer, which runs
// ahead of ascending lines within a 4 KB page, fetches the rest. Each prefetch holds one of the
// core's few line-fill buffers until its line arrives, so a whole page's (a float32 page of 16
// slots: 64 lines) stalled the loop; its first 1 KB ran a decode step's attention 1.15x faster
// (Ice Lake, float32 pools, contexts 200 and 500; 1, 4, 8 or 32 lines a page were slower).
constexpr int64_t kPrefetchBytes = 1024;

// Fetches the starts of pages table[first .. last - 1] of one KV head's pool (`head`, pages of
// `page` elements) into L2.
template <typename T>
void Prefetch(const T* head, const int32_t* table, int64_t page, int64_t first, int64_t last) {
  const int64_t upto = std::min<int64_t>(page, kPrefetchBytes / sizeof(T));
  for (int64_t i = first; i < last; ++i) {
    const T* at = head + static_cast<int64_t>(table[i]) * page;
    for (int64_t x = 0; x < upto; x += 64 / sizeof(T)) __builtin_prefetch(at + x, 0, 2);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kBf16Scores = true;

// A block of kBlock query vectors' scores over keys j .. j + 31 (of L a row): s [kBlock, L] =
// scale * q_pairs [kBlock, D / 2] . k_pairs [D / 2, L], as `vdpbf16ps` sums: each pair of
// channels' two products exact in float32 (the values are bfloat16), added in float32
// (denormal inputs and sums flushed to zero, as the instruction does).
inline void Bf16Scores(const uint32_t* q_pairs, const uint32_t* k_pairs, int64_t half_d,
                       int64_t L, int64_t j, float scale, float* s) {
  __m512 acc[kBlock][2];
  for (int64_t u = 0; u < kBlock; ++u) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
  for (int64_t e = 0; e < half_d; ++e) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k_pairs + e * L + j);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(k_pairs + e * L + j + 16);
    for (int64_t u = 0; u < kBlock; ++u) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(int(q_pairs[u * half_d + e]));
      acc[u][0] = _mm512_dpbf16_ps(acc[u][0], q, k0);
      acc[u][1] = _mm512_dpbf16_ps(acc[u][1], q, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t u = 0; u < kBlock; ++u) {
    _mm512_storeu_ps(s + u * L + j, _mm512_mul_ps(acc[u][0], sc));
    _mm512_storeu_ps(s + u * L + j + 16, _mm512_mul_ps(acc[u][1], sc));
  }
}

// Lane u of the result: the sum of a[u]'s 16 lanes, for 16 vectors at once. Keys 2i, 2i + 1
// first: lanes (0, 2) of each 128-bit quarter hold 2i's partial sums, (1, 3) 2i + 1's; then
// keys 4i .. 4i + 3, lane r of each quarter key 4i + r's; then the quarters.
inline __m512 Sums16(const __m512* a) {
  __m512 b[8];
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  __m512 c[4];
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // quarters (c0's 0 + 1, c0's 2 + 3, c1's 0 + 1, c1's 2 + 3), and the same of c2, c3
  __m512 d[2];
  for (int i = 0; i < 2; ++i) {
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query vector's scores over n <= 16 keys read in place, as the rows k_rows[0 .. n - 1]
// hold them: s[u] = scale * q_pairs [D / 2] . key u's channel pairs, `vdpbf16ps` sums as above.
// The 16 keys' sums reduced together (`Sums16`).
inline void Bf16KeyScores(const uint32_t* q_pairs, const uint16_t* const* k_rows, int64_t n,
                          int64_t half_d, float scale, float* s) {
  const uint32_t* k[16];
  for (int64_t u = 0; u < 16; ++u) {
    k[u] = reinterpret_cast<const uint32_t*>(k_rows[std::min<int64_t>(u, n - 1)]);
  }
  __m512 a[16];
  for (int64_t u = 0; u < 16; ++u) a[u] = _mm512_setzero_ps();
  for (int64_t e = 0; e < half_d; e += 16) {
    const __mmask16 in = First(half_d - e);
    const __m512bh q = (__m512bh)_mm512_maskz_loadu_epi32(in, q_pairs + e);
    for (int64_t u = 0; u < 16; ++u) {
      a[u] = _mm512_dpbf16_ps(a[u], q, (__m512bh)_mm512_maskz_loadu_epi32(in, k[u] + e));
    }
  }
  _mm512_mask_storeu_ps(s, First(n), _mm512_mul_ps(Sums16(a), _mm512_set1_ps(scale)));
}
#else
constexpr bool kBf16Scores = false;
inline void Bf16Scores(const uint32_t*, const uint32_t*, int64_t, int64_t, int64_t, float,
                       float*) {}
inline void Bf16KeyScores(const uint32_t*, const uint16_t* const*, int64_t, int64_t, float,
                          float*) {}
#endif

template <typename T>
void RunItem(const Problem& p, const Item& it, std::vector<float>& scratch, Rows<T>& rows) {
  const int64_t D = p.D, S = p.S, R = p.R;
  const int64_t C = std::max<int64_t>(1, kChunkKeys / S);  // pages a chunk
  const int64_t L = (C * S + 4 * kW - 1) / (4 * kW) * (4 * kW);  // its keys, whole blocks of 32
  const int64_t tokens = it.last - it.first, vecs = tokens * R;
  // query vectors (token i, head r at i * R + r) in blocks of kBlock, the last padded with zeros
  const int64_t padded_vecs = (vecs + kBlock - 1) / kBlock * kBlock;
  scratch.resize(padded_vecs * (2 * D + 3 + L) + D * L);
  float* qs = scratch.data();          // [vecs, D] scaled queries
  float* acc = qs + padded_vecs * D;   // [vecs, D] running sum of weighted values
  float* m = acc + padded_vecs * D;    // [vecs] running max
  float* l = m + padded_vecs;          // [vecs] running sum of weights
  float* alpha = l + padded_vecs;      // [vecs] this chunk's rescale of the running sums
  float* s = alpha + padded_vecs;      // [vecs, L] scores over the chunk, then their weights
  float* kt = s + padded_vecs * L;     // [D, L] this chunk's keys, keys minor
  rows.begin.resize(padded_vecs);
  rows.end.resize(padded_vecs);
  int64_t* begin = rows.begin.data();  // [vecs] a vector's keys in the chunk: begin .. end - 1
  int64_t* end = rows.end.data();
  std::fill(qs + vecs * D, qs + padded_vecs * D, 0.0f);
  const int64_t cached = p.cached[it.row], start = p.starts[it.row];
  uint32_t low_bits = 0;  // of every query value: 0 when all are bfloat16 values
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      const float* src = p.q + ((start + it.first + i) * p.H + it.head * R + r) * D;
      float* dst = qs + (i * R + r) * D;
      for (int64_t d = 0; d < D; ++d) {
        uint32_t bits;
        std::memcpy(&bits, src + d, 4);
        low_bits |= bits & 0xffffu;
        dst[d] = src[d] * p.scale;
      }
    }
  }
  // A bfloat16 pool and queries of bfloat16 values (a bfloat16 model's): the scores are
  // bfloat16 dot products, twice float32's multiply-adds a cycle, each product exact as in
  // float32 (the scale applied to the sums, not the queries).
  const bool bf16_scores = kBf16Scores && std::is_same_v<T, uint16_t> && p.k_scale == nullptr &&
                           low_bits == 0;
  const int64_t half_d = D / 2;
  if (bf16_scores) {
    rows.q_pairs.assign(padded_vecs * half_d, 0u);
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t r = 0; r < R; ++r) {
        const float* src = p.q + ((start + it.first + i) * p.H + it.head * R + r) * D;
        uint32_t* dst = rows.q_pairs.data() + (i * R + r) * half_d;
        for (int64_t e = 0; e < half_d; ++e) {
          uint32_t lo, hi;
          std::memcpy(&lo, src + 2 * e, 4);
          std::memcpy(&hi, src + 2 * e + 1, 4);
          dst[e] = (lo >> 16) | (hi & 0xffff0000u);  // channel 2e low, 2e + 1 high
        }
      }
    }
    rows.k_pairs.resize(half_d * L);
    bf16_score_items.fetch_add(1, std::memory_order_relaxed);
  }
  std::fill(acc, acc + padded_vecs * D, 0.0f);
  std::fill(m, m + padded_vecs, -std::numeric_limits<float>::infinity());
  std::fill(l, l + padded_vecs, 0.0f);
  const int64_t pages = (cached + it.last - 1) / S + 1;  // up to the tile's last position
  // the first key any token of the tile sees: its chunks start at that key's page
  const int64_t lowest = p.window > 0 ? std::max<int64_t>(0, cached + it.first - p.window + 1) : 0;
  const int32_t* table = p.tables + it.row * p.N;
  const T* k_head = static_cast<const T*>(p.k) + it.head * p.P * S * D;
  const T* v_head = static_cast<const T*>(p.v) + it.head * p.P * S * D;
  const int64_t scale_head = it.head * p.P * S;
  rows.k.resize(L);
  rows.v.resize(L);
  rows.k_scale.assign(L + kW, 1.0f);  // kW past the keys: the key-by-key scores' last load
  rows.v_scale.assign(L, 1.0f);
  auto& k_rows = rows.k;
  auto& v_rows = rows.v;
  rows.vf.resize(L);
  const float** vf = rows.vf.data();
  if constexpr (!std::is_same_v<T, float>) rows.v_float.resize(L * D);
  float* k_sc = rows.k_scale.data();
  float* v_sc = rows.v_scale.data();
  const int64_t page0 = lowest / S;
  for (int64_t c0 = page0; c0 < pages; c0 += C) {
    const int64_t n_pages = std::min(C, pages - c0), j0 = c0 * S;
    for (int64_t pi = 0; pi < n_pages; ++pi) {
      const int64_t page = static_cast<int64_t>(table[c0 + pi]) * S * D;
      for (int64_t j = 0; j < S; ++j) {
        k_rows[pi * S + j] = k_head + page + j * D;
        v_rows[pi * S + j] = v_head + page + j * D;
      }
      if (p.k_scale != nullptr) {
        const int64_t at = scale_head + static_cast<int64_t>(table[c0 + pi]) * S;
        std::memcpy(k_sc + pi * S, p.k_scale + at, sizeof(float) * S);
        std::memcpy(v_sc + pi * S, p.v_scale + at, sizeof(float) * S);
      }
    }
    // The next chunk's keys are fetched while this one is scored and its values while this
    // one's are weighed (the first chunk's before they are read): a sequence's pages lie
    // anywhere in the pool, so the hardware prefetcher cannot follow from one to the next.
    // Into L2, a half at a time: fetched into L1, or all at once, they evicted the rows being
    // read, or waited for room.
    const int64_t ahead = c0 == page0 ? page0 : c0 + C, ahead_end = std::min(pages, c0 + 2 * C);
    Prefetch(k_head, table, S * D, ahead, ahead_end);
    // Each query vector's keys in the chunk: its token's positions up to its own, within the
    // window; none for the tile's tokens before the chunk's first key, and for the padding.
    const int64_t keys = n_pages * S;
    // the tile's first token at or past the chunk's first key
    const int64_t from = std::max<int64_t>(0, j0 - cached - it.first);
    int64_t lo = keys, hi = 0;  // the union of the vectors' keys
    for (int64_t vec = 0; vec < padded_vecs; ++vec) {
      const int64_t i = vec / R, pos = cached + it.first + i;
      begin[vec] = end[vec] = 0;
      if (i < from || vec >= vecs) continue;
      const int64_t seen = std::min(keys, pos - j0 + 1);
      // keys before j0 + first lie outside the window: never scored, weighted or read
      const int64_t first = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - j0) : 0;
      if (first >= seen) continue;
      begin[vec] = first, end[vec] = seen;
      lo = std::min(lo, first), hi = std::max(hi, seen);
    }
    if (lo >= hi) continue;
    const bool transposed = (vecs - from * R) >= kTranspose;
    // Many query vectors read each row many times: bfloat16 or int8 rows are then converted to
    // floats once, here (the keys as they are transposed). A few read the pools in place,
    // converting as they load: at decode's one token a row, a copy would cost more than the
    // products that read it.
    const bool v_converted = transposed && !std::is_same_v<T, float>;
    if (v_converted) {
      for (int64_t j = 0; j < n_pages * S; ++j) {
        float* vd = rows.v_float.data() + j * D;
        for (int64_t d = 0; d < D; d += kW) Store(vd + d, Load(v_rows[j] + d));
        vf[j] = vd;
      }
    }
    if (transposed && bf16_scores) {  // the same blocks from channel pairs of the keys
      uint32_t* kp = rows.k_pairs.data();
      for (int64_t j = lo / (4 * kW) * (4 * kW); j < n_pages * S; ++j) {
        const uint32_t* krow = reinterpret_cast<const uint32_t*>(k_rows[j]);
        for (int64_t e = 0; e < half_d; ++e) kp[e * L + j] = krow[e];
      }
      const int64_t padded = (keys + 4 * kW - 1) / (4 * kW) * (4 * kW);
      for (int64_t e = 0; e < half_d; ++e) {  // the padding keys score 0, never weighted
        std::fill(kp + e * L + keys, kp + e * L + padded, 0u);
      }
      for (int64_t b = from * R / kBlock * kBlock; b < vecs; b += kBlock) {
        const auto [b_lo, b_hi] = BlockKeys(begin + b, end + b, kBlock, keys);
        for (int64_t j = b_lo / (4 * kW) * (4 * kW); j < b_hi; j += 4 * kW) {
          Bf16Scores(rows.q_pairs.data() + b * half_d, kp, half_d, L, j, p.scale, s + b * L);
        }
      }
    } else if (transposed) {  // the scores of kBlock vectors x 32 (or 64) keys at a time
      int64_t first = lo / (4 * kW) * (4 * kW);
      if (kWide && D % 16 == 0) first = TransposeKeys(k_rows.data(), k_sc, first, keys, D, L, kt);
      for (int64_t j = first; j < keys; ++j) {
        const T* krow = k_rows[j];
        const F8 sc = Splat(k_sc[j]);
        for (int64_t d = 0; d < D; d += kW) {
          const F8 x = Load(krow + d) * sc;
          for (int64_t e = 0; e < kW; ++e) kt[(d + e) * L + j] = x[e];
        }
      }
      const int64_t padded = (keys + 4 * kW - 1) / (4 * kW) * (4 * kW);
      for (int64_t d = 0; d < D; ++d) {  // the padding keys score 0 and are never weighted
        std::fill(kt + d * L + keys, kt + d * L + padded, 0.0f);
      }
      for (int64_t b = from * R / kBlock * kBlock; b < vecs; b += kBlock) {
        const auto [b_lo, b_hi] = BlockKeys(begin + b, end + b, kBlock, keys);
        const float* q0 = qs + b * D;
        int64_t j = b_lo / (4 * kW) * (4 * kW);
        if constexpr (kWide) {  // 64 keys at a time while the second 32 hold any, then 32
          for (; j + 4 * kW < b_hi; j += 8 * kW) WideScores<2>(q0, kt, D, L, j, s + b * L);
          if (j < b_hi) WideScores<1>(q0, kt, D, L, j, s + b * L);
          continue;
        }
        for (; j < b_hi; j += 4 * kW) {
          F32x4 t[kBlock] = {};
          for (int64_t d = 0; d < D; ++d) {
            const F32x4 k = F32x4::Load(kt + d * L + j);
            for (int64_t u = 0; u < kBlock; ++u) t[u].AddScaled(Splat(q0[u * D + d]), k);
          }
          for (int64_t u = 0; u < kBlock; ++u) t[u].Store(s + (b + u) * L + j);
        }
      }
    } else if (bf16_scores) {  // few query vectors: 16 keys at a time, read in place
      if constexpr (std::is_same_v<T, uint16_t>) {
        for (int64_t vec = from * R; vec < vecs; ++vec) {
          const uint32_t* qp = rows.q_pairs.data() + vec * half_d;
          for (int64_t j = begin[vec]; j < end[vec]; j += 16) {
            const int64_t n = std::min<int64_t>(16, end[vec] - j);
            Bf16KeyScores(qp, k_rows.data() + j, n, half_d, p.scale, s + vec * L + j);
          }
        }
      }
    } else {  // the chunk's few query vectors: eight keys at a time, their sums reduced together
      for (int64_t j = lo; j < hi; j += kW) {
        const int64_t n = std::min(kW, hi - j);
        const T* krow[kW];
        for (int64_t u = 0; u < kW; ++u) krow[u] = k_rows[j + std::min(u, n - 1)];
        const F8 sc = Load(k_sc + j);  // k_sc holds kW slots past the chunk's keys
        for (int64_t vec = from * R; vec < vecs; ++vec) {
          if (begin[vec] >= end[vec]) continue;
          const float* qv = qs + vec * D;
          F8 t[kW] = {};
          for (int64_t d = 0; d < D; d += kW) {
            const F8 x = Load(qv + d);
            for (int64_t u = 0; u < kW; ++u) t[u] += x * Load(krow[u] + d);
          }
          const F8 scores = Sums(t) * sc;
          if (n == kW) {
            Store(s + vec * L + j, scores);
          } else {
            for (int64_t u = 0; u < n; ++u) s[vec * L + j + u] = scores[u];
          }
        }
      }
    }
    Prefetch(v_head, table, S * D, ahead, ahead_end);
    // The online softmax's update, a block of vectors at a time: each vector's new max, its
    // scores' weights and the factor alpha by which its running sums shrink. A weight is set to
    // exactly 0 at each key of lo .. hi - 1 outside the vector's own (a score there may be a
    // stale slot's NaN, and the blocks below weigh keys of the union).
    for (int64_t b = from * R / kBlock * kBlock; b < padded_vecs; b += kBlock) {
      if (p.softcap > 0) {
        for (int64_t vec = b; vec < b + kBlock; ++vec) {
          float* sr = s + vec * L;
          for (int64_t j = begin[vec]; j < end[vec]; ++j) {
            sr[j] = p.softcap * std::tanh(sr[j] / p.softcap);
          }
        }
      }
      SoftmaxBlock(s + b * L, L, begin + b, end + b, lo, hi, p.v_scale != nullptr ? v_sc : nullptr,
                   m + b, l + b, alpha + b);
    }
    // The weighted values: a group of vectors x 32 channels (kBlock vectors; kWideGroup x 64
    // channels in 512-bit registers over the rows in place) held over their keys, each value row
    // read once for the group's vectors.
    const int64_t group = kWide && !v_converted ? kWideGroup : kBlock;
    for (int64_t b = from * R / kBlock * kBlock; b < vecs; b += group) {
      const int64_t nb = std::min(group, vecs - b);  // decode's R vectors, no padding
      const auto [b_lo, b_hi] = BlockKeys(begin + b, end + b, nb, keys);
      const float* w0 = s + b * L;
      float* a0 = acc + b * D;
      if (b_lo >= b_hi) {
        continue;  // alpha is 1 for each: the sums stay
      }
      if (v_converted) {
        WeighValues(vf, b_lo, b_hi, D, L, w0, alpha + b, a0);
      } else {
        WeighBlock(nb, v_rows.data(), b_lo, b_hi, D, L, w0, alpha + b, a0);
      }
    }
  }
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t vec = i * R + r;
      float* dst = p.out + ((start + it.first + i) * p.H + it.head * R + r) * D;
      const float inv = 1.0f / l[vec];  // > 0: the token's own key is always seen
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[vec * D + d] * inv;
    }
  }
}

template <typename T>
void Work(Problem& p) {
  std::vector<float> scratch;
  Rows<T> rows;
  const int64_t n = static_cast<int64_t>(p.items.size());
  for (int64_t i = p.next.fetch_add(1); i < n; i = p.next.fetch_add(1)) {
    RunItem<T>(p, p.items[i], scratch, rows);
  }
}

// The whole call for pools of E (float, or int8 with scales k_scale / v_scale [G, P, S]).
template <typename E, typename Pool>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, Pool& k, Pool& v,
               const float* k_scale, const float* v_scale, ffi::Buffer<ffi::S32>& tables,
               ffi::Buffer<ffi::S32>& starts, ffi::Buffer<ffi::S32>& counts,
               ffi::Buffer<ffi::S32>& cached, ffi::Buffer<ffi::S32>& window,
               ffi::ResultBuffer<ffi::F32>& out, float sm_scale, float softcap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("expected q [T, H, D], pools [G, P, S, D], tables [B, N]");
  }
  if (v.dimensions().size() != 4 || !std::equal(kd.begin(), kd.end(), v.dimensions().begin())) {
    return ffi::Error::InvalidArgument("the K and V pools differ in shape");
  }
  const int64_t T = qd[0], H = qd[1], D = qd[2], G = kd[0], P = kd[1], S = kd[2];
  const int64_t B = td[0], N = td[1];
  if (kd[3] != D || G == 0 || H % G != 0 || D % kW != 0) {
    return ffi::Error::InvalidArgument(
        "head dims differ or are not a multiple of 8, or query heads not a multiple of KV heads");
  }
  if (window.element_count() != 1) {
    return ffi::Error::InvalidArgument("window must be one int32");
  }
  for (auto* x : {&starts, &counts, &cached}) {
    if (x->dimensions().size() != 1 || x->dimensions()[0] != B) {
      return ffi::Error::InvalidArgument("starts, counts and cached must be [B], B = tables' rows");
    }
  }
  auto state = std::make_shared<Problem>();
  Problem& p = *state;
  p.q = q.typed_data();
  p.k = k.typed_data();
  p.v = v.typed_data();
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.tables = tables.typed_data();
  p.starts = starts.typed_data();
  p.cached = cached.typed_data();
  p.out = out->typed_data();
  p.H = H, p.D = D, p.G = G, p.P = P, p.S = S, p.N = N, p.R = H / G;
  p.scale = sm_scale;
  p.softcap = softcap;
  p.window = std::max<int32_t>(0, window.typed_data()[0]);
  if (T * H * D > 0) std::memset(p.out, 0, sizeof(float) * T * H * D);
  std::vector<char> covered(T, 0);  // rows must not share a token: each output has one writer
  const int32_t* cnt = counts.typed_data();
  int64_t long_items = 0;
  for (int64_t b = 0; b < B; ++b) long_items += std::max<int64_t>(0, cnt[b] + kTile - 1) / kTile;
  const int64_t tile =
      long_items * G >= kItemsPerThread * std::max<int64_t>(1, pool.num_threads()) ? kTile
                                                                                    : kShortTile;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = cnt[b], first = p.starts[b], pos0 = p.cached[b];
    if (c <= 0) continue;
    if (first < 0 || first + c > T || pos0 < 0 || pos0 + c > N * S) {
      return ffi::Error::InvalidArgument(
          "row " + std::to_string(b) + " (start " + std::to_string(first) + ", count " +
          std::to_string(c) + ", cached " + std::to_string(pos0) + ") lies outside the " +
          std::to_string(T) + " tokens or its " + std::to_string(N * S) + "-key table");
    }
    for (int64_t t = first; t < first + c; ++t) {
      if (covered[t]) {
        return ffi::Error::InvalidArgument("row " + std::to_string(b) + " holds token " +
                                           std::to_string(t) + ", which another row holds too");
      }
      covered[t] = 1;
    }
    const int64_t lowest = p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
    for (int64_t i = lowest / S; i <= (pos0 + c - 1) / S; ++i) {  // the pages it reads
      const int32_t page = p.tables[b * N + i];
      if (page < 0 || page >= P) {
        return ffi::Error::InvalidArgument("row " + std::to_string(b) + " reads page " +
                                           std::to_string(page) + ", outside the pool's " +
                                           std::to_string(P));
      }
    }
    for (int64_t f = 0; f < c; f += tile) {
      for (int64_t g = 0; g < G; ++g) {
        p.items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(g),
                           static_cast<int32_t>(f), static_cast<int32_t>(std::min(c, f + tile))});
      }
    }
  }
  work_items.fetch_add(static_cast<int64_t>(p.items.size()), std::memory_order_relaxed);
  // The longest items first, so that the last ones taken are short.
  std::stable_sort(p.items.begin(), p.items.end(), [&](const Item& a, const Item& b) {
    auto cost = [&](const Item& x) {
      const int64_t tokens = x.last - x.first;
      return tokens * (static_cast<int64_t>(p.cached[x.row]) + x.last);
    };
    return cost(a) > cost(b);
  });
  // The caller takes items too: with the pool's other threads, one worker per thread.
  const int64_t helpers = std::max<int64_t>(
      0, std::min<int64_t>(pool.num_threads() - 1, static_cast<int64_t>(p.items.size()) - 1));
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([state] {
      state->active.fetch_add(1);
      if (!state->closed.load()) Work<E>(*state);  // a task that starts late finds nothing to do
      state->active.fetch_sub(1);
    });
  }
  Work<E>(p);
  // Wait for the tasks that started before the close: each finishes the item it holds. One
  // that starts after it touches only `state`, which it owns a share of.
  p.closed.store(true);
  while (p.active.load() != 0) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> tables,
                ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> counts,
                ffi::Buffer<ffi::S32> cached, ffi::Buffer<ffi::S32> window,
                ffi::ResultBuffer<ffi::F32> out, float sm_scale, float softcap) {
  return Run<float>(pool, q, k, v, nullptr, nullptr, tables, starts, counts, cached, window, out,
                    sm_scale, softcap);
}

ffi::Error ImplBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U16> k,
                    ffi::Buffer<ffi::U16> v, ffi::Buffer<ffi::S32> tables,
                    ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> counts,
                    ffi::Buffer<ffi::S32> cached, ffi::Buffer<ffi::S32> window,
                    ffi::ResultBuffer<ffi::F32> out, float sm_scale, float softcap) {
  return Run<uint16_t>(pool, q, k, v, nullptr, nullptr, tables, starts, counts, cached, window,
                       out, sm_scale, softcap);
}

ffi::Error ImplInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                    ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scales,
                    ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> tables,
                    ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> counts,
                    ffi::Buffer<ffi::S32> cached, ffi::Buffer<ffi::S32> window,
                    ffi::ResultBuffer<ffi::F32> out, float sm_scale, float softcap) {
  const auto kd = k.dimensions();
  for (auto* x : {&k_scales, &v_scales}) {
    const auto sd = x->dimensions();
    if (kd.size() != 4 || sd.size() != 3 || !std::equal(sd.begin(), sd.end(), kd.begin())) {
      return ffi::Error::InvalidArgument("the scales must be [G, P, S], the pools' leading axes");
    }
  }
  return Run<int8_t>(pool, q, k, v, k_scales.typed_data(), v_scales.typed_data(), tables, starts,
                     counts, cached, window, out, sm_scale, softcap);
}

}  // namespace

// How many work items in this process scored their keys as bfloat16 dot products; -1 where
// the kernel was built without AVX512_BF16.
// Work items made by the calls of this process so far (each a row's tile of tokens, one KV head).
extern "C" int64_t JaxpipeWorkItems() { return work_items.load(); }

extern "C" int64_t JaxpipeBf16ScoreItems() {
  return kBf16Scores ? bf16_score_items.load() : -1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeRaggedPagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pool [G, P, S, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pool [G, P, S, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables [B, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cached [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (0: none)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeRaggedPagedAttentionBf16, ImplBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, H, D]
                                  .Arg<ffi::Buffer<ffi::U16>>()   // k pool [G, P, S, D],
                                  .Arg<ffi::Buffer<ffi::U16>>()   // v: bfloat16 bits
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tables [B, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // starts [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // counts [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cached [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window [] (0: none)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, H, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeRaggedPagedAttentionInt8, ImplInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, D]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // k pool [G, P, S, D]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // v pool [G, P, S, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales [G, P, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales [G, P, S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables [B, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // starts [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cached [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (0: none)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("softcap"));
