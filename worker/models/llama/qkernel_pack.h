// The blocked layout's code kinds, packing (qkernel.py's blocked(), pack_six) and GGUF loading
// (unpack_blocked), shared by the AVX-512 product (qkernel.cpp, whose header comment describes the
// layout) and the AVX2 one (qkernel_avx2.cpp). Portable x86-64: SSE2 transposes; row_form's 64-code
// loops where the file is compiled for AVX-512 BW, its scalar loop otherwise (the same bytes).
//
// SS_QUAD_LAYOUT (defined by qkernel_avx2.cpp before including this): NIB, MAGIC and WIDE codes are
// laid out with rows as dwords instead, the quad layout (qkernel.py's quad_layout()): per 4 bytes of a
// row's per-row form (NIB: 8 columns' nibble pairs; MAGIC: 4 columns' u = code - low, WIDE: their
// codes, in column order) 64 bytes, row j's 4 bytes at 4 * j, so that two 32-byte loads are the
// quads of rows 0-7 and 8-15 that vpmaddubsw takes (NIB: after an AND, or a shift and an AND; MAGIC:
// as they lie) where the column-pair layout takes a 4 x 16 transpose a quad. [N / 16, K / 8, 16, 4]
// bytes (NIB) or [N / 16, K / 4, 16, 4] int8 (MAGIC, WIDE): a block's bytes, in another order.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

enum Kind { NIB = 0, MAGIC = 1, WIDE = 2, SIX = 3 };

// bytes of a 16-row block's codes per column: 4, 6 or 8 bits a code
constexpr int64_t column_bytes(int64_t kind) { return kind == NIB ? 8 : kind == SIX ? 12 : 16; }

// a per-group factor of one 16-row block: value[g] = fp32(d[g >> shift]) * fp32(q[g]), 16 lanes
struct Factor {
    const uint16_t* d;   // fp16 [groups >> shift, 16]
    const uint8_t* q;    // [groups, 16] uint8 or int8, or null (value = d)
    int shift;
    bool q_signed;
};

// a layer's factor (quantized.py's GroupScales in the blocked layout): d fp16 [N / 16, groups >> shift, 16],
// q (u)int8 [N / 16, groups, 16] or empty; of_block(i) is block i's Factor
struct Factors {
    const uint16_t* d = nullptr;
    const uint8_t* q = nullptr;
    int shift = 0;
    bool q_signed = false;
    int64_t groups = 0;
    Factor of_block(int64_t i) const {
        if (!d) return Factor{nullptr, nullptr, 0, false};
        return Factor{d + i * (groups >> shift) * 16, q ? q + i * groups * 16 : nullptr, shift, q_signed};
    }
};

Factors factors(const torch::Tensor& d, const torch::Tensor& q, int64_t shift, int64_t blocks, int64_t groups,
                const char* what) {
    Factors f;
    if (d.numel() == 0) return f;  // no offsets
    TORCH_CHECK(shift >= 0 && shift < 16 && groups % (int64_t{1} << shift) == 0, what, ": groups per d must divide the groups");
    TORCH_CHECK(d.scalar_type() == torch::kHalf && d.is_contiguous() && d.numel() == blocks * (groups >> shift) * 16,
                what, ": d must be contiguous fp16 [N / 16, groups >> shift, 16]");
    f.d = reinterpret_cast<const uint16_t*>(d.data_ptr());
    if (q.numel()) {
        TORCH_CHECK((q.scalar_type() == torch::kByte || q.scalar_type() == torch::kChar) && q.is_contiguous() &&
                    q.numel() == blocks * groups * 16, what, ": q must be contiguous (u)int8 [N / 16, groups, 16]");
        f.q = static_cast<const uint8_t*>(q.data_ptr());
        f.q_signed = q.scalar_type() == torch::kChar;
    }
    f.shift = static_cast<int>(shift);
    f.groups = groups;
    return f;
}

}  // namespace

// ---- Packing: int8 codes, row-major, into the layout above (at load: qkernel.py's blocked(),
// gguf_blocks.stored_weight). A 16-row block's rows are first put in the kind's per-row form
// (NIB: a byte per column pair; SIX: three bytes per 4 columns; MAGIC, WIDE: the even columns'
// codes, then the odd ones'), then transposed 16 x 16 bytes at a time (SSE2 unpacks), so every step
// runs on whole vectors. In the quad layout (SS_QUAD_LAYOUT) MAGIC's and WIDE's rows are in column
// order, MAGIC's as u = code - low, and a block is 4 x 4 dword transposes of them.
namespace {

// bytes a row takes in kind's per-row form, per K columns
constexpr int64_t row_bytes_of(int64_t kind, int64_t K) { return kind == NIB ? K / 2 : kind == SIX ? 3 * K / 4 : K; }

// Row c (int8 codes [K]) in kind's per-row form at r. NIB: byte p = u(2p) | u(2p + 1) << 4. SIX:
// per 4 columns q, bytes q, K / 4 + q and K / 2 + q: u0 | u1 << 4 and u2 | u3 << 4 of the low
// nibbles, and the four high bit pairs (qkernel.py's blocked()). u = (code - low) & 63 (& 15 for
// NIB), as pack_six always computed it. MAGIC, WIDE: the even columns' codes, then the odd ones'
// (SS_QUAD_LAYOUT: in column order, MAGIC's as u = code - low).
void row_form(int64_t kind, const int8_t* c, int64_t K, int64_t low, uint8_t* r) {
    int64_t k = 0;
#ifdef SS_QUAD_LAYOUT
    if (kind == WIDE) {  // the codes in column order
        std::memcpy(r, c, K);
        return;
    }
    if (kind == MAGIC) {  // u = code - low in column order (0 .. 127: MAGIC's codes lie in [-64, 63])
        for (int64_t j = 0; j < K; ++j) r[j] = static_cast<uint8_t>(c[j] - low);
        return;
    }
#endif
    if (kind == MAGIC || kind == WIDE) {
#if defined(__AVX512BW__)
        for (; k + 64 <= K; k += 64) {  // 64 codes as 16-bit lanes (even | odd << 8): each byte apart
            const __m512i v = _mm512_loadu_si512(c + k);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + k / 2), _mm512_cvtepi16_epi8(v));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + K / 2 + k / 2), _mm512_cvtepi16_epi8(_mm512_srli_epi16(v, 8)));
        }
#elif defined(__AVX2__)
        const __m256i byte = _mm256_set1_epi16(0x00FF);
        for (; k + 64 <= K; k += 64) {  // the same on 2 x 32 codes: packus per 128-bit lane, then the lanes in order
            const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k));
            const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k + 32));
            const __m256i even = _mm256_packus_epi16(_mm256_and_si256(v0, byte), _mm256_and_si256(v1, byte));
            const __m256i odd = _mm256_packus_epi16(_mm256_srli_epi16(v0, 8), _mm256_srli_epi16(v1, 8));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + k / 2), _mm256_permute4x64_epi64(even, 0xD8));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + K / 2 + k / 2), _mm256_permute4x64_epi64(odd, 0xD8));
        }
#endif
        for (; k < K; k += 2) { r[k / 2] = static_cast<uint8_t>(c[k]); r[K / 2 + k / 2] = static_cast<uint8_t>(c[k + 1]); }
        return;
    }
#if defined(__AVX512BW__)
    const __m512i lowv = _mm512_set1_epi8(static_cast<char>(low)), six = _mm512_set1_epi8(63);
#endif
    if (kind == NIB) {
#if defined(__AVX512BW__)
        for (; k + 64 <= K; k += 64) {  // 64 codes -> 32 bytes, as 16-bit lanes (even | odd << 8)
            const __m512i u = _mm512_sub_epi8(_mm512_loadu_si512(c + k), lowv);
            const __m512i w = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi16(0x000F)),
                                              _mm512_and_si512(_mm512_srli_epi16(u, 4), _mm512_set1_epi16(0x00F0)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + k / 2), _mm512_cvtepi16_epi8(w));
        }
#elif defined(__AVX2__)
        const __m256i lowv = _mm256_set1_epi8(static_cast<char>(low));
        for (; k + 64 <= K; k += 64) {  // the same on 2 x 32 codes (packus per 128-bit lane, then the lanes in order)
            __m256i w[2];
            for (int h = 0; h < 2; ++h) {
                const __m256i u = _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k + 32 * h)), lowv);
                w[h] = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi16(0x000F)),
                                       _mm256_and_si256(_mm256_srli_epi16(u, 4), _mm256_set1_epi16(0x00F0)));
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + k / 2), _mm256_permute4x64_epi64(_mm256_packus_epi16(w[0], w[1]), 0xD8));
        }
#endif
        for (; k < K; k += 2) r[k / 2] = static_cast<uint8_t>(((c[k] - low) & 15) | ((c[k + 1] - low) & 15) << 4);
        return;
    }
    const int64_t q4 = K / 4;  // SIX: 64 codes (16 units of 4) at a time, as 32-bit lanes u0 | u1 << 8 | ...
#if defined(__AVX512BW__)
    for (; k + 64 <= K; k += 64) {
        const __m512i x = _mm512_and_si512(_mm512_sub_epi8(_mm512_loadu_si512(c + k), lowv), six);
        const auto bits = [&](int shift, int mask) {
            return _mm512_and_si512(_mm512_srli_epi32(x, shift), _mm512_set1_epi32(mask));
        };
        const __m512i lo01 = _mm512_or_si512(bits(0, 0x0F), bits(4, 0xF0));
        const __m512i lo23 = _mm512_or_si512(bits(16, 0x0F), bits(20, 0xF0));
        const __m512i hi = _mm512_or_si512(_mm512_or_si512(bits(4, 0x03), bits(10, 0x0C)),
                                           _mm512_or_si512(bits(16, 0x30), bits(22, 0xC0)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r + k / 4), _mm512_cvtepi32_epi8(lo01));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r + q4 + k / 4), _mm512_cvtepi32_epi8(lo23));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r + 2 * q4 + k / 4), _mm512_cvtepi32_epi8(hi));
    }
#endif
    for (; k < K; k += 4) {
        uint8_t u[4];
        for (int t = 0; t < 4; ++t) u[t] = static_cast<uint8_t>((c[k + t] - low) & 63);
        r[k / 4] = static_cast<uint8_t>((u[0] & 15) | (u[1] & 15) << 4);
        r[q4 + k / 4] = static_cast<uint8_t>((u[2] & 15) | (u[3] & 15) << 4);
        r[2 * q4 + k / 4] = static_cast<uint8_t>((u[0] >> 4) | (u[1] >> 4) << 2 | (u[2] >> 4) << 4 | (u[3] >> 4) << 6);
    }
}

// Column p of 16 rows (bytes p of rows + j * ld, j < 16) -> the 16 bytes at out + p * out_ld, for
// p < width: four rounds of unpacks transpose 16 x 16 bytes (register i then holds column
// bit-reverse(i) of its 16), the last columns one by one.
void transpose16(const uint8_t* rows, int64_t ld, int64_t width, uint8_t* out, int64_t out_ld) {
    static constexpr int REV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    int64_t p = 0;
    for (; p + 16 <= width; p += 16) {
        __m128i a[16], b[16];
        for (int j = 0; j < 16; ++j) a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + j * ld + p));
        for (int i = 0; i < 8; ++i) { b[i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]); b[i + 8] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]); }
        for (int i = 0; i < 8; ++i) { a[i] = _mm_unpacklo_epi16(b[2 * i], b[2 * i + 1]); a[i + 8] = _mm_unpackhi_epi16(b[2 * i], b[2 * i + 1]); }
        for (int i = 0; i < 8; ++i) { b[i] = _mm_unpacklo_epi32(a[2 * i], a[2 * i + 1]); b[i + 8] = _mm_unpackhi_epi32(a[2 * i], a[2 * i + 1]); }
        for (int i = 0; i < 8; ++i) { a[i] = _mm_unpacklo_epi64(b[2 * i], b[2 * i + 1]); a[i + 8] = _mm_unpackhi_epi64(b[2 * i], b[2 * i + 1]); }
        for (int i = 0; i < 16; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (p + REV[i]) * out_ld), a[i]);
    }
    for (; p < width; ++p)
        for (int j = 0; j < 16; ++j) out[p * out_ld + j] = rows[j * ld + p];
}

// One 16-row block's codes in kind's layout, from its rows' per-row forms (row j at rows + j * W,
// W = row_bytes_of(kind, K); a row past N all zero bytes: u = 0 for NIB and SIX (and MAGIC in the
// quad layout), code 0 for WIDE (and MAGIC in the column-pair layout), as blocked() pads).
void pack_block(int64_t kind, const uint8_t* rows, int64_t K, uint8_t* out) {
#ifdef SS_QUAD_LAYOUT
    if (kind != SIX) {  // per 4 bytes of the per-row form 64: rows 0-3, 4-7, 8-11, 12-15 as 4 x 4 dword transposes
        const int64_t W = row_bytes_of(kind, K), units = W / 4;
        int64_t u = 0;
        for (; u + 4 <= units; u += 4)
            for (int j = 0; j < 16; j += 4) {
                const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + j * W + 4 * u)),
                              b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + (j + 1) * W + 4 * u)),
                              c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + (j + 2) * W + 4 * u)),
                              d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + (j + 3) * W + 4 * u));
                const __m128i ab0 = _mm_unpacklo_epi32(a, b), ab1 = _mm_unpackhi_epi32(a, b);
                const __m128i cd0 = _mm_unpacklo_epi32(c, d), cd1 = _mm_unpackhi_epi32(c, d);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(out + u * 64 + 4 * j), _mm_unpacklo_epi64(ab0, cd0));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (u + 1) * 64 + 4 * j), _mm_unpackhi_epi64(ab0, cd0));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (u + 2) * 64 + 4 * j), _mm_unpacklo_epi64(ab1, cd1));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (u + 3) * 64 + 4 * j), _mm_unpackhi_epi64(ab1, cd1));
            }
        for (; u < units; ++u)
            for (int j = 0; j < 16; ++j) std::memcpy(out + u * 64 + 4 * j, rows + j * W + 4 * u, 4);
        return;
    }
#endif
    if (kind == NIB) {
        transpose16(rows, K / 2, K / 2, out, 16);
    } else if (kind == SIX) {  // per 4 columns 48 bytes: the three per-row parts' columns side by side
        for (int part = 0; part < 3; ++part) transpose16(rows + part * (K / 4), 3 * K / 4, K / 4, out + part * 16, 48);
    } else {  // per column pair 32 bytes: the even columns' 16 bytes and the odd ones', then interleaved
        transpose16(rows, K, K / 2, out, 32);
        transpose16(rows + K / 2, K, K / 2, out + 16, 32);
        for (int64_t p = 0; p < K / 2; ++p) {
            __m128i* unit = reinterpret_cast<__m128i*>(out + p * 32);
            const __m128i even = _mm_loadu_si128(unit), odd = _mm_loadu_si128(unit + 1);
            _mm_storeu_si128(unit, _mm_unpacklo_epi8(even, odd));
            _mm_storeu_si128(unit + 1, _mm_unpackhi_epi8(even, odd));
        }
    }
}

}  // namespace

// int8 codes [N, K] (row-major, contiguous) -> the SIX layout [ceil(N / 16), K / 4, 48] bytes of
// u = code - low (rows past N: u = 0). One pass, parallel over 16-row blocks.
torch::Tensor pack_six(torch::Tensor codes, int64_t low) {
    TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.dim() == 2 && codes.is_contiguous(),
                "codes: contiguous int8 [N, K]");
    const int64_t N = codes.size(0), K = codes.size(1), blocks = (N + 15) / 16, W = row_bytes_of(SIX, K);
    TORCH_CHECK(K % 4 == 0, "SIX: K must be a multiple of 4");
    auto out = torch::empty({blocks, K / 4, 48}, codes.options().dtype(torch::kByte));
    const int8_t* src = codes.data_ptr<int8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
        std::vector<uint8_t> rows(16 * W);
        for (int64_t b = b0; b < b1; ++b) {
            for (int j = 0; j < 16; ++j) {
                if (b * 16 + j < N) row_form(SIX, src + (b * 16 + j) * K, K, low, rows.data() + j * W);
                else std::memset(rows.data() + j * W, 0, W);
            }
            pack_block(SIX, rows.data(), K, dst + b * K / 4 * 48);
        }
    });
    return out;
}

// ---- Loading: a GGUF tensor's stored blocks straight into the layout above (gguf_blocks.stored_weight)
//
// The formats in gguf_blocks.FORMATS's order, their bit layouts as the gguf package's quants.py
// reads them (llama.cpp's ggml-quants.c reference), and gguf_blocks.py's numbers: per block,
// codes (the file's q minus the format's zero), an fp16 d (and Q4_1/Q5_1's m, the K formats'
// dmin, stored here negated: -dmin is the offsets' d) and the K formats' sub-block scale (and
// min) per group. That unpack() (numpy) and this give the same tensors is tested per format.
namespace {

enum Format { Q4_0 = 0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };
struct Spec { int64_t cols, bytes, group; };  // columns and bytes per block, columns per group
constexpr Spec SPECS[] = {{32, 18, 32}, {32, 20, 32}, {32, 22, 32}, {32, 24, 32}, {32, 34, 32},
                          {256, 144, 32}, {256, 176, 32}, {256, 210, 16}};

inline uint16_t u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// where one row's factors go: its lane of the blocked [.., 16] tensors (stride 16), null if absent
struct Lanes { uint16_t* sd; uint8_t* sq; uint16_t* od; uint8_t* oq; };

// Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes s (gguf's
// Q4_K.get_scale_min, llama.cpp's get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4; *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4; }
}

// One row of K columns of format FMT: its codes into c[K], its factors into its lanes.
template <int FMT>
void decode_row(const uint8_t* src, int64_t K, int8_t* c, const Lanes& o) {
    constexpr Spec sp = SPECS[FMT];
    for (int64_t i = 0; i < K / sp.cols; ++i, src += sp.bytes, c += sp.cols) {
        const uint8_t* b = src;
        if constexpr (FMT == Q4_0 || FMT == Q4_1) {  // d (m), 16 bytes: column t low nibble, t + 16 high
            const uint8_t* qs = b + (FMT == Q4_0 ? 2 : 4);
            constexpr int z = FMT == Q4_0 ? 8 : 0;
            for (int t = 0; t < 16; ++t) { c[t] = (qs[t] & 15) - z; c[t + 16] = (qs[t] >> 4) - z; }
            o.sd[i * 16] = u16(b);
            if constexpr (FMT == Q4_1) o.od[i * 16] = u16(b + 2);
        } else if constexpr (FMT == Q5_0 || FMT == Q5_1) {  // d (m), 32 bits: column t's fifth bit, nibbles as Q4_0's
            constexpr int64_t at = FMT == Q5_0 ? 2 : 4;
            uint32_t qh;
            std::memcpy(&qh, b + at, 4);  // little-endian, as x86 and the file
            const uint8_t* qs = b + at + 4;
            constexpr int z = FMT == Q5_0 ? 16 : 0;
            for (int t = 0; t < 16; ++t) {
                c[t] = ((qs[t] & 15) | ((qh >> t) & 1) << 4) - z;
                c[t + 16] = ((qs[t] >> 4) | ((qh >> (t + 16)) & 1) << 4) - z;
            }
            o.sd[i * 16] = u16(b);
            if constexpr (FMT == Q5_1) o.od[i * 16] = u16(b + 2);
        } else if constexpr (FMT == Q8_0) {
            std::memcpy(c, b + 2, 32);
            o.sd[i * 16] = u16(b);
        } else if constexpr (FMT == Q4_K || FMT == Q5_K) {  // d, dmin, 12 bytes of scales and mins, (Q5_K: 32 of fifth bits,) 128 of nibbles
            const uint8_t* qh = b + 16;
            const uint8_t* qs = b + (FMT == Q4_K ? 16 : 48);
            for (int r = 0; r < 4; ++r)  // per 64 columns: 32 low nibbles, then the 32 high ones
                for (int t = 0; t < 32; ++t) {
                    int lo = qs[r * 32 + t] & 15, hi = qs[r * 32 + t] >> 4;
                    if constexpr (FMT == Q5_K) { lo |= ((qh[t] >> (2 * r)) & 1) << 4; hi |= ((qh[t] >> (2 * r + 1)) & 1) << 4; }
                    c[r * 64 + t] = static_cast<int8_t>(lo);
                    c[r * 64 + 32 + t] = static_cast<int8_t>(hi);
                }
            o.sd[i * 16] = u16(b);
            o.od[i * 16] = u16(b + 2) ^ 0x8000;  // -dmin: the sign bit, as numpy negates fp16
            for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, o.sq + (i * 8 + j) * 16, o.oq + (i * 8 + j) * 16);
        } else {  // Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
            const uint8_t* ql = b;
            const uint8_t* qh = b + 128;
            for (int h = 0; h < 2; ++h)  // per 128 columns, as llama.cpp's dequantize_row_q6_K
                for (int t = 0; t < 32; ++t) {
                    const int x = qh[h * 32 + t], l0 = ql[h * 64 + t], l1 = ql[h * 64 + t + 32];
                    int8_t* q = c + h * 128 + t;
                    q[0] = static_cast<int8_t>(((l0 & 15) | (x & 3) << 4) - 32);
                    q[32] = static_cast<int8_t>(((l1 & 15) | (x >> 2 & 3) << 4) - 32);
                    q[64] = static_cast<int8_t>(((l0 >> 4) | (x >> 4 & 3) << 4) - 32);
                    q[96] = static_cast<int8_t>(((l1 >> 4) | (x >> 6 & 3) << 4) - 32);
                }
            for (int g = 0; g < 16; ++g) o.sq[(i * 16 + g) * 16] = b[192 + g];
            o.sd[i * 16] = u16(b + 208);
        }
    }
}

using DecodeRow = void (*)(const uint8_t*, int64_t, int8_t*, const Lanes&);
constexpr DecodeRow DECODERS[] = {decode_row<Q4_0>, decode_row<Q4_1>, decode_row<Q5_0>, decode_row<Q5_1>,
                                  decode_row<Q8_0>, decode_row<Q4_K>, decode_row<Q5_K>, decode_row<Q6_K>};

// a blocked factor tensor: its bytes, entries per row lane, bytes per entry
struct FactorOut {
    uint8_t* p;
    int64_t per, size;
    uint8_t* lane(int64_t b, int j) const { return p ? p + (b * per * 16 + j) * size : nullptr; }
    void zero_lane(int64_t b, int j) const { for (int64_t i = 0; p && i < per; ++i) std::memset(lane(b, j) + i * 16 * size, 0, size); }
};

FactorOut factor_out(const torch::Tensor& t, int64_t per) {
    return FactorOut{t.numel() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr, per, t.element_size()};
}

}  // namespace

// parts: the stored rows of one or more GGUF tensors of format fmt (a Format) and one width, each
// uint8 [N_i, row_bytes] (read where they lie, e.g. in the mapped file; every part but the last
// whole 16-row blocks), read as one tensor of their rows stacked (the runner fuses q/k/v and
// gate/up: a part is then a slice of whole blocks) into kind's layout with u = code - low (NIB,
// SIX; MAGIC too in the quad layout). Returns (packed, sd, sq, od, oq, ranges): the codes as
// blocked() lays them out, the scales' and offsets' factors as blocked_groups() does (fp16 d
// [N / 16, K / cols, 16]; sq, oq [N / 16, K / group, 16]; empty where the format has none; rows
// past N zero), and each part's (lowest, highest) code (the caller reads a part again where that
// disagrees with kind and low).
// One pass over the bytes, 16 rows at a time (at::parallel_for over 16-row blocks), without the GIL.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, std::vector<std::pair<int64_t, int64_t>>>
unpack_blocked(std::vector<py::buffer> parts, int64_t fmt, int64_t kind, int64_t low) {
    TORCH_CHECK(fmt >= Q4_0 && fmt <= Q6_K, "fmt: 0 .. 7 (gguf_blocks.FORMATS)");
    TORCH_CHECK(kind >= NIB && kind <= SIX, "kind: 0, 1, 2 or 3");
    TORCH_CHECK(!parts.empty(), "parts: at least one");
    const Spec sp = SPECS[fmt];
    std::vector<const uint8_t*> srcs;
    std::vector<int64_t> first_block{0}, first_row{0};  // per part, and past the last
    int64_t stride = -1;
    for (py::buffer& part : parts) {
        const py::buffer_info info = part.request();
        TORCH_CHECK(info.ndim == 2 && info.itemsize == 1 && info.strides[1] == 1 && info.strides[0] == info.shape[1] &&
                    info.shape[1] % sp.bytes == 0 && (stride < 0 || info.shape[1] == stride),
                    "parts: contiguous uint8 [N, row_bytes] of whole blocks, one row_bytes");
        TORCH_CHECK(first_row.back() % 16 == 0, "parts: all but the last of whole 16-row blocks");
        stride = info.shape[1];
        srcs.push_back(static_cast<const uint8_t*>(info.ptr));
        first_row.push_back(first_row.back() + info.shape[0]);
        first_block.push_back((first_row.back() + 15) / 16);
    }
    const int64_t N = first_row.back(), K = stride / sp.bytes * sp.cols, blocks = first_block.back();
    TORCH_CHECK(K % 4 == 0 || kind != SIX, "SIX: K must be a multiple of 4");
    const int64_t dn = K / sp.cols, gn = K / sp.group, W = row_bytes_of(kind, K);
    const bool k_fmt = fmt >= Q4_K, offsets = fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K;
    auto bytes = torch::TensorOptions().dtype(torch::kByte);
    auto half = torch::TensorOptions().dtype(torch::kHalf);
#ifdef SS_QUAD_LAYOUT
    TORCH_CHECK(kind == SIX || K % 8 == 0, "the quad layout: K must be a multiple of 8");
    torch::Tensor packed = kind == NIB ? torch::empty({blocks, K / 8, 16, 4}, bytes)
                         : kind == SIX ? torch::empty({blocks, K / 4, 48}, bytes)
                         : torch::empty({blocks, K / 4, 16, 4}, bytes.dtype(torch::kChar));
#else
    torch::Tensor packed = kind == NIB ? torch::empty({blocks, K / 2, 16}, bytes)
                         : kind == SIX ? torch::empty({blocks, K / 4, 48}, bytes)
                         : torch::empty({blocks, K / 2, 16, 2}, bytes.dtype(torch::kChar));
#endif
    torch::Tensor sd = torch::empty({blocks, dn, 16}, half), none = torch::empty({0}, bytes);
    torch::Tensor sq = k_fmt ? torch::empty({blocks, gn, 16}, bytes.dtype(fmt == Q6_K ? torch::kChar : torch::kByte)) : none;
    torch::Tensor od = offsets ? torch::empty({blocks, dn, 16}, half) : none;
    torch::Tensor oq = offsets && k_fmt ? torch::empty({blocks, gn, 16}, bytes) : none;
    const FactorOut fo[4] = {factor_out(sd, dn), factor_out(sq, gn), factor_out(od, dn), factor_out(oq, gn)};
    std::vector<int> lows(blocks, 127), highs(blocks, -128);
    uint8_t* out = static_cast<uint8_t*>(packed.data_ptr());
    const DecodeRow decode = DECODERS[fmt];
    {
        // torch's threads: on 2 idle cores 0.23 s for the 1.5B's tensors against 0.40 s on one
        // (on a machine loaded past its cores, 1.3-2.0 s against 0.7 s: the threads wait on each other)
        py::gil_scoped_release unlocked;
        at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
            std::vector<int8_t> codes(K);
            std::vector<uint8_t> rows(16 * W);
            for (int64_t b = b0; b < b1; ++b) {
                const size_t part = std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin() - 1;
                int8_t lo = 127, hi = -128;
                for (int j = 0; j < 16; ++j) {
                    const int64_t row = b * 16 + j - first_row[part];  // in its part
                    if (row >= first_row[part + 1] - first_row[part]) {  // padding: zero codes (u = 0) and factors
                        std::memset(rows.data() + j * W, 0, W);
                        for (const FactorOut& f : fo) f.zero_lane(b, j);
                        continue;
                    }
                    decode(srcs[part] + row * stride, K, codes.data(),
                           Lanes{reinterpret_cast<uint16_t*>(fo[0].lane(b, j)), fo[1].lane(b, j),
                                 reinterpret_cast<uint16_t*>(fo[2].lane(b, j)), fo[3].lane(b, j)});
                    for (int64_t k = 0; k < K; ++k) { lo = std::min(lo, codes[k]); hi = std::max(hi, codes[k]); }
                    row_form(kind, codes.data(), K, low, rows.data() + j * W);
                }
                lows[b] = lo;
                highs[b] = hi;
                pack_block(kind, rows.data(), K, out + b * K * column_bytes(kind));
            }
        });
    }
    std::vector<std::pair<int64_t, int64_t>> ranges;  // (0, 0) for a part of no rows, as QuantizedWeight's
    for (size_t i = 0; i < parts.size(); ++i) {
        const auto b0 = lows.begin() + first_block[i], b1 = lows.begin() + first_block[i + 1];
        const bool rows = first_block[i + 1] > first_block[i];
        ranges.emplace_back(rows ? *std::min_element(b0, b1) : 0,
                            rows ? *std::max_element(highs.begin() + first_block[i], highs.begin() + first_block[i + 1]) : 0);
    }
    return {packed, sd, sq, od, oq, ranges};
}
