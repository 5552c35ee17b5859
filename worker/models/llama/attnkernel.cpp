// Decode attention as one operation (issue 32): each decode entry's query heads over its own cache
// row's keys [start, length), grouped-query heads sharing one pass over the keys and values, with
// the iteration's new keys and values stored into the cache first. See attnkernel.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// Built for AVX-512 (CPU_CAPABILITY_AVX512: Vec and the raw vectors 16 fp32 lanes) or, on a CPU
// without it, for AVX2 with FMA and F16C (CPU_CAPABILITY_AVX2: 8 lanes; attnkernel.py picks): the
// same algorithm, each vector operation at the register's width (W lanes).
using Vec = at::vec::Vectorized<float>;

namespace {

#if defined(__AVX512F__)
using V = __m512;  // W fp32 lanes
constexpr int W = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline float hmax(V v) { return _mm512_reduce_max_ps(v); }
#else
using V = __m256;
constexpr int W = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoreu(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float hsum(V v) {  // (lanes 0-3 + 4-7, then pairs, then the last two)
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}
inline float hmax(V v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}
#endif
static_assert(W == Vec::size(), "Vec and the raw vectors: one width");

inline Vec load(const float* p) { return Vec::loadu(p); }
#if defined(__AVX512F__)
inline Vec load(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the bits shifted up
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}

inline Vec load(const at::Half* p) {  // fp16 -> fp32 is exact (F16C)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#else
inline Vec load(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
}

inline Vec load(const at::Half* p) { return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
#endif

inline void store(float* dst, const float* src, int64_t d) { std::copy(src, src + d, dst); }
inline void store(at::Half* dst, const float* src, int64_t d) {  // round to nearest even, as Tensor.to
  for (int64_t i = 0; i < d; i++) dst[i] = c10::Half(src[i]);
}
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

constexpr int KB = 16;  // keys a 16-bit cache widens at once (score16: tiles of TK keys)
// keys and values are prefetched a block (KB keys) and VALUES_AHEAD rows ahead: in a decode step each
// layer's cache comes from memory (a step reads every layer's); 24 layers' caches in turn, 8 rows of
// 2,048 fp16 keys, 2 threads, 2-core AMD EPYC Zen 3: SmolLM2's 785 -> 612 us a layer, Qwen2.5-0.5B's
// 863 -> 756 (4 to 32 values ahead: the same; keys 2 or 4 blocks ahead: slower than one)
constexpr int64_t VALUES_AHEAD = 8;
constexpr int64_t HB = 4;  // heads whose weighted sums of values run at a time, at most (values_block: HB x 4 sums)

#if defined(__AVX512F__)
constexpr int64_t TK = 8;  // keys a score tile (score_keys)

// r[0 .. 8) = the sums of a[0 .. 8)'s W lanes: a transposing tree (unpack, in-lane shuffle, 128-bit
// lane shuffle), 25 operations for 8 sums where one horizontal reduce each takes ~8 in a dependent
// chain
inline __m256 reduce8(const __m512* a) {
  __m512 x[4], y[2];
  for (int i = 0; i < 4; i++)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; i++)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lanes: y[0] (0+1), y[0] (2+3), y[1] (0+1), y[1] (2+3); then lanes 0+1 and 2+3
  const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 t = _mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, 0xB1));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm512_extractf32x4_ps(t, 0)), _mm512_extractf32x4_ps(t, 2), 1);
}

// s[g * count + i] = qs_g . k_i for GB heads of the group (qs: the first one's d values, the next d
// apart) and 8 keys (kstride apart): each key's columns loaded once for the GB heads
template <int GB>
inline void score_keys(const float* qs, const float* kb, int64_t kstride, int64_t d, float* s, int64_t count) {
  V acc[GB][8];
  for (int g = 0; g < GB; g++)
    for (int i = 0; i < 8; i++) acc[g][i] = vzero();
  for (int64_t c = 0; c < d; c += W) {
    V qv[GB];
    for (int g = 0; g < GB; g++) qv[g] = vloadu(qs + g * d + c);
    for (int i = 0; i < 8; i++) {
      const V kv = vloadu(kb + i * kstride + c);
      for (int g = 0; g < GB; g++) acc[g][i] = vfmadd(qv[g], kv, acc[g][i]);
    }
  }
  for (int g = 0; g < GB; g++) _mm256_storeu_ps(s + g * count, reduce8(acc[g]));
}

#else
constexpr int64_t TK = 4;  // keys a score tile (score_keys)

// r[0 .. 4) = the sums of a[0 .. 4)'s 8 lanes (hadd pairs, then the 128-bit halves)
inline __m128 reduce4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// AVX2's tile of 4 keys (16 ymm registers), so that GB (<= 3) heads' 4 GB sums, their queries and
// a key's columns fit without spills (8 keys by 3 heads are 24 sums: that tile spilled on every
// column). With values_block's AVX2 order, a layer's decode attention at 8 slots, fp16 cache, 2
// threads, 2-core AMD EPYC Zen 3, the kernels in turns in one process (us, 190 / 2,048 cached keys):
// SmolLM2 (9 heads over 3, D 64) 64.1 -> 47.3 / 578.9 -> 415.2, Qwen2.5-0.5B (14 over 2) 81.5 ->
// 65.5 / 783.9 -> 618.3, -1.5B (12 over 2, D 128) 117.1 -> 87.1 / 1,191.5 -> 847.9; one thread
// 1.27-1.48x
template <int GB>
inline void score_keys(const float* qs, const float* kb, int64_t kstride, int64_t d, float* s, int64_t count) {
  __m256 acc[GB][4];
  for (int g = 0; g < GB; g++)
    for (int i = 0; i < 4; i++) acc[g][i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    __m256 qv[GB];
    for (int g = 0; g < GB; g++) qv[g] = _mm256_loadu_ps(qs + g * d + c);
    for (int i = 0; i < 4; i++) {
      const __m256 kv = _mm256_loadu_ps(kb + i * kstride + c);
      for (int g = 0; g < GB; g++) acc[g][i] = _mm256_fmadd_ps(qv[g], kv, acc[g][i]);
    }
  }
  for (int g = 0; g < GB; g++) _mm_storeu_ps(s + g * count, reduce4(acc[g]));
}
#endif

// scores[g * count + i] = qs_g . k_i, i < 16, for the group's heads (up to 3 at a time, each key
// loaded once for them); kb: 16 keys of d fp32 each, kstride apart
inline void score16(const float* qs, const float* kb, int64_t kstride, int64_t group, int64_t d, float* scores,
                    int64_t count) {
  for (int64_t i0 = 0; i0 < 16; i0 += TK)
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
      const float* q = qs + g0 * d;
      const float* k = kb + i0 * kstride;
      float* s = scores + g0 * count + i0;
      switch (std::min<int64_t>(3, group - g0)) {
        case 1: score_keys<1>(q, k, kstride, d, s, count); break;
        case 2: score_keys<2>(q, k, kstride, d, s, count); break;
        default: score_keys<3>(q, k, kstride, d, s, count);
      }
    }
}

// out[g][c0 .. c0 + W CB) = inv[g] * sum_j p[g][j] v_j[c0 ..], for GB heads of the group from g0 (p:
// the softmax's numerators, inv: 1 / their sum): the sums in registers (GB * CB <= 16), one pass
// over the keys
template <int GB, int CB, typename T>
inline void values_block(const float* p, const float* inv, int64_t count, const T* vr, int64_t vstride, int64_t c0,
                         float* o, int64_t d) {
  V acc[GB][CB];
  for (int g = 0; g < GB; g++)
    for (int c = 0; c < CB; c++) acc[g][c] = vzero();
  for (int64_t j = 0; j < count; j++) {
    const T* vj = vr + j * vstride + c0;
    if (c0 == 0 && j + VALUES_AHEAD < count)  // (the first pass over the values: they come from memory)
      for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vr + (j + VALUES_AHEAD) * vstride) + b, _MM_HINT_T0);
#if !defined(__AVX512F__)
    if constexpr (GB <= 3) {  // the heads' weights first, then a column at a time: GB * CB sums, GB weights and one
      V pg[GB];               // column in 16 ymm (the columns first spilled: 3 x 4 sums, 4 columns and a weight;
                              // 4 heads keep that order, where 4 weights would spill as much)
      for (int g = 0; g < GB; g++) pg[g] = vset1(p[g * count + j]);
      for (int c = 0; c < CB; c++) {
        const V v = V(load(vj + W * c));
        for (int g = 0; g < GB; g++) acc[g][c] = vfmadd(pg[g], v, acc[g][c]);
      }
      continue;
    }
#endif
    {
    V v[CB];
    for (int c = 0; c < CB; c++) v[c] = V(load(vj + W * c));
    for (int g = 0; g < GB; g++) {
      const V pg = vset1(p[g * count + j]);
      for (int c = 0; c < CB; c++) acc[g][c] = vfmadd(pg, v[c], acc[g][c]);
    }
    }
  }
  for (int g = 0; g < GB; g++)
    for (int c = 0; c < CB; c++)
      vstoreu(o + g * d + c0 + W * c, vmul(acc[g][c], vset1(inv[g])));
}

template <int GB, typename T>
inline void values_cb(int64_t cb, const float* p, const float* inv, int64_t count, const T* vr, int64_t vstride,
                      int64_t c0, float* o, int64_t d) {
  switch (cb) {
    case 1: values_block<GB, 1>(p, inv, count, vr, vstride, c0, o, d); break;
    case 2: values_block<GB, 2>(p, inv, count, vr, vstride, c0, o, d); break;
    case 3: values_block<GB, 3>(p, inv, count, vr, vstride, c0, o, d); break;
    default: values_block<GB, 4>(p, inv, count, vr, vstride, c0, o, d); break;
  }
}

// 16 keys (stride apart) as fp32 for score16: fp32 read in place (stride unchanged); bf16 widened
// once into buf (stride d), for every head of the group
inline const float* keys_fp32(const float* k, int64_t&, int64_t, float*) { return k; }
template <typename T>
inline const float* keys_fp32(const T* k, int64_t& stride, int64_t d, float* buf) {
  for (int64_t i = 0; i < KB; i++)
    for (int64_t c = 0; c < d; c += W) load(k + i * stride + c).store(buf + i * d + c);
  stride = d;
  return buf;
}

template <typename T>
void attend(const float* q, int64_t q_stride, const T* k, const T* v, const int64_t* ks, const int64_t* rows, const int64_t* lengths,
            float* out, int64_t n, int64_t heads, int64_t kv_heads, int64_t d, float scaling, int64_t window,
            float softcap) {
  const int64_t group = heads / kv_heads, dv = d / Vec::size();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(group * d), kbuf(KB * d), inv(group);
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
      int64_t j = 0;
      for (; j + KB <= count; j += KB) {  // scores[g][j] = (q_g * scaling) . k_j, 16 keys at a time
        int64_t stride = ks[2];
        if (j + 2 * KB <= count)  // the next block's keys on their way to L1 (a step's keys come from memory)
          for (int64_t i = 0; i < KB; i++)
            for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64)
              _mm_prefetch(reinterpret_cast<const char*>(kr + (j + KB + i) * ks[2]) + b, _MM_HINT_T0);
        const float* kb = keys_fp32(kr + j * ks[2], stride, d, kbuf.data());
        score16(qs.data(), kb, stride, group, d, &scores[j], count);
      }
      for (; j < count; j++) {  // the last keys one by one
        const T* kj = kr + j * ks[2];
        for (int64_t g = 0; g < group; g++) acc[g] = Vec(0.0f);
        for (int64_t c = 0; c < dv; c++) {
          Vec kc = load(kj + c * Vec::size());
          for (int64_t g = 0; g < group; g++) acc[g] = at::vec::fmadd(load(&qs[g * d + c * Vec::size()]), kc, acc[g]);
        }
        for (int64_t g = 0; g < group; g++) scores[g * count + j] = hsum(V(acc[g]));
      }
      for (int64_t g = 0; g < group; g++) {  // soft cap, then the softmax over the row's keys
        float* s = &scores[g * count];
        if (softcap > 0)
          for (int64_t i = 0; i < count; i++) s[i] = std::tanh(s[i] / softcap) * softcap;
        int64_t i = 0;
        Vec max_v(-std::numeric_limits<float>::infinity());
        for (; i + Vec::size() <= count; i += Vec::size()) max_v = at::vec::maximum(max_v, Vec::loadu(s + i));
        float top = hmax(V(max_v)), sum = 0.0f;
        for (; i < count; i++) top = std::max(top, s[i]);
        i = 0;
        Vec top_v(top), sum_v(0.0f);
        for (; i + Vec::size() <= count; i += Vec::size()) {
          Vec p = (Vec::loadu(s + i) - top_v).exp_u20();
          p.store(s + i);
          sum_v = sum_v + p;
        }
        if (i < count) {
          Vec p = (Vec::loadu(s + i, count - i) - top_v).exp_u20();
          p.store(s + i, count - i);
          sum_v = sum_v + Vec::set(Vec(0.0f), p, count - i);
        }
        sum = hsum(V(sum_v));
        inv[g] = 1.0f / sum;  // (applied to the weighted sums, not to each of the count numerators)
      }
      // out_g = sum_j p[g][j] v_j: up to 4 heads x 4 W columns at a time in registers
      // in ceil(group / HB) runs of heads as even as can be (7: 4 and 3, not 3, 3 and 1: each run is a
      // pass over the values; a run of one reloads each column for one head)
      const int64_t runs = (group + HB - 1) / HB;
      for (int64_t r = 0, g0 = 0; r < runs; r++) {
        const int64_t gb = (group - g0) / (runs - r);
        const float* p = &scores[g0 * count];
        for (int64_t c = 0; c < dv; c += 4) {
          const int64_t cb = std::min<int64_t>(4, dv - c);
          switch (gb) {
            case 1: values_cb<1>(cb, p, &inv[g0], count, vr, ks[2], c * W, o + g0 * d, d); break;
            case 2: values_cb<2>(cb, p, &inv[g0], count, vr, ks[2], c * W, o + g0 * d, d); break;
            case 3: values_cb<3>(cb, p, &inv[g0], count, vr, ks[2], c * W, o + g0 * d, d); break;
            default: values_cb<4>(cb, p, &inv[g0], count, vr, ks[2], c * W, o + g0 * d, d); break;
          }
        }
        g0 += gb;
      }
    }
  });
}

}  // namespace

// cache: one layer's [2, rows, kv_heads, capacity, D] (keys, values; fp32, bf16 or fp16, unit stride on D).
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
  TORCH_CHECK(cache.size(4) == d && d % 16 == 0 && heads % kv_heads == 0, "head shapes");  // (16: attnkernel.LANES)
  TORCH_CHECK(new_kv.size(0) == write_rows.numel() && new_kv.size(1) == 2 && new_kv.size(2) == kv_heads &&
              new_kv.size(3) == d && write_rows.numel() == write_pos.numel(),
              "new_kv: [N, 2, kv_heads, D] with N write rows and positions");
  TORCH_CHECK(rows.numel() == n && lengths.numel() == n, "rows, lengths: one per query entry");
  for (auto* t : {&write_rows, &write_pos, &rows, &lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices: contiguous int64");
  auto out = torch::empty({n, heads, d}, q.options());
  const int64_t ks[3] = {cache.stride(1), cache.stride(2), cache.stride(3)};
  auto run = [&](auto* k) {  // k: the keys (the cache's element type), the values one stride(0) on
    auto* v = k + cache.stride(0);
    write_new(k, v, ks, new_kv.data_ptr<float>(), new_kv.stride(0), write_rows.data_ptr<int64_t>(),
              write_pos.data_ptr<int64_t>(), write_rows.numel(), kv_heads, d);
    attend(q.data_ptr<float>(), q.stride(0), k, v, ks, rows.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
           out.data_ptr<float>(), n, heads, kv_heads, d, (float)scaling, window, (float)softcap);
  };
  AT_DISPATCH_SWITCH(cache.scalar_type(), "decode_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] { run(cache.data_ptr<float>()); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { run(cache.data_ptr<at::BFloat16>()); })
    AT_DISPATCH_CASE(at::kHalf, [&] { run(cache.data_ptr<at::Half>()); }));
  return out;
}

// ---- the layer's small operations, one call each instead of a handful of ATen ones (issue 32: ~80
// operations a layer, at ~2-5 us each, were most of a small model's decode step). Built with
// -ffp-contract=off: each product and sum rounds as ATen's separate operations round.

// RMSNorm (Zhang & Sennrich 2019) of x fp32 [N, H] (rows contiguous): y = (x * r) * weight with
// r = 1 / sqrt(sum(x^2) * inv + eps) per row (inv: fp32 1 / H), as model.py's _rms_norm computes it
// (the sum of squares in another order: within fp32 rounding of it). Returns fp32 [N, H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double inv, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: fp32 [N, H], unit stride on H");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
              weight.size(0) == x.size(1), "weight: fp32 [H]");
  const int64_t n = x.size(0), h = x.size(1), xs = x.stride(0);
  auto y = torch::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float fi = static_cast<float>(inv), fe = static_cast<float>(eps);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const float* xr = xp + r * xs;
      float* yr = yp + r * h;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 16 <= h; c += 16) {
        const __m512 v = _mm512_loadu_ps(xr + c);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      const __mmask16 tail = static_cast<__mmask16>((1u << (h - c)) - 1);
      if (c < h) {
        const __m512 v = _mm512_maskz_loadu_ps(tail, xr + c);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      const float ss = _mm512_reduce_add_ps(acc);
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(ss * fi + fe));
      for (c = 0; c + 16 <= h; c += 16)
        _mm512_storeu_ps(yr + c, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + c), scale), _mm512_loadu_ps(wp + c)));
      if (c < h)
        _mm512_mask_storeu_ps(yr + c, tail, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + c), scale),
                                                          _mm512_maskz_loadu_ps(tail, wp + c)));
#else
      __m256 acc = _mm256_setzero_ps();
      int64_t c = 0;
      for (; c + 8 <= h; c += 8) {
        const __m256 v = _mm256_loadu_ps(xr + c);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
      }
      float ss = hsum(acc);
      for (; c < h; c++) ss += xr[c] * xr[c];
      const float sc = 1.0f / std::sqrt(ss * fi + fe);
      const __m256 scale = _mm256_set1_ps(sc);
      for (c = 0; c + 8 <= h; c += 8)
        _mm256_storeu_ps(yr + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c), scale), _mm256_loadu_ps(wp + c)));
      for (; c < h; c++) yr[c] = (xr[c] * sc) * wp[c];
#endif
    }
  });
  return y;
}

// The gated MLP's SwiGLU activations (Shazeer 2020) from the fused gate-up product gu fp32 [N, 2F]
// (unit stride on its columns; gate = columns [0, F), up = [F, 2F)): y fp32 [N, F] = silu(gate) * up,
// each value as model.py's F.silu(gate).mul_(up) rounds it in ATen: silu(x) = x / (1 + exp(-x)) with
// Vec's exp (Sleef's expf, 1 ulp) on whole pairs of vectors of a row and std::exp on the row's last
// F % (2 W) values (ATen's vectorized loop and its scalar tail), then one product. One call where
// there were two operations and a [N, F] temporary (SmolLM2 at 8 rows: 26 -> 6 us a layer).
torch::Tensor silu_mul(torch::Tensor gu, int64_t f) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.stride(1) == 1 && f > 0 && gu.size(1) == 2 * f,
              "gu: fp32 [N, 2F], unit stride on its columns");
  const int64_t n = gu.size(0), gs = gu.stride(0);
  auto y = torch::empty({n, f}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t L = Vec::size();
  at::parallel_for(0, n, std::max<int64_t>(1, 32768 / f), [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    for (int64_t r = begin; r < end; r++) {
      const float* g = gp + r * gs;
      const float* u = g + f;
      float* o = yp + r * f;
      int64_t j = 0;
      for (; j + 2 * L <= f; j += 2 * L)
        for (int64_t k = j; k < j + 2 * L; k += L) {
          const Vec x = Vec::loadu(g + k);
          ((x / (one + x.neg().exp())) * Vec::loadu(u + k)).store(o + k);
        }
      for (; j < f; j++) o[j] = (g[j] / (1.0f + std::exp(-g[j]))) * u[j];
    }
  });
  return y;
}

// In place in qkv fp32 [N, W] (unit stride on W): columns [kv_from, W) (the new keys and values)
// made finite (NaN and +-inf -> 0, as nan_to_num_(0, 0, 0)), then RoPE on the first `heads` heads
// of D columns (the queries and keys) at each row's cos and sin_signed (fp32 [N, D] rows, sin with
// its second half negated): per head, with x1, x2 its halves, x1 <- x1 * cos1 + x2 * sin_signed2 and
// x2 <- x2 * cos2 + x1 * sin_signed1, each product and the sum rounded as model.py's _rope_ rounds
// them (transformers' apply_rotary_pos_emb, bit for bit).
void rope_finite_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, int64_t heads, int64_t d,
                  int64_t kv_from) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1, "qkv: fp32 [N, W], unit stride on W");
  const int64_t n = qkv.size(0), w = qkv.size(1), half = d / 2;
  TORCH_CHECK(d % 32 == 0 && heads * d <= w && kv_from <= w, "heads of D columns (a multiple of 32) within qkv");
  for (auto* t : {&cos, &sin_signed})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n * d && t->is_contiguous(), "cos, sin_signed: fp32 [N, D]");
  float* q = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  const int64_t qs = qkv.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const V zero = vzero();
    for (int64_t r = begin; r < end; r++) {
      float* row = q + r * qs;
      int64_t c = kv_from;
      for (; c + W <= w; c += W) {  // (v - v is 0 where v is finite, NaN elsewhere)
        const V v = vloadu(row + c);
#if defined(__AVX512F__)
        const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_EQ_OQ);
        _mm512_storeu_ps(row + c, _mm512_maskz_mov_ps(finite, v));
#else
        _mm256_storeu_ps(row + c, _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ), v));
#endif
      }
      for (; c < w; c++)
        if (!std::isfinite(row[c])) row[c] = 0.0f;
      const float* cr = cp + r * d;
      const float* sr = sp + r * d;
      for (int64_t hd = 0; hd < heads; hd++) {
        float* x = row + hd * d;
        for (int64_t i = 0; i < half; i += W) {
          const V x1 = vloadu(x + i), x2 = vloadu(x + half + i);
          const V a = vadd(vmul(x1, vloadu(cr + i)), vmul(x2, vloadu(sr + half + i)));
          const V b = vadd(vmul(x2, vloadu(cr + half + i)), vmul(x1, vloadu(sr + i)));
          vstoreu(x + i, a);
          vstoreu(x + half + i, b);
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over per-row lengths, with the KV write", py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows", py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of the fused gate-up product", py::call_guard<py::gil_scoped_release>());
  m.def("rope_finite_", &rope_finite_, "the new keys and values made finite, RoPE on the queries and keys, in place", py::call_guard<py::gil_scoped_release>());
}
