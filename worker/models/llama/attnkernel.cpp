// Decode attention as one operation (issue 32): each decode entry's query heads over its own cache
// row's keys [start, length), grouped-query heads sharing one pass over the keys and values, with
// the iteration's new keys and values stored into the cache first. See attnkernel.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

using Vec = at::vec::Vectorized<float>;  // 16 fp32 lanes (built with CPU_CAPABILITY_AVX512)

namespace {

inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the bits shifted up
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}

inline void store(float* dst, const float* src, int64_t d) { std::copy(src, src + d, dst); }
inline void store(at::BFloat16* dst, const float* src, int64_t d) {  // round to nearest even, as Tensor.to
  for (int64_t i = 0; i < d; i++) dst[i] = c10::BFloat16(src[i]);
}

// keys/values of one layer: [rows, kv_heads, capacity, D] with unit stride on D
template <typename T>
void write_new(T* k, T* v, const int64_t* ks, const float* new_kv, int64_t new_stride, const int64_t* rows,
               const int64_t* pos, int64_t n, int64_t kv_heads, int64_t d) {
  for (int64_t e = 0; e < n; e++) {
    for (int64_t h = 0; h < kv_heads; h++) {
      int64_t at = rows[e] * ks[0] + h * ks[1] + pos[e] * ks[2];
      store(k + at, new_kv + e * new_stride + h * d, d);
      store(v + at, new_kv + e * new_stride + (kv_heads + h) * d, d);
    }
  }
}

template <typename T>
void attend(const float* q, int64_t q_stride, const T* k, const T* v, const int64_t* ks, const int64_t* rows, const int64_t* lengths,
            float* out, int64_t n, int64_t heads, int64_t kv_heads, int64_t d, float scaling, int64_t window,
            float softcap) {
  const int64_t group = heads / kv_heads, dv = d / Vec::size();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(group * d);
    std::vector<Vec> acc(group * dv);
    for (int64_t task = begin; task < end; task++) {
      const int64_t e = task / kv_heads, h = task % kv_heads, len = lengths[e];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, count = len - start;
      float* o = out + (e * heads + h * group) * d;
      if (count <= 0) {
        std::fill(o, o + group * d, 0.0f);
        continue;
      }
      const float* qh = q + e * q_stride + h * group * d;
      for (int64_t i = 0; i < group * d; i++) qs[i] = qh[i] * scaling;
      const T* kr = k + rows[e] * ks[0] + h * ks[1] + start * ks[2];
      const T* vr = v + rows[e] * ks[0] + h * ks[1] + start * ks[2];
      scores.resize(group * count);
      for (int64_t j = 0; j < count; j++) {  // scores[g][j] = (q_g * scaling) . k_j
        const T* kj = kr + j * ks[2];
        for (int64_t g = 0; g < group; g++) acc[g] = Vec(0.0f);
        for (int64_t c = 0; c < dv; c++) {
          Vec kc = load(kj + c * Vec::size());
          for (int64_t g = 0; g < group; g++) acc[g] = at::vec::fmadd(load(&qs[g * d + c * Vec::size()]), kc, acc[g]);
        }
        for (int64_t g = 0; g < group; g++) {
          float s = _mm512_reduce_add_ps(acc[g]);
          scores[g * count + j] = softcap > 0 ? std::tanh(s / softcap) * softcap : s;
        }
      }
      for (int64_t g = 0; g < group; g++) {  // softmax over the row's keys
        float* s = &scores[g * count];
        float top = *std::max_element(s, s + count), sum = 0.0f;
        int64_t j = 0;
        Vec top_v(top), sum_v(0.0f);
        for (; j + Vec::size() <= count; j += Vec::size()) {
          Vec p = (Vec::loadu(s + j) - top_v).exp_u20();
          p.store(s + j);
          sum_v = sum_v + p;
        }
        if (j < count) {
          Vec p = (Vec::loadu(s + j, count - j) - top_v).exp_u20();
          p.store(s + j, count - j);
          sum_v = sum_v + Vec::set(Vec(0.0f), p, count - j);
        }
        sum = _mm512_reduce_add_ps(sum_v);
        float inv = 1.0f / sum;
        for (int64_t i = 0; i < count; i++) s[i] *= inv;
      }
      for (int64_t i = 0; i < group * dv; i++) acc[i] = Vec(0.0f);
      for (int64_t j = 0; j < count; j++) {  // out_g = sum_j p[g][j] v_j
        const T* vj = vr + j * ks[2];
        for (int64_t c = 0; c < dv; c++) {
          Vec vc = load(vj + c * Vec::size());
          for (int64_t g = 0; g < group; g++)
            acc[g * dv + c] = at::vec::fmadd(Vec(scores[g * count + j]), vc, acc[g * dv + c]);
        }
      }
      for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < dv; c++) acc[g * dv + c].store(o + g * d + c * Vec::size());
    }
  });
}

}  // namespace

// cache: one layer's [2, rows, kv_heads, capacity, D] (keys, values; fp32 or bf16, unit stride on D).
// new_kv: [N, 2, kv_heads, D] fp32, stored at (write_rows[i], write_pos[i]) first. Then for the
// first n = q.size(0) entries (q [n, heads, D] fp32): attention over cache row rows[i]'s keys
// [max(0, lengths[i] - window), lengths[i]) (window <= 0: all), scores scaled by `scaling` and
// soft-capped (softcap > 0). Returns [n, heads, D] fp32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor new_kv, torch::Tensor write_rows,
                               torch::Tensor write_pos, torch::Tensor rows, torch::Tensor lengths, double scaling,
                               int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: fp32 [n, heads, D], each entry's heads contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.stride(4) == 1, "cache: [2, rows, kv_heads, capacity, D], unit stride on D");
  TORCH_CHECK(new_kv.dim() == 4 && new_kv.scalar_type() == at::kFloat && new_kv.stride(3) == 1 &&
              new_kv.stride(2) == new_kv.size(3) && new_kv.stride(1) == new_kv.size(2) * new_kv.size(3),
              "new_kv: fp32 [N, 2, kv_heads, D], each entry's keys and values contiguous");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = cache.size(2);
  TORCH_CHECK(cache.size(4) == d && d % Vec::size() == 0 && heads % kv_heads == 0, "head shapes");
  TORCH_CHECK(new_kv.size(0) == write_rows.numel() && new_kv.size(1) == 2 && new_kv.size(2) == kv_heads &&
              new_kv.size(3) == d && write_rows.numel() == write_pos.numel(),
              "new_kv: [N, 2, kv_heads, D] with N write rows and positions");
  TORCH_CHECK(rows.numel() == n && lengths.numel() == n, "rows, lengths: one per query entry");
  for (auto* t : {&write_rows, &write_pos, &rows, &lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices: contiguous int64");
  auto out = torch::empty({n, heads, d}, q.options());
  const int64_t ks[3] = {cache.stride(1), cache.stride(2), cache.stride(3)};
  AT_DISPATCH_SWITCH(cache.scalar_type(), "decode_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      auto* k = cache.data_ptr<float>();
      auto* v = k + cache.stride(0);
      write_new(k, v, ks, new_kv.data_ptr<float>(), new_kv.stride(0), write_rows.data_ptr<int64_t>(), write_pos.data_ptr<int64_t>(),
                write_rows.numel(), kv_heads, d);
      attend(q.data_ptr<float>(), q.stride(0), k, v, ks, rows.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
             out.data_ptr<float>(), n, heads, kv_heads, d, (float)scaling, window, (float)softcap);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      auto* k = cache.data_ptr<at::BFloat16>();
      auto* v = k + cache.stride(0);
      write_new(k, v, ks, new_kv.data_ptr<float>(), new_kv.stride(0), write_rows.data_ptr<int64_t>(), write_pos.data_ptr<int64_t>(),
                write_rows.numel(), kv_heads, d);
      attend(q.data_ptr<float>(), q.stride(0), k, v, ks, rows.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
             out.data_ptr<float>(), n, heads, kv_heads, d, (float)scaling, window, (float)softcap);
    }));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over per-row lengths, with the KV write");
}
