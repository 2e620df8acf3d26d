// Row-invariant paged attention (see rowwise.h): one key set per row, fixed-order lane sums.

#include "rowwise.h"

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

