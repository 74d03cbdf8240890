// A GEMM on the CPU through oneDNN's matmul primitive, an XLA FFI custom call
// (kernels_cpu/matmul.py).
//
// y [M, N] = x [M, K] @ w, where w is [K, N] row-major, or with transpose_w its [N, K] transpose
// read in place (a tied embedding [V, D] as the output head). x and w are float32 or bfloat16
// alike; y is float32, or bfloat16 for bfloat16 x and w (oneDNN accumulates in float32).
// Why: XLA:CPU's own dots run bfloat16 at well under half the rate oneDNN's brgemm kernels get
// from AVX512_BF16 (docs/benchmarks.md, "Where a serving step's time goes").
//
// One primitive per (M, K, N, dtypes, layout) is created on first use and kept: creation costs
// about a millisecond, execution is what each call pays. Primitives are immutable and oneDNN
// executes one from several threads at once, each with its own stream and scratchpad, so the
// cache's lock is held only to look up or insert. oneDNN threads the GEMM itself (OpenMP).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Key {
  int64_t m, k, n;
  int x_type, y_type;
  bool transpose_w;
  bool operator==(const Key& o) const {
    return m == o.m && k == o.k && n == o.n && x_type == o.x_type && y_type == o.y_type &&
           transpose_w == o.transpose_w;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = std::hash<int64_t>()(key.m);
    for (int64_t v : {key.k, key.n, int64_t(key.x_type), int64_t(key.y_type),
                      int64_t(key.transpose_w)}) {
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

const Gemm& Cached(const Key& key) {
  static std::mutex mu;
  static std::unordered_map<Key, Gemm, KeyHash> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const auto x_type = static_cast<dt>(key.x_type), y_type = static_cast<dt>(key.y_type);
  dnnl::memory::desc x({key.m, key.k}, x_type, tag::ab);
  dnnl::memory::desc w({key.k, key.n}, x_type, key.transpose_w ? tag::ba : tag::ab);
  dnnl::memory::desc y({key.m, key.n}, y_type, tag::ab);
  // The caller's scratchpad: oneDNN's own is one buffer shared by every primitive, which two
  // calls at once (XLA runs independent ops, and each host device, on threads of its own) would
  // both write.
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(Engine(), x, w, y, attr);
  return cache.emplace(key, Gemm{dnnl::matmul(pd), x, w, y, pd.scratchpad_desc()})
      .first->second;
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

ffi::Error Impl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                bool transpose_w) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("matmul: x, w and y must be 2-D");
  }
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = transpose_w ? wd[0] : wd[1];
  if ((transpose_w ? wd[1] : wd[0]) != k || yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument("matmul: shapes of x, w and y do not agree");
  }
  dnnl::memory::data_type x_type, w_type, y_type;
  if (!OneDnnType(x.element_type(), &x_type) || !OneDnnType(w.element_type(), &w_type) ||
      !OneDnnType(y->element_type(), &y_type) || x_type != w_type ||
      (y_type != x_type && y_type != dnnl::memory::data_type::f32)) {
    return ffi::Error::InvalidArgument(
        "matmul: x and w must both be float32 or both bfloat16, y float32 or x's dtype");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // an empty sum
    std::memset(y->untyped_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  try {
    const Gemm& g = Cached(Key{m, k, n, int(x_type), int(y_type), transpose_w});
    thread_local dnnl::stream stream(Engine());
    thread_local std::vector<uint8_t> scratch;  // this thread's scratchpad
    scratch.resize(std::max<size_t>(scratch.size(), g.scratch.get_size()));
    dnnl::memory xm(g.x, Engine(), x.untyped_data());
    dnnl::memory wm(g.w, Engine(), w.untyped_data());
    dnnl::memory ym(g.y, Engine(), y->untyped_data());
    dnnl::memory sm(g.scratch, Engine(), scratch.data());
    g.primitive.execute(stream, {{DNNL_ARG_SRC, xm},
                                 {DNNL_ARG_WEIGHTS, wm},
                                 {DNNL_ARG_DST, ym},
                                 {DNNL_ARG_SCRATCHPAD, sm}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul failed: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpipeMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [K, N], or [N, K] transposed
                                  .Ret<ffi::AnyBuffer>()  // y [M, N]
                                  .Attr<bool>("transpose_w"));
