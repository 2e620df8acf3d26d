// Row-invariant CPU kernels for decode and verify steps (headstart.kernels).
//
// Every output row is computed by one thread with a reduction order that depends only on that row's
// own inputs (its activations, its key set), never on how many other rows share the call or on how
// the work is split between threads. So a token decoded alone, in a batch, or as one of the k + 1
// rows of a speculative verify step gets bit-identical logits: greedy speculation equals greedy AR.
//
//   linear_rows(x (M, K), w (N, K), bias (N) | None) -> (M, N) in x's dtype; weights bf16 or fp32
//   paged_attention_rows(q (R, Hq, Dh), k_cache, v_cache (P, page, Hkv, Dh), page_table (B, maxp),
//       row_seq (R), row_len (R), extra (R, E), extra_len (R), scale) -> (R, Hq, Dh)
//       row r attends keys [0, row_len[r]) of sequence row_seq[r], then the KV indices
//       extra[r, :extra_len[r]] (tree ancestors), in that order.
//
//   pack_linear(w) -> the weight in the kernel's layout; linear_packed(x, packed, N, K, bias) -> (M, N)
//
// Accumulation is fp32. A linear's output accumulates in its own vector lane in input order; the
// weights are streamed from memory once for all rows, which is what makes a k + 1 row verify cost
// about one row. Attention reductions use VL independent lanes (element i goes to lane i mod VL),
// summed lane by lane in a fixed order, then a scalar tail.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif

typedef float fvec __attribute__((vector_size(VL * 4)));
typedef uint32_t uvec __attribute__((vector_size(VL * 4)));
typedef uint16_t hvec __attribute__((vector_size(VL * 2)));

static inline fvec load(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline fvec load(const uint16_t* p) {  // bf16 -> fp32 is exact: the bits move up by 16
  hvec h;
  std::memcpy(&h, p, sizeof(h));
  uvec u = __builtin_convertvector(h, uvec) << 16;
  fvec v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

static inline float scalar(float x) { return x; }
static inline float scalar(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float hsum(fvec v) {  // a fixed pairwise tree over the lanes: the same for every row
#if defined(__AVX512F__)
  __m512 m;
  std::memcpy(&m, &v, sizeof(m));
  return _mm512_reduce_add_ps(m);
#endif
  float t[VL];
  std::memcpy(t, &v, sizeof(t));
  for (int w = VL / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's cast
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

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

// --------------------------------------------------------------------------------- attention

typedef int32_t ivec __attribute__((vector_size(VL * 4)));

// exp for x <= 0 (softmax after subtracting the max): 2^n * p(r), r = x - n ln2 in (-ln2, 0],
// p the degree-8 Taylor polynomial (relative error ~1e-7); x below -87 is clamped (exp ~ 1e-38).
static inline fvec vexp(fvec x) {
  x = x < -87.f ? fvec{} - 87.f : x;
  const fvec t = x * 1.44269504088896341f;
  const ivec n = __builtin_convertvector(t, ivec);  // toward zero: n >= t
  const fvec fn = __builtin_convertvector(n, fvec);
  const fvec r = (x - fn * 0.693145751953125f) - fn * 1.428606765330187045e-06f;
  fvec p = fvec{} + (1.f / 40320.f);
  p = p * r + (1.f / 5040.f);
  p = p * r + (1.f / 720.f);
  p = p * r + (1.f / 120.f);
  p = p * r + (1.f / 24.f);
  p = p * r + (1.f / 6.f);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const ivec bits = (n + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One task = one row and up to four query heads of one KV head: scores over the row's key set,
// softmax, the weighted sum of values. The heads of a task share each key and value load; every
// head's arithmetic is the same whatever the grouping, and nothing depends on any other row.
template <typename T>
static void attention_impl(const T* q, const T* kc, const T* vc, const int32_t* table, int64_t max_pages,
                           const int32_t* row_seq, const int32_t* row_len, const int32_t* extra, int64_t E,
                           const int32_t* extra_len, int64_t R, int64_t Hq, int64_t Hkv, int64_t Dh, int64_t page,
                           double scale, float* outf) {
  constexpr int64_t GMAX = 4;
  const int64_t G = Hq / Hkv;
  const bool vec = Dh % VL == 0 && Dh / VL <= 16;
  // Few rows (decode): one head per task keeps both threads busy; more rows: heads share loads.
  const int64_t GB = R * Hkv >= 2 * at::get_num_threads() ? std::min(G, GMAX) : 1;
  const int64_t gblocks = (G + GB - 1) / GB;
  at::parallel_for(0, R * Hkv * gblocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(GMAX * Dh), scores;
    std::vector<int64_t> slots;
    int64_t slots_row = -1;
    const float sc = static_cast<float>(scale);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / (Hkv * gblocks), h = (t / gblocks) % Hkv, g0 = (t % gblocks) * GB;
      const int64_t n = std::min(GB, G - g0), hq0 = h * G + g0;
      const int64_t L = row_len[r], total = L + extra_len[r];
      for (int64_t g = 0; g < n; ++g)
        for (int64_t d = 0; d < Dh; ++d) qf[g * Dh + d] = scalar(q[(r * Hq + hq0 + g) * Dh + d]);
      if (slots_row != r) {  // the row's key slots (x Hkv), page by page: no division per key
        const int32_t* pages = table + static_cast<int64_t>(row_seq[r]) * max_pages;
        slots.resize(total);
        for (int64_t i = 0, pg = 0; i < L; ++pg) {
          const int64_t base = static_cast<int64_t>(pages[pg]) * page;
          for (int64_t off = 0; off < page && i < L; ++off, ++i) slots[i] = (base + off) * Hkv;
        }
        for (int64_t i = L; i < total; ++i) {
          const int64_t pos = extra[r * E + (i - L)];
          slots[i] = (static_cast<int64_t>(pages[pos / page]) * page + pos % page) * Hkv;
        }
        slots_row = r;
      }
      const int64_t padded = (total + VL - 1) / VL * VL;
      scores.assign(n * padded, -std::numeric_limits<float>::infinity());
      int64_t i = 0;
      if (vec) {  // four keys at a time: independent chains (each key's sum is computed alone)
        for (; i + 4 <= total; i += 4) {
          const T* kp[4];
          for (int c = 0; c < 4; ++c) kp[c] = kc + (slots[i + c] + h) * Dh;
          fvec a[GMAX][4];
          for (int64_t g = 0; g < n; ++g)
            for (int c = 0; c < 4; ++c) a[g][c] = fvec{};
          for (int64_t d = 0; d < Dh; d += VL) {
            fvec kv[4];
            for (int c = 0; c < 4; ++c) kv[c] = load(kp[c] + d);
            for (int64_t g = 0; g < n; ++g) {
              const fvec qv = load(qf.data() + g * Dh + d);
              for (int c = 0; c < 4; ++c) a[g][c] = a[g][c] + qv * kv[c];
            }
          }
          for (int64_t g = 0; g < n; ++g)
            for (int c = 0; c < 4; ++c) scores[g * padded + i + c] = hsum(a[g][c]) * sc;
        }
      }
      for (; i < total; ++i) {
        const T* kp = kc + (slots[i] + h) * Dh;
        for (int64_t g = 0; g < n; ++g) {
          const float* qg = qf.data() + g * Dh;
          float s = 0.f;
          int64_t d = 0;
          if (vec) {
            fvec a{};
            for (; d < Dh; d += VL) a = a + load(qg + d) * load(kp + d);
            s = hsum(a);
          }
          for (; d < Dh; ++d) s += qg[d] * scalar(kp[d]);
          scores[g * padded + i] = s * sc;
        }
      }
      float inv[GMAX];
      for (int64_t g = 0; g < n; ++g) {
        float* sg = scores.data() + g * padded;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < total; ++j) mx = sg[j] > mx ? sg[j] : mx;
        fvec sums{};
        for (int64_t j = 0; j < padded; j += VL) {
          fvec e = vexp(load(sg + j) - mx);
          if (j + VL > total)
            for (int64_t l = total - j; l < VL; ++l) e[l] = 0.f;
          std::memcpy(sg + j, &e, sizeof(e));
          sums = sums + e;
        }
        inv[g] = 1.f / hsum(sums);
      }
      if (vec) {
        const int64_t nv = Dh / VL;
        fvec acc[GMAX][16];
        for (int64_t g = 0; g < n; ++g)
          for (int64_t j = 0; j < nv; ++j) acc[g][j] = fvec{};
        for (int64_t k = 0; k < total; ++k) {
          const T* vp = vc + (slots[k] + h) * Dh;
          for (int64_t j = 0; j < nv; ++j) {
            const fvec v = load(vp + j * VL);
            for (int64_t g = 0; g < n; ++g) acc[g][j] = acc[g][j] + scores[g * padded + k] * v;
          }
        }
        for (int64_t g = 0; g < n; ++g) {
          float* o = outf + (r * Hq + hq0 + g) * Dh;
          for (int64_t j = 0; j < nv; ++j) {
            const fvec y = acc[g][j] * inv[g];
            std::memcpy(o + j * VL, &y, sizeof(y));
          }
        }
      } else {
        for (int64_t g = 0; g < n; ++g) {
          float* o = outf + (r * Hq + hq0 + g) * Dh;
          for (int64_t d = 0; d < Dh; ++d) o[d] = 0.f;
          for (int64_t k = 0; k < total; ++k) {
            const T* vp = vc + (slots[k] + h) * Dh;
            const float p = scores[g * padded + k];
            for (int64_t d = 0; d < Dh; ++d) o[d] += p * scalar(vp[d]);
          }
          for (int64_t d = 0; d < Dh; ++d) o[d] *= inv[g];
        }
      }
    }
  });
}

torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor page_table, torch::Tensor row_seq, torch::Tensor row_len,
                                   torch::Tensor extra, torch::Tensor extra_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_attention_rows: q (R, Hq, Dh), cache (P, page, Hkv, Dh)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_attention_rows: q and cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "paged_attention_rows: bf16 or fp32");
  const int64_t R = q.size(0), Hq = q.size(1), Dh = q.size(2), page = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hkv > 0 && page > 0 && Hq % Hkv == 0 && k_cache.size(3) == Dh, "paged_attention_rows: head shapes");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention_rows: k and v caches differ in shape or dtype");
  for (const auto* t : {&q, &k_cache, &v_cache, &page_table, &row_seq, &row_len, &extra, &extra_len})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention_rows: CPU tensors");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention_rows: contiguous caches");
  TORCH_CHECK(page_table.dim() == 2 && extra.dim() == 2 && extra.size(0) == R && row_seq.numel() == R &&
                  row_len.numel() == R && extra_len.numel() == R,
              "paged_attention_rows: page_table (B, P), extra (R, E), row_seq / row_len / extra_len (R)");
  auto qc = q.contiguous();
  auto table = page_table.to(at::kInt).contiguous();
  auto seq = row_seq.to(at::kInt).contiguous();
  auto len = row_len.to(at::kInt).contiguous();
  auto ex = extra.to(at::kInt).contiguous();
  auto exl = extra_len.to(at::kInt).contiguous();
  {  // every index the kernel follows stays inside the tensors it reads
    const int64_t B = table.size(0), maxp = table.size(1), P = k_cache.size(0), E = ex.size(1);
    const int32_t* tp = table.data_ptr<int32_t>();
    for (int64_t i = 0; i < B * maxp; ++i)
      TORCH_CHECK(tp[i] >= 0 && tp[i] < P, "paged_attention_rows: page id ", tp[i], " outside the cache's ", P);
    for (int64_t r = 0; r < R; ++r) {
      const int32_t s = seq.data_ptr<int32_t>()[r], l = len.data_ptr<int32_t>()[r], e = exl.data_ptr<int32_t>()[r];
      TORCH_CHECK(s >= 0 && s < B, "paged_attention_rows: row ", r, " names sequence ", s, " of ", B);
      TORCH_CHECK(l >= 0 && l <= maxp * page && e >= 0 && e <= E && l + e > 0,
                  "paged_attention_rows: row ", r, " has ", l, " + ", e, " keys (at most ", maxp * page, " + ", E, ")");
      for (int64_t j = 0; j < e; ++j) {
        const int32_t pos = ex.data_ptr<int32_t>()[r * E + j];
        TORCH_CHECK(pos >= 0 && pos < maxp * page, "paged_attention_rows: row ", r, " extra key ", pos, " outside");
      }
    }
  }
  auto outf = torch::empty({R, Hq, Dh}, q.options().dtype(at::kFloat));
  const int64_t E = ex.dim() == 2 ? ex.size(1) : 0;
  if (q.scalar_type() == at::kBFloat16) {
    auto cast = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    attention_impl<uint16_t>(cast(qc), cast(k_cache), cast(v_cache), table.data_ptr<int32_t>(), table.size(1),
                             seq.data_ptr<int32_t>(), len.data_ptr<int32_t>(), ex.data_ptr<int32_t>(), E,
                             exl.data_ptr<int32_t>(), R, Hq, Hkv, Dh, page, scale, outf.data_ptr<float>());
    auto out = torch::empty({R, Hq, Dh}, q.options());
    const float* src = outf.data_ptr<float>();
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < R * Hq * Dh; ++i) dst[i] = to_bf16(src[i]);
    return out;
  }
  attention_impl<float>(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                        table.data_ptr<int32_t>(), table.size(1), seq.data_ptr<int32_t>(), len.data_ptr<int32_t>(),
                        ex.data_ptr<int32_t>(), E, exl.data_ptr<int32_t>(), R, Hq, Hkv, Dh, page, scale,
                        outf.data_ptr<float>());
  return outf;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_isa", &linear_isa, "the instructions a bf16 x bf16 linear_packed uses in this process");
  m.def("pack_linear", &pack_linear, "pack a bf16 / fp32 weight (N, K) for linear_packed");
  m.def("linear_packed", &linear_packed, "row-invariant small-M linear over a packed weight");
  m.def("linear_rows", &linear_rows, "row-invariant small-M linear (bf16 / fp32 weights), packing on the call");
  m.def("paged_attention_rows", &paged_attention_rows, "row-invariant paged attention, one key set per row");
}
