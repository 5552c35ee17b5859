// y = x @ W.T for a GGUF block-quantised W held as codes and per-group scales/offsets
// (worker/models/llama/quantized.py), on AMX-BF16 tiles or AVX-512 BF16 (vdpbf16ps).
//
// W[n, k] = scale[n, g] * code[n, k] + offset[n, g], g = k / group. The codes are small
// integers, exact in bf16, so with the activations rounded to bf16 each product
// x[m, k] * code[n, k] is exact in fp32, and
//     y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * code[n, k])
//             + offset[n, g] * (sum_{k in g} x[m, k])
// multiplies by the file's weights with fp32 sums.
//
// Layout (qkernel.py's blocked(), once at load): rows in blocks of 16 (a zmm's fp32 lanes),
// columns in pairs (both products take bf16 pairs). For each 16-row block and column pair p:
//   NIB (4-bit codes): 16 bytes, byte j = (code[n0+j, 2p] - low) | (code[n0+j, 2p+1] - low) << 4;
//   MAGIC, WIDE (int8 codes): 32 bytes, code[n0+j, 2p] then code[n0+j, 2p+1] for j = 0..15.
// MAGIC codes lie in [-64, 63]: the bf16 bits 0x4340 + c are the number 192 + c, exactly (one
// add decodes 32 of them); the kernel then subtracts 192 * scale * sum(x) per group. WIDE codes
// (Q8_0's full int8 range) go through fp32. Scales and offsets: [N / 16, K / group, 16] fp32.
// Each 16-row block is one task of a parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace {

enum Kind { NIB = 0, MAGIC = 1, WIDE = 2 };
constexpr float MAGIC_ZERO = 192.0f;  // what MAGIC decoding adds to a code
constexpr int MR = 8;  // AVX-512 path: activation rows in registers at once (2 * MR accumulators)

inline __m512i bf16_lut(int64_t low) {  // nibble -> bf16 of (low + nibble): small integers, exact
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) {
        float f = static_cast<float>(low + (i & 15));
        uint32_t u;
        std::memcpy(&u, &f, 4);
        t[i] = static_cast<uint16_t>(u >> 16);
    }
    return _mm512_load_si512(t);
}

// 32 bf16 weights: one column pair of a 16-row block
template <int KIND>
inline __m512bh decode(const uint8_t* p, __m512i lut) {
    if constexpr (KIND == NIB) {
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
        return (__m512bh)_mm512_permutexvar_epi16(idx, lut);  // idx: (d | d << 12) & 0x000F000F
    } else if constexpr (KIND == MAGIC) {
        __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return (__m512bh)_mm512_add_epi16(w, _mm512_set1_epi16(0x4340));
    } else {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
}

constexpr int64_t pair_bytes(int kind) { return kind == NIB ? 16 : 32; }

// what one block's product needs besides x
struct Block {
    const uint8_t* w;    // codes
    const float* sc;     // [groups, 16]
    const float* of;     // [groups, 16] or null
    float* y;            // y[0, n0]
    int64_t ldy;
    __mmask16 valid;     // rows of the block that exist
};

struct Rows {
    const uint16_t* x;   // bf16 [M, K]
    const float* xsum;   // [M, groups] or null: sum of each group's (bf16) activations
    int64_t K, group, groups;
};

// the group's additive term: the offset, and 192 * scale taken back off for MAGIC codes
template <int KIND, bool OFF>
inline __m512 group_offset(const Block& b, int64_t g, __m512 s) {
    __m512 o = OFF ? _mm512_loadu_ps(b.of + g * 16) : _mm512_setzero_ps();
    if constexpr (KIND == MAGIC) o = _mm512_fnmadd_ps(_mm512_set1_ps(MAGIC_ZERO), s, o);
    return o;
}

constexpr bool needs_sum(int kind, bool off) { return off || kind == MAGIC; }


// ---- AVX-512 BF16: R <= MR rows, sums in registers; each column pair decoded once per call
template <int R, int KIND, bool OFF>
void avx_block(const Rows& a, const Block& b, __m512i lut) {
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const int64_t pairs = a.group / 2;
    for (int64_t g = 0; g < a.groups; ++g) {
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
            const __m512bh wv = decode<KIND>(b.w + p * pair_bytes(KIND), lut);
            for (int r = 0; r < R; ++r) {
                uint32_t xp;
                std::memcpy(&xp, a.x + r * a.K + 2 * p, 4);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(xp), wv);
            }
        }
        const __m512 s = _mm512_loadu_ps(b.sc + g * 16);
        for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(acc[r], s, tot[r]);
        if constexpr (needs_sum(KIND, OFF)) {
            const __m512 o = group_offset<KIND, OFF>(b, g, s);
            for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * a.groups + g]), o, tot[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]);
}

template <int KIND, bool OFF>
void avx_rows(int64_t M, const Rows& a, const Block& b, __m512i lut) {
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        Rows part = a;
        part.x = a.x + m0 * a.K;
        part.xsum = a.xsum ? a.xsum + m0 * a.groups : nullptr;
        Block out = b;
        out.y = b.y + m0 * b.ldy;
        switch (std::min<int64_t>(MR, M - m0)) {
#define CASE(n) case n: avx_block<n, KIND, OFF>(part, out, lut); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
    }
}

// ---- AMX-BF16: each group's decoded weights (16 rows x group columns) are the B tile, up to 16
// activation rows the A tile, one tdpbf16ps; the group's sums (the C tile) are scaled in zmm.

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

bool amx_ready() {  // Linux hands the AMX tile state to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

// tiles: 0, 3 = C (rows x 16 fp32), 1 = A (rows x group bf16), 2 = B (group / 2 pairs x 16 rows x 2)
inline void amx_config(int rows, int64_t group) {
    TileConfig c;
    c.rows[0] = rows; c.colsb[0] = 64;
    c.rows[3] = rows; c.colsb[3] = 64;
    c.rows[1] = rows; c.colsb[1] = static_cast<uint16_t>(group * 2);
    c.rows[2] = static_cast<uint8_t>(group / 2); c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

// The block's weights, decoded once into wbuf ([K / 2] zmm: pair p's 16 rows x 2 columns, the B
// tiles' layout), then every chunk of up to 16 activation rows multiplies them group by group. Two
// C tiles alternate, so a group's product runs while the previous group's sums are scaled.
template <int KIND>
inline void decode_block(const uint8_t* w, int64_t pairs, __m512i* wbuf, __m512i lut) {
    // the next block's codes (where this thread goes next) are fetched meanwhile: the tile phase
    // that follows reads no weights, so memory would idle through it
    const int64_t bytes = pairs * pair_bytes(KIND);
    for (int64_t p = 0; p < pairs; ++p) {
        if ((p * pair_bytes(KIND)) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + bytes + p * pair_bytes(KIND)), _MM_HINT_T1);
        _mm512_store_si512(wbuf + p, (__m512i)decode<KIND>(w + p * pair_bytes(KIND), lut));
    }
}

template <int R, int KIND, bool OFF>
inline void scale_group(const Rows& a, const Block& b, int64_t g, const float* cbuf, __m512* tot) {
    const __m512 s = _mm512_loadu_ps(b.sc + g * 16);
    for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + r * 16), s, tot[r]);
    if constexpr (needs_sum(KIND, OFF)) {
        const __m512 o = group_offset<KIND, OFF>(b, g, s);
        for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * a.groups + g]), o, tot[r]);
    }
}

// R <= 16 rows of x (a.x points at the chunk's first row), sums in registers, into b.y's rows
template <int R, int KIND, bool OFF>
void amx_chunk(const Rows& a, const Block& b, const __m512i* wbuf) {
    alignas(64) float cbuf[16 * 16];
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const int64_t pairs = a.group / 2;
    for (int64_t g = 0; g < a.groups; ++g) {
        _tile_loadd(1, a.x + g * a.group, a.K * 2);
        _tile_loadd(2, wbuf + g * pairs, 64);
        if (g % 2 == 0) {
            _tile_zero(0);
            _tile_dpbf16ps(0, 1, 2);
            if (g) { _tile_stored(3, cbuf, 64); scale_group<R, KIND, OFF>(a, b, g - 1, cbuf, tot); }
        } else {
            _tile_zero(3);
            _tile_dpbf16ps(3, 1, 2);
            _tile_stored(0, cbuf, 64);
            scale_group<R, KIND, OFF>(a, b, g - 1, cbuf, tot);
        }
    }
    if ((a.groups - 1) % 2 == 0) _tile_stored(0, cbuf, 64);  // tile numbers are immediates
    else _tile_stored(3, cbuf, 64);
    scale_group<R, KIND, OFF>(a, b, a.groups - 1, cbuf, tot);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]);
}

template <int KIND, bool OFF>
void amx_rows(int64_t M, const Rows& a, const Block& b, __m512i lut, __m512i* wbuf) {
    decode_block<KIND>(b.w, a.K / 2, wbuf, lut);
    for (int64_t m0 = 0; m0 < M; m0 += 16) {  // M <= 16 or a multiple of 16
        Rows part = a;
        part.x = a.x + m0 * a.K;
        part.xsum = a.xsum ? a.xsum + m0 * a.groups : nullptr;
        Block out = b;
        out.y = b.y + m0 * b.ldy;
        switch (std::min<int64_t>(16, M - m0)) {
#define CASE(n) case n: amx_chunk<n, KIND, OFF>(part, out, wbuf); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
    }
}

template <int KIND, bool OFF>
void rows(bool amx, int64_t M, const Rows& a, const Block& b, __m512i lut, __m512i* wbuf) {
    if (amx) amx_rows<KIND, OFF>(M, a, b, lut, wbuf);
    else avx_rows<KIND, OFF>(M, a, b, lut);
}

}  // namespace

// x: bf16 [M, K] (on AMX: M <= 16 or a multiple of 16); packed: the codes (layout above, kind 0/1/2
// = NIB/MAGIC/WIDE); scales (and offsets, or an empty tensor): fp32 [N / 16, K / group, 16].
// Returns fp32 [M, N].
torch::Tensor qmm(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t low, torch::Tensor scales,
                  torch::Tensor offsets, int64_t group, int64_t N, bool amx) {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
    const int64_t M = x.size(0), K = x.size(1), blocks = (N + 15) / 16, groups = K / group;
    TORCH_CHECK(group % 2 == 0 && K % group == 0, "K must be a multiple of the (even) group");
    TORCH_CHECK(kind >= NIB && kind <= WIDE, "kind: 0, 1 or 2");
    TORCH_CHECK(scales.numel() == blocks * groups * 16, "scales do not fit [N / 16, K / group, 16]");
    TORCH_CHECK(packed.numel() == blocks * K * (kind == NIB ? 8 : 16), "codes do not fit the blocked layout");
    if (amx) {
        TORCH_CHECK(group == 16 || group == 32, "AMX: groups of 16 or 32 columns");
        TORCH_CHECK(M <= 16 || M % 16 == 0, "AMX: up to 16 rows, or a multiple of 16");
        TORCH_CHECK(amx_ready(), "AMX: the OS refused the tile state (arch_prctl)");
    }
    const bool off = offsets.numel() > 0;
    auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
    if (M == 0 || N == 0) return y;  // a step with no rows for this weight (no logits wanted)
    torch::Tensor xsum;
    if (needs_sum(static_cast<int>(kind), off)) xsum = x.to(torch::kFloat32).view({M, groups, group}).sum(-1).contiguous();
    const Rows a{reinterpret_cast<const uint16_t*>(x.data_ptr()), xsum.defined() ? xsum.data_ptr<float>() : nullptr,
                 K, group, groups};
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());  // uint8 nibbles or int8 codes
    const float* sp = scales.data_ptr<float>();
    const float* op = off ? offsets.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t block_bytes = K * (kind == NIB ? 8 : 16);  // 16 rows x K codes, 4 or 8 bits each
    const __m512i lut = bf16_lut(low);
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        // one block's decoded weights (AMX): K / 2 zmm
        std::unique_ptr<__m512i, decltype(&std::free)> wbuf(
            amx ? static_cast<__m512i*>(std::aligned_alloc(64, K / 2 * sizeof(__m512i))) : nullptr, &std::free);
        if (amx) amx_config(static_cast<int>(std::min<int64_t>(M, 16)), group);
        for (int64_t i = b0; i < b1; ++i) {
            const int64_t valid = std::min<int64_t>(16, N - i * 16);
            const Block b{wp + i * block_bytes, sp + i * groups * 16, off ? op + i * groups * 16 : nullptr, yp + i * 16,
                          N, static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1)};
            switch (kind * 2 + off) {
                case NIB * 2: rows<NIB, false>(amx, M, a, b, lut, wbuf.get()); break;
                case NIB * 2 + 1: rows<NIB, true>(amx, M, a, b, lut, wbuf.get()); break;
                case MAGIC * 2: rows<MAGIC, false>(amx, M, a, b, lut, wbuf.get()); break;
                case MAGIC * 2 + 1: rows<MAGIC, true>(amx, M, a, b, lut, wbuf.get()); break;
                case WIDE * 2: rows<WIDE, false>(amx, M, a, b, lut, wbuf.get()); break;
                default: rows<WIDE, true>(amx, M, a, b, lut, wbuf.get());
            }
        }
        if (amx) _tile_release();
    });
    return y;
}

// The transposed weight W.T [K, N] (fp32: exactly dequantize()'s values, fl(scale * code) + offset;
// or those rounded to bf16, nearest even), for products with many rows on a GEMM library.
torch::Tensor dequant_t(torch::Tensor packed, int64_t kind, int64_t low, torch::Tensor scales, torch::Tensor offsets,
                        int64_t group, int64_t N, int64_t K, bool bf16) {
    const int64_t blocks = (N + 15) / 16, groups = K / group, pairs = group / 2;
    TORCH_CHECK(packed.numel() == blocks * K * (kind == NIB ? 8 : 16), "codes do not fit the blocked layout");
    const bool off = offsets.numel() > 0;
    auto out = torch::empty({K, N}, scales.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
    const float* sp = scales.data_ptr<float>();
    const float* op = off ? offsets.data_ptr<float>() : nullptr;
    char* outp = static_cast<char*>(out.data_ptr());
    const int64_t esize = bf16 ? 2 : 4, block_bytes = K * (kind == NIB ? 8 : 16);
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        const __m512i low_v = _mm512_set1_epi32(static_cast<int>(low)), nib = _mm512_set1_epi32(15);
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t valid = std::min<int64_t>(16, N - b * 16);
            const __mmask16 m = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
            const uint8_t* w = wp + b * block_bytes;
            for (int64_t g = 0; g < groups; ++g) {
                const __m512 s = _mm512_loadu_ps(sp + (b * groups + g) * 16);
                const __m512 o = off ? _mm512_loadu_ps(op + (b * groups + g) * 16) : _mm512_setzero_ps();
                for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
                    __m512 c[2];
                    if (kind == NIB) {
                        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
                        c[0] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_and_si512(d, nib), low_v));
                        c[1] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_srli_epi32(d, 4), low_v));
                    } else {
                        // dword j = row j's (even, odd) codes as int16 words: split by shifts
                        __m512i d = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
                        c[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 16), 16));
                        c[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(d, 16));
                    }
                    for (int h = 0; h < 2; ++h) {
                        __m512 v = _mm512_mul_ps(c[h], s);  // then the offset: two roundings, as dequantize()
                        if (off) v = _mm512_add_ps(v, o);
                        char* dst = outp + ((2 * p + h) * N + b * 16) * esize;
                        if (bf16) _mm256_mask_storeu_epi16(dst, m, (__m256i)_mm512_cvtneps_pbh(v));
                        else _mm512_mask_storeu_ps(reinterpret_cast<float*>(dst), m, v);
                    }
                }
            }
        }
    });
    return out;
}

bool has_amx() { return amx_ready(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("qmm", &qmm, "y = x @ W.T, W GGUF-quantised as codes and per-group scales (AMX-BF16 or AVX-512 BF16)");
    m.def("dequant_t", &dequant_t, "W.T [K, N] as fp32 (exact) or bf16, from the blocked codes and scales");
    m.def("has_amx", &has_amx, "whether this process may use AMX tiles (asks the OS once)");
}
