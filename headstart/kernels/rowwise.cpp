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
// Accumulation is fp32. Reductions use VL independent lanes (element i goes to lane i mod VL),
// summed lane by lane in a fixed order, then a scalar tail. The weights of a linear are streamed
// once for up to four rows at a time, which is what makes a k + 1 row verify cost about one row.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// Rows [m0, m0 + MB) x outputs [j0, j0 + JB): each (row, output) pair accumulates in its own lanes.
template <int MB, int JB, typename W>
static inline void tile(const float* x, const W* w, const float* bias, float* y, int64_t m0, int64_t j0,
                        int64_t N, int64_t K) {
  fvec acc[MB][JB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < JB; ++j) acc[m][j] = fvec{};
  const int64_t kv = K - K % VL;
  // The weight rows 8 tiles ahead are prefetched; past the last row the address is clamped to it
  // (forming a pointer beyond the tensor is undefined behaviour, even for a prefetch).
  const int64_t ahead = std::min<int64_t>(j0 + 8 * JB, N - JB);
  for (int64_t k = 0; k < kv; k += VL) {
    fvec wv[JB];
    for (int j = 0; j < JB; ++j) {
      __builtin_prefetch(w + (ahead + j) * K + k);
      wv[j] = load(w + (j0 + j) * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      fvec xv = load(x + (m0 + m) * K + k);
      for (int j = 0; j < JB; ++j) acc[m][j] = acc[m][j] + xv * wv[j];
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < JB; ++j) {
      float s = hsum(acc[m][j]);
      for (int64_t k = kv; k < K; ++k) s += x[(m0 + m) * K + k] * scalar(w[(j0 + j) * K + k]);
      if (bias) s += bias[j0 + j];
      y[(m0 + m) * N + j0 + j] = s;
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 activations x bf16 weights with the CPU's bf16 dot product (pairs of products summed into
// fp32 lanes): half the instructions of widening both operands, and no conversion of the weights.
template <int MB, int JB>
static inline void tile(const uint16_t* x, const uint16_t* w, const float* bias, float* y, int64_t m0, int64_t j0,
                        int64_t N, int64_t K) {
  __m512 acc[MB][JB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < JB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t kv = K - K % 32;
  const int64_t ahead = std::min<int64_t>(j0 + 8 * JB, N - JB);  // clamped to the last rows, as above
  for (int64_t k = 0; k < kv; k += 32) {
    __m512bh wv[JB];
    for (int j = 0; j < JB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (ahead + j) * K + k), _MM_HINT_T1);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + (j0 + j) * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * K + k);
      for (int j = 0; j < JB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < JB; ++j) {
      float s = _mm512_reduce_add_ps(acc[m][j]);
      for (int64_t k = kv; k < K; ++k) s += scalar(x[(m0 + m) * K + k]) * scalar(w[(j0 + j) * K + k]);
      if (bias) s += bias[j0 + j];
      y[(m0 + m) * N + j0 + j] = s;
    }
  }
}

#endif

// The rows in tiles of four (then three, two, one): a row's arithmetic is the same in every tile size.
template <int JB, typename X, typename W>
static void rows_tile(const X* x, const W* w, const float* bias, float* y, int64_t M, int64_t j0, int64_t N,
                      int64_t K) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, JB>(x, w, bias, y, m, j0, N, K);
  switch (M - m) {
    case 3: tile<3, JB>(x, w, bias, y, m, j0, N, K); break;
    case 2: tile<2, JB>(x, w, bias, y, m, j0, N, K); break;
    case 1: tile<1, JB>(x, w, bias, y, m, j0, N, K); break;
    default: break;
  }
}

template <typename X, typename W>
static void linear_impl(const X* x, const W* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int JB = 4;
  const int64_t blocks = (N + JB - 1) / JB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * JB;
      if (j0 + JB <= N) {
        rows_tile<JB>(x, w, bias, y, M, j0, N, K);
      } else {
        for (int64_t j = j0; j < N; ++j) rows_tile<1>(x, w, bias, y, M, j, N, K);
      }
    }
  });
}

torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_rows: shapes (M, K) x (N, K)");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat, "linear_rows: bf16 or fp32 weights");
  TORCH_CHECK(x.is_floating_point(), "linear_rows: floating-point inputs");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_rows: CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N && bias->is_floating_point(),
                "linear_rows: bias must be a CPU float vector of ", N, " values");
  auto wc = w.contiguous();
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
#if defined(__AVX512BF16__)
  const bool dp = wc.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16;
#else
  const bool dp = false;
#endif
  auto xf = dp ? x.contiguous() : x.to(at::kFloat).contiguous();
  if (dp) {
#if defined(__AVX512BF16__)
    linear_impl(reinterpret_cast<const uint16_t*>(xf.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), bp, y.data_ptr<float>(), M, N, K);
#endif
  } else if (wc.scalar_type() == at::kBFloat16) {
    linear_impl(xf.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), bp,
                y.data_ptr<float>(), M, N, K);
  } else {
    linear_impl(xf.data_ptr<float>(), wc.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "row-invariant small-M linear (bf16 / fp32 weights)");
  m.def("paged_attention_rows", &paged_attention_rows, "row-invariant paged attention, one key set per row");
}
