// y = x @ W.T for a GGUF block-quantised W held as codes and per-group scales/offsets
// (worker/models/llama/quantized.py), on AVX-512 BF16 (vdpbf16ps).
//
// W[n, k] = scale[n, g] * code[n, k] + offset[n, g], g = k / group. The codes are small
// integers, exact in bf16, so with the activations rounded to bf16 each product
// x[m, k] * code[n, k] is exact in fp32, and
//     y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * code[n, k])
//             + offset[n, g] * (sum_{k in g} x[m, k])
// multiplies by the file's weights with fp32 sums.
//
// Layout (built by pack_* below, once at load): rows in blocks of 16 (a zmm's fp32 lanes),
// columns in pairs (vdpbf16ps multiplies bf16 pairs). For each 16-row block and column pair p:
//   4-bit codes: 16 bytes, byte j = (code[n0 + j, 2p] - low) | (code[n0 + j, 2p + 1] - low) << 4;
//   8-bit codes: 32 bytes, 16 of column 2p then 16 of column 2p + 1 (int8).
// Scales and offsets: [N / 16, K / group, 16] fp32. Each 16-row block is one task of a
// parallel_for; a block reads its weights once for up to MR activation rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>

namespace {

constexpr int MR = 8;  // activation rows in registers at once (2 * MR accumulators + 6)

inline __m512i bf16_lut(int64_t low) {
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) {
        float f = static_cast<float>(low + (i & 15));
        uint32_t u;
        std::memcpy(&u, &f, 4);
        t[i] = static_cast<uint16_t>(u >> 16);  // small integers: exact in bf16
    }
    return _mm512_load_si512(t);
}

// 32 bf16 weights of one column pair for 16 rows, from 16 bytes of nibbles
inline __m512bh decode4(const uint8_t* p, __m512i lut, __m512i mask) {
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m512i s = _mm512_slli_epi32(d, 12);
    __m512i idx = _mm512_ternarylogic_epi32(d, s, mask, 0xA8);  // (d | s) & mask
    return (__m512bh)_mm512_permutexvar_epi16(idx, lut);
}

// the same from 32 bytes of int8 codes (16 of the even column, 16 of the odd)
inline __m512bh decode8(const uint8_t* p, __m512i interleave) {
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // words 0-15: a, 16-31: b
    return (__m512bh)_mm512_permutexvar_epi16(interleave, ab);
}

template <int R, bool NIB, bool OFF>
void block_rows(const uint16_t* x, int64_t K, const float* xsum, const uint8_t* w, const float* sc,
                const float* of, int64_t group, float* y, int64_t ldy, int valid, __m512i lut) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    alignas(64) uint16_t il[32];
    for (int j = 0; j < 16; ++j) { il[2 * j] = j; il[2 * j + 1] = 16 + j; }
    const __m512i interleave = _mm512_load_si512(il);
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const int64_t groups = K / group, pairs = group / 2, step = NIB ? 16 : 32;
    for (int64_t g = 0; g < groups; ++g) {
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        const int64_t p0 = g * pairs;
        for (int64_t p = p0; p < p0 + pairs; ++p) {
            __m512bh wv = NIB ? decode4(w + p * step, lut, mask) : decode8(w + p * step, interleave);
            for (int r = 0; r < R; ++r) {
                uint32_t xp;
                std::memcpy(&xp, x + r * K + 2 * p, 4);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(xp), wv);
            }
        }
        const __m512 s = _mm512_loadu_ps(sc + g * 16);
        for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(acc[r], s, tot[r]);
        if constexpr (OFF) {
            const __m512 o = _mm512_loadu_ps(of + g * 16);
            for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), o, tot[r]);
        }
    }
    const __mmask16 m = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, tot[r]);
}

// More than MR rows: each group's weights are decoded once into wbuf (16 zmm at most), then every
// chunk of R rows multiplies them; the running sums live in y (read, added to, written per group).
template <int R, bool OFF>
void chunk_rows(const uint16_t* x, int64_t K, const float* xsum, const __m512bh* wbuf, int64_t p0, int64_t pairs,
                __m512 s, const float* of, int64_t g, int64_t groups, float* y, int64_t ldy, __mmask16 m) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
        for (int r = 0; r < R; ++r) {
            uint32_t xp;
            std::memcpy(&xp, x + r * K + 2 * (p0 + i), 4);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(xp), wbuf[i]);
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 t = g ? _mm512_maskz_loadu_ps(m, y + r * ldy) : _mm512_setzero_ps();
        t = _mm512_fmadd_ps(acc[r], s, t);
        if constexpr (OFF) t = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), _mm512_loadu_ps(of), t);
        _mm512_mask_storeu_ps(y + r * ldy, m, t);
    }
}

template <bool NIB, bool OFF>
void block_tall(int64_t M, const uint16_t* x, int64_t K, const float* xsum, const uint8_t* w, const float* sc,
                const float* of, int64_t group, float* y, int64_t ldy, int valid, __m512i lut) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    alignas(64) uint16_t il[32];
    for (int j = 0; j < 16; ++j) { il[2 * j] = j; il[2 * j + 1] = 16 + j; }
    const __m512i interleave = _mm512_load_si512(il);
    const __mmask16 m = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const int64_t groups = K / group, pairs = group / 2, step = NIB ? 16 : 32;
    __m512bh wbuf[16];
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t p0 = g * pairs;
        for (int64_t i = 0; i < pairs; ++i)
            wbuf[i] = NIB ? decode4(w + (p0 + i) * step, lut, mask) : decode8(w + (p0 + i) * step, interleave);
        const __m512 s = _mm512_loadu_ps(sc + g * 16);
        int64_t m0 = 0;
        for (; m0 + MR <= M; m0 += MR)
            chunk_rows<MR, OFF>(x + m0 * K, K, xsum + (OFF ? m0 * groups : 0), wbuf, p0, pairs, s, of + (OFF ? g * 16 : 0),
                                g, groups, y + m0 * ldy, ldy, m);
        switch (M - m0) {
#define CASE(n) case n: chunk_rows<n, OFF>(x + m0 * K, K, xsum + (OFF ? m0 * groups : 0), wbuf, p0, pairs, s, \
                                           of + (OFF ? g * 16 : 0), g, groups, y + m0 * ldy, ldy, m); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
#undef CASE
            default: break;
        }
    }
}

template <bool NIB, bool OFF>
void run_rows(int64_t M, const uint16_t* x, int64_t K, const float* xsum, const uint8_t* w, const float* sc,
              const float* of, int64_t group, float* y, int64_t ldy, int valid, __m512i lut) {
    switch (M) {
#define CASE(n) case n: block_rows<n, NIB, OFF>(x, K, xsum, w, sc, of, group, y, ldy, valid, lut); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default: block_tall<NIB, OFF>(M, x, K, xsum, w, sc, of, group, y, ldy, valid, lut);
    }
}


// ---- AMX-BF16: each group's decoded weights (16 rows x group columns, the B tile) multiply up to 16
// activation rows (the A tile) in one tdpbf16ps; the group's sums (the C tile) are then scaled in zmm.

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

bool amx_ready() {  // Linux hands AMX state to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

// tiles: 0 = C (rows x 16 fp32), 1 = A (rows x group bf16), 2 = B (group / 2 pairs x 16 rows x 2)
inline void amx_config(int rows, int64_t group) {
    TileConfig c;
    c.rows[0] = rows; c.colsb[0] = 64;
    c.rows[1] = rows; c.colsb[1] = static_cast<uint16_t>(group * 2);
    c.rows[2] = static_cast<uint8_t>(group / 2); c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

template <bool NIB>
inline void decode_group(const uint8_t* w, int64_t p0, int64_t pairs, __m512i* wbuf, __m512i lut, __m512i mask,
                         __m512i interleave) {
    const int64_t step = NIB ? 16 : 32;
    for (int64_t i = 0; i < pairs; ++i)
        _mm512_store_si512(wbuf + i, (__m512i)(NIB ? decode4(w + (p0 + i) * step, lut, mask)
                                                   : decode8(w + (p0 + i) * step, interleave)));
}

// R <= 16 rows, sums in registers
template <int R, bool NIB, bool OFF>
void amx_block(const uint16_t* x, int64_t K, const float* xsum, const uint8_t* w, const float* sc, const float* of,
               int64_t group, float* y, int64_t ldy, int valid, __m512i lut, __m512i interleave) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    alignas(64) __m512i wbuf[16];
    alignas(64) float cbuf[16 * 16];
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const int64_t groups = K / group, pairs = group / 2;
    for (int64_t g = 0; g < groups; ++g) {
        decode_group<NIB>(w, g * pairs, pairs, wbuf, lut, mask, interleave);
        _tile_zero(0);
        _tile_loadd(1, x + g * group, K * 2);
        _tile_loadd(2, wbuf, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, cbuf, 64);
        const __m512 s = _mm512_loadu_ps(sc + g * 16);
        for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + r * 16), s, tot[r]);
        if constexpr (OFF) {
            const __m512 o = _mm512_loadu_ps(of + g * 16);
            for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), o, tot[r]);
        }
    }
    const __mmask16 m = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, tot[r]);
}

// M a multiple of 16 rows (padded): each group's B tile serves every 16-row chunk; sums in y
template <bool NIB, bool OFF>
void amx_tall(int64_t M, const uint16_t* x, int64_t K, const float* xsum, const uint8_t* w, const float* sc,
              const float* of, int64_t group, float* y, int64_t ldy, int valid, __m512i lut, __m512i interleave) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    const __mmask16 m = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    alignas(64) __m512i wbuf[16];
    alignas(64) float cbuf[16 * 16];
    const int64_t groups = K / group, pairs = group / 2;
    for (int64_t g = 0; g < groups; ++g) {
        decode_group<NIB>(w, g * pairs, pairs, wbuf, lut, mask, interleave);
        _tile_loadd(2, wbuf, 64);
        const __m512 s = _mm512_loadu_ps(sc + g * 16);
        const __m512 o = OFF ? _mm512_loadu_ps(of + g * 16) : _mm512_setzero_ps();
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            _tile_zero(0);
            _tile_loadd(1, x + m0 * K + g * group, K * 2);
            _tile_dpbf16ps(0, 1, 2);
            _tile_stored(0, cbuf, 64);
            for (int r = 0; r < 16; ++r) {
                float* yr = y + (m0 + r) * ldy;
                __m512 t = g ? _mm512_maskz_loadu_ps(m, yr) : _mm512_setzero_ps();
                t = _mm512_fmadd_ps(_mm512_load_ps(cbuf + r * 16), s, t);
                if (OFF) t = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(m0 + r) * groups + g]), o, t);
                _mm512_mask_storeu_ps(yr, m, t);
            }
        }
    }
}

template <bool NIB, bool OFF>
void amx_rows(int64_t M, const uint16_t* x, int64_t K, const float* xsum, const uint8_t* w, const float* sc,
              const float* of, int64_t group, float* y, int64_t ldy, int valid, __m512i lut, __m512i il) {
    switch (M) {
#define CASE(n) case n: amx_block<n, NIB, OFF>(x, K, xsum, w, sc, of, group, y, ldy, valid, lut, il); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        default: amx_tall<NIB, OFF>(M, x, K, xsum, w, sc, of, group, y, ldy, valid, lut, il);
    }
}

}  // namespace

// The same product as qmm on AMX-BF16 tiles; x: bf16 [M, K], M <= 16 or a multiple of 16 (pad it).
torch::Tensor qmm_amx(torch::Tensor x, torch::Tensor packed, bool nibbles, int64_t low, torch::Tensor scales,
                      torch::Tensor offsets, int64_t group, int64_t N) {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
    const int64_t M = x.size(0), K = x.size(1), blocks = (N + 15) / 16, groups = K / group;
    TORCH_CHECK(K % group == 0 && (group == 16 || group == 32), "AMX: groups of 16 or 32 columns");
    TORCH_CHECK(M <= 16 || M % 16 == 0, "AMX: up to 16 rows, or a multiple of 16");
    TORCH_CHECK(scales.numel() == blocks * groups * 16, "scales do not fit [N / 16, K / group, 16]");
    TORCH_CHECK(amx_ready(), "AMX: the kernel refused the tile state (arch_prctl)");
    const bool off = offsets.numel() > 0;
    auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
    torch::Tensor xsum;
    if (off) xsum = x.to(torch::kFloat32).view({M, groups, group}).sum(-1).contiguous();
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const float* xs = off ? xsum.data_ptr<float>() : nullptr;
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
    const float* sp = scales.data_ptr<float>();
    const float* op = off ? offsets.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t block_bytes = nibbles ? K * 8 : K * 16;
    const __m512i lut = bf16_lut(low);
    alignas(64) uint16_t il[32];
    for (int j = 0; j < 16; ++j) { il[2 * j] = j; il[2 * j + 1] = 16 + j; }
    const __m512i interleave = _mm512_load_si512(il);
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        amx_config(static_cast<int>(std::min<int64_t>(M, 16)), group);
        for (int64_t b = b0; b < b1; ++b) {
            const int valid = static_cast<int>(std::min<int64_t>(16, N - b * 16));
            const uint8_t* w = wp + b * block_bytes;
            const float* s = sp + b * groups * 16;
            const float* o = off ? op + b * groups * 16 : nullptr;
            float* yb = yp + b * 16;
            if (nibbles) {
                if (off) amx_rows<true, true>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut, interleave);
                else amx_rows<true, false>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut, interleave);
            } else {
                if (off) amx_rows<false, true>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut, interleave);
                else amx_rows<false, false>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut, interleave);
            }
        }
        _tile_release();
    });
    return y;
}

bool has_amx() { return amx_ready(); }

namespace {
}  // namespace

// x: bf16 [M, K]; packed: uint8 (layout above); scales (and offsets, or an empty tensor): fp32
// [N / 16, K / group, 16]; returns fp32 [M, N].
torch::Tensor qmm(torch::Tensor x, torch::Tensor packed, bool nibbles, int64_t low, torch::Tensor scales,
                  torch::Tensor offsets, int64_t group, int64_t N) {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
    const int64_t M = x.size(0), K = x.size(1), blocks = (N + 15) / 16, groups = K / group;
    TORCH_CHECK(K % group == 0 && group % 2 == 0, "K must be a multiple of the (even) group");
    TORCH_CHECK(scales.numel() == blocks * groups * 16, "scales do not fit [N / 16, K / group, 16]");
    const bool off = offsets.numel() > 0;
    auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
    torch::Tensor xsum;
    if (off) xsum = x.to(torch::kFloat32).view({M, groups, group}).sum(-1).contiguous();
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const float* xs = off ? xsum.data_ptr<float>() : nullptr;
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());  // uint8 nibbles or int8 codes
    const float* sp = scales.data_ptr<float>();
    const float* op = off ? offsets.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t block_bytes = nibbles ? K * 8 : K * 16;  // 16 rows x K codes, 4 or 8 bits each
    const __m512i lut = bf16_lut(low);
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const int valid = static_cast<int>(std::min<int64_t>(16, N - b * 16));
            const uint8_t* w = wp + b * block_bytes;
            const float* s = sp + b * groups * 16;
            const float* o = off ? op + b * groups * 16 : nullptr;
            float* yb = yp + b * 16;
            if (nibbles) {
                if (off) run_rows<true, true>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut);
                else run_rows<true, false>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut);
            } else {
                if (off) run_rows<false, true>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut);
                else run_rows<false, false>(M, xp, K, xs, w, s, o, group, yb, N, valid, lut);
            }
        }
    });
    return y;
}

// The transposed weight W.T [K, N] (fp32: exactly dequantize()'s values, fl(scale * code) + offset;
// or those rounded to bf16, nearest even), for products with many rows on a GEMM library.
torch::Tensor dequant_t(torch::Tensor packed, bool nibbles, int64_t low, torch::Tensor scales, torch::Tensor offsets,
                        int64_t group, int64_t N, int64_t K, bool bf16) {
    const int64_t blocks = (N + 15) / 16, groups = K / group, pairs = group / 2;
    const bool off = offsets.numel() > 0;
    auto out = torch::empty({K, N}, packed.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
    const float* sp = scales.data_ptr<float>();
    const float* op = off ? offsets.data_ptr<float>() : nullptr;
    char* outp = static_cast<char*>(out.data_ptr());
    const int64_t esize = bf16 ? 2 : 4, block_bytes = nibbles ? K * 8 : K * 16;
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        const __m512i low_v = _mm512_set1_epi32(static_cast<int>(low)), nib = _mm512_set1_epi32(15);
        for (int64_t b = b0; b < b1; ++b) {
            const int valid = static_cast<int>(std::min<int64_t>(16, N - b * 16));
            const __mmask16 m = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
            const uint8_t* w = wp + b * block_bytes;
            for (int64_t g = 0; g < groups; ++g) {
                const __m512 s = _mm512_loadu_ps(sp + (b * groups + g) * 16);
                const __m512 o = off ? _mm512_loadu_ps(op + (b * groups + g) * 16) : _mm512_setzero_ps();
                for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
                    __m512 c[2];
                    if (nibbles) {
                        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
                        c[0] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_and_si512(d, nib), low_v));
                        c[1] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_srli_epi32(d, 4), low_v));
                    } else {
                        for (int h = 0; h < 2; ++h)
                            c[h] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 32 + h * 16))));
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("qmm", &qmm, "y = x @ W.T, W GGUF-quantised as codes and per-group scales (AVX-512 BF16)");
    m.def("qmm_amx", &qmm_amx, "qmm on AMX-BF16 tiles (M <= 16 or a multiple of 16)");
    m.def("has_amx", &has_amx, "whether this process may use AMX tiles");
    m.def("dequant_t", &dequant_t, "W.T [K, N] as fp32 (exact) or bf16, from the blocked codes and scales");
}
