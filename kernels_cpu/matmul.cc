// A GEMM on the CPU through oneDNN's matmul primitive, an XLA FFI custom call
// (kernels_cpu/matmul.py).
//
// y [M, N] = x [M, K] @ w, where w is [K, N] row-major, or with transpose_w its [N, K] transpose
// read in place (a tied embedding [V, D] as the output head). x and w are float32 or bfloat16
// alike; y is float32, or bfloat16 for bfloat16 x and w (oneDNN accumulates in float32).
// JaxpipePrepack reorders w once into oneDNN's blocked layout, and JaxpipeMatmulPrepacked runs
// the product on those bytes (no reorder at each call); JaxpipeMatmulPrepackedRows computes only
// the first rows of y that an operand names (a serving step's real tokens), the rest zeros.
// Why: XLA:CPU's own dots run bfloat16 at well under half the rate oneDNN's brgemm kernels get
// from AVX512_BF16 (docs/benchmarks.md, "Where a serving step's time goes").
//
// On a CPU without bfloat16 dot products (no AVX512_BF16 or AMX: Ice Lake, Cascade Lake, Zen 3,
// AVX2 machines) oneDNN's bfloat16 matmul is a slow emulated GEMM, at about a fifth of its
// float32 rate. There a bfloat16 product runs as a float32 one instead (`Bf16InFloat32`): x is
// widened (exactly), packed bfloat16 weights are held as bfloat16 and widened in registers where
// `Panels` runs (`Bf16Panels`: Intel CPUs with AVX-512), else packed as float32 (twice the
// bytes), row-major ones widened at each call, and the float32 sums are rounded to bfloat16
// once, as oneDNN's bfloat16 kernels round them: the same product, at float32's rate.
//
// One primitive per (M, K, N, dtypes, layout) is created on first use and kept: creation costs
// about a millisecond, execution is what each call pays. Primitives are immutable and oneDNN
// executes one from several threads at once, each with its own stream and scratchpad, so the
// cache's lock is held only to look up or insert. oneDNN threads the GEMM itself (OpenMP), on
// as many threads as the call is given: a product split over several host devices runs on each
// device's share of the cores (more threads than cores, their teams would take turns).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <omp.h>  // the runtime oneDNN's gomp build threads with (libgomp)

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// How a product reads its weights: [K, N] row-major, its [N, K] transpose in place, or packed
// (`PackedDesc`: oneDNN's own blocked layout, reordered once by `PrepackImpl`).
enum Layout { kRowMajor = 0, kTransposed = 1, kPacked = 2 };

struct Key {
  int64_t m, k, n;
  int x_type, y_type;
  int layout;
  int threads;  // oneDNN blocks a product for the threads it is created under
  bool operator==(const Key& o) const {
    return m == o.m && k == o.k && n == o.n && x_type == o.x_type && y_type == o.y_type &&
           layout == o.layout && threads == o.threads;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = std::hash<int64_t>()(key.m);
    for (int64_t v : {key.k, key.n, int64_t(key.x_type), int64_t(key.y_type),
                      int64_t(key.layout), int64_t(key.threads)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    }
    return h;
  }
};

struct Gemm {
  dnnl::matmul primitive;
  dnnl::memory::desc x, w, y, scratch;
};

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

// -1: decide by the CPU; 0 or 1: as set (`JaxpipeSetBf16InFloat32`, for tests).
std::atomic<int> bf16_in_float32_override{-1};

// Whether bfloat16 products run as float32 ones here: oneDNN's effective ISA (the CPU's, capped
// by ONEDNN_MAX_CPU_ISA) has no bfloat16 dot products (AVX512_BF16, AMX and later include them).
bool Bf16InFloat32() {
  const int set = bf16_in_float32_override.load();
  if (set >= 0) return set != 0;
  static const bool emulate = [] {
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & bf16) != bf16;
  }();
  return emulate;
}

// The dtype a product of `type` inputs runs in (and its packed weights are held in).
dt ComputeType(dt type) { return type == dt::bf16 && Bf16InFloat32() ? dt::f32 : type; }

// The rows of the product that chooses a packed layout: oneDNN blocks the weights for the
// kernels it would pick at this M, and runs products of any M on that layout.
constexpr int64_t kProbeRows = 128;

// The packed layout of [K, N] weights of a dtype: the weights' format oneDNN chooses (`any`) for
// a product of kProbeRows rows. Deterministic within a process; packed bytes are not kept across
// processes.
dnnl::memory::desc PackedDesc(int64_t k, int64_t n, dt type) {
  type = ComputeType(type);
  static std::mutex mu;
  static std::unordered_map<Key, dnnl::memory::desc, KeyHash> cache;
  const Key key{0, k, n, int(type), int(type), kPacked, 0};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  dnnl::memory::desc x({kProbeRows, k}, type, tag::ab);
  dnnl::memory::desc w({k, n}, type, tag::any);
  dnnl::memory::desc y({kProbeRows, n}, type, tag::ab);
  dnnl::matmul::primitive_desc pd(Engine(), x, w, y);
  return cache.emplace(key, pd.weights_desc()).first->second;
}

const Gemm& Cached(const Key& key) {
  static std::mutex mu;
  static std::unordered_map<Key, Gemm, KeyHash> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const auto x_type = static_cast<dt>(key.x_type), y_type = static_cast<dt>(key.y_type);
  dnnl::memory::desc x({key.m, key.k}, x_type, tag::ab);
  dnnl::memory::desc w =
      key.layout == kPacked
          ? PackedDesc(key.k, key.n, x_type)
          : dnnl::memory::desc({key.k, key.n}, x_type, key.layout == kTransposed ? tag::ba : tag::ab);
  dnnl::memory::desc y({key.m, key.n}, y_type, tag::ab);
  // The caller's scratchpad: oneDNN's own is one buffer shared by every primitive, which two
  // calls at once (XLA runs independent ops, and each host device, on threads of its own) would
  // both write.
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(Engine(), x, w, y, attr);
  Gemm gemm{dnnl::matmul(pd), x, w, y, pd.scratchpad_desc()};
  std::lock_guard<std::mutex> lock(mu);  // a thread that created the same one first wins
  return cache.emplace(key, std::move(gemm)).first->second;
}

bool OneDnnType(ffi::DataType t, dnnl::memory::data_type* out) {
  if (t == ffi::DataType::F32) {
    *out = dnnl::memory::data_type::f32;
  } else if (t == ffi::DataType::BF16) {
    *out = dnnl::memory::data_type::bf16;
  } else {
    return false;
  }
  return true;
}

// OpenMP's thread count before any call set one: OMP_NUM_THREADS, else every core.
int DefaultThreads() {
  static const int threads = omp_get_max_threads();
  return threads;
}

// Rows a row-limited product computes past its last wanted one, at most: its M is rounded up to
// a multiple of this, so that a few primitives serve every count.
constexpr int64_t kRowGrain = 16;

// Runs `g` on x, w and y at these addresses, with this thread's stream and scratchpad.
void Execute(const Gemm& g, void* x, void* w, void* y) {
  thread_local dnnl::stream stream(Engine());
  thread_local std::vector<uint8_t> scratch;  // this thread's scratchpad
  scratch.resize(std::max<size_t>(scratch.size(), g.scratch.get_size()));
  dnnl::memory xm(g.x, Engine(), x);
  dnnl::memory wm(g.w, Engine(), w);
  dnnl::memory ym(g.y, Engine(), y);
  dnnl::memory sm(g.scratch, Engine(), scratch.data());
  g.primitive.execute(stream, {{DNNL_ARG_SRC, xm},
                               {DNNL_ARG_WEIGHTS, wm},
                               {DNNL_ARG_DST, ym},
                               {DNNL_ARG_SCRATCHPAD, sm}});
  stream.wait();
}

// Conversions of at least this many elements are split over the call's threads; fewer (a decode
// step's x and y) cost less than starting the team.
constexpr int64_t kParallelCount = int64_t(1) << 16;

// to[i] = from[i] widened: a bfloat16 is a float32's upper half.
void Widen(const uint16_t* from, int64_t count, float* to) {
#pragma omp parallel for schedule(static) if (count >= kParallelCount)
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = uint32_t(from[i]) << 16;
    std::memcpy(&to[i], &bits, sizeof(bits));
  }
}

// to[i] = from[i] rounded to the nearest bfloat16, ties to even (a NaN stays a quiet NaN).
void Narrow(const float* from, int64_t count, uint16_t* to) {
#pragma omp parallel for schedule(static) if (count >= kParallelCount)
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &from[i], sizeof(bits));
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    to[i] = uint16_t(nan ? (bits >> 16) | 0x40u : rounded);
  }
}

// -- Panels: float32 products on packed weights, in 512-bit registers ---------------------------
//
// Packed float32 weights are oneDNN's BA16a64b layout on AVX-512 CPUs: N in panels of 64
// columns, each panel's K rows (padded to a multiple of 16) one after another, 64 floats a row.
// `Panels` multiplies x by those bytes directly: tiles of 6 rows of x times one panel, their 6 x
// 64 sums held in 24 registers over a block of K (each weight row loaded once for the tile's 6
// rows, each x value broadcast once for its 64 columns). Where a panel has few tiles (a decode
// step's few rows) each tile also fetches its share of the next block into L2, so that the
// weights stream from memory while the sums are computed. Weights of bfloat16 values may be
// held as bfloat16 in the same layout and widened as they load (half the bytes to stream). On
// the Ice Lake machine, alternated with oneDNN 3.2's brgemm on the same bytes, the 64-row GEMMs
// of SmolLM2-135M and 16-row ones of Llama-3.2-1B ran 1.16-1.17x as fast, 1,024-row ones
// 0.94-0.99x (docs/serving.md, "GEMMs on the CPU"): it runs on Intel CPUs with AVX-512
// (`PanelsHere`) for float32 products of up to kPanelsRows rows, oneDNN elsewhere.

// -1: decide by the CPU; 0 or 1: as set (`JaxpipeSetPanels`, for tests).
std::atomic<int> panels_override{-1};
std::atomic<int64_t> panels_calls{0};  // products `Panels` ran, for JaxpipePanelsCalls

#if defined(__AVX512F__)
constexpr bool kPanelsBuilt = true;
constexpr int64_t kPanel = 64;     // columns of a panel (BA16a64b's inner block)
constexpr int64_t kTileRows = 6;   // 6 x 4 sums + 4 weight vectors + 1 broadcast: 29 of 32 zmm
constexpr int64_t kAheadTiles = 16;  // at most this many tiles a panel: fetch the next one ahead

// 16 weights from `at` as floats: float32 as they are, bfloat16 widened (a float's upper half).
inline __m512 Weights16(const float* at) { return _mm512_loadu_ps(at); }
inline __m512 Weights16(const uint16_t* at) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// y[0 .. R - 1, panel's columns] (+)= x[0 .. R - 1, :k] @ panel[:k]: x rows ldx apart, y rows n
// apart, the panel's 4 column quarters stored under `cols`, added to what y holds when `add` (a
// later block of K); fetches `lines` cache lines from `ahead` into L2 along the way, spread
// over the k rows.
template <int R, typename W>
void Tile(const float* x, int64_t ldx, const W* panel, int64_t k, float* y, int64_t n,
          const __mmask16* cols, bool add, const char* ahead, int64_t lines) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {  // a later block of K adds to the sums the earlier ones stored
    for (int q = 0; q < 4; ++q) {
      acc[r][q] = add ? _mm512_maskz_loadu_ps(cols[q], y + r * n + 16 * q) : _mm512_setzero_ps();
    }
  }
  const int64_t every = lines > 0 ? std::max<int64_t>(1, k / lines) : k + 1;
  int64_t countdown = 0;
  for (int64_t kk = 0; kk < k; ++kk) {
    if (lines > 0 && --countdown <= 0) {
      _mm_prefetch(ahead, _MM_HINT_T1);
      ahead += 64;
      --lines;
      countdown = every;
    }
    const W* row = panel + kk * kPanel;
    const __m512 w0 = Weights16(row), w1 = Weights16(row + 16);
    const __m512 w2 = Weights16(row + 32), w3 = Weights16(row + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_set1_ps(x[r * ldx + kk]);
      acc[r][0] = _mm512_fmadd_ps(v, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(v, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(v, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(v, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < 4; ++q) _mm512_mask_storeu_ps(y + r * n + 16 * q, cols[q], acc[r][q]);
  }
}

// A panel's K rows are taken in blocks of at most this many bytes, each block run by every tile
// before the next: a longer panel (the 1B's down projection: 8,192 rows, 2 MB in float32) would
// leave L2 between one tile and the next, and each tile would stream it from memory again
// (0.59x oneDNN's rate at 16 rows, before the blocks).
constexpr int64_t kBlockBytes = 256 << 10;

// y [m, n] = x [m, k] @ w, w float32 or bfloat16 laid out as BA16a64b; on the OpenMP team the
// caller set.
template <typename W>
void Panels(const float* x, const W* w, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t kp = (k + 15) / 16 * 16, panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (m + kTileRows - 1) / kTileRows, units = panels * tiles;
  const int64_t row_bytes = kPanel * int64_t(sizeof(W));
  const int64_t blocks = std::max<int64_t>(1, (k * row_bytes + kBlockBytes - 1) / kBlockBytes);
  const int64_t kb = (k + blocks - 1) / blocks;  // rows a block
  const bool ahead = tiles <= kAheadTiles;
  panels_calls.fetch_add(1, std::memory_order_relaxed);
#pragma omp parallel if (units > 1)
  {
    const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
    // consecutive units (panel-major) per thread: each reads a few panels, each panel once
    const int64_t u0 = units * t / team, u1 = units * (t + 1) / team;
    for (int64_t p = u0 / tiles; p * tiles < u1; ++p) {
      const int64_t tile0 = std::max(u0 - p * tiles, int64_t(0));
      const int64_t tile1 = std::min(u1 - p * tiles, tiles);
      const int64_t valid = std::min(kPanel, n - p * kPanel);
      __mmask16 cols[4];
      for (int q = 0; q < 4; ++q) {
        const int64_t c = std::clamp<int64_t>(valid - 16 * q, 0, 16);
        cols[q] = __mmask16((uint32_t(1) << c) - 1);
      }
      const W* panel = w + p * kp * kPanel;
      for (int64_t k0 = 0; k0 < k; k0 += kb) {
        const int64_t rows_k = std::min(kb, k - k0);
        // what the tiles fetch meanwhile: the panel's next block, or the next panel's first
        const bool last_block = k0 + kb >= k;
        const W* next_block = last_block ? panel + kp * kPanel : panel + (k0 + kb) * kPanel;
        const int64_t next_rows = last_block ? kb : std::min(kb, k - k0 - kb);
        const int64_t block_lines = next_rows * row_bytes / 64;
        const bool fetch = ahead && !(last_block && p + 1 >= panels);
        for (int64_t tile = tile0; tile < tile1; ++tile) {
          const int64_t i = tile * kTileRows, rows = std::min(kTileRows, m - i);
          const int64_t first = block_lines * (tile - tile0) / (tile1 - tile0);
          const int64_t last = block_lines * (tile - tile0 + 1) / (tile1 - tile0);
          const char* next = reinterpret_cast<const char*>(next_block) + 64 * first;
          const int64_t lines = fetch ? last - first : 0;
          const float* xi = x + i * k + k0;
          const W* pb = panel + k0 * kPanel;
          float* yi = y + i * n + p * kPanel;
          const bool add = k0 > 0;
          switch (rows) {
            case 6: Tile<6>(xi, k, pb, rows_k, yi, n, cols, add, next, lines); break;
            case 5: Tile<5>(xi, k, pb, rows_k, yi, n, cols, add, next, lines); break;
            case 4: Tile<4>(xi, k, pb, rows_k, yi, n, cols, add, next, lines); break;
            case 3: Tile<3>(xi, k, pb, rows_k, yi, n, cols, add, next, lines); break;
            case 2: Tile<2>(xi, k, pb, rows_k, yi, n, cols, add, next, lines); break;
            default: Tile<1>(xi, k, pb, rows_k, yi, n, cols, add, next, lines); break;
          }
        }
      }
    }
  }
}
#else
constexpr bool kPanelsBuilt = false;
template <typename W>
void Panels(const float*, const W*, float*, int64_t, int64_t, int64_t) {}
#endif

// Whether float32 products on packed [k, n] weights run `Panels`: built with AVX-512, on an
// Intel CPU (where it was measured; elsewhere oneDNN's own), and the weights packed as BA16a64b.
bool PanelsHere(int64_t k, int64_t n) {
  const int set = panels_override.load();
  static const bool intel = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f");
#else
    return false;  // the vendor test is x86's; the tiles are AVX-512 anyway
#endif
  }();
  if (!kPanelsBuilt || !(set >= 0 ? set != 0 : intel)) return false;
  // oneDNN's packing of a shape is fixed within a process: the answer is kept per shape, as
  // every packed product asks (building a memory::desc to compare took about a microsecond)
  static std::mutex mu;
  static std::unordered_map<Key, bool, KeyHash> cache;
  const Key key{0, k, n, int(dt::f32), int(dt::f32), kPacked, 0};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const bool panels =
      PackedDesc(k, n, dt::f32) == dnnl::memory::desc({k, n}, dt::f32, tag::BA16a64b);
  return cache.emplace(key, panels).first->second;
}

// Float32 products of at most this many rows run `Panels` where it runs, longer ones oneDNN's
// matmul on the same bytes: alternated on the Ice Lake machine, the tiles ran 1.16-1.17x
// oneDNN's rate at 16 and 64 rows, but 0.99x (SmolLM2-135M's GEMMs) and 0.94x (Llama-3.2-1B's)
// at 1,024, where oneDNN's blocking over rows keeps x in cache. bfloat16 weights held for the
// tiles (`Bf16Panels`) run them at every row count.
constexpr int64_t kPanelsRows = 256;

// Bytes after bfloat16 weights held for `Panels` (zeros): they make the array's size differ from
// any other packing of the same weights, so that weights packed on one path are refused on
// another (`bf16_as_float32`, `panels_forced`) rather than misread.
constexpr int64_t kBf16PanelsTrailer = 64;

// Whether bfloat16 [k, n] weights are held as bfloat16 in BA16a64b for `Panels`, which widens
// them in registers: where bfloat16 products run as float32 ones and float32 ones run `Panels`.
// Elsewhere on such CPUs they are packed as float32, twice the bytes.
bool Bf16Panels(int64_t k, int64_t n) { return Bf16InFloat32() && PanelsHere(k, n); }

// The layout packed [k, n] weights of `type` are held in: bfloat16 ones as bfloat16 BA16a64b
// where `Bf16Panels`, else oneDNN's (`PackedDesc`).
dnnl::memory::desc HeldDesc(int64_t k, int64_t n, dt type) {
  if (type == dt::bf16 && Bf16Panels(k, n)) {
    return dnnl::memory::desc({k, n}, dt::bf16, tag::BA16a64b);
  }
  return PackedDesc(k, n, type);
}

// The packed bytes of [k, n] weights of `type` (`PrepackImpl`'s output): the held layout's, and
// the trailer of bfloat16 weights held for `Panels`.
int64_t PackedBytes(int64_t k, int64_t n, dt type) {
  const bool trailer = type == dt::bf16 && Bf16Panels(k, n);
  return int64_t(HeldDesc(k, n, type).get_size()) + (trailer ? kBf16PanelsTrailer : 0);
}

// A bfloat16 product as a float32 one (`Bf16InFloat32`): x [m, k] widened; packed weights are
// bfloat16 widened in registers (`Bf16Panels`) or float32 already, row-major ones widened for
// this call; the sums rounded once into a bfloat16 y.
void RunInFloat32(const void* x, void* w, void* y, int64_t m, int64_t k, int64_t n, dt y_type,
                  Layout layout, int team) {
  thread_local std::vector<float> x_f32, y_f32;  // a step's activations, kept for the next call
  x_f32.resize(std::max<size_t>(x_f32.size(), size_t(m * k)));
  Widen(static_cast<const uint16_t*>(x), m * k, x_f32.data());
  std::vector<float> w_f32;  // a whole weight: not kept past the call
  if (layout != kPacked) {
    w_f32.resize(size_t(k * n));
    Widen(static_cast<const uint16_t*>(w), k * n, w_f32.data());
    w = w_f32.data();
  }
  float* out = static_cast<float*>(y);
  if (y_type == dt::bf16) {
    y_f32.resize(std::max<size_t>(y_f32.size(), size_t(m * n)));
    out = y_f32.data();
  }
  if (layout == kPacked && Bf16Panels(k, n)) {  // bfloat16 weights, widened in registers
    Panels(x_f32.data(), static_cast<const uint16_t*>(w), out, m, k, n);
  } else {
    Execute(Cached(Key{m, k, n, int(dt::f32), int(dt::f32), layout, team}), x_f32.data(), w, out);
  }
  if (y_type == dt::bf16) Narrow(out, m * n, static_cast<uint16_t*>(y));
}

// y = x @ w for checked 2-D x [M, K] and y [M, N], w at `w` in `layout`, on `threads` threads
// (0: OpenMP's default). With rows >= 0 only y's first rows (rounded up to kRowGrain, at most M)
// are computed and the rest are zeros: a step's padding rows cost no multiply-adds.
ffi::Error Run(ffi::AnyBuffer x, void* w, ffi::Result<ffi::AnyBuffer> y, int64_t n, dt x_type,
               dt y_type, Layout layout, int64_t threads, int64_t rows = -1) {
  const int64_t k = x.dimensions()[1];
  int64_t m = x.dimensions()[0];
  // set at every call: the count stays with the calling thread (one of XLA's), for its next call
  const int team = threads > 0 ? int(threads) : DefaultThreads();
  omp_set_num_threads(team);
  if (rows >= 0 && rows < m) {
    const int64_t used = std::min(m, (rows + kRowGrain - 1) / kRowGrain * kRowGrain);
    const size_t row_bytes = y->size_bytes() / size_t(m);
    std::memset(static_cast<uint8_t*>(y->untyped_data()) + used * row_bytes, 0,
                (m - used) * row_bytes);
    m = used;
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // an empty sum
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  try {
    if (ComputeType(x_type) != x_type) {
      RunInFloat32(x.untyped_data(), w, y->untyped_data(), m, k, n, y_type, layout, team);
    } else if (layout == kPacked && x_type == dt::f32 && m <= kPanelsRows && PanelsHere(k, n)) {
      Panels(static_cast<const float*>(x.untyped_data()), static_cast<const float*>(w),
             static_cast<float*>(y->untyped_data()), m, k, n);
    } else {
      const Gemm& g = Cached(Key{m, k, n, int(x_type), int(y_type), layout, team});
      Execute(g, x.untyped_data(), w, y->untyped_data());
    }
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul failed: ") + e.what());
  }
  return ffi::Error::Success();
}

// x's and y's dtypes as oneDNN's, checked: x float32 or bfloat16, y float32 or x's dtype.
ffi::Error Types(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>& y, dt* x_type, dt* y_type) {
  if (!OneDnnType(x.element_type(), x_type) || !OneDnnType(y->element_type(), y_type) ||
      (*y_type != *x_type && *y_type != dt::f32)) {
    return ffi::Error::InvalidArgument(
        "matmul: x must be float32 or bfloat16, y float32 or x's dtype");
  }
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                bool transpose_w, int64_t threads) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("matmul: x, w and y must be 2-D");
  }
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = transpose_w ? wd[0] : wd[1];
  if ((transpose_w ? wd[1] : wd[0]) != k || yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument("matmul: shapes of x, w and y do not agree");
  }
  dt x_type, w_type, y_type;
  if (ffi::Error e = Types(x, y, &x_type, &y_type); e.failure()) return e;
  if (!OneDnnType(w.element_type(), &w_type) || w_type != x_type) {
    return ffi::Error::InvalidArgument("matmul: x and w must both be float32 or both bfloat16");
  }
  return Run(x, w.untyped_data(), y, n, x_type, y_type, transpose_w ? kTransposed : kRowMajor,
             threads);
}

// y = x @ w, w packed by `PrepackImpl` for x's K, y's N and x's dtype; rows as `Run` takes it.
ffi::Error Packed(ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> y,
                  int64_t threads, int64_t rows) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0]) {
    return ffi::Error::InvalidArgument("packed matmul: x [M, K] and y [M, N] must be 2-D");
  }
  dt x_type, y_type;
  if (ffi::Error e = Types(x, y, &x_type, &y_type); e.failure()) return e;
  try {
    if (packed.element_type() != ffi::DataType::U8 ||
        int64_t(packed.size_bytes()) != PackedBytes(xd[1], yd[1], x_type)) {
      return ffi::Error::InvalidArgument(
          "packed matmul: the weights were not packed for this K, N and dtype");
    }
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN packing failed: ") + e.what());
  }
  return Run(x, packed.untyped_data(), y, yd[1], x_type, y_type, kPacked, threads, rows);
}

ffi::Error PrepackedImpl(ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> y,
                         int64_t threads) {
  return Packed(x, packed, y, threads, -1);
}

// The packed product of y's first `rows` rows only (rounded up to kRowGrain), the rest zeros.
ffi::Error PrepackedRowsImpl(ffi::AnyBuffer x, ffi::AnyBuffer packed,
                             ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> y,
                             int64_t threads) {
  if (rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("packed matmul: rows must hold one count");
  }
  return Packed(x, packed, y, threads, std::max<int64_t>(0, rows.typed_data()[0]));
}

// packed = w [K, N] (or its [N, K] transpose) reordered into `PackedDesc`'s layout.
ffi::Error PrepackImpl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> packed, bool transpose_w) {
  auto wd = w.dimensions();
  dt type;
  if (wd.size() != 2 || !OneDnnType(w.element_type(), &type)) {
    return ffi::Error::InvalidArgument("pack: w must be 2-D, float32 or bfloat16");
  }
  const int64_t k = transpose_w ? wd[1] : wd[0], n = transpose_w ? wd[0] : wd[1];
  try {
    const dnnl::memory::desc to = HeldDesc(k, n, type);
    const int64_t bytes = PackedBytes(k, n, type);
    if (int64_t(packed->size_bytes()) != bytes) {
      return ffi::Error::InvalidArgument("pack: the output's size is not the packed layout's");
    }
    // the trailer of bfloat16 weights held for `Panels` (none elsewhere): zeros
    std::memset(static_cast<uint8_t*>(packed->untyped_data()) + to.get_size(), 0,
                bytes - int64_t(to.get_size()));
    if (k == 0 || n == 0) return ffi::Error::Success();
    dnnl::memory from({{k, n}, type, transpose_w ? tag::ba : tag::ab}, Engine(), w.untyped_data());
    dnnl::memory into(to, Engine(), packed->untyped_data());
    dnnl::stream stream(Engine());
    dnnl::reorder(from, into).execute(stream, from, into);
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN packing failed: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

// Sets whether bfloat16 products run as float32 ones: 1 or 0, or -1 to decide by the CPU (the
// default). Weights packed before a change are refused after it (their size is the other's).
extern "C" void JaxpipeSetBf16InFloat32(int value) { bf16_in_float32_override.store(value); }

// Sets whether float32 products on packed weights run `Panels`: 1 or 0, or -1 to decide by the
// CPU (the default). Both read the same packed bytes.
extern "C" void JaxpipeSetPanels(int value) { panels_override.store(value); }

// Whether float32 products on packed [k, n] weights run `Panels` here: 1 or 0.
extern "C" int JaxpipePanels(int64_t k, int64_t n) {
  try {
    return PanelsHere(k, n) ? 1 : 0;
  } catch (const dnnl::error&) {
    return 0;
  }
}

// Products `Panels` ran in this process so far.
extern "C" int64_t JaxpipePanelsCalls() { return panels_calls.load(); }

// Whether bfloat16 products run as float32 ones here (`Bf16InFloat32`): 1 or 0.
extern "C" int JaxpipeBf16InFloat32() { return Bf16InFloat32() ? 1 : 0; }

// The bytes of [K, N] weights packed (`PrepackImpl`), for Python to shape the packed array;
// -1 where oneDNN has no product of these weights. bf16: 1 for bfloat16, 0 for float32.
extern "C" int64_t JaxpipePrepackedBytes(int64_t k, int64_t n, int bf16) {
  try {
    return PackedBytes(k, n, bf16 ? dt::bf16 : dt::f32);
  } catch (const dnnl::error&) {
    return -1;
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [K, N], or [N, K] transposed
                                  .Ret<ffi::AnyBuffer>()  // y [M, N]
                                  .Attr<bool>("transpose_w")
                                  .Attr<int64_t>("threads"));  // 0: OpenMP's default

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeMatmulPrepacked, PrepackedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w packed, uint8 [bytes]
                                  .Ret<ffi::AnyBuffer>()  // y [M, N]
                                  .Attr<int64_t>("threads"));  // 0: OpenMP's default

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeMatmulPrepackedRows, PrepackedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()        // x [M, K]
                                  .Arg<ffi::AnyBuffer>()        // w packed, uint8 [bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows wanted, one count
                                  .Ret<ffi::AnyBuffer>()        // y [M, N]
                                  .Attr<int64_t>("threads"));   // 0: OpenMP's default

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipePrepack, PrepackImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // w [K, N], or [N, K] transposed
                                  .Ret<ffi::AnyBuffer>()  // packed, uint8 [bytes]
                                  .Attr<bool>("transpose_w"));
