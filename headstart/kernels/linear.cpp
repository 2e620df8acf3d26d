// The row-invariant linear (see rowwise.h): packed weights, AMX / AVX-512 bf16 / AVX2 tiles.

#include "rowwise.h"

// ------------------------------------------------------------------------------------ linear
//
// The weight is packed once (pack_linear) so that a vector load reads one input's weights for VL
// consecutive outputs: every output accumulates in its own lane, in input order, with no
// horizontal reduction. Layouts, outputs in blocks of VL lanes, zero-padded past N and K:
//   bf16 weights: (NB, KP, VL, 2): inputs 2p and 2p + 1 side by side in one 32-bit word per lane
//                 (what the CPU's bf16 dot product and AMX read; widened with a shift and a mask
//                 elsewhere); KP is padded to a multiple of 16 pairs (an AMX tile's depth);
//   fp32 weights: (NB, K, VL).
// A tile is up to four rows x JV blocks; the row groups reread the tile's weights from cache, so
// the weights are streamed from memory once for any number of rows. A row's arithmetic is the same
// in every tile shape and thread split: a k + 1 row verify gives each row the bits it gets alone.

#if defined(__AVX512F__)
constexpr int JVMAX = 4;  // 4 rows x 4 blocks: 16 accumulators of 32 registers
#else
constexpr int JVMAX = 2;  // 4 rows x 2 blocks: 8 accumulators of 16 registers
#endif

static inline int64_t pairs(int64_t K) { return (K + 31) / 32 * 16; }  // bf16 input pairs, padded

struct LinearArgs {
  const void* x;  // the rows, prepared for the path (see linear_packed)
  const void* w;  // the packed weight
  const float* bias;  // padded to NB * VL, or null
  float* y;  // (M, N)
  int64_t M, N, K, KP;  // KP: input pairs (bf16) or inputs (fp32) per row of the packed weight
};

static inline void store_lanes(const LinearArgs& a, int64_t m, int64_t b, fvec acc) {
  if (a.bias) acc = acc + load(a.bias + b * VL);
  float out[VL];
  std::memcpy(out, &acc, sizeof(out));
  const int64_t n0 = b * VL, n = std::min<int64_t>(VL, a.N - n0);
  std::memcpy(a.y + m * a.N + n0, out, n * sizeof(float));
}

template <int MB, int JV, typename V>  // V: fvec, or __m512 (the same 16 floats)
static inline void store_tile(const LinearArgs& a, int64_t m0, int64_t b0, const V (&acc)[MB][JV]) {
  static_assert(sizeof(V) == sizeof(fvec), "an accumulator is one vector of VL floats");
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < JV; ++j) {
      fvec v;
      std::memcpy(&v, &acc[m][j], sizeof(v));
      store_lanes(a, m0 + m, b0 + j, v);
    }
}

// bf16 weights, fp32 rows (padded to 2 * KP): each pair widened exactly, products added in order.
struct WidenTile {
  template <int MB, int JV>
  static void run(const LinearArgs& a, int64_t m0, int64_t b0) {
    const float* x = static_cast<const float*>(a.x);
    const uint32_t* w = static_cast<const uint32_t*>(a.w) + b0 * a.KP * VL;
    fvec acc[MB][JV] = {};
    for (int64_t p = 0; p < a.KP; ++p) {
      fvec lo[JV], hi[JV];
      for (int j = 0; j < JV; ++j) {
        uvec u;
        std::memcpy(&u, w + (j * a.KP + p) * VL, sizeof(u));
        const uvec ul = u << 16, uh = u & 0xFFFF0000u;
        std::memcpy(&lo[j], &ul, sizeof(fvec));
        std::memcpy(&hi[j], &uh, sizeof(fvec));
      }
      for (int m = 0; m < MB; ++m) {
        const float x0 = x[(m0 + m) * 2 * a.KP + 2 * p], x1 = x[(m0 + m) * 2 * a.KP + 2 * p + 1];
        for (int j = 0; j < JV; ++j) acc[m][j] = (acc[m][j] + x0 * lo[j]) + x1 * hi[j];
      }
    }
    store_tile(a, m0, b0, acc);
  }
};

// fp32 weights and rows.
struct FloatTile {
  template <int MB, int JV>
  static void run(const LinearArgs& a, int64_t m0, int64_t b0) {
    const float* x = static_cast<const float*>(a.x);
    const float* w = static_cast<const float*>(a.w) + b0 * a.KP * VL;
    fvec acc[MB][JV] = {};
    for (int64_t k = 0; k < a.KP; ++k) {
      fvec wv[JV];
      for (int j = 0; j < JV; ++j) wv[j] = load(w + (j * a.KP + k) * VL);
      for (int m = 0; m < MB; ++m) {
        const float xk = x[(m0 + m) * a.KP + k];
        for (int j = 0; j < JV; ++j) acc[m][j] = acc[m][j] + xk * wv[j];
      }
    }
    store_tile(a, m0, b0, acc);
  }
};

#if defined(__AVX512BF16__)
// bf16 weights and rows: the CPU's bf16 dot product adds each pair's two products into the lane.
struct DotTile {
  template <int MB, int JV>
  static void run(const LinearArgs& a, int64_t m0, int64_t b0) {
    const uint32_t* x = static_cast<const uint32_t*>(a.x);  // (M, KP) pairs
    const uint16_t* w = static_cast<const uint16_t*>(a.w) + b0 * a.KP * VL * 2;
    __m512 acc[MB][JV];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < JV; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < a.KP; ++p) {
      __m512bh wv[JV];
      for (int j = 0; j < JV; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * a.KP + p) * VL * 2);
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[(m0 + m) * a.KP + p]));
        for (int j = 0; j < JV; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
      }
    }
    store_tile(a, m0, b0, acc);
  }
};
#endif

template <class Tile, int JV>
static void row_groups(const LinearArgs& a, int64_t b0) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) Tile::template run<4, JV>(a, m, b0);
  switch (a.M - m) {
    case 3: Tile::template run<3, JV>(a, m, b0); break;
    case 2: Tile::template run<2, JV>(a, m, b0); break;
    case 1: Tile::template run<1, JV>(a, m, b0); break;
    default: break;
  }
}

template <class Tile>
static void linear_blocks(const LinearArgs& a) {
  const int64_t NB = (a.N + VL - 1) / VL;
  // ~64 KB of weights per task at least: small layers stay on one thread rather than pay a fork.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, a.KP * VL * 4));
  at::parallel_for(0, NB, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t b = c0; b < c1; b += JVMAX) {
      switch (std::min<int64_t>(JVMAX, c1 - b)) {
        case 4: if constexpr (JVMAX >= 4) row_groups<Tile, 4>(a, b); break;
        case 3: if constexpr (JVMAX >= 3) row_groups<Tile, 3>(a, b); break;
        case 2: row_groups<Tile, 2>(a, b); break;
        default: row_groups<Tile, 1>(a, b); break;
      }
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HEADSTART_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// Intel AMX (bf16 tiles): one instruction multiplies up to 16 rows x 32 inputs by 32 inputs x 16
// outputs into fp32 accumulators. Each accumulator row is its own row's dot products (rows never
// mix), and a row's inputs are consumed in the same 32-input steps whatever the number of rows,
// so a row's bits do not depend on the rows beside it. Linux grants the tile state on request.
static bool amx_ready() {  // HEADSTART_AMX=0 keeps the AVX-512 kernel (a process never mixes the two)
  static const bool ok = [] {
    const char* env = std::getenv("HEADSTART_AMX");
    if (env && std::string(env) == "0") return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: the accumulators of four blocks of 16 outputs; 4: the rows' inputs; 5-7: weights.
static void amx_configure(int64_t rows) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

template <int JV>
static void amx_tile(const LinearArgs& a, int64_t m0, int64_t rows, int64_t b0, float* buf) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * 2 * a.KP;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + b0 * a.KP * 32;
  const int64_t stride = 4 * a.KP;  // bytes per row of inputs
  _tile_zero(0);
  if constexpr (JV > 1) _tile_zero(1);
  if constexpr (JV > 2) _tile_zero(2);
  if constexpr (JV > 3) _tile_zero(3);
  for (int64_t p = 0; p < a.KP; p += 16) {
    _tile_loadd(4, x + 2 * p, stride);
    _tile_loadd(5, w + p * 32, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (JV > 1) {
      _tile_loadd(6, w + (a.KP + p) * 32, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (JV > 2) {
      _tile_loadd(7, w + (2 * a.KP + p) * 32, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (JV > 3) {
      _tile_loadd(5, w + (3 * a.KP + p) * 32, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, buf, 64);
  if constexpr (JV > 1) _tile_stored(1, buf + 256, 64);
  if constexpr (JV > 2) _tile_stored(2, buf + 512, 64);
  if constexpr (JV > 3) _tile_stored(3, buf + 768, 64);
  for (int64_t m = 0; m < rows; ++m)
    for (int j = 0; j < JV; ++j) store_lanes(a, m0 + m, b0 + j, load(buf + j * 256 + m * 16));
}

static void linear_amx(const LinearArgs& a) {
  const int64_t NB = (a.N + VL - 1) / VL;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, a.KP * VL * 4));
  at::parallel_for(0, NB, grain, [&](int64_t c0, int64_t c1) {
    alignas(64) float buf[4 * 256];
    int64_t configured = 0;
    for (int64_t b = c0; b < c1; b += 4) {
      for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
        const int64_t rows = std::min<int64_t>(16, a.M - m0);
        if (rows != configured) {
          amx_configure(rows);
          configured = rows;
        }
        switch (std::min<int64_t>(4, c1 - b)) {
          case 4: amx_tile<4>(a, m0, rows, b, buf); break;
          case 3: amx_tile<3>(a, m0, rows, b, buf); break;
          case 2: amx_tile<2>(a, m0, rows, b, buf); break;
          default: amx_tile<1>(a, m0, rows, b, buf); break;
        }
      }
    }
    if (configured) _tile_release();
  });
}
#endif

torch::Tensor pack_linear(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "pack_linear: a CPU weight (N, K)");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat, "pack_linear: bf16 or fp32 weights");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + VL - 1) / VL;
  TORCH_CHECK(N > 0 && K > 0, "pack_linear: an empty weight");
  auto wc = w.contiguous();
  if (wc.scalar_type() == at::kBFloat16) {
    const int64_t KP = pairs(K);
    auto out = torch::zeros({NB, KP, VL, 2}, wc.options());
    const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t k = 0; k < K; ++k) dst[(((n / VL) * KP + k / 2) * VL + n % VL) * 2 + k % 2] = src[n * K + k];
    });
    return out;
  }
  auto out = torch::zeros({NB, K, VL}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) dst[((n / VL) * K + k) * VL + n % VL] = src[n * K + k];
  });
  return out;
}

torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K_in,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point() && x.device().is_cpu(),
              "linear_packed: CPU floating-point rows (M, K)");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous(), "linear_packed: a weight from pack_linear");
  const bool wbf = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK((wbf && packed.dim() == 4 && packed.size(3) == 2 && packed.size(2) == VL) ||
                  (packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == VL),
              "linear_packed: a weight from pack_linear on this CPU");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KP = packed.size(1);
  TORCH_CHECK(N > 0 && (N + VL - 1) / VL == NB, "linear_packed: ", N, " outputs do not fit the packed weight");
  TORCH_CHECK(K == K_in && (wbf ? pairs(K) == KP : K == KP), "linear_packed: rows of ", K,
              " inputs for a packed weight of ", K_in);
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N && bias->is_floating_point(),
                "linear_packed: bias must be a CPU float vector of ", N, " values");
    bf = torch::zeros({NB * VL}, x.options().dtype(at::kFloat));
    bf.narrow(0, 0, N).copy_(*bias);
  }
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  LinearArgs a{nullptr, packed.data_ptr(), bf.defined() ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(),
               M, N, K, KP};
  torch::Tensor xs;  // the rows as the path reads them
  if (M > 0) {
#if defined(__AVX512BF16__)
    if (wbf && x.scalar_type() == at::kBFloat16) {
      xs = 2 * KP != K ? torch::constant_pad_nd(x, {0, 2 * KP - K}).contiguous() : x.contiguous();
      a.x = xs.data_ptr();
#if defined(HEADSTART_AMX)
      if (amx_ready()) {
        linear_amx(a);
      } else
#endif
        linear_blocks<DotTile>(a);
    } else
#endif
    if (wbf) {
      xs = torch::constant_pad_nd(x.to(at::kFloat), {0, 2 * KP - K}).contiguous();
      a.x = xs.data_ptr();
      linear_blocks<WidenTile>(a);
    } else {
      xs = x.to(at::kFloat).contiguous();
      a.x = xs.data_ptr();
      linear_blocks<FloatTile>(a);
    }
  }
  if (x.scalar_type() == at::kFloat) return y;
  if (x.scalar_type() == at::kBFloat16) {
    auto out = torch::empty({M, N}, x.options());
    const float* src = y.data_ptr<float>();
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < M * N; ++i) dst[i] = to_bf16(src[i]);
    return out;
  }
  return y.to(x.scalar_type());
}

// The same, packing the weight on every call (tests, one-off calls): a module packs once.
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_rows: shapes (M, K) x (N, K)");
  return linear_packed(x, pack_linear(w), w.size(0), w.size(1), bias);
}

// Which instructions serve a bf16 linear in this process (reports name it beside their figures).
std::string linear_isa() {
#if defined(HEADSTART_AMX)
  if (amx_ready()) return "amx-bf16";
#endif
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "avx2";
#endif
}

