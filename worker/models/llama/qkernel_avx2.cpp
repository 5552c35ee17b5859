// y = x @ W.T for a GGUF block-quantised W in qkernel.cpp's blocked layout (16 output rows a
// block; qkernel_pack.h packs and loads it), on a CPU with AVX2, FMA and F16C but no AVX-512 (AMD
// Zen 2/3, Intel Haswell to Alder Lake): what qkernel.cpp's qmm8 computes, with int8 activations.
//
// x is rounded per row and group to int8 exactly as qkernel.cpp's qrows rounds it (xs = max|x| /
// 127, xq = nearest(x / xs); the same operations, so the same bytes), the integer sums
// sum_{k in g} code[n, k] * xq[m, k] are exact, and the epilogue is qmm8's in its order:
//     tot += fp32(isum) * (scale[n, g] * xs[m, g]);  tot += xsum[m, g] * offset[n, g]
// (fp32, no contraction: -ffp-contract=off, FMA where qkernel.cpp has one), so a row's result has
// the same bits here as on AVX-512 VNNI, whatever rows run beside it.
//
// The integer sums use vpmaddubsw (unsigned codes u = code - base times signed xq, pairs summed to
// int16 with saturation) then vpmaddwd by ones (int16 pairs to int32), llama.cpp's AVX2 dot
// product. A pair sum must stay inside int16: 4-bit codes (u <= 15) keep up to 8 quads (32
// columns) in int16 before widening (8 * 2 * 15 * 127 = 30,480); byte codes in [-64, 63] are held
// from base low (u <= 127: one quad a widening; a block whose u are all <= 63, as Q6_K's, two quads:
// 2 * 2 * 63 * 127 = 32,004; all <= 31, as Q5's, four: 4 * 2 * 31 * 127 = 31,496); any int8 code
// (WIDE, Q8_0) multiplies |code| by xq carrying the code's sign (vpsignb, as llama.cpp's
// mul_sum_i8_pairs: |code| <= 128, so a pair sum <= 32,512; vpmaddwd on int16 codes instead
// measured 7-40 % slower, and code + 128's two nibbles each summed as NIB's 5-11 % slower).
// vpmaddubsw takes quads: dword j = row j's 4 codes, two ymm of 8 rows a quad. The codes are held in
// the quad layout (qkernel_pack.h's SS_QUAD_LAYOUT: rows as dwords, MAGIC as u = code - low), where a
// block's MAGIC quads are its bytes as they lie and its 4-bit quads an AND (or a shift and an AND)
// away: MAGIC blocks, and 4-bit and int8 ones (WIDE, |code| taken in the loop) in calls of up to
// 32 rows, multiply where they lie; in longer calls (prefill) those are decoded once per call into a
// per-thread buffer that every QR rows then multiply. Against the column-pair layout with
// every block decoded first (a 4 x 16 transpose a quad), one thread, 2-core AMD EPYC Zen 3: Q4_K
// 8,960 x 1,536 at 1 row 0.59 -> 0.35 ms, 8 rows 1.61 -> 1.36, 32 rows even; Q6_K 1,536 x 8,960 at 1
// row 0.78 -> 0.45, 8 rows 2.21 -> 1.76; Q5_0 4,864 x 896 at 1 row 0.172 -> 0.104, 8 rows 0.54 ->
// 0.44; Q8_0 4,864 x 896 at 1 row 0.235 -> 0.112, 8 rows 0.74 -> 0.63. x's quads are broadcast in
// the loop (vpbroadcastd from the rounded row). A copy of x broadcast in memory for decode-sized
// calls (vpmaddubsw's load operand, no broadcast operation) was faster on one weight called again
// and again, but slower in a model's sequence of products, where its M * K * 8 bytes compete with the
// streamed weights for L2 (a step's linears in turns, 2 threads, Zen 3, without it: Qwen2.5-0.5B at 8
// rows 1.04-1.21x, 32 rows 1.04-1.05x; the 1.5B 1.06x and 1.05-1.08x; SmolLM2 1.10x; its LM heads
// 1.00-1.13x): gone. 6-bit codes (SIX) are held only where AMX tiles run (qkernel.six_bits), never here.
//
// What bounds it (2-core AMD EPYC Zen 3, one thread, 2026-12-07): a Q5_0 block held in L1 and multiplied
// again and again runs 28-31 multiply-adds a cycle at 8 rows, about what blocks streamed from memory
// run (25-29; Q6_K 22-26, Q8_0 20-22): the products are bound in the core, not by memory. The same loop
// alone (4 rows x 16 outputs, widened every 4 quads, no groups or epilogue), in a standalone test, ran
// 47 a cycle with x from memory and 63 without the widening (vpmaddubsw's peak, 2 a cycle); a build
// without the fp32 epilogue ran a step's linears 1.14-1.17x faster. The rest is vector operations a
// quad besides vpmaddubsw (a vpaddw each, a broadcast per row, the widening) on Zen 3's 4 pipes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#define SS_QUAD_LAYOUT  // rows as dwords (qkernel_pack.h): a block's quads are its bytes as they lie
#include "qkernel_pack.h"  // the layout's kinds, Factors, packing and GGUF loading (shared with qkernel.cpp)

namespace {

constexpr int QR = 4;  // activation rows a pass: 2 QR accumulators of 8 lanes, with the quad and x in 16 ymm
// the most rows whose products decode 4-bit codes in the loop (qmm8), each 4-row pass again; above,
// a block is decoded once into the buffer (Q4_K 8,960 x 1,536, one thread, Zen 3: in the loop 16 rows
// 2.61 ms against 3.00, 32 rows 5.32 against 5.76; 512 rows 80.7 against 76.7)
constexpr int64_t NIB_DIRECT_ROWS = 32;
// and int8 codes (WIDE: |code| taken in the loop; Q8_0 4,864 x 896: 1 row 0.235 -> 0.112 ms, 8 rows
// 0.739 -> 0.627, 16 1.33 -> 1.25, 32 even; 64 rows 5.19 against 4.97, 512 rows 39.1 against 38.4)
constexpr int64_t WIDE_DIRECT_ROWS = 32;
// calls of up to this many rows prefetch the next block's codes while multiplying one (rows_block): a
// group's share of them each group of the first 4-row pass, into L1. Decode-sized products wait on
// memory between blocks otherwise (a 16-row block of Q4_K 17,920 x 1,536 takes ~1 us at 1 row): the
// same product cycling through 28 copies (more than the caches hold) against one copy again and
// again, one thread, 8 rows, 1.36 against 1.02 ms. With it (2-core AMD EPYC Zen 3, the copies in turn,
// the same bits): Q4_K 17,920 x 1,536 on 2 threads at 1 row 0.667 -> 0.581 ms, 8 rows 1.594 -> 1.508,
// 32 rows 5.62 -> 5.50; Q5_0 9,728 x 896 at 8 rows 0.733 -> 0.647; Q8_0 4,864 x 896 at 8 rows 0.404
// -> 0.376; one thread Q4_K at 1 row 1.34 -> 1.10, Q5_0 at 8 rows 1.45 -> 1.26. Prefetching 2 or 4
// blocks ahead, or into L2, or the next block's scales too, measured the same; at 512 rows -2 % to
// +5 % (noise): not there.
constexpr int64_t PREFETCH_ROWS = 64;

// a per-group factor of one 16-row block, rows h * 8 .. h * 8 + 7: fp32(d[g >> shift]) * fp32(q[g])
inline __m256 factor8(const Factor& f, int64_t g, int h) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.d + (g >> f.shift) * 16 + h * 8)));
    if (!f.q) return d;
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(f.q + g * 16 + h * 8));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(f.q_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b)));
}

// One block's scales and offsets as fp32 [groups, 16]: qkernel.cpp's expand with zero 0, in its
// operations (offset - 0 * scale, one fnmadd: a scale of inf makes the offset NaN there, so the
// same here, and not the offset alone)
void expand(const Factor& s, const Factor& o, int64_t groups, float* sbuf, float* obuf) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g)
        for (int h = 0; h < 2; ++h) {
            const __m256 sv = factor8(s, g, h);
            _mm256_store_ps(sbuf + g * 16 + h * 8, sv);
            if (obuf) _mm256_store_ps(obuf + g * 16 + h * 8, _mm256_fnmadd_ps(zero, sv, factor8(o, g, h)));
        }
}

// quads of one 16-row block: wbuf[2 q + h] = quad q's rows 8 h .. 8 h + 7 (dword j = row's 4 codes
// as unsigned bytes; WIDE: signed codes, with their absolute values at wbuf[2 (K / 4) + 2 q + h])
int decode_block(int kind, const uint8_t* w, int64_t K, __m256i* wbuf) {
    const __m256i* v = reinterpret_cast<const __m256i*>(w);  // the quad layout: rows 0-7 and 8-15 of a unit
    if (kind == NIB) {  // per 8 columns (a unit of 4 pair bytes a row): quads (0, 2, 4, 6) and (1, 3, 5, 7)
        const __m256i nib = _mm256_set1_epi8(15);
        for (int64_t t = 0; t < K / 8; ++t) {
            const __m256i lo = _mm256_loadu_si256(v + 2 * t), hi = _mm256_loadu_si256(v + 2 * t + 1);
            _mm256_store_si256(wbuf + 4 * t, _mm256_and_si256(lo, nib));
            _mm256_store_si256(wbuf + 4 * t + 1, _mm256_and_si256(hi, nib));
            _mm256_store_si256(wbuf + 4 * t + 2, _mm256_and_si256(_mm256_srli_epi16(lo, 4), nib));
            _mm256_store_si256(wbuf + 4 * t + 3, _mm256_and_si256(_mm256_srli_epi16(hi, 4), nib));
        }
        return 15;
    }
    // MAGIC, WIDE: per quad (4 columns) rows 0-7 and 8-15, dword j = row j's 4 u (MAGIC) or codes (WIDE)
    const int64_t quads = K / 4;
    __m256i top = _mm256_setzero_si256();  // MAGIC: the block's largest u
    for (int64_t q = 0; q < quads; ++q) {
        const __m256i r0 = _mm256_loadu_si256(v + 2 * q), r1 = _mm256_loadu_si256(v + 2 * q + 1);
        if (kind == MAGIC) {
            top = _mm256_max_epu8(top, _mm256_max_epu8(r0, r1));
        } else {
            _mm256_store_si256(wbuf + 2 * quads + 2 * q, _mm256_abs_epi8(r0));
            _mm256_store_si256(wbuf + 2 * quads + 2 * q + 1, _mm256_abs_epi8(r1));
        }
        _mm256_store_si256(wbuf + 2 * q, r0);
        _mm256_store_si256(wbuf + 2 * q + 1, r1);
    }
    if (kind != MAGIC) return 255;
    alignas(32) uint8_t t[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), top);
    return *std::max_element(t, t + 32);
}

// the largest u of a MAGIC block in the quad layout (K * 16 bytes)
int block_top(const uint8_t* w, int64_t K) {
    const __m256i* v = reinterpret_cast<const __m256i*>(w);
    __m256i top = _mm256_setzero_si256();
    for (int64_t i = 0; i < K / 2; ++i) top = _mm256_max_epu8(top, _mm256_loadu_si256(v + i));
    alignas(32) uint8_t t[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), top);
    return *std::max_element(t, t + 32);
}

struct QRows {
    const int8_t* xq;      // [M, K], NIB: per 8 columns the even ones, then the odd ones
    const float* xs;       // [M, groups]
    const float* xsum;     // [M, groups]: xs * sum(xq)
    const int32_t* qbase;  // [M, groups]: base * sum(xq)
    int64_t K, group, groups;
};

struct Block {
    const __m256i* wbuf;  // decode_block's quads
    const float* sc;      // [groups, 16]
    const float* of;      // [groups, 16] or null
    float* y;             // y[0, n0]
    int64_t ldy, valid;   // rows of the block that exist
    const uint8_t* next = nullptr;  // codes to prefetch a group's share of each group (PREFETCH_ROWS), or null
    int64_t next_bytes = 0;         // bytes of them a group
};

inline int32_t x_quad(const QRows& a, int r, int64_t q) {
    int32_t v;
    std::memcpy(&v, a.xq + r * a.K + 4 * q, 4);
    return v;
}

// row r's quad q of x in all 8 dwords (vpbroadcastd)
inline __m256i x_at(const QRows& a, int r, int64_t q) { return _mm256_set1_epi32(x_quad(a, r, q)); }

// The NIB inner loop of a 4-row pass (QR rows: every pass of decode and prefill past 3 rows) as
// inline assembly. Compiled from the intrinsics (rows_block's loop, which R < 4 still runs), GCC 12
// -O3 rotated the 8 int16 accumulators through a vmovdqa copy each a quad (30 instructions a quad
// where 18 do the work: the front end, 6 a cycle on Zen 3, bound the loop rather than vpmaddubsw's
// 2 a cycle) and, with x broadcast in the loop, spilled one to the stack. Here each accumulator
// stays in its register ("+x"), and the operations are the intrinsics' own (integer sums: the same
// bits). A Q4_K product, one thread, 2-core AMD EPYC Zen 3 (same runs): 8,960 x 1,536 at 32 rows
// 5.85 -> 5.39 ms, 512 rows 99 -> 80; 1,536 x 8,960 (x broadcast) at 8 rows 2.13 -> 1.78, 32 rows
// 7.13 -> 5.54. MAGIC (paired) and WIDE written the same way measured no faster (Q6_K, Q8_0 at 8,
// 32 and 512 rows): their loops are bound by the multiply pipes, not by the copies. AT&T operand
// order: vpmaddubsw m, w, t is t = maddubs(w unsigned, m signed).
#define SS_ASM_NIB_ROW(X, A0, A1)                                                             \
    "vpmaddubsw " X ", %[w0], %[t0]\n\tvpmaddubsw " X ", %[w1], %[t1]\n\t"                   \
    "vpaddw %[t0], " A0 ", " A0 "\n\tvpaddw %[t1], " A1 ", " A1 "\n\t"
#define SS_ASM_ACC                                                                            \
    [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11), [s20] "+x"(s20), [s21] "+x"(s21), \
    [s30] "+x"(s30), [s31] "+x"(s31)

// 4 rows' NIB pair sums over quads q0 .. q1 - 1, added to s[r][h] (int16 lanes). DIRECT: b.wbuf is
// the block in the quad layout (unit t = quads 2t, 2t + 1: its low nibbles, then its high ones; q0
// even), decoded here, a unit's two loads for both quads
template <bool DIRECT>
__attribute__((always_inline)) inline void nib_rows4(const QRows& a, const Block& b, int64_t q0, int64_t q1, __m256i (&s)[4][2]) {
    __m256i s00 = s[0][0], s01 = s[0][1], s10 = s[1][0], s11 = s[1][1], s20 = s[2][0], s21 = s[2][1],
            s30 = s[3][0], s31 = s[3][1];
    const int64_t n = a.K / 4;  // a row's quads
#define SS_NIB_QUAD(Q, W0, W1)                                                                                        \
    {                                                                                                                 \
        const __m256i w0 = (W0), w1 = (W1);                                                                           \
        __m256i t0, t1, v;                                                                                            \
        const int32_t* x = reinterpret_cast<const int32_t*>(a.xq) + (Q);                                             \
        asm("vpbroadcastd %[x0], %[v]\n\t" SS_ASM_NIB_ROW("%[v]", "%[s00]", "%[s01]")                                  \
            "vpbroadcastd %[x1], %[v]\n\t" SS_ASM_NIB_ROW("%[v]", "%[s10]", "%[s11]")                                  \
            "vpbroadcastd %[x2], %[v]\n\t" SS_ASM_NIB_ROW("%[v]", "%[s20]", "%[s21]")                                  \
            "vpbroadcastd %[x3], %[v]\n\t" SS_ASM_NIB_ROW("%[v]", "%[s30]", "%[s31]")                                  \
            : SS_ASM_ACC, [t0] "=&x"(t0), [t1] "=&x"(t1), [v] "=&x"(v)                                               \
            : [w0] "x"(w0), [w1] "x"(w1), [x0] "m"(x[0]), [x1] "m"(x[n]), [x2] "m"(x[2 * n]), [x3] "m"(x[3 * n]));     \
    }
    if constexpr (DIRECT) {
        const __m256i nib = _mm256_set1_epi8(15);
        for (int64_t q = q0; q < q1; q += 2) {
            const __m256i lo = _mm256_load_si256(b.wbuf + q), hi = _mm256_load_si256(b.wbuf + q + 1);
            SS_NIB_QUAD(q, _mm256_and_si256(lo, nib), _mm256_and_si256(hi, nib))
            SS_NIB_QUAD(q + 1, _mm256_and_si256(_mm256_srli_epi16(lo, 4), nib), _mm256_and_si256(_mm256_srli_epi16(hi, 4), nib))
        }
    } else {
        for (int64_t q = q0; q < q1; ++q)
            SS_NIB_QUAD(q, _mm256_load_si256(b.wbuf + 2 * q), _mm256_load_si256(b.wbuf + 2 * q + 1))
    }
#undef SS_NIB_QUAD
    s[0][0] = s00; s[0][1] = s01; s[1][0] = s10; s[1][1] = s11; s[2][0] = s20; s[2][1] = s21; s[3][0] = s30; s[3][1] = s31;
}

#undef SS_ASM_NIB_ROW
#undef SS_ASM_ACC

// R rows of x times one block: the integer sums per group, then qmm8's epilogue
// (DIRECT: b.wbuf is the block in the quad layout as it lies: NIB's quads decoded in the loop, as in
// nib_rows4; WIDE's |code| taken there)
template <int R, int KIND, bool OFF, bool BASED, int SPAN = 1, bool DIRECT = false>
void rows_block(const QRows& a, const Block& b) {
    alignas(32) float tot[R][16] = {};
    const int64_t quads = a.group / 4, all = a.K / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < a.groups; ++g) {
        if (b.next)
            for (int64_t off = 0; off < b.next_bytes; off += 64)
                _mm_prefetch(reinterpret_cast<const char*>(b.next + g * b.next_bytes + off), _MM_HINT_T0);
        __m256i acc[R][2];
        if constexpr (KIND == NIB) {  // the group's (at most 8 quads: qmm8 checks) sums in int16, then widened
            // (no int32 sums live during the products: with them, R = 4 rows' 16 accumulators and the
            // quad left no register free; a Q4_K product of 8,960 x 1,536 at 8 rows, one thread, 2.0 ->
            // 1.84 ms without, 32 rows 6.9 -> 6.2, 2-core AMD EPYC Zen 3)
            __m256i s16[R][2];
            for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
            if constexpr (R == 4) nib_rows4<DIRECT>(a, b, g * quads, (g + 1) * quads, s16);
            else if constexpr (DIRECT) {
                const __m256i nib = _mm256_set1_epi8(15);
                for (int64_t q = g * quads; q < (g + 1) * quads; q += 2) {
                    const __m256i lo = _mm256_load_si256(b.wbuf + q), hi = _mm256_load_si256(b.wbuf + q + 1);
                    const __m256i w[2][2] = {{_mm256_and_si256(lo, nib), _mm256_and_si256(hi, nib)},
                                             {_mm256_and_si256(_mm256_srli_epi16(lo, 4), nib),
                                              _mm256_and_si256(_mm256_srli_epi16(hi, 4), nib)}};
                    for (int e = 0; e < 2; ++e)
                        for (int r = 0; r < R; ++r) {
                            const __m256i xv = x_at(a, r, q + e);
                            s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(w[e][0], xv));
                            s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(w[e][1], xv));
                        }
                }
            } else
            for (int64_t q = g * quads; q < (g + 1) * quads; ++q) {
                const __m256i w0 = _mm256_load_si256(b.wbuf + 2 * q), w1 = _mm256_load_si256(b.wbuf + 2 * q + 1);
                for (int r = 0; r < R; ++r) {
                    const __m256i xv = x_at(a, r, q);
                    s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(w0, xv));
                    s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(w1, xv));
                }
            }
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_madd_epi16(s16[r][h], ones);
        } else {
            for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
            if constexpr (SPAN == 4 && R == 4) {  // MAGIC, u <= 31: four quads' pair sums in int16 (4 * 2 * 31 * 127 = 31,496), NIB's loop
                for (int64_t q = g * quads; q < (g + 1) * quads; q += 4) {
                    __m256i s16[4][2];
                    for (int r = 0; r < 4; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
                    nib_rows4<false>(a, b, q, q + 4, s16);
                    for (int r = 0; r < 4; ++r)
                        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(s16[r][h], ones));
                }
            } else if constexpr (SPAN >= 2) {  // MAGIC, u <= 63: two quads' pair sums in int16 (2 * 2 * 63 * 127 = 32,004), one widening
                for (int64_t q = g * quads; q < (g + 1) * quads; q += 2) {
                    const __m256i w0 = _mm256_load_si256(b.wbuf + 2 * q), w1 = _mm256_load_si256(b.wbuf + 2 * q + 1);
                    const __m256i v0 = _mm256_load_si256(b.wbuf + 2 * q + 2), v1 = _mm256_load_si256(b.wbuf + 2 * q + 3);
                    for (int r = 0; r < R; ++r) {
                        const __m256i x0 = x_at(a, r, q), x1 = x_at(a, r, q + 1);
                        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(v0, x1));
                        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w1, x0), _mm256_maddubs_epi16(v1, x1));
                        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
                        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
                    }
                }
            } else
            for (int64_t q = g * quads; q < (g + 1) * quads; ++q) {
                const __m256i w0 = _mm256_load_si256(b.wbuf + 2 * q), w1 = _mm256_load_si256(b.wbuf + 2 * q + 1);
                __m256i a0, a1;
                if constexpr (KIND == WIDE && DIRECT) {  // the codes as they lie: |code| here
                    a0 = _mm256_abs_epi8(w0);
                    a1 = _mm256_abs_epi8(w1);
                } else if constexpr (KIND == WIDE) {
                    a0 = _mm256_load_si256(b.wbuf + 2 * all + 2 * q);
                    a1 = _mm256_load_si256(b.wbuf + 2 * all + 2 * q + 1);
                }
                for (int r = 0; r < R; ++r) {
                    const __m256i xv = x_at(a, r, q);
                    __m256i p0, p1;
                    if constexpr (KIND == WIDE) {  // |code| times xq with the code's sign
                        p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0));
                        p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1));
                    } else {
                        p0 = _mm256_maddubs_epi16(w0, xv);
                        p1 = _mm256_maddubs_epi16(w1, xv);
                    }
                    acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
                    acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
                }
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 sc = _mm256_load_ps(b.sc + g * 16 + h * 8);
            for (int r = 0; r < R; ++r) {
                const __m256 f = _mm256_mul_ps(sc, _mm256_set1_ps(a.xs[r * a.groups + g]));
                __m256i sum = acc[r][h];
                if constexpr (BASED) sum = _mm256_add_epi32(sum, _mm256_set1_epi32(a.qbase[r * a.groups + g]));
                __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), f, _mm256_load_ps(tot[r] + h * 8));
                if constexpr (OFF)
                    t = _mm256_fmadd_ps(_mm256_set1_ps(a.xsum[r * a.groups + g]), _mm256_load_ps(b.of + g * 16 + h * 8), t);
                _mm256_store_ps(tot[r] + h * 8, t);
            }
        }
    }
    for (int r = 0; r < R; ++r) std::memcpy(b.y + r * b.ldy, tot[r], b.valid * sizeof(float));
}

// r rows (at most QR) of x times one block
template <int KIND, bool OFF, bool BASED, int SPAN = 1, bool DIRECT = false>
void rows_step(int64_t r, const QRows& a, const Block& b) {
    switch (r) {
        case 1: rows_block<1, KIND, OFF, BASED, SPAN, DIRECT>(a, b); break;
        case 2: rows_block<2, KIND, OFF, BASED, SPAN, DIRECT>(a, b); break;
        case 3: rows_block<3, KIND, OFF, BASED, SPAN, DIRECT>(a, b); break;
        default: rows_block<QR, KIND, OFF, BASED, SPAN, DIRECT>(a, b);
    }
}

inline float reduce_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

inline int32_t reduce_add8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// qkernel.cpp's qrows on 8 lanes: the same operations per value, so the same xq, xs, xsum, qbase
constexpr int64_t QROWS_GRAIN = 32768;
void qrows(const float* x, int64_t M, int64_t K, int64_t group, int kind, int32_t base, int8_t* xq, float* xs,
           float* xsum, int32_t* qbase) {
    const int64_t groups = K / group;
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    at::parallel_for(0, M, std::max<int64_t>(1, QROWS_GRAIN / K), [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
            for (int64_t g = 0; g < groups; ++g) {
                const float* v = x + m * K + g * group;
                __m256 amax = _mm256_setzero_ps();
                int nan = 0;
                for (int64_t k = 0; k < group; k += 8) {
                    const __m256 vk = _mm256_loadu_ps(v + k);
                    amax = _mm256_max_ps(amax, _mm256_and_ps(vk, absmask));
                    nan |= _mm256_movemask_ps(_mm256_cmp_ps(vk, vk, _CMP_UNORD_Q));
                }
                const float mx = nan ? std::numeric_limits<float>::quiet_NaN() : reduce_max8(amax);
                xs[m * groups + g] = mx / 127.0f;
                const float rcp = 127.0f / mx;
                const __m256 inv = _mm256_set1_ps(mx > 0.0f && rcp <= std::numeric_limits<float>::max() ? rcp : 0.0f);
                int8_t* out = xq + m * K + g * group;
                __m256i isum = _mm256_setzero_si256();
                for (int64_t k = 0; k < group; k += 8) {
                    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + k), inv));
                    isum = _mm256_add_epi32(isum, q);
                    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                    __m128i b = _mm_packs_epi16(w, w);  // (saturating twice: int32 -> int8 saturated)
                    if (kind == NIB) b = _mm_shuffle_epi8(b, order);
                    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), b);
                }
                const int32_t total = reduce_add8(isum);
                xsum[m * groups + g] = xs[m * groups + g] * static_cast<float>(total);
                qbase[m * groups + g] = static_cast<int32_t>(static_cast<int64_t>(base) * total);
            }
        }
    });
}

// n bytes (32-aligned) of the calling thread's scratch, kept between calls and grown as needed
uint8_t* scratch(int slot, int64_t n) {
    thread_local std::unique_ptr<uint8_t, decltype(&std::free)> mem[2] = {{nullptr, &std::free}, {nullptr, &std::free}};
    thread_local int64_t size[2] = {0, 0};
    if (n > size[slot]) {
        size[slot] = (n + 4095) / 4096 * 4096;
        mem[slot].reset(static_cast<uint8_t*>(std::aligned_alloc(64, size[slot])));
        TORCH_CHECK(mem[slot], "qmm8: could not allocate ", size[slot], " bytes of scratch");
    }
    return mem[slot].get();
}

}  // namespace

bool has_q8() { return true; }  // (this module is built only where the CPU has AVX2, FMA and F16C)
bool has_amx() { return false; }

// qkernel.cpp's qmm8 (the same arguments; amx and vnni_rows ignored): x fp32 [M, K] -> fp32 [M, N].
// MAGIC's kind may carry 1 + the codes' largest u in bits 8 and up (qkernel.py's kernel_kind): its
// blocks are then multiplied where they lie, without a pass to find each block's own.
torch::Tensor qmm8(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t low, torch::Tensor sd, torch::Tensor sq,
                   int64_t sshift, torch::Tensor od, torch::Tensor oq, int64_t oshift, int64_t group, int64_t N,
                   bool, int64_t) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous fp32 [M, K]");
    const int64_t told = kind >> 8;  // 1 + the largest u (MAGIC), or 0: found per block
    kind &= 255;
    TORCH_CHECK(told == 0 || (kind == MAGIC && told <= 128), "kind: a largest u (bits 8 and up) goes with MAGIC, at most 127");
    TORCH_CHECK(kind == NIB || kind == MAGIC || kind == WIDE, "kind: 0, 1 or 2 (6-bit codes are held only for AMX)");
    TORCH_CHECK(kind != MAGIC || (low >= -64 && low <= 63), "MAGIC: codes in [-64, 63]");
    // code = u + base: NIB u = code - low; MAGIC u = code - low (<= 127); WIDE the signed codes themselves
    const int64_t base = kind == WIDE ? 0 : low;
    const int64_t M = x.size(0), K = x.size(1), blocks = (N + 15) / 16, groups = K / group;
    TORCH_CHECK(group % 16 == 0 && K % group == 0 && (kind != NIB || group <= 32), "K: whole groups of 16 or 32 "
                "columns (4-bit codes: at most 32, whose int16 sums cannot overflow)");
    TORCH_CHECK(sd.numel() > 0, "scales: d is required");
    const Factors sf = factors(sd, sq, sshift, blocks, groups, "scales"), of = factors(od, oq, oshift, blocks, groups, "offsets");
    TORCH_CHECK(packed.numel() == blocks * K * column_bytes(kind), "codes do not fit the blocked layout");
    auto y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const int64_t q_bytes = (M * K + 63) / 64 * 64;
    uint8_t* rounded = scratch(0, q_bytes + 3 * M * groups * static_cast<int64_t>(sizeof(float)));
    int8_t* xq = reinterpret_cast<int8_t*>(rounded);
    float* xs = reinterpret_cast<float*>(rounded + q_bytes);
    int32_t* qbase = reinterpret_cast<int32_t*>(xs + 2 * M * groups);
    qrows(x.data_ptr<float>(), M, K, group, static_cast<int>(kind), static_cast<int32_t>(base), xq, xs, xs + M * groups,
          qbase);
    const QRows a{xq, xs, xs + M * groups, qbase, K, group, groups};
    const bool off = od.numel() > 0;
    const uint8_t* wp = static_cast<const uint8_t*>(packed.data_ptr());
    float* yp = y.data_ptr<float>();
    const int64_t block_bytes = K * column_bytes(kind);
    const int64_t wbuf_bytes = (kind == WIDE ? 4 : 2) * (K / 4) * 32;
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
        uint8_t* mem = scratch(1, wbuf_bytes + 2 * groups * 16 * static_cast<int64_t>(sizeof(float)));
        __m256i* wbuf = reinterpret_cast<__m256i*>(mem);
        float* sbuf = reinterpret_cast<float*>(mem + wbuf_bytes);
        float* obuf = off ? sbuf + groups * 16 : nullptr;
        for (int64_t i = b0; i < b1; ++i) {
            // MAGIC's u multiply as they lie (no copy: a Q5_0 product of 4,864 x 896, one thread, Zen 3, 1 row
            // 0.174 -> 0.104 ms, 8 rows 0.58 -> 0.45), and NIB's and WIDE's up to their rows; else decoded into wbuf
            const uint8_t* codes = wp + i * block_bytes;
            const bool aligned = reinterpret_cast<uintptr_t>(codes) % 32 == 0;
            const bool direct = aligned && (kind == MAGIC || (kind == NIB && M <= NIB_DIRECT_ROWS)
                                            || (kind == WIDE && M <= WIDE_DIRECT_ROWS));
            const bool nib_direct = direct && kind == NIB, wide_direct = direct && kind == WIDE;
            const int top = !direct ? decode_block(static_cast<int>(kind), codes, K, wbuf)
                          : kind != MAGIC ? 255 : told ? static_cast<int>(told - 1) : block_top(codes, K);
            const __m256i* quads = direct ? reinterpret_cast<const __m256i*>(codes) : wbuf;
            // MAGIC blocks whose u fit 6 bits (all of Q6_K's, Q5's) sum two quads before widening
            const bool pair = top <= 63 && group % 8 == 0;
            // and those whose u fit 5 bits (Q5_0, Q5_1, Q5_K's) four, in NIB's loop (a Q5_0 product of
            // 4,864 x 896, one thread, Zen 3: 8 rows 0.626 -> 0.585 ms, 32 rows 2.14 -> 2.02; 512 rows 1 %)
            const bool four = top <= 31 && group % 16 == 0;
            expand(sf.of_block(i), of.of_block(i), groups, sbuf, obuf);
            for (int64_t m0 = 0; m0 < M; m0 += QR) {
                QRows part = a;
                part.xq = a.xq + m0 * K;
                part.xs = a.xs + m0 * groups;
                part.xsum = a.xsum + m0 * groups;
                part.qbase = a.qbase + m0 * groups;
                Block b{quads, sbuf, obuf, yp + m0 * N + i * 16, N, std::min<int64_t>(16, N - i * 16)};
                if (m0 == 0 && M <= PREFETCH_ROWS && i + 1 < b1) {  // the next block this thread multiplies
                    b.next = wp + (i + 1) * block_bytes;
                    b.next_bytes = block_bytes / groups;
                }
                const int64_t r = std::min<int64_t>(QR, M - m0);
                // the formats' cases: 4-bit codes with offsets from base 0 (Q4_1, Q4_K) or none from -8
                // (Q4_0); bytes from their lowest code with offsets (Q5_1, Q5_K) or none (Q5_0, Q6_K);
                // any int8 (Q8_0) signed, base 0 (the base's integers added only where base is not 0)
                if (kind == NIB && nib_direct && off && base == 0) rows_step<NIB, true, false, 1, true>(r, part, b);
                else if (kind == NIB && nib_direct && off) rows_step<NIB, true, true, 1, true>(r, part, b);
                else if (kind == NIB && nib_direct) rows_step<NIB, false, true, 1, true>(r, part, b);
                else if (kind == NIB && off && base == 0) rows_step<NIB, true, false>(r, part, b);
                else if (kind == NIB && off) rows_step<NIB, true, true>(r, part, b);
                else if (kind == NIB) rows_step<NIB, false, true>(r, part, b);
                else if (kind == MAGIC && off && four) rows_step<MAGIC, true, true, 4>(r, part, b);
                else if (kind == MAGIC && off && pair) rows_step<MAGIC, true, true, 2>(r, part, b);
                else if (kind == MAGIC && off) rows_step<MAGIC, true, true>(r, part, b);
                else if (kind == MAGIC && four) rows_step<MAGIC, false, true, 4>(r, part, b);
                else if (kind == MAGIC && pair) rows_step<MAGIC, false, true, 2>(r, part, b);
                else if (kind == MAGIC) rows_step<MAGIC, false, true>(r, part, b);
                else if (wide_direct && off) rows_step<WIDE, true, false, 1, true>(r, part, b);
                else if (wide_direct) rows_step<WIDE, false, false, 1, true>(r, part, b);
                else if (off) rows_step<WIDE, true, false>(r, part, b);
                else rows_step<WIDE, false, false>(r, part, b);
            }
        }
    });
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("pack_six", &pack_six, "int8 codes [N, K] -> the 6-bit blocked layout (u = code - low)", py::call_guard<py::gil_scoped_release>());
    m.def("unpack_blocked", &unpack_blocked, "GGUF tensors' stored rows, stacked -> the blocked codes and factors, and each part's code range");
    m.def("qmm8", &qmm8, "y = x @ W.T with x rounded to int8 per row and group (AVX2)", py::call_guard<py::gil_scoped_release>());
    m.def("has_q8", &has_q8, "whether this CPU runs qmm8 (here: always)");
    m.def("has_amx", &has_amx, "whether this process may use AMX tiles (never, on this module)");
    m.def("quad_layout", []() { return true; }, "whether NIB, MAGIC and WIDE codes are in the quad layout (qkernel_pack.h): here, always");
}
