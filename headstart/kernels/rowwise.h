// Row-invariant CPU kernels for decode and verify steps (headstart.kernels): the shared header.
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
//   rms_norm_rows(x (..., D), weight (D), eps) -> RMSNorm of every row, in x's dtype (bf16 / fp32)
//
// Accumulation is fp32. A linear's output accumulates in its own vector lane in input order; the
// weights are streamed from memory once for all rows, which is what makes a k + 1 row verify cost
// about one row. Attention reductions use VL independent lanes (element i goes to lane i mod VL),
// summed lane by lane in a fixed order, then a scalar tail.

#pragma once

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

// The kernels, one source each: linear.cpp (pack_linear, linear_packed, linear_rows, linear_isa),
// attention.cpp (paged_attention_rows), norm.cpp (rms_norm_rows); module.cpp binds them.
torch::Tensor pack_linear(torch::Tensor w);
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K_in,
                            c10::optional<torch::Tensor> bias);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
std::string linear_isa();
torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor page_table, torch::Tensor row_seq, torch::Tensor row_len,
                                   torch::Tensor extra, torch::Tensor extra_len, double scale);
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps);
