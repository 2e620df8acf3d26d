// The row-wise RMSNorm (see rowwise.h), what headstart.nn.norm.RMSNorm computes in one pass:
//   y = weight * cast(x * rsqrt(mean(x^2) + eps))      x, weight and y in one dtype (bf16 or fp32)
// The square sum runs in fp32 in VL lanes (element i in lane i mod VL), the lanes summed by a fixed
// tree, then a scalar tail: a row's bits depend on its own values only. The rest follows torch's
// formula step by step (fp32 mean, the sum divided by D; 1 / sqrt; the normed row rounded to the
// dtype before the weight's product, which is rounded again), so the result differs from torch's
// only where its square sum's order moves the last bit.

#include "rowwise.h"

static inline float narrow(float v, float) { return v; }
static inline float narrow(float v, uint16_t) { return scalar(to_bf16(v)); }
static inline void put(float* y, float v) { *y = v; }
static inline void put(uint16_t* y, float v) { *y = to_bf16(v); }

template <typename T>
static void rms_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  fvec acc = {};
  int64_t i = 0;
  for (; i + VL <= D; i += VL) {
    const fvec v = load(x + i);
    acc = acc + v * v;
  }
  float s = hsum(acc);
  for (; i < D; ++i) {
    const float v = scalar(x[i]);
    s += v * v;
  }
  const float r = 1.0f / std::sqrt(s / static_cast<float>(D) + eps);
  for (i = 0; i < D; ++i) put(y + i, scalar(w[i]) * narrow(scalar(x[i]) * r, T{}));
}

// Rows split over threads in big blocks only: a decode step's few rows stay on the calling thread (a
// parallel region costs more than a 576-wide row).
template <typename T>
static void rms_rows(const T* x, const T* w, T* y, int64_t M, int64_t D, float eps) {
  at::parallel_for(0, M, 256, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_row(x + m * D, w, y + m * D, D, eps);
  });
}

torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm_rows: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm_rows: x and weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm_rows: bf16 or fp32");
  const int64_t D = weight.numel();
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == D, "rms_norm_rows: x (..., D), weight (D)");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t M = D ? xc.numel() / D : 0;
  const float e = static_cast<float>(eps);
  if (xc.scalar_type() == at::kFloat) {
    rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, D, e);
  } else {
    rms_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()),
             reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, D, e);
  }
  return y;
}
