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
// Scales and offsets are held as the file holds them (quantized.py's GroupScales) and formed
// per group here: value[n, g] = fp32(d[n, g >> shift]) * fp32(q[n, g]), d fp16 (one per 2^shift
// groups: a K format's super-block d or dmin, or Q4_0's d per group with shift 0) and q the
// sub-block's uint8 / int8 scale or min (absent: 1). An fp16 (11 significant bits) times an
// integer of at most 8 bits is exact in fp32, so value is the fp32 number gguf.dequantize forms.
//
// Layout (qkernel.py's blocked(), once at load): rows in blocks of 16 (a zmm's fp32 lanes),
// columns in pairs (both products take bf16 pairs). For each 16-row block and column pair p:
//   NIB (4-bit codes): 16 bytes, byte j = (code[n0+j, 2p] - low) | (code[n0+j, 2p+1] - low) << 4;
//   MAGIC, WIDE (int8 codes): 32 bytes, code[n0+j, 2p] then code[n0+j, 2p+1] for j = 0..15;
//   SIX (codes spanning at most 64 values, u = code - low in 6 bits: Q5_0 .. Q6_K): per two pairs
//   (4 columns) 48 bytes, each pair's low nibbles as NIB's, then byte j = the 4 columns' high bit
//   pairs (six_u below). The bf16 bits 0x4300 | u are the number 128 + u: one OR decodes them, and
//   the kernel subtracts (128 - low) * scale * sum(x) per group, as for MAGIC.
// MAGIC codes lie in [-64, 63]: the bf16 bits 0x4340 + c are the number 192 + c, exactly (one
// add decodes 32 of them); the kernel then subtracts 192 * scale * sum(x) per group. WIDE codes
// (Q8_0's full int8 range) go through fp32. Scale and offset factors: d [N / 16, groups >> shift,
// 16] fp16, q [N / 16, groups, 16] (u)int8.
// Each 16-row block is one task of a parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>
#include "qkernel_pack.h"  // the layout's kinds, packing and GGUF loading (shared with qkernel_avx2.cpp)

namespace {

constexpr float MAGIC_ZERO = 192.0f;  // what MAGIC decoding adds to a code (SIX: 128 - low)
constexpr int MR = 8;  // AVX-512 path: activation rows in registers at once (2 * MR accumulators)
// AVX-512 path: above this many rows each block is decoded once per call (Decoded), else in
// registers per MR rows: 6-bit codes always (their decode takes 9 operations per two pairs and two
// blocks' worth spill registers), the others above 48 rows. Measured (2-core EPYC Zen 4, 2 threads,
// a Qwen2.5-1.5B layer, in registers -> decoded): Q6_K 1 row 1.93 -> 1.89 ms, 4 rows 2.87 -> 2.55,
// 8 rows 3.76 -> 3.60, 16 rows 6.85 -> 5.81, 64 rows 23.9 -> 19.4, 512 rows 197 -> 157; Q4_K 16 rows
// 5.51 -> 5.85, 48 rows 13.89 -> 13.84, 128 rows 34.9 -> 33.4, 512 rows 150 -> 144; Q8_0 (wide
// codes) 1 row 1.50 -> 1.81, 8 rows 2.72 -> 3.52, 16 rows 4.79 -> 5.34, 64 and 128 rows even.
// The same bits either way.
constexpr int64_t decoded_rows(int64_t kind) { return kind == SIX ? 0 : 48; }
// The tiles' rings (amx_chunk, amx8_chunk): groups decoded AHEAD groups ahead into RING_SLOTS
// slots. A tile load of weights the vector stores wrote waits until those stores have left the
// store buffer; int8 quads decoded one group ahead, the decode and the tile products ran one after
// the other (Qwen2.5-1.5B, int8, all its products: 67.9 ms at 1 row, 79.5 at 8; two groups ahead
// 61.0 and 74.8, three 59.3 and 72.8, six 59.0 and 73.7; 2 threads, one run). bf16 pairs (twice the
// bytes a group) measured best one group ahead (Qwen2.5-Coder-0.5B's products at 8 rows: 26.2 ms
// against 28.4 two ahead; SmolLM2 7.0 against 7.1; the 1.5B 82.2 against 80.3, within its spread).
constexpr int BF16_AHEAD = 1, INT8_AHEAD = 3, RING_SLOTS = 4;

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

// SIX: the 6-bit u = code - low of column pair p of a 16-row block as 16-bit lanes (row j's even
// column in lane 2j, odd in 2j + 1). Per two pairs (4 columns) 48 bytes: 16 bytes of low nibbles
// per pair (as NIB), then 16 bytes of high bit pairs, byte j = h0 | h1 << 2 | h2 << 4 | h3 << 6
// for row j's 4 columns.
inline __m512i six_u(const uint8_t* w, int64_t p) {
    const uint8_t* unit = w + (p >> 1) * 48;
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + (p & 1) * 16)));
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 32)));
    if (p & 1) e = _mm512_srli_epi32(e, 4);
    const __m512i lo = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    const __m512i hi = _mm512_ternarylogic_epi32(e, _mm512_slli_epi32(e, 14), _mm512_set1_epi32(0x00030003), 0xA8);
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
}

// SIX where the CPU has VBMI (every AMX CPU, Zen 4; not Cooper Lake): a unit's two pairs as bf16
// bits 0x4300 | u in 9 operations, where six_u and the OR take ~10 a pair. The unit's 48 bytes are
// gathered per row (dword j = A_j, B_j, H_j, 0: as the int8 quads gather them), then each output
// byte's bits are taken from its row's qword by multishift, once for the nibbles (n) and once with
// the high bit pair at bits 4-5 (h): bf16 bits = ((SEL ? n : h) & 0x3F) | 0x43 in the high byte
// (the high bytes read the zero byte).
struct alignas(64) SixTables {
    uint8_t perm[64], n[2][64], h[2][64];
    SixTables() {
        for (int j = 0; j < 16; ++j) {  // A_j, B_j, H_j, then byte 63 (past the 48 loaded: zero)
            perm[4 * j] = static_cast<uint8_t>(j); perm[4 * j + 1] = static_cast<uint8_t>(16 + j);
            perm[4 * j + 2] = static_cast<uint8_t>(32 + j); perm[4 * j + 3] = 63;
        }
        // bit offsets in the qword of rows j, j + 1 (32 r: the row's dword), for pair t: the even
        // column's low byte (byte 0 of the row's dword), the odd column's (byte 2); bytes 1, 3: 24
        for (int i = 0; i < 64; ++i) {
            const int base = (i >> 2 & 1) * 32, b = i & 3;
            for (int t = 0; t < 2; ++t) {
                n[t][i] = static_cast<uint8_t>(base + (b == 0 ? 8 * t : b == 2 ? 8 * t + 4 : 24));
                h[t][i] = static_cast<uint8_t>(base + (b == 0 ? 12 + 4 * t : b == 2 ? 14 + 4 * t : 24));
            }
        }
    }
};

inline const SixTables& six_tables() {  // (built on first use; the int8 quads' gather is its perm too)
    static const SixTables t;
    return t;
}

struct SixVbmi {  // SixTables in registers
    __m512i perm, cn0, cn1, ch0, ch1;
    __attribute__((target("avx512f,avx512bw,avx512vbmi"))) SixVbmi() {
        const SixTables& t = six_tables();
        perm = _mm512_load_si512(t.perm);
        cn0 = _mm512_load_si512(t.n[0]); cn1 = _mm512_load_si512(t.n[1]);
        ch0 = _mm512_load_si512(t.h[0]); ch1 = _mm512_load_si512(t.h[1]);
    }
    // unit u's pairs 2u, 2u + 1 (codes at w) as bf16 bits
    __attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline))
    inline void pairs(const uint8_t* w, int64_t u, __m512i& p0, __m512i& p1) const {
        const __m512i sel = _mm512_set1_epi32(0x000F000F), keep = _mm512_set1_epi32(0x003F003F),
                      bits = _mm512_set1_epi32(0x43004300);
        const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFull, w + u * 48));
        const __m512i m0 = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(cn0, v),
                                                     _mm512_multishift_epi64_epi8(ch0, v), sel, 0xE4);
        const __m512i m1 = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(cn1, v),
                                                     _mm512_multishift_epi64_epi8(ch1, v), sel, 0xE4);
        p0 = _mm512_ternarylogic_epi32(m0, keep, bits, 0xEA);  // (m & keep) | bits
        p1 = _mm512_ternarylogic_epi32(m1, keep, bits, 0xEA);
    }
};

bool NIB_VBMI = [] {  // NibQuadDecode where the CPU has VBMI
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") != 0;
}();

bool SIX_VBMI = [] {  // (a static initializer: the CPU model is read first); six_vbmi() sets it
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") != 0;
}();

// pairs p0 .. p1 - 1 (both even: groups and K are whole units) into wbuf, as decode_range
__attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline))
void six_pairs_vbmi(const uint8_t* w, int64_t K, __m512i* wbuf, int64_t p0, int64_t p1) {
    const SixVbmi six;
    for (int64_t u = p0 / 2; u < p1 / 2; ++u) {
        _mm_prefetch(reinterpret_cast<const char*>(w + K * 12 + u * 48), _MM_HINT_T1);  // the next block's
        six.pairs(w, u, wbuf[2 * u - p0], wbuf[2 * u + 1 - p0]);
    }
}

// 32 bf16 weights: column pair p of a 16-row block (codes at w)
template <int KIND>
inline __m512bh decode(const uint8_t* w, int64_t p, __m512i lut) {
    if constexpr (KIND == SIX) {  // bf16 bits 0x4300 | u: the number 128 + u, exactly
        return (__m512bh)_mm512_or_si512(six_u(w, p), _mm512_set1_epi16(0x4300));
    } else if constexpr (KIND == NIB) {
        const uint8_t* ptr = w + p * 16;
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr)));
        __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
        return (__m512bh)_mm512_permutexvar_epi16(idx, lut);  // idx: (d | d << 12) & 0x000F000F
    } else if constexpr (KIND == MAGIC) {
        __m512i c = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
        return (__m512bh)_mm512_add_epi16(c, _mm512_set1_epi16(0x4340));
    } else {
        const uint8_t* ptr = w + p * 32;
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr))));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr + 16))));
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
}



inline __m512 factor(const Factor& f, int64_t g) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f.d + (g >> f.shift) * 16)));
    if (!f.q) return d;
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f.q + g * 16));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(f.q_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b)));
}

// what one block's product needs besides x
struct Block {
    const uint8_t* w;    // codes
    const float* sc;     // [groups, 16] fp32: the scales (expand() below)
    const float* of;     // [groups, 16] fp32: each group's additive term (offset - zero * scale), or null
    float* y;            // y[0, n0]
    int64_t ldy;
    __mmask16 valid;     // rows of the block that exist
};

// The next 16-row block's weights, decoded a group's worth at a time while this block's products run
// on the AMX tiles (part(g) after group g): the vector ports decode and the memory streams the codes
// while the tiles multiply. Decoded whole before the products, a block's decode and its products
// took their sum's time (measured, int8 at 8 rows: 1.69 ms a Qwen2.5-1.5B layer, 0.91 of it without
// the decode). fn decodes units [lo, hi) (bf16 column pairs, or int8 quads) of the block at w into
// wbuf; per: units per group; w null: no next block.
struct NextBlock {
    void (*fn)(const uint8_t*, int64_t, __m512i*, int64_t, int64_t, __m512i) = nullptr;
    const uint8_t* w = nullptr;
    int64_t K = 0, per = 0;
    __m512i* wbuf = nullptr;
    __m512i lut = __m512i{};
    void part(int64_t g) const {
        if (w) fn(w, K, wbuf + g * per, g * per, (g + 1) * per, lut);
    }
};

struct Rows {
    const uint16_t* x;   // bf16 [M, K]
    const float* xsum;   // [M, groups] or null: sum of each group's (bf16) activations
    int64_t K, group, groups;
    const uint16_t* x2 = nullptr;  // amx_stack's A tiles ([groups / 2, 2 M, 2 group] bf16), or null
    float zero = 0.0f;             // what decoding adds to a code (expand()'s zero)
};

// the group's additive term: the offset, and zero * scale taken back off for MAGIC and SIX codes
// (expand() folded both into b.of)
template <int KIND, bool OFF>
inline __m512 group_offset(const Block& b, int64_t g, __m512) {
    return _mm512_load_ps(b.of + g * 16);
}

// One block's scales and additive terms as fp32 [groups, 16], formed once per block from the held
// factors (a loop of its own: formed inside the tile loop, they cost 20-28 % of a 1-row product,
// measured in CPU time). zero: what decoding adds to a code (MAGIC 192, SIX 128 - low), else 0.
inline void expand(const Factor& s, const Factor& o, float zero, int64_t groups, float* sbuf, float* obuf) {
    const __m512 z = _mm512_set1_ps(zero);
    for (int64_t g = 0; g < groups; ++g) {
        const __m512 sv = factor(s, g);
        _mm512_store_ps(sbuf + g * 16, sv);
        if (obuf) _mm512_store_ps(obuf + g * 16, _mm512_fnmadd_ps(z, sv, o.d ? factor(o, g) : _mm512_setzero_ps()));
    }
}

constexpr bool needs_sum(int kind, bool off) { return off || kind == MAGIC || kind == SIX; }
// AVX-512 path: a group's sums start at -zero * sum(x) (MAGIC, SIX without offsets: one fmadd a
// group and row, not two)
constexpr bool zero_first(int kind, bool off) { return !off && (kind == MAGIC || kind == SIX); }


// ---- AVX-512 BF16: R <= MR rows of x times NB (1 or 2) 16-row blocks, each group's sums in
// registers (the running totals in an L1 buffer); each column pair decoded once per call. Two
// blocks a call use each broadcast of x and each decode's loop twice (a Q4_K layer at 8 rows 2.97
// -> 2.60 ms on Zen 4). There a 512-bit vdpbf16ps (and vpdpbusd) runs one a cycle, ~3.65 G/s a
// core, with or without broadcasts (measured with distinct inputs; an earlier "9.7 G/s" came from
// unchanging operands), so the products here run at 55-80 % of that bound. A row's sums run in
// the same order whatever NB and R (the same bits either way).
// A Decode gives a unit of U column pairs in two stages, load(w, unit) then pair(state, c) for
// c < U, so that only a pair per block is held in registers at once.
template <int KIND>
struct PairDecode {  // a unit is one column pair (decode<KIND>)
    static constexpr int U = 1;
    static constexpr int64_t COLUMN_BYTES = column_bytes(KIND);  // a block's bytes a column (avx_blocks' prefetch)
    struct State { const uint8_t* w; int64_t unit; };
    __m512i lut;
    inline State load(const uint8_t* w, int64_t unit) const { return State{w, unit}; }
    inline __m512i pair(const State& s, int) const { return (__m512i)decode<KIND>(s.w, s.unit, lut); }
};

// NIB on VBMI: a unit is four pairs (their 64 bytes), gathered once so that each qword holds the
// bytes of its two rows for the four pairs (vpermb); each pair is then one multishift (byte 4 j + 2 t
// of a row's dword: the pair's byte shifted right 0 or 4, its high bits garbage) and the table
// lookup, whose index is the word's low 5 bits (bf16_lut repeats its 16 values at 16-31). The same
// bf16 values as decode<NIB>, in 2 operations a pair (and a quarter of a load and of a vpermb)
// where decode<NIB> takes 4. Used up to 4 rows: at 8 its registers spill. Q4_K layer (Qwen2.5-1.5B's
// shapes, Zen 4, 2 threads, decode<NIB> -> this): 1 row 1.65 -> 1.55 ms, 2 rows 1.82 -> 1.73, 4 rows
// 2.40 -> 2.20; 8 rows 2.54 -> 2.73 (not used there).
struct alignas(64) NibQuadTables {  // (constants: NIB_QUAD_TABLES)
    uint8_t g[64], m[4][64];
    constexpr NibQuadTables() : g(), m() {
        for (int t = 0; t < 8; ++t)  // qword t: rows 2t, 2t + 1 of pairs 0-3, byte 8t + 2c + s
            for (int c = 0; c < 4; ++c)
                for (int s = 0; s < 2; ++s) g[8 * t + 2 * c + s] = static_cast<uint8_t>(16 * c + 2 * t + s);
        for (int c = 0; c < 4; ++c)  // output byte 4s + 2h of a qword: row s's byte of pair c, >> 4h
            for (int i = 0; i < 64; ++i)
                m[c][i] = static_cast<uint8_t>(8 * (2 * c + (i >> 2 & 1)) + 4 * (i >> 1 & 1));
    }
};

constexpr NibQuadTables NIB_QUAD_TABLES{};

struct NibQuadDecode {
    static constexpr int U = 4;
    static constexpr int64_t COLUMN_BYTES = 8;
    using State = __m512i;
    __m512i lut, gather, shift[4];
    __attribute__((target("avx512f,avx512bw,avx512vbmi"))) explicit NibQuadDecode(__m512i table) : lut(table) {
        const NibQuadTables& t = NIB_QUAD_TABLES;
        gather = _mm512_load_si512(t.g);
        for (int c = 0; c < 4; ++c) shift[c] = _mm512_load_si512(t.m[c]);
    }
    __attribute__((target("avx512f,avx512bw,avx512vbmi")))
    inline State load(const uint8_t* w, int64_t unit) const {
        return _mm512_permutexvar_epi8(gather, _mm512_loadu_si512(w + unit * 64));
    }
    __attribute__((target("avx512f,avx512bw,avx512vbmi")))
    inline __m512i pair(const State& v, int c) const {
        return _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(shift[c], v), lut);
    }
};

// (inlined whole into its callers by their flatten: the VBMI decode only into a VBMI function)
template <int R, int NB, bool SUM, bool ZINIT, class Decode>
inline void avx_blocks(const Rows& a, const Block* bs, const Decode& dec) {
    constexpr int U = Decode::U;
    alignas(64) float tot[NB][R][16];
    for (int nb = 0; nb < NB; ++nb)
        for (int r = 0; r < R; ++r) _mm512_store_ps(tot[nb][r], _mm512_setzero_ps());
    const int64_t units = a.group / 2 / U;
    // codes streamed from memory: each unit's bytes of the next call's blocks (NB blocks further on)
    // are fetched to L2 as this call reads its own, one prefetch a 64-byte line, as vnni_blocks does
    // (decode steps at 8 slots, bf16 activations, 2-core Zen 4: the 0.5B 40.1 -> 33.1 ms, SmolLM2
    // 14.9 -> 13.5)
    constexpr int64_t unit_bytes = 2 * U * Decode::COLUMN_BYTES;
    const int64_t ahead = NB * a.K * Decode::COLUMN_BYTES;
    for (int64_t g = 0; g < a.groups; ++g) {
        __m512 acc[NB][R];
        for (int r = 0; r < R; ++r) {  // ZINIT: the sums start at -zero * sum(x) (the zero taken back off)
            const __m512 z = ZINIT ? _mm512_set1_ps(-a.zero * a.xsum[r * a.groups + g]) : _mm512_setzero_ps();
            for (int nb = 0; nb < NB; ++nb) acc[nb][r] = z;
        }
        for (int64_t u = g * units; u < (g + 1) * units; ++u) {
            if constexpr (unit_bytes > 0) {
                if ((u * unit_bytes) % 64 < unit_bytes)
                    for (int nb = 0; nb < NB; ++nb)
                        _mm_prefetch(reinterpret_cast<const char*>(bs[nb].w + ahead + u * unit_bytes / 64 * 64), _MM_HINT_T1);
            }
            typename Decode::State st[NB];
            for (int nb = 0; nb < NB; ++nb) st[nb] = dec.load(bs[nb].w, u);
            for (int c = 0; c < U; ++c) {
                __m512i wv[NB];
                for (int nb = 0; nb < NB; ++nb) wv[nb] = dec.pair(st[nb], c);
                for (int r = 0; r < R; ++r) {
                    uint32_t xp;
                    std::memcpy(&xp, a.x + r * a.K + 2 * (u * U + c), 4);
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
                    for (int nb = 0; nb < NB; ++nb) acc[nb][r] = _mm512_dpbf16_ps(acc[nb][r], xv, (__m512bh)wv[nb]);
                }
            }
        }
        for (int nb = 0; nb < NB; ++nb) {
            const __m512 s = _mm512_load_ps(bs[nb].sc + g * 16);
            for (int r = 0; r < R; ++r) {
                __m512 t = _mm512_fmadd_ps(acc[nb][r], s, _mm512_load_ps(tot[nb][r]));
                if constexpr (SUM && !ZINIT)
                    t = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * a.groups + g]), _mm512_load_ps(bs[nb].of + g * 16), t);
                _mm512_store_ps(tot[nb][r], t);
            }
        }
    }
    for (int nb = 0; nb < NB; ++nb)
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(bs[nb].y + r * bs[nb].ldy, bs[nb].valid, _mm512_load_ps(tot[nb][r]));
}

template <int R, int NB, int KIND, bool OFF>
__attribute__((flatten)) void avx_block(const Rows& a, const Block* bs, __m512i lut) {
    avx_blocks<R, NB, needs_sum(KIND, OFF), zero_first(KIND, OFF)>(a, bs, PairDecode<KIND>{lut});
}

template <int R, int NB, bool OFF>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,fma"), flatten))
void avx_block_nib4(const Rows& a, const Block* bs, __m512i lut) {
    avx_blocks<R, NB, needs_sum(NIB, OFF), false>(a, bs, NibQuadDecode(lut));
}

// A prefill chunk's weights: each block decoded once (decode_range, the same bf16 pairs) into a
// buffer that every MR rows of the chunk read, rather than decoded again per MR rows; b.w is the buffer
struct Decoded {
    static constexpr int U = 1;
    static constexpr int64_t COLUMN_BYTES = 0;  // a buffer, no codes streamed: nothing to prefetch
    using State = const __m512i*;
    inline State load(const uint8_t* w, int64_t unit) const { return reinterpret_cast<const __m512i*>(w) + unit; }
    inline __m512i pair(const State& s, int) const { return _mm512_load_si512(s); }
};

template <int R, int NB, bool SUM, bool ZINIT>
__attribute__((flatten)) void avx_block_decoded(const Rows& a, const Block* bs) {
    avx_blocks<R, NB, SUM, ZINIT>(a, bs, Decoded{});
}

template <int KIND, bool OFF, int NB>
void avx_rows(int64_t M, const Rows& a, const Block* bs, __m512i lut, bool decoded) {
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        Rows part = a;
        part.x = a.x + m0 * a.K;
        part.xsum = a.xsum ? a.xsum + m0 * a.groups : nullptr;
        Block out[NB];
        for (int nb = 0; nb < NB; ++nb) {
            out[nb] = bs[nb];
            out[nb].y = bs[nb].y + m0 * bs[nb].ldy;
        }
        switch (std::min<int64_t>(MR, M - m0)) {
#define CASE(n) case n: \
            if (decoded) avx_block_decoded<n, NB, needs_sum(KIND, OFF), zero_first(KIND, OFF)>(part, out); \
            else if (KIND == NIB && n <= 4 && NIB_VBMI && a.group % 8 == 0) avx_block_nib4<n, NB, OFF>(part, out, lut); \
            else avx_block<n, NB, KIND, OFF>(part, out, lut); \
            break;
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

// Above 16 rows, the block's weights are decoded once into wbuf ([K / 2] zmm: pair p's 16 rows x 2
// columns, the B tiles' layout), then every chunk of up to 16 activation rows multiplies them group by
// group; up to 16 rows, a group at a time into a ring (amx_chunk). Two C tiles alternate, so a
// group's product runs while the previous group's sums are scaled. decode_range writes pairs
// p0 .. p1 - 1 to wbuf[0 .. p1 - p0) (SIX on VBMI: six_pairs_vbmi).
template <int KIND>
void decode_range(const uint8_t* w, int64_t K, __m512i* wbuf, int64_t p0, int64_t p1, __m512i lut) {
    // pairs p0 .. p1 - 1; the next block's codes (where this thread goes next) are fetched meanwhile
    if constexpr (KIND == SIX) {
        if (SIX_VBMI) return six_pairs_vbmi(w, K, wbuf, p0, p1);
    }
    const int64_t bytes = K * column_bytes(KIND), pair = 2 * column_bytes(KIND);
    for (int64_t p = p0; p < p1; ++p) {  // one prefetch per 64 bytes decoded, spread through the loop
        if ((p * pair) % 64 < pair) _mm_prefetch(reinterpret_cast<const char*>(w + bytes + (p * pair) / 64 * 64), _MM_HINT_T1);
        _mm512_store_si512(wbuf + (p - p0), (__m512i)decode<KIND>(w, p, lut));
    }
}

template <int R, int KIND, bool OFF>
inline void scale_group(const Rows& a, const Block& b, int64_t g, const float* cbuf, __m512* tot) {
    const __m512 s = _mm512_load_ps(b.sc + g * 16);
    for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + r * 16), s, tot[r]);
    if constexpr (needs_sum(KIND, OFF)) {
        const __m512 o = group_offset<KIND, OFF>(b, g, s);
        for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * a.groups + g]), o, tot[r]);
    }
}

// R <= 16 rows of x (a.x points at the chunk's first row), sums in registers, into b.y's rows.
// RING (the block's only chunk: a decode step's few rows): the block's weights are not decoded whole
// first; group g + BF16_AHEAD's are decoded into a ring while group g's product runs, so the B
// tiles are read from L1. (Decoded whole into wbuf -- K / 2 zmm a block, two blocks held, 57 KB at
// K = 896, 311 KB at 4,864 -- every decoded pair went out to L2 and back: the ring took a
// Qwen2.5-Coder-0.5B step's products from 29.3 to 26.3 ms and its Q8_0 head from 10.0 to 8.6 ms at
// 8 rows, 2 threads.)
template <int R, int KIND, bool OFF, bool RING>
void amx_chunk(const Rows& a, const Block& b, const __m512i* wbuf, const NextBlock& next, __m512i lut) {
    alignas(64) float cbuf[16 * 16];
    alignas(64) __m512i ring[RING ? RING_SLOTS : 1][16];  // a group's pairs: group <= 32 (qmm checks)
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const int64_t pairs = a.group / 2;
    if constexpr (RING)
        for (int64_t g = 0; g < BF16_AHEAD && g < a.groups; ++g) decode_range<KIND>(b.w, a.K, ring[g], g * pairs, (g + 1) * pairs, lut);
    for (int64_t g = 0; g < a.groups; ++g) {
        _tile_loadd(1, a.x + g * a.group, a.K * 2);
        _tile_loadd(2, RING ? ring[g % RING_SLOTS] : wbuf + g * pairs, 64);
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
        if constexpr (RING) {
            const int64_t d = g + BF16_AHEAD;
            if (d < a.groups) decode_range<KIND>(b.w, a.K, ring[d % RING_SLOTS], d * pairs, (d + 1) * pairs, lut);
        } else {
            next.part(g);
        }
    }
    if ((a.groups - 1) % 2 == 0) _tile_stored(0, cbuf, 64);  // tile numbers are immediates
    else _tile_stored(3, cbuf, 64);
    scale_group<R, KIND, OFF>(a, b, a.groups - 1, cbuf, tot);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]);
}

// 32 rows (a step verifying speculative drafts: 8 rows and their drafts, padded to 32): two chunks of
// 16 rows over one ring, so the block's weights are decoded once and read from L1 by both chunks'
// tile products (A tiles 1 and 4, C tiles 0 / 3 and 5 / 6 alternating). Each row's sums are those
// of amx_chunk's, in the same order: the same bits.
inline void amx_config32(int64_t group) {
    TileConfig c;
    for (int t : {0, 3, 5, 6}) { c.rows[t] = 16; c.colsb[t] = 64; }
    for (int t : {1, 4}) { c.rows[t] = 16; c.colsb[t] = static_cast<uint16_t>(group * 2); }
    c.rows[2] = static_cast<uint8_t>(group / 2); c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

template <int KIND, bool OFF>
void amx_ring32(const Rows& a, const Block& b, __m512i lut) {
    alignas(64) float cbuf[2][16 * 16];
    alignas(64) __m512i ring[RING_SLOTS][16];
    __m512 tot[16], tot2[16];
    for (int r = 0; r < 16; ++r) tot[r] = tot2[r] = _mm512_setzero_ps();
    Rows a2 = a;  // rows 16 .. 31
    a2.x = a.x + 16 * a.K;
    a2.xsum = a.xsum ? a.xsum + 16 * a.groups : nullptr;
    const int64_t pairs = a.group / 2;
    for (int64_t g = 0; g < BF16_AHEAD && g < a.groups; ++g) decode_range<KIND>(b.w, a.K, ring[g], g * pairs, (g + 1) * pairs, lut);
    auto scale = [&](int64_t g) {
        scale_group<16, KIND, OFF>(a, b, g, cbuf[0], tot);
        scale_group<16, KIND, OFF>(a2, b, g, cbuf[1], tot2);
    };
    for (int64_t g = 0; g < a.groups; ++g) {
        _tile_loadd(2, ring[g % RING_SLOTS], 64);
        _tile_loadd(1, a.x + g * a.group, a.K * 2);
        _tile_loadd(4, a2.x + g * a.group, a.K * 2);
        if (g % 2 == 0) {
            _tile_zero(0);
            _tile_zero(5);
            _tile_dpbf16ps(0, 1, 2);
            _tile_dpbf16ps(5, 4, 2);
            if (g) { _tile_stored(3, cbuf[0], 64); _tile_stored(6, cbuf[1], 64); scale(g - 1); }
        } else {
            _tile_zero(3);
            _tile_zero(6);
            _tile_dpbf16ps(3, 1, 2);
            _tile_dpbf16ps(6, 4, 2);
            _tile_stored(0, cbuf[0], 64);
            _tile_stored(5, cbuf[1], 64);
            scale(g - 1);
        }
        const int64_t d = g + BF16_AHEAD;
        if (d < a.groups) decode_range<KIND>(b.w, a.K, ring[d % RING_SLOTS], d * pairs, (d + 1) * pairs, lut);
    }
    if ((a.groups - 1) % 2 == 0) { _tile_stored(0, cbuf[0], 64); _tile_stored(5, cbuf[1], 64); }
    else { _tile_stored(3, cbuf[0], 64); _tile_stored(6, cbuf[1], 64); }
    scale(a.groups - 1);
    for (int r = 0; r < 16; ++r) {
        _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]);
        _mm512_mask_storeu_ps(b.y + (16 + r) * b.ldy, b.valid, tot2[r]);
    }
}

// The loop of the stacked tile products (amx_stack, amx8_stack), per half h (groups 2h, 2h + 1):
// the A tile at a2 + h * tile_bytes (rows a_stride bytes apart), the B tile from a ring that
// decode(h, slot) fills AHEAD halves ahead; C tiles 0 and 3 alternate, and each half's sums
// (fp32, or int32 with INT8: tdpbsud, else tdpbf16ps) are scaled a half later, scale(h, sums, tot),
// so their loads find the tile's store written. store(tot) writes the R rows.
template <int R, bool INT8, int AHEAD, class Decode, class Scale, class Store>
__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))
void stacked_loop(int64_t halves, const void* a2, int64_t tile_bytes, int64_t a_stride, Decode decode,
                  Scale scale, Store store) {
    alignas(64) int32_t cbuf[2][16 * 16];
    alignas(64) __m512i ring[RING_SLOTS][16];  // a half's weights: two groups' tiles
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const char* ap = static_cast<const char*>(a2);
    for (int64_t h = 0; h < AHEAD && h < halves; ++h) decode(h, ring[h]);
    for (int64_t h = 0; h < halves; ++h) {
        _tile_loadd(1, ap + h * tile_bytes, a_stride);
        _tile_loadd(2, ring[h % RING_SLOTS], 64);
        if (h % 2 == 0) {
            _tile_zero(0);
            if constexpr (INT8) _tile_dpbsud(0, 1, 2);
            else _tile_dpbf16ps(0, 1, 2);
            if (h) _tile_stored(3, cbuf[1], 64);
        } else {
            _tile_zero(3);
            if constexpr (INT8) _tile_dpbsud(3, 1, 2);
            else _tile_dpbf16ps(3, 1, 2);
            _tile_stored(0, cbuf[0], 64);
        }
        if (h >= 2) scale(h - 2, cbuf[h % 2], tot);
        if (h + AHEAD < halves) decode(h + AHEAD, ring[(h + AHEAD) % RING_SLOTS]);
    }
    const int64_t last = halves - 1;
    if (last % 2 == 0) _tile_stored(0, cbuf[0], 64);
    else _tile_stored(3, cbuf[1], 64);
    if (last >= 1) scale(last - 1, cbuf[(last - 1) % 2], tot);
    scale(last, cbuf[last % 2], tot);
    store(tot);
}

// Up to 8 rows of a 16-column-group weight (Q6_K): two groups a tile product, as amx8_stack (the
// int8 product's) does: the A tile holds the rows twice, block-diagonally over two groups' 32
// columns (Rows::x2, stack_rows), the B tile both groups' pairs; C's rows 0 .. R - 1 are group 2h's
// sums, R .. 2R - 1 group 2h + 1's. The zeros add exact zeros, so the sums are those of one group a
// tile product, bit for bit.
template <int R, int KIND, bool OFF>
void amx_stack(const Rows& a, const Block& b, __m512i lut) {
    const int64_t pairs = a.group;  // two groups' column pairs: a half
    stacked_loop<R, false, BF16_AHEAD>(
        a.groups / 2, a.x2, 2 * R * 2 * a.group * 2, 4 * a.group,
        [&](int64_t h, __m512i* slot) { decode_range<KIND>(b.w, a.K, slot, h * pairs, (h + 1) * pairs, lut); },
        [&](int64_t h, const int32_t* c, __m512* tot) {
            const float* sums = reinterpret_cast<const float*>(c);
            scale_group<R, KIND, OFF>(a, b, 2 * h, sums, tot);
            scale_group<R, KIND, OFF>(a, b, 2 * h + 1, sums + R * 16, tot);
        },
        [&](const __m512* tot) { for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]); });
}

// two groups' tile configuration (amx_stack, amx8_stack): rows activation rows, group columns a
// group, bytes bytes a column (bf16 2, int8 1)
inline void stack_config(int rows, int64_t group, int bytes) {
    TileConfig c;
    c.rows[0] = static_cast<uint8_t>(2 * rows); c.colsb[0] = 64;
    c.rows[3] = static_cast<uint8_t>(2 * rows); c.colsb[3] = 64;
    c.rows[1] = static_cast<uint8_t>(2 * rows); c.colsb[1] = static_cast<uint16_t>(2 * group * bytes);
    c.rows[2] = static_cast<uint8_t>(2 * group * bytes / 4); c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

// the A tiles of two groups a tile product: T [groups / 2, 2 M, 2 group] from x T [M, K]
template <class T>
void stack_rows(const T* x, int64_t M, int64_t K, int64_t group, T* x2) {
    std::memset(static_cast<void*>(x2), 0, static_cast<size_t>(K * 2 * M) * sizeof(T));
    for (int64_t h = 0; h < K / group / 2; ++h) {
        T* t = x2 + h * 2 * M * 2 * group;
        for (int64_t r = 0; r < M; ++r) {
            std::memcpy(t + r * 2 * group, x + r * K + 2 * h * group, group * sizeof(T));
            std::memcpy(t + (M + r) * 2 * group + group, x + r * K + (2 * h + 1) * group, group * sizeof(T));
        }
    }
}

template <int KIND, bool OFF>
void amx_rows(int64_t M, const Rows& a, const Block& b, const __m512i* wbuf, const NextBlock& next, __m512i lut) {
    if (a.x2) {  // up to 8 rows, two groups a tile product
        switch (M) {
#define CASE(n) case n: amx_stack<n, KIND, OFF>(a, b, lut); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
        return;
    }
    if (M == 32) {  // two chunks over one ring
        amx_ring32<KIND, OFF>(a, b, lut);
        return;
    }
    if (M <= 16) {  // one chunk: its weights through the ring
        switch (M) {
#define CASE(n) case n: amx_chunk<n, KIND, OFF, true>(a, b, nullptr, NextBlock{}, lut); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 16) {  // a multiple of 16
        Rows part = a;
        part.x = a.x + m0 * a.K;
        part.xsum = a.xsum ? a.xsum + m0 * a.groups : nullptr;
        Block out = b;
        out.y = b.y + m0 * b.ldy;
        switch (std::min<int64_t>(16, M - m0)) {
#define CASE(n) case n: amx_chunk<n, KIND, OFF, false>(part, out, wbuf, m0 == 0 ? next : NextBlock{}, lut); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
    }
}

// nb (1, or 2 on AVX-512) blocks at bs (decoded: their b.w the decoded pairs, Decoded)
template <int KIND, bool OFF>
void rows(bool amx, int64_t M, const Rows& a, const Block* bs, int nb, __m512i lut, const __m512i* wbuf,
          const NextBlock& next, bool decoded) {
    if (amx) amx_rows<KIND, OFF>(M, a, bs[0], wbuf, next, lut);
    else if (nb == 2) avx_rows<KIND, OFF, 2>(M, a, bs, lut, decoded);
    else avx_rows<KIND, OFF, 1>(M, a, bs, lut, decoded);
}

}  // namespace

namespace {

// fp32 [M, K] -> bf16, nearest even (as Tensor.to)
torch::Tensor bf16_rows(const torch::Tensor& x) {
    auto out = torch::empty(x.sizes(), x.options().dtype(torch::kBFloat16));
    const float* s = x.data_ptr<float>();
    uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr());
    const int64_t n = x.numel();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i)));
    for (; i < n; ++i) {
        const c10::BFloat16 v(s[i]);
        d[i] = v.x;
    }
    return out;
}

// bf16 [M, K] -> fp32 [M, K / group]: each group's sum, in order
torch::Tensor group_sums(const torch::Tensor& xb, int64_t groups, int64_t group) {
    const int64_t M = xb.size(0);
    auto out = torch::empty({M, groups}, xb.options().dtype(torch::kFloat32));
    const uint16_t* s = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    float* d = out.data_ptr<float>();
    for (int64_t i = 0; i < M * groups; ++i) {
        const uint16_t* v = s + i * group;
        __m512 acc = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= group; k += 16)
            acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + k))), 16)));
        float t = _mm512_reduce_add_ps(acc);
        for (; k < group; ++k) t += c10::detail::f32_from_bits(v[k]);
        d[i] = t;
    }
    return out;
}

}  // namespace

// x: bf16 or fp32 [M, K] (fp32: rounded to bf16 here; on AMX: M <= 16 or a multiple of 16); packed: the codes (layout above, kind 0/1/2
// = NIB/MAGIC/WIDE); the scales' factors sd, sq (empty: none), sshift and the offsets' od (empty:
// no offsets), oq, oshift (Factors above). Returns fp32 [M, N].
torch::Tensor qmm(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t low, torch::Tensor sd, torch::Tensor sq,
                  int64_t sshift, torch::Tensor od, torch::Tensor oq, int64_t oshift, int64_t group, int64_t N, bool amx) {
    TORCH_CHECK((x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32) && x.dim() == 2 &&
                x.is_contiguous(), "x: contiguous bf16 or fp32 [M, K]");
    const int64_t M = x.size(0), K = x.size(1), blocks = (N + 15) / 16, groups = K / group;
    TORCH_CHECK(group % 2 == 0 && K % group == 0, "K must be a multiple of the (even) group");
    TORCH_CHECK(kind >= NIB && kind <= SIX, "kind: 0, 1, 2 or 3");
    TORCH_CHECK(kind != SIX || group % 4 == 0, "SIX: groups of whole 4-column units");
    TORCH_CHECK(sd.numel() > 0, "scales: d is required");
    const Factors sf = factors(sd, sq, sshift, blocks, groups, "scales"), of = factors(od, oq, oshift, blocks, groups, "offsets");
    TORCH_CHECK(packed.numel() == blocks * K * column_bytes(kind), "codes do not fit the blocked layout");
    if (amx) {
        TORCH_CHECK(group == 16 || group == 32, "AMX: groups of 16 or 32 columns");
        TORCH_CHECK(M <= 16 || M % 16 == 0, "AMX: up to 16 rows, or a multiple of 16");
        TORCH_CHECK(amx_ready(), "AMX: the OS refused the tile state (arch_prctl)");
    }
    const bool off = od.numel() > 0;
    auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
    if (M == 0 || N == 0) return y;  // a step with no rows for this weight (no logits wanted)
    // x as bf16 (fp32 rounded here, nearest even) and, where the epilogue needs it, each group's sum
    // of those bf16 values: in this call, not as ATen operations (three a call cost ~10 us of a
    // SmolLM2 product's ~40 at 8 rows)
    torch::Tensor xb = x.scalar_type() == torch::kBFloat16 ? x : bf16_rows(x);
    torch::Tensor xsum;
    if (needs_sum(static_cast<int>(kind), off)) xsum = group_sums(xb, groups, group);
    Rows a{reinterpret_cast<const uint16_t*>(xb.data_ptr()), xsum.defined() ? xsum.data_ptr<float>() : nullptr,
           K, group, groups};
    const bool stack = amx && M <= 8 && group == 16 && groups % 2 == 0;  // amx_stack
    torch::Tensor x2;
    if (stack) {
        x2 = torch::empty({K * 2 * M}, xb.options());
        stack_rows<uint16_t>(a.x, M, K, group, reinterpret_cast<uint16_t*>(x2.data_ptr()));
        a.x2 = reinterpret_cast<const uint16_t*>(x2.data_ptr());
    }
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());  // uint8 nibbles or int8 codes
    float* yp = y.data_ptr<float>();
    const int64_t block_bytes = K * column_bytes(kind);  // 16 rows x K codes, 4, 6 or 8 bits each
    const __m512i lut = bf16_lut(low);
    const float zero = kind == SIX ? static_cast<float>(128 - low) : kind == MAGIC ? MAGIC_ZERO : 0.0f;
    a.zero = zero;
    const bool sums = needs_sum(static_cast<int>(kind), off);
    const auto decoder = kind == NIB ? decode_range<NIB> : kind == MAGIC ? decode_range<MAGIC>
                       : kind == WIDE ? decode_range<WIDE> : decode_range<SIX>;
    const bool whole = amx && M > 32;  // blocks decoded whole (several chunks of rows share them), else a ring
    const bool decoded = !amx && M > decoded_rows(kind);  // AVX-512: the call's blocks decoded first (Decoded)
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        // above 16 rows: two blocks' decoded weights (K / 2 zmm each), this block's and the next one's
        // (NextBlock); AVX-512: the two blocks of a call
        std::unique_ptr<__m512i, decltype(&std::free)> wmem(
            whole || decoded ? static_cast<__m512i*>(std::aligned_alloc(64, 2 * (K / 2) * sizeof(__m512i))) : nullptr,
            &std::free);
        // two blocks' scales and additive terms, fp32 [groups, 16] each (AVX-512: two blocks a call)
        std::unique_ptr<float, decltype(&std::free)> fbuf(
            static_cast<float*>(std::aligned_alloc(64, 4 * groups * 16 * sizeof(float))), &std::free);
        if (stack) stack_config(static_cast<int>(M), group, 2);
        else if (amx && M == 32) amx_config32(group);
        else if (amx) amx_config(static_cast<int>(std::min<int64_t>(M, 16)), group);
        if (whole) decoder(wp + b0 * block_bytes, K, wmem.get(), 0, K / 2, lut);
        for (int64_t i = b0; i < b1;) {
            // two blocks a call on AVX-512 (Q4_K layer, 8 rows: 2.97 -> 2.60 ms, 32 rows 9.55 -> 8.94;
            // 2-core EPYC, 2 threads); the AMX paths a block at a time
            const int nb = !amx && i + 1 < b1 ? 2 : 1;
            Block bs[2];
            for (int j = 0; j < nb; ++j) {
                const int64_t valid = std::min<int64_t>(16, N - (i + j) * 16);
                float* sbuf = fbuf.get() + j * 2 * groups * 16;
                float* obuf = sums ? sbuf + groups * 16 : nullptr;
                expand(sf.of_block(i + j), of.of_block(i + j), zero, groups, sbuf, obuf);
                const uint8_t* w = wp + (i + j) * block_bytes;
                if (decoded) {
                    __m512i* pairs = wmem.get() + j * (K / 2);
                    decoder(w, K, pairs, 0, K / 2, lut);
                    w = reinterpret_cast<const uint8_t*>(pairs);
                }
                bs[j] = Block{w, sbuf, obuf, yp + (i + j) * 16, N,
                              static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1)};
            }
            const int64_t cur = (i - b0) % 2;
            const __m512i* wbuf = whole ? wmem.get() + cur * (K / 2) : nullptr;
            NextBlock next;
            if (whole && i + 1 < b1) next = NextBlock{decoder, wp + (i + 1) * block_bytes, K, group / 2, wmem.get() + (1 - cur) * (K / 2), lut};
            switch (kind * 2 + off) {
                case NIB * 2: rows<NIB, false>(amx, M, a, bs, nb, lut, wbuf, next, decoded); break;
                case NIB * 2 + 1: rows<NIB, true>(amx, M, a, bs, nb, lut, wbuf, next, decoded); break;
                case MAGIC * 2: rows<MAGIC, false>(amx, M, a, bs, nb, lut, wbuf, next, decoded); break;
                case MAGIC * 2 + 1: rows<MAGIC, true>(amx, M, a, bs, nb, lut, wbuf, next, decoded); break;
                case WIDE * 2: rows<WIDE, false>(amx, M, a, bs, nb, lut, wbuf, next, decoded); break;
                case WIDE * 2 + 1: rows<WIDE, true>(amx, M, a, bs, nb, lut, wbuf, next, decoded); break;
                case SIX * 2: rows<SIX, false>(amx, M, a, bs, nb, lut, wbuf, next, decoded); break;
                default: rows<SIX, true>(amx, M, a, bs, nb, lut, wbuf, next, decoded);
            }
            i += nb;
        }
        if (amx) _tile_release();
    });
    return y;
}

// ---- int8 activations: the codes as unsigned bytes on VNNI (vpdpbusd) or AMX-INT8 (tdpbsud)
//
// x is rounded per row and group to int8 (llama.cpp's Q8 activations, one scale per group of the
// weight: xs = max|x| / 127, xq = nearest(x / xs), so |x - xs * xq| <= xs / 2), each code is
// u + low (u unsigned: NIB's nibble, SIX's 6 bits), and
//     y[m, n] = sum_g (scale[n, g] * xs[m, g]) * (sum_{k in g} u[n, k] * xq[m, k] + low * sum_{k in g} xq[m, k])
//             + offset[n, g] * (xs[m, g] * sum_{k in g} xq[m, k]),
// the integer sum in the first line being sum(code * xq) exactly (q8_epilogue): the file's weights
// times the rounded x (up to the fp32 epilogue's roundings).
// The integer sums are exact, so both instruction sets give the same int32 per group, and every
// row the same result whatever the rows beside it (the float epilogue is one code path).
// The weights' codes stay in the layout above; each 16-row block is decoded once into "quads"
// (wbuf: per 4 columns a zmm, dword j = row j's 4 codes as bytes, the B tiles' layout), NIB's in
// the order (0, 2, 4, 6), (1, 3, 5, 7) per 8 columns (x's bytes are laid out to match, qrows()).
// MAGIC and WIDE hold int8 codes: u = code + 128 (the sign bit flipped), so low is -128 there.
namespace {

constexpr int QR = 8;  // VNNI: activation rows in registers at once
constexpr int64_t IN_REGISTER_ROWS = 64;  // VNNI: byte codes decoded in registers up to this many rows (qmm8)

struct alignas(64) Bytes64 {  // a byte table filled once (a function-local static: built on first use)
    uint8_t b[64];
    template <class Fill> explicit Bytes64(Fill fill) { fill(b); }
};

struct alignas(64) Table64 { uint8_t b[64]; };
constexpr Table64 NIB_QUAD_PERM = [] {  // NIB: dword j = row j's byte of pairs 0-3
    Table64 t{};
    for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 4; ++i) t.b[4 * j + i] = static_cast<uint8_t>(16 * i + j);
    return t;
}();
constexpr Table64 WIDE_QUAD_PERM = [] {  // int8 codes: dword j = row j's columns 0, 1 (pair 0), 2, 3 (pair 1)
    Table64 t{};
    for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 4; ++i) t.b[4 * j + i] = static_cast<uint8_t>((i >> 1) * 32 + 2 * j + (i & 1));
    return t;
}();

// A 16-row block's int8 quads in two stages, load(w, unit) then quad(state, c) for the unit's U
// quads: what quads_range stores, and what vnni_blocks multiplies in registers.
struct NibQuads {  // per 8 columns 64 bytes (pair i's 16 rows at 16 i): quads (0, 2, 4, 6), (1, 3, 5, 7)
    static constexpr int U = 2;
    using State = __m512i;
    __m512i perm, nib;
    __attribute__((target("avx512f,avx512bw,avx512vbmi"))) NibQuads()
        : perm(_mm512_load_si512(NIB_QUAD_PERM.b)), nib(_mm512_set1_epi8(15)) {}
    __attribute__((target("avx512f,avx512bw,avx512vbmi")))
    inline State load(const uint8_t* w, int64_t unit) const {
        return _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(w + unit * 64));
    }
    __attribute__((target("avx512f,avx512bw")))
    inline __m512i quad(const State& v, int c) const {
        return _mm512_and_si512(c ? _mm512_srli_epi16(v, 4) : v, nib);
    }
};

struct WideQuads {  // int8 codes, per column pair 32 bytes (row j: 2j, 2j + 1); u = code + 128
    static constexpr int U = 1;
    using State = __m512i;
    __m512i perm, flip;
    __attribute__((target("avx512f,avx512bw,avx512vbmi"))) WideQuads()
        : perm(_mm512_load_si512(WIDE_QUAD_PERM.b)), flip(_mm512_set1_epi8(static_cast<char>(0x80))) {}
    __attribute__((target("avx512f,avx512bw,avx512vbmi")))
    inline State load(const uint8_t* w, int64_t unit) const {  // u = code + 128: the sign bit flipped
        return _mm512_xor_si512(_mm512_permutexvar_epi8(perm, _mm512_loadu_si512(w + unit * 64)), flip);
    }
    inline __m512i quad(const State& v, int) const { return v; }
};

// quads q0 .. q1 - 1 of one 16-row block from its codes (all of them: K / 4 zmm; NIB: q0, q1 even)
template <int KIND>
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
void quads_range(const uint8_t* w, int64_t K, __m512i* wbuf, int64_t q0, int64_t q1, __m512i) {
    if constexpr (KIND == NIB) {
        const NibQuads dec;
        for (int64_t t = q0 / 2; t < q1 / 2; ++t) {
            _mm_prefetch(reinterpret_cast<const char*>(w + K * 8 + t * 64), _MM_HINT_T1);  // the next block's
            const __m512i v = dec.load(w, t);
            _mm512_store_si512(wbuf + (2 * t - q0), dec.quad(v, 0));
            _mm512_store_si512(wbuf + (2 * t + 1 - q0), dec.quad(v, 1));
        }
    } else if constexpr (KIND == WIDE || KIND == MAGIC) {
        const WideQuads dec;
        for (int64_t q = q0; q < q1; ++q) {
            _mm_prefetch(reinterpret_cast<const char*>(w + K * 16 + q * 64), _MM_HINT_T1);
            _mm512_store_si512(wbuf + (q - q0), dec.load(w, q));
        }
    } else {  // SIX, per 4 columns 48 bytes: A (columns 0, 1), B (2, 3) nibble pairs, H high bit pairs
        // bit offsets in the qword of rows j, j + 1: nibble t at 4 t; h_t to bits 4-5
        static const Bytes64 cn([](uint8_t* t) {
            for (int j = 0; j < 64; ++j) t[j] = static_cast<uint8_t>((j >> 2 & 1) * 32 + 4 * (j & 3));
        });
        static const Bytes64 ch([](uint8_t* t) {
            for (int j = 0; j < 64; ++j) t[j] = static_cast<uint8_t>((j >> 2 & 1) * 32 + 12 + 2 * (j & 3));
        });
        // dword j = A_j, B_j, H_j, 0 (byte 63 lies past the 48 loaded): SixTables' gather
        const __m512i perm = _mm512_load_si512(six_tables().perm), ctrl_n = _mm512_load_si512(cn.b),
                      ctrl_h = _mm512_load_si512(ch.b);
        const __m512i low4 = _mm512_set1_epi8(15), six = _mm512_set1_epi8(63);
        for (int64_t q = q0; q < q1; ++q) {
            _mm_prefetch(reinterpret_cast<const char*>(w + K * 12 + q * 48), _MM_HINT_T1);
            const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFull, w + q * 48));
            const __m512i n = _mm512_multishift_epi64_epi8(ctrl_n, v), h = _mm512_multishift_epi64_epi8(ctrl_h, v);
            // low 4 bits from n, bits 4-5 from h
            _mm512_store_si512(wbuf + (q - q0), _mm512_and_si512(_mm512_ternarylogic_epi32(n, h, low4, 0xE4), six));
        }
    }
}

struct QRows {
    const int8_t* xq;    // [M, K], each group's bytes in its quads' order
    const float* xs;     // [M, groups]
    const float* xsum;   // [M, groups]: xs * sum(xq), the rounded x's sum
    const int32_t* qbase;  // [M, groups]: base * sum(xq), what the codes' base adds to a group's integer sum
    int64_t K, group, groups;
    bool based;            // base != 0 (qbase not all zeros)
};

// A group's integer sum includes base * sum(xq) (vnni_block: the accumulators' first value;
// vnni_blocks and the AMX tiles, q8_from: added to the sums), so that it is sum(code * xq) exactly, whatever base
// the codes are held from (u = code - base); the epilogue then scales it and, for a format with
// offsets (Q4_1, Q5_1, the K formats' mins), adds xsum * offset:
//     tot[r] += acc[r] * (scale * xs) [+ xsum * offset]
// (before, the base went into the offset term in fp32, one fmadd a group and row more: Q5_0, Q6_K
// and Q8_0, without offsets, now take none; see qmm8's measurement.)
template <int R>
inline void q8_epilogue(const QRows& a, const Block& b, int64_t g, const __m512i* acc, __m512* tot) {
    const __m512 s = _mm512_load_ps(b.sc + g * 16);
    for (int r = 0; r < R; ++r) {
        const __m512 f = _mm512_mul_ps(s, _mm512_set1_ps(a.xs[r * a.groups + g]));
        tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), f, tot[r]);
    }
    if (b.of) {
        const __m512 o = _mm512_load_ps(b.of + g * 16);
        for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * a.groups + g]), o, tot[r]);
    }
}

// acc += w (unsigned bytes) . x (signed bytes) per dword, in place. (GCC 12 compiles the intrinsic
// _mm512_dpbusd_epi32 with two register copies of the accumulator around each instruction: 16 moves
// per 8 rows' products, which made vnni_block bound by the front end, not the VNNI port; in
// vnni_blocks it also stored accumulators to the stack inside the loop. There, 2-core Zen 4, 2
// threads, a Qwen2.5-1.5B layer, intrinsic -> this: Q4_K 8 rows 1.55 -> 1.42 ms, Q6_K 8 rows 2.13 ->
// 1.96. The same asm for vdpbf16ps in avx_blocks measured slower: Q6_K 8 rows 2.62 -> 5.18 ms.)
__attribute__((target("avx512f,avx512vnni")))
inline void dpbusd(__m512i& acc, __m512i w, __m512i x) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void vnni_block(const QRows& a, const Block& b, const __m512i* wbuf) {
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const int64_t quads = a.group / 4;
    for (int64_t g = 0; g < a.groups; ++g) {
        __m512i acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_set1_epi32(a.qbase[r * a.groups + g]);
        for (int64_t q = g * quads; q < (g + 1) * quads; ++q) {
            const __m512i wv = _mm512_load_si512(wbuf + q);
            for (int r = 0; r < R; ++r) {
                int32_t xp;
                std::memcpy(&xp, a.xq + r * a.K + 4 * q, 4);
                dpbusd(acc[r], wv, _mm512_set1_epi32(xp));
            }
        }
        q8_epilogue<R>(a, b, g, acc, tot);
    }
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]);
}

// ---- VNNI, a decode step's few rows: R rows times NB (1 or 2) 16-row blocks with each block's quads
// decoded in registers as the products need them (NibQuads, WideQuads: what quads_range stores), so
// each broadcast of x feeds both blocks and no block goes through a buffer. The epilogue is
// q8_epilogue's, in its order (the same bits as vnni_block). Measured against vnni_block on a block decoded whole
// first (2-core EPYC Zen 4, 2 threads, a Qwen2.5-1.5B layer): Q4_K 1 row 0.81 -> 0.45 ms, 4 rows
// 1.24 -> 0.89, 8 rows 1.96 -> 1.65; Q8_0 1 row 1.79 -> 1.28, 8 rows 2.95 -> 2.52.
template <int R, int NB, class Decode, bool OFF, bool BASED>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma"), flatten))
void vnni_blocks(const QRows& a, const Block* bs) {
    const Decode dec;
    constexpr int U = Decode::U;
    alignas(64) float tot[NB][R][16];
    for (int nb = 0; nb < NB; ++nb)
        for (int r = 0; r < R; ++r) _mm512_store_ps(tot[nb][r], _mm512_setzero_ps());
    const int64_t units = a.group / 4 / U;
    // Each unit's line of the next call's blocks (NB blocks of 16 rows x K codes further on: where this
    // thread reads next) is fetched to L2 as this call reads its own. Without it the codes' memory
    // time added to the products' instead of overlapping them (2-core Zen 4, 2 threads, int8
    // activations: the 0.5B's Q8_0 head, 151,936 x 896, 1 row 6.20 -> 4.81 ms, 8 rows 9.50 -> 6.71;
    // the 1.5B's Q6_K head 8 rows 16.2 -> 13.7; decode steps at 8 slots: the 0.5B 38.2 -> 30.6 ms,
    // the 1.5B 90.6 -> 76.5, SmolLM2 13.3 -> 12.1). Two calls ahead: the 0.5B's head 5.99 and 7.05 ms.
    const int64_t ahead = NB * 16 * a.K / U;
    for (int64_t g = 0; g < a.groups; ++g) {
        __m512i acc[NB][R];
        for (int nb = 0; nb < NB; ++nb)
            for (int r = 0; r < R; ++r) acc[nb][r] = _mm512_setzero_si512();
        for (int64_t u = g * units; u < (g + 1) * units; ++u) {
            typename Decode::State st[NB];
            for (int nb = 0; nb < NB; ++nb) {
                _mm_prefetch(reinterpret_cast<const char*>(bs[nb].w + ahead + u * 64), _MM_HINT_T1);
                st[nb] = dec.load(bs[nb].w, u);
            }
            for (int c = 0; c < U; ++c) {
                __m512i wv[NB];
                for (int nb = 0; nb < NB; ++nb) wv[nb] = dec.quad(st[nb], c);
                for (int r = 0; r < R; ++r) {
                    int32_t xp;
                    std::memcpy(&xp, a.xq + r * a.K + 4 * (u * U + c), 4);
                    const __m512i xv = _mm512_set1_epi32(xp);
                    for (int nb = 0; nb < NB; ++nb) dpbusd(acc[nb][r], wv[nb], xv);
                }
            }
        }
        // q8_epilogue's arithmetic, written out on the totals in L1: through q8_epilogue on a register
        // copy of them, 8 rows measured 8-10 % slower (Q4_K layer 1.75 -> 1.90 ms, Q8_0 2.55 -> 2.73)
        // (BASED: the base's integers added here, not as the accumulators' first value, the same
        // integers; and OFF, BASED template arguments, not branches: either measured slower, a Q4_K
        // layer of the 1.5B at 8 rows 1.62 -> 1.75-1.88 ms)
        for (int nb = 0; nb < NB; ++nb) {
            const __m512 sc = _mm512_load_ps(bs[nb].sc + g * 16);
            for (int r = 0; r < R; ++r) {
                const __m512 f = _mm512_mul_ps(sc, _mm512_set1_ps(a.xs[r * a.groups + g]));
                __m512i sum = acc[nb][r];
                if constexpr (BASED) sum = _mm512_add_epi32(sum, _mm512_set1_epi32(a.qbase[r * a.groups + g]));
                __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, _mm512_load_ps(tot[nb][r]));
                if constexpr (OFF)
                    t = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * a.groups + g]), _mm512_load_ps(bs[nb].of + g * 16), t);
                _mm512_store_ps(tot[nb][r], t);
            }
        }
    }
    for (int nb = 0; nb < NB; ++nb)
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(bs[nb].y + r * bs[nb].ldy, bs[nb].valid, _mm512_load_ps(tot[nb][r]));
}

template <class Decode, bool OFF, bool BASED>
void vnni_step(int64_t M, const QRows& a, const Block* bs, int nb) {
    switch (M * 2 + (nb - 1)) {
#define CASE(n) case 2 * n: vnni_blocks<n, 1, Decode, OFF, BASED>(a, bs); break; \
                case 2 * n + 1: vnni_blocks<n, 2, Decode, OFF, BASED>(a, bs); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}

// tiles: 0, 3 = C (rows x 16 int32), 1 = A (rows x group int8), 2 = B (group / 4 quads x 16 rows x 4)
inline void amx8_config(int rows, int64_t group) {  // (the file's flags: -mamx-tile)
    TileConfig c;
    c.rows[0] = rows; c.colsb[0] = 64;
    c.rows[3] = rows; c.colsb[3] = 64;
    c.rows[1] = rows; c.colsb[1] = static_cast<uint16_t>(group);
    c.rows[2] = static_cast<uint8_t>(group / 4); c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

template <int R>
inline void q8_from(const QRows& a, const Block& b, int64_t g, const int32_t* cbuf, __m512* tot) {
    __m512i acc[R];  // the tile's sums plus the base's (q8_epilogue): the integers VNNI's accumulator ends at
    for (int r = 0; r < R; ++r)
        acc[r] = _mm512_add_epi32(_mm512_load_si512(cbuf + r * 16), _mm512_set1_epi32(a.qbase[r * a.groups + g]));
    q8_epilogue<R>(a, b, g, acc, tot);
}

// Group g's product runs on C tile g % 2 while group g - 1's tile is stored and group g - 2's
// stored sums are scaled: the loads of a tile's store then find it written. RING: as amx_chunk's
// (the block's only chunk, its quads decoded INT8_AHEAD groups ahead into the ring from the codes at
// w by decoder; else its quads are wbuf and next decodes the next block's during the products).
template <int R, bool RING>
__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))
void amx8_chunk(const QRows& a, const Block& b, const __m512i* wbuf, const NextBlock& next, const uint8_t* w,
                void (*decoder)(const uint8_t*, int64_t, __m512i*, int64_t, int64_t, __m512i)) {
    alignas(64) int32_t cbuf[2][16 * 16];
    alignas(64) __m512i ring[RING ? RING_SLOTS : 1][16];  // a group's quads: group <= 64 (qmm8 checks)
    __m512 tot[R];
    for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
    const int64_t quads = a.group / 4;
    if constexpr (RING)
        for (int64_t g = 0; g < INT8_AHEAD && g < a.groups; ++g) decoder(w, a.K, ring[g], g * quads, (g + 1) * quads, __m512i{});
    for (int64_t g = 0; g < a.groups; ++g) {
        _tile_loadd(1, a.xq + g * a.group, a.K);
        _tile_loadd(2, RING ? ring[g % RING_SLOTS] : wbuf + g * quads, 64);
        if (g % 2 == 0) {
            _tile_zero(0);
            _tile_dpbsud(0, 1, 2);
            if (g) _tile_stored(3, cbuf[1], 64);
        } else {
            _tile_zero(3);
            _tile_dpbsud(3, 1, 2);
            _tile_stored(0, cbuf[0], 64);
        }
        if (g >= 2) q8_from<R>(a, b, g - 2, cbuf[g % 2], tot);
        if constexpr (RING) {
            const int64_t d = g + INT8_AHEAD;
            if (d < a.groups) decoder(w, a.K, ring[d % RING_SLOTS], d * quads, (d + 1) * quads, __m512i{});
        } else {
            next.part(g);
        }
    }
    const int64_t last = a.groups - 1;
    if (last % 2 == 0) _tile_stored(0, cbuf[0], 64);
    else _tile_stored(3, cbuf[1], 64);
    if (last >= 1) q8_from<R>(a, b, last - 1, cbuf[(last - 1) % 2], tot);
    q8_from<R>(a, b, last, cbuf[last % 2], tot);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]);
}

// Up to 8 rows (the ring's rows, an even number of groups of at most 32 columns): two groups per tile
// product. A tile product's cost does not depend on its rows, and at a decode step's rows the tile
// operations (two loads, a zero, the product, a store: about 50 cycles a group, measured) were as
// long as the decode and the memory. So the A tile stacks the rows twice, block-diagonally, over
// two groups' columns (x2: rows 0 .. R - 1 = [x of group 2h, 0], rows R .. 2R - 1 = [0, x of group
// 2h + 1]) and the B tile holds both groups' quads: C's rows 0 .. R - 1 are group 2h's integer
// sums and rows R .. 2R - 1 group 2h + 1's, the same integers as one group at a time.
template <int R>
void amx8_stack(const QRows& a, const Block& b, const int8_t* x2, const uint8_t* w,
                void (*decoder)(const uint8_t*, int64_t, __m512i*, int64_t, int64_t, __m512i)) {
    const int64_t quads = a.group / 4;
    stacked_loop<R, true, INT8_AHEAD>(
        a.groups / 2, x2, 2 * R * 2 * a.group, 2 * a.group,
        [&](int64_t h, __m512i* slot) { decoder(w, a.K, slot, 2 * h * quads, (2 * h + 2) * quads, __m512i{}); },
        [&](int64_t h, const int32_t* c, __m512* tot) {
            q8_from<R>(a, b, 2 * h, c, tot);
            q8_from<R>(a, b, 2 * h + 1, c + R * 16, tot);
        },
        [&](const __m512* tot) { for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(b.y + r * b.ldy, b.valid, tot[r]); });
}

// x fp32 [M, K] -> QRows' arrays: per row and group the scale, the int8 values (NIB: per 8 columns
// the even ones, then the odd ones), the sum of the rounded x (xs * sum(xq)) and base * sum(xq).
// Rows on torch's threads where there are at least QROWS_GRAIN values a thread (each row its own: the
// same bits): on one thread it took ~0.28 ns a value (2-core Zen 4), 250 us of a 99-row prompt
// chunk's product with Qwen2.5-1.5B's down projection (8,960 columns), 25 us at 8 rows.
constexpr int64_t QROWS_GRAIN = 32768;
void qrows(const float* x, int64_t M, int64_t K, int64_t group, int kind, int32_t base, int8_t* xq, float* xs,
           float* xsum, int32_t* qbase) {
    const int64_t groups = K / group;
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    at::parallel_for(0, M, std::max<int64_t>(1, QROWS_GRAIN / K), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
            for (int64_t g = 0; g < groups; ++g) {
                const float* v = x + m * K + g * group;
                __m512 amax = _mm512_setzero_ps();
                __mmask16 nan = 0;  // vmaxps drops a NaN (it returns its second operand): found apart
                for (int64_t k = 0; k < group; k += 16) {
                    const __m512 vk = _mm512_loadu_ps(v + k);
                    amax = _mm512_max_ps(amax, _mm512_abs_ps(vk));
                    nan |= _mm512_cmp_ps_mask(vk, vk, _CMP_UNORD_Q);
                }
                // a NaN in the group makes its scale NaN, so the row's products are NaN (as the bf16
                // product's are), not the finite sums of a NaN rounded to -128; an inf makes it inf (0 * inf)
                const float mx = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(amax);
                xs[m * groups + g] = mx / 127.0f;
                // a group whose largest |x| is below ~127 / FLT_MAX (denormals) rounds to zeros: 127 / mx
                // is inf there, and x * inf rounded every value, zeros and positives too, to -128
                const float rcp = 127.0f / mx;
                const __m512 inv = _mm512_set1_ps(mx > 0.0f && rcp <= std::numeric_limits<float>::max() ? rcp : 0.0f);
                int8_t* out = xq + m * K + g * group;
                __m512i isum = _mm512_setzero_si512();
                for (int64_t k = 0; k < group; k += 16) {
                    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + k), inv));
                    isum = _mm512_add_epi32(isum, q);
                    __m128i b = _mm512_cvtsepi32_epi8(q);
                    if (kind == NIB) b = _mm_shuffle_epi8(b, order);
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), b);
                }
                // the sum of the rounded values, as llama.cpp's Q8_1 s and Q8_K bsums: base * sum(xq) goes
                // into the integer sums and xs * sum(xq) meets the offsets, so both multiply what the codes'
                // sums multiply, and a code held as u = code - base loses nothing to base (Q6_K codes held as
                // bytes, u = code + 128: sum(x) here once put 128 * scale * sum(x - xs * xq) into the result,
                // ~8 % of a random layer's product where the rounding's own error is up to 1.5 %)
                const int32_t total = _mm512_reduce_add_epi32(isum);  // |total| <= 127 * group
                xsum[m * groups + g] = xs[m * groups + g] * static_cast<float>(total);
                // (in int64: a row with an inf sums INT_MIN codes; its products are non-finite anyway)
                qbase[m * groups + g] = static_cast<int32_t>(static_cast<int64_t>(base) * total);
            }
        }
    });
}

// n bytes (64-aligned) of the calling thread's scratch for qmm8's rounded rows, kept between calls and
// grown as needed (its contents do not outlive the call that asked)
uint8_t* q8_scratch(int64_t n) {
    thread_local std::unique_ptr<uint8_t, decltype(&std::free)> mem(nullptr, &std::free);
    thread_local int64_t size = 0;
    if (n > size) {
        size = (n + 4095) / 4096 * 4096;
        mem.reset(static_cast<uint8_t*>(std::aligned_alloc(64, size)));
        TORCH_CHECK(mem, "qmm8: could not allocate ", size, " bytes of scratch");
    }
    return mem.get();
}

}  // namespace

bool has_q8() {  // the CPU's VNNI and VBMI (the AMX-INT8 tiles as has_amx())
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}

// qmm with x rounded to int8 per row and group (above): x fp32 [M, K]; any kind; amx: rows
// above vnni_rows on AMX-INT8 tiles (M <= 16 or a multiple of 16 there), else all on VNNI.
torch::Tensor qmm8(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t low, torch::Tensor sd, torch::Tensor sq,
                   int64_t sshift, torch::Tensor od, torch::Tensor oq, int64_t oshift, int64_t group, int64_t N,
                   bool amx, int64_t vnni_rows) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [M, K]");
    TORCH_CHECK(has_q8(), "int8 activations need AVX-512 VNNI and VBMI");
    TORCH_CHECK(kind >= NIB && kind <= SIX, "kind: 0, 1, 2 or 3");
    const int64_t base = kind == NIB || kind == SIX ? low : -128;  // code = u + base (MAGIC, WIDE: u = code + 128)
    const int64_t M = x.size(0), K = x.size(1), blocks = (N + 15) / 16, groups = K / group;
    TORCH_CHECK(group % 16 == 0 && K % group == 0 && (kind != NIB || group % 8 == 0), "K: whole groups of 16 or 32 columns");
    TORCH_CHECK(sd.numel() > 0, "scales: d is required");
    const Factors sf = factors(sd, sq, sshift, blocks, groups, "scales"), of = factors(od, oq, oshift, blocks, groups, "offsets");
    TORCH_CHECK(packed.numel() == blocks * K * column_bytes(kind), "codes do not fit the blocked layout");
    const bool tiles = amx && M > vnni_rows;
    if (tiles) {
        TORCH_CHECK(group <= 64, "AMX: groups of at most 64 columns");
        TORCH_CHECK(M <= 16 || M % 16 == 0, "AMX: up to 16 rows, or a multiple of 16");
        TORCH_CHECK(amx_ready(), "AMX: the OS refused the tile state (arch_prctl)");
    }
    auto y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    // x rounded (xq [M, K]), its scales and sums (xs, xsum [M, groups]) in this thread's scratch, not
    // three tensors a call: a decode step makes one call per product (~120-200), and the tensors and
    // their views cost ~6 dispatched operations each (SmolLM2 at 8 slots: 1,612 operations a step
    // against bf16's 1,006)
    const int64_t q_bytes = (M * K + 63) / 64 * 64;
    uint8_t* scratch = q8_scratch(q_bytes + 3 * M * groups * static_cast<int64_t>(sizeof(float)));
    int8_t* xq = reinterpret_cast<int8_t*>(scratch);
    float* xs = reinterpret_cast<float*>(scratch + q_bytes);
    int32_t* qbase = reinterpret_cast<int32_t*>(xs + 2 * M * groups);
    qrows(x.data_ptr<float>(), M, K, group, static_cast<int>(kind), static_cast<int32_t>(base), xq, xs, xs + M * groups,
          qbase);
    const QRows a{xq, xs, xs + M * groups, qbase, K, group, groups, base != 0};
    const bool off = od.numel() > 0;  // offsets (a group's additive term; the base is in the integer sums)
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
    float* yp = y.data_ptr<float>();
    const int64_t block_bytes = K * column_bytes(kind);
    const auto decoder = kind == NIB ? quads_range<NIB> : kind == SIX ? quads_range<SIX> : quads_range<WIDE>;
    const bool ring = tiles && M <= 16;  // the tiles' one chunk of rows: its quads through amx8_chunk's ring
    const bool stack = ring && M <= 8 && groups % 2 == 0 && group <= 32;  // and two groups a tile product
    torch::Tensor x2;
    if (stack) {
        x2 = torch::empty({K * 2 * M}, x.options().dtype(torch::kChar));
        stack_rows<int8_t>(a.xq, M, K, group, x2.data_ptr<int8_t>());
    }
    // VNNI: vnni_blocks per QR rows, each pair of blocks decoded in registers again for every QR rows
    // (the decode's operations run beside the dot products': taking them out left a layer's time
    // unchanged), but for 6-bit codes (their in-register decode measured slower than a block decoded
    // whole first: a Q6_K layer at 8 rows 2.90 -> 3.25 ms, 1 row 1.49 -> 1.65). Up to IN_REGISTER_ROWS
    // rows for byte codes, every row count for 4-bit ones; else each block decoded whole into wbuf
    // first, then vnni_block per QR rows (one block a broadcast of x). Measured on a Qwen2.5-1.5B
    // layer (2-core Zen 4, 2 threads, both in one process, decoded whole -> in registers): Q4_K 16
    // rows 3.40 -> 2.83 ms, 64 rows 11.7 -> 10.6, 100 rows 17.4 -> 16.3, 128 rows 22.0 -> 20.9, 512
    // rows 96.2 -> 93.6; Q6_K codes as bytes 16 rows 4.42 -> 3.57, 64 rows 13.3 -> 12.8, 100 rows
    // 19.3 -> 19.6, 512 rows 104.5 -> 110.7; 8 rows (in registers before too) even. The same
    // integers and epilogue either way, so the same bits.
    const bool in_registers = !tiles && kind != SIX && (kind == NIB || M <= IN_REGISTER_ROWS);
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        // the tiles above 16 rows: two blocks' quads, this block's and the next one's (decoded during this
        // one's products); VNNI with the blocks decoded whole: one block's
        std::unique_ptr<__m512i, decltype(&std::free)> wmem(
            ring || in_registers ? nullptr
                                 : static_cast<__m512i*>(std::aligned_alloc(64, (tiles ? 2 : 1) * (K / 4) * sizeof(__m512i))),
            &std::free);
        // scales and additive terms, fp32 [groups, 16] each: one block's, two for vnni_blocks
        std::unique_ptr<float, decltype(&std::free)> fbuf(
            static_cast<float*>(std::aligned_alloc(64, 4 * groups * 16 * sizeof(float))), &std::free);
        float* sbuf = fbuf.get();
        float* obuf = off ? sbuf + groups * 16 : nullptr;
        if (in_registers) {  // two blocks a call (each broadcast of x feeds both), quads decoded in registers
            for (int64_t i = b0; i < b1;) {
                const int nb = i + 1 < b1 ? 2 : 1;
                Block bs[2];
                for (int j = 0; j < nb; ++j) {
                    const int64_t valid = std::min<int64_t>(16, N - (i + j) * 16);
                    float* sj = sbuf + j * 2 * groups * 16;
                    float* oj = off ? sj + groups * 16 : nullptr;
                    expand(sf.of_block(i + j), of.of_block(i + j), 0.0f, groups, sj, oj);
                    bs[j] = Block{wp + (i + j) * block_bytes, sj, oj, yp + (i + j) * 16, N,
                                  static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1)};
                }
                // the formats' cases: 4-bit codes with offsets from base 0 (Q4_1, Q4_K) or none from -8
                // (Q4_0); bytes from base -128 with offsets (Q5_1, Q5_K) or none (Q5_0, Q6_K, Q8_0)
                for (int64_t m0 = 0; m0 < M; m0 += QR) {  // QR rows a call, the blocks' codes from L1
                    const int64_t r = std::min<int64_t>(QR, M - m0);
                    QRows part = a;
                    part.xq = a.xq + m0 * K;
                    part.xs = a.xs + m0 * groups;
                    part.xsum = a.xsum + m0 * groups;
                    part.qbase = a.qbase + m0 * groups;
                    Block out[2] = {bs[0], bs[1]};
                    for (int j = 0; j < nb; ++j) out[j].y = bs[j].y + m0 * N;
                    if (kind == NIB && off && !a.based) vnni_step<NibQuads, true, false>(r, part, out, nb);
                    else if (kind == NIB && off) vnni_step<NibQuads, true, true>(r, part, out, nb);
                    else if (kind == NIB) vnni_step<NibQuads, false, true>(r, part, out, nb);
                    else if (off) vnni_step<WideQuads, true, true>(r, part, out, nb);
                    else vnni_step<WideQuads, false, true>(r, part, out, nb);
                }
                i += nb;
            }
            return;
        }
        if (stack) stack_config(static_cast<int>(M), group, 1);
        else if (tiles) amx8_config(static_cast<int>(std::min<int64_t>(M, 16)), group);
        if (tiles && !ring) decoder(wp + b0 * block_bytes, K, wmem.get(), 0, K / 4, __m512i{});
        for (int64_t i = b0; i < b1; ++i) {
            const int64_t valid = std::min<int64_t>(16, N - i * 16), cur = tiles ? (i - b0) % 2 : 0;
            __m512i* wbuf = ring ? nullptr : wmem.get() + cur * (K / 4);
            expand(sf.of_block(i), of.of_block(i), 0.0f, groups, sbuf, obuf);
            // VNNI (a few rows, the memory the bound): the block decoded whole first (decoding the next
            // block during the products measured slower there: 0.96 against 0.86 ms a layer at 1 row)
            NextBlock next;
            if (!tiles) decoder(wp + i * block_bytes, K, wbuf, 0, K / 4, __m512i{});
            else if (!ring && i + 1 < b1) next = NextBlock{decoder, wp + (i + 1) * block_bytes, K, group / 4, wmem.get() + (1 - cur) * (K / 4), __m512i{}};
            const Block b{nullptr, sbuf, obuf, yp + i * 16, N, static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1)};
            const int64_t step = tiles ? 16 : QR;
            for (int64_t m0 = 0; m0 < M; m0 += step) {
                QRows part = a;
                part.xq = a.xq + m0 * K;
                part.xs = a.xs + m0 * groups;
                part.xsum = a.xsum + m0 * groups;
                part.qbase = a.qbase + m0 * groups;
                Block out = b;
                out.y = b.y + m0 * N;
                const int64_t r = std::min<int64_t>(step, M - m0);
                if (stack) {
                    const uint8_t* w = wp + i * block_bytes;
                    const int8_t* xs2 = x2.data_ptr<int8_t>();
                    switch (r) {
#define CASE(n) case n: amx8_stack<n>(part, out, xs2, w, decoder); break;
                        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
                    }
                } else if (tiles) {
                    const NextBlock& during = m0 == 0 ? next : NextBlock{};
                    const uint8_t* w = wp + i * block_bytes;
                    switch (r + (ring ? 16 : 0)) {
#define CASE(n) case n: amx8_chunk<n, false>(part, out, wbuf, during, w, decoder); break; \
                    case n + 16: amx8_chunk<n, true>(part, out, wbuf, during, w, decoder); break;
                        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
                        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
                    }
                } else {
                    switch (r) {
#define CASE(n) case n: vnni_block<n>(part, out, wbuf); break;
                        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
                    }
                }
            }
        }
        if (tiles) _tile_release();
    });
    return y;
}

// ---- Many rows (a prefill chunk): each 16-row block's weights decoded once into bf16 B tiles with
// their scales and offsets applied (bf16(fl(scale * code) + offset): the file's weight rounded to
// bf16, as dequant_t(bf16) gives it), then every 16 activation rows multiply them over all of K in
// one C tile (tdpbf16ps per 32 columns, no per-group work): the products of a GEMM library on a
// bf16 weight, with the weight at rest still as stored.
namespace {

// pair p of a block as two fp32 vectors (columns 2p, 2p + 1; lane j = row j), codes only
inline void codes_f32(int64_t kind, const uint8_t* w, int64_t p, int64_t low, __m512* c) {
    const __m512i low_v = _mm512_set1_epi32(static_cast<int>(low));
    if (kind == SIX) {
        const __m512i u = six_u(w, p);
        c[0] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0xFFFF)), low_v));
        c[1] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_srli_epi32(u, 16), low_v));
    } else if (kind == NIB) {
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
        c[0] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_and_si512(d, _mm512_set1_epi32(15)), low_v));
        c[1] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_srli_epi32(d, 4), low_v));
    } else {
        const __m512i d = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
        c[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 16), 16));
        c[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(d, 16));
    }
}

// one block's weights as bf16 B tiles: wbuf[p] = pair p's 16 rows x (column 2p, 2p + 1)
void bf16_block(int64_t kind, const uint8_t* w, int64_t K, int64_t group, int64_t low, const Factor& sf,
                const Factor& of, bool off, __m512i* wbuf) {
    const int64_t pairs = group / 2, bytes = K * column_bytes(kind);
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t g = 0; g < K / group; ++g) {
        const __m512 s = factor(sf, g);
        const __m512 o = off ? factor(of, g) : _mm512_setzero_ps();
        for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
            if (p % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + bytes + p * 2 * column_bytes(kind)), _MM_HINT_T1);
            __m512 c[2];
            codes_f32(kind, w, p, low, c);
            __m512 v0 = _mm512_mul_ps(c[0], s), v1 = _mm512_mul_ps(c[1], s);  // then the offset, as dequantize()
            if (off) { v0 = _mm512_add_ps(v0, o); v1 = _mm512_add_ps(v1, o); }
            // cvtne2ps: v0's 16 bf16 low, v1's high; interleave to (v0[j], v1[j]) pairs
            _mm512_store_si512(wbuf + p, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(v1, v0)));
        }
    }
}

}  // namespace

// x: bf16 [M, K], M a multiple of 16; the weight as qmm takes it. Returns fp32 [M, N]: x times the
// weight rounded to bf16, fp32 sums (AMX-BF16).
torch::Tensor qmm_tiles(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t low, torch::Tensor sd,
                        torch::Tensor sq, int64_t sshift, torch::Tensor od, torch::Tensor oq, int64_t oshift,
                        int64_t group, int64_t N) {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
    const int64_t M = x.size(0), K = x.size(1), blocks = (N + 15) / 16, groups = K / group;
    TORCH_CHECK(M % 16 == 0, "rows: a multiple of 16");
    TORCH_CHECK(group % 2 == 0 && K % group == 0 && K % 32 == 0, "K: whole groups, a multiple of 32");
    TORCH_CHECK(kind >= NIB && kind <= SIX && (kind != SIX || group % 4 == 0), "kind: 0, 1, 2 or 3");
    TORCH_CHECK(packed.numel() == blocks * K * column_bytes(kind), "codes do not fit the blocked layout");
    TORCH_CHECK(sd.numel() > 0, "scales: d is required");
    TORCH_CHECK(amx_ready(), "AMX: the OS refused the tile state (arch_prctl)");
    const Factors sf = factors(sd, sq, sshift, blocks, groups, "scales"), of = factors(od, oq, oshift, blocks, groups, "offsets");
    const bool off = od.numel() > 0;
    auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
    if (M == 0 || N == 0) return y;
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
    float* yp = y.data_ptr<float>();
    const int64_t block_bytes = K * column_bytes(kind);
    // two weight blocks (32 output columns) a task: 2 x 2 C tiles, so each A and B tile loaded serves two
    // tile products
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
        std::unique_ptr<__m512i, decltype(&std::free)> wbuf(
            static_cast<__m512i*>(std::aligned_alloc(64, K * sizeof(__m512i))), &std::free);
        __m512i* wb[2] = {wbuf.get(), wbuf.get() + K / 2};
        alignas(64) float cbuf[16 * 16];
        TileConfig c;  // 0-3 = C (16 x 16 fp32: rows h, block b at 2 h + b); 4, 5 = A (16 rows x 32 bf16); 6, 7 = B
        for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
        _tile_loadconfig(&c);
        for (int64_t pr = p0; pr < p1; ++pr) {
            const int64_t i0 = 2 * pr, nb = std::min<int64_t>(2, blocks - i0);
            for (int64_t b = 0; b < 2; ++b)  // a missing second block: zero weights, its sums unused
                if (b < nb) bf16_block(kind, wp + (i0 + b) * block_bytes, K, group, low, sf.of_block(i0 + b),
                                       of.of_block(i0 + b), off, wb[b]);
                else std::memset(static_cast<void*>(wb[b]), 0, K / 2 * sizeof(__m512i));
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const bool two = m0 + 16 < M;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t t = 0; t < K / 32; ++t) {
                    _tile_loadd(6, wb[0] + t * 16, 64);
                    _tile_loadd(7, wb[1] + t * 16, 64);
                    _tile_loadd(4, xp + m0 * K + t * 32, K * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, xp + (m0 + 16) * K + t * 32, K * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int h = 0; h < (two ? 2 : 1); ++h)
                    for (int64_t b = 0; b < nb; ++b) {
                        const int64_t valid = std::min<int64_t>(16, N - (i0 + b) * 16);
                        float* out = yp + (m0 + 16 * h) * N + (i0 + b) * 16;
                        float* dst = valid == 16 ? out : cbuf;
                        const int64_t ld = valid == 16 ? N * 4 : 64;
                        switch (2 * h + b) {  // tile numbers are immediates
                            case 0: _tile_stored(0, dst, ld); break;
                            case 1: _tile_stored(1, dst, ld); break;
                            case 2: _tile_stored(2, dst, ld); break;
                            default: _tile_stored(3, dst, ld);
                        }
                        if (valid < 16)
                            for (int r = 0; r < 16; ++r)
                                _mm512_mask_storeu_ps(out + r * N, static_cast<__mmask16>((1u << valid) - 1),
                                                      _mm512_load_ps(cbuf + r * 16));
                    }
            }
        }
        _tile_release();
    });
    return y;
}

// The transposed weight W.T [K, N] (fp32: exactly dequantize()'s values, fl(scale * code) + offset;
// or those rounded to bf16, nearest even), for products with many rows on a GEMM library.
torch::Tensor dequant_t(torch::Tensor packed, int64_t kind, int64_t low, torch::Tensor sd, torch::Tensor sq,
                        int64_t sshift, torch::Tensor od, torch::Tensor oq, int64_t oshift, int64_t group, int64_t N,
                        int64_t K, bool bf16) {
    const int64_t blocks = (N + 15) / 16, groups = K / group, pairs = group / 2;
    TORCH_CHECK(group % 2 == 0 && K % group == 0, "K must be a multiple of the (even) group");
    TORCH_CHECK(kind >= NIB && kind <= SIX && (kind != SIX || group % 4 == 0), "kind: 0, 1, 2 or 3 (SIX: group % 4 == 0)");
    TORCH_CHECK(packed.numel() == blocks * K * column_bytes(kind), "codes do not fit the blocked layout");
    TORCH_CHECK(sd.numel() > 0, "scales: d is required");
    const Factors sf = factors(sd, sq, sshift, blocks, groups, "scales"), of = factors(od, oq, oshift, blocks, groups, "offsets");
    const bool off = od.numel() > 0;
    auto out = torch::empty({K, N}, torch::TensorOptions().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
    char* outp = static_cast<char*>(out.data_ptr());
    const int64_t esize = bf16 ? 2 : 4, block_bytes = K * column_bytes(kind);
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t valid = std::min<int64_t>(16, N - b * 16);
            const __mmask16 m = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
            const uint8_t* w = wp + b * block_bytes;
            const Factor bs = sf.of_block(b), bo = of.of_block(b);
            for (int64_t g = 0; g < groups; ++g) {
                const __m512 s = factor(bs, g);
                const __m512 o = off ? factor(bo, g) : _mm512_setzero_ps();
                for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
                    __m512 c[2];
                    codes_f32(kind, w, p, low, c);
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

// The SIX decode on VBMI (SixVbmi) or not (six_u), for tests comparing the two: sets it where the
// CPU has VBMI; returns what it was.
bool six_vbmi(bool on) {
    const bool was = SIX_VBMI;
    __builtin_cpu_init();
    SIX_VBMI = on && __builtin_cpu_supports("avx512vbmi");
    return was;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("six_vbmi", &six_vbmi, "use the VBMI decode of 6-bit codes where the CPU has it (tests); returns the last setting");
    m.def("qmm", &qmm, "y = x @ W.T, W GGUF-quantised as codes and per-group scales (AMX-BF16 or AVX-512 BF16)", py::call_guard<py::gil_scoped_release>());
    m.def("dequant_t", &dequant_t, "W.T [K, N] as fp32 (exact) or bf16, from the blocked codes and scale factors", py::call_guard<py::gil_scoped_release>());
    m.def("pack_six", &pack_six, "int8 codes [N, K] -> the 6-bit blocked layout (u = code - low)", py::call_guard<py::gil_scoped_release>());
    m.def("unpack_blocked", &unpack_blocked, "GGUF tensors' stored rows, stacked -> the blocked codes and factors, and each part's code range");
    m.def("qmm_tiles", &qmm_tiles, "y = x @ W.T for many rows: W decoded to bf16 tiles per block, AMX-BF16 over all of K", py::call_guard<py::gil_scoped_release>());
    m.def("qmm8", &qmm8, "y = x @ W.T with x rounded to int8 per row and group (AVX-512 VNNI or AMX-INT8)", py::call_guard<py::gil_scoped_release>());
    m.def("has_q8", &has_q8, "whether this CPU runs qmm8 (AVX-512 VNNI and VBMI)");
    m.def("has_amx", &has_amx, "whether this process may use AMX tiles (asks the OS once)");
}
