/* The int8 multiply-add peak of one core, for bench/roofline.py (loaded with ctypes).

   Each function runs `iters` rounds of independent multiply-adds of bytes held in registers (no
   memory operand, no dependency between the chains of a round), so it measures the instruction's
   throughput on this core, the ceiling of any int8 product (qkernel_avx2.cpp, qkernel.cpp) here,
   and returns the multiply-adds per second (one u8 x s8 product summed = one).

   - int8_peak_avx2: vpmaddubsw (32 byte products a ymm, summed in pairs to int16) then vpaddw into
     an int16 accumulator: the pair qkernel_avx2.cpp's 4-bit loop issues per 32 multiply-adds
     (llama.cpp's AVX2 dot products widen with vpmaddwd instead). Six chains: 6 accumulators, 6
     products and the two operands in 14 of the 16 ymm registers.
   - int8_peak_vnni: vpdpbusd on zmm (64 byte products summed in fours into int32), the AVX-512
     VNNI instruction of qkernel.cpp's decode products. Eight chains.

   Call each only where the CPU has its instructions (bench/roofline.py reads /proc/cpuinfo's flags). */
#include <immintrin.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define SS_AVX2_CHAIN(T, A) "vpmaddubsw %[x], %[w], %[" T "]\n\tvpaddw %[" T "], %[" A "], %[" A "]\n\t"

__attribute__((target("avx2"))) double int8_peak_avx2(long iters) {
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256i t0, t1, t2, t3, t4, t5;
    const double start = seconds();
    for (long i = 0; i < iters; ++i)
        __asm__ volatile(SS_AVX2_CHAIN("t0", "a0") SS_AVX2_CHAIN("t1", "a1") SS_AVX2_CHAIN("t2", "a2")
                         SS_AVX2_CHAIN("t3", "a3") SS_AVX2_CHAIN("t4", "a4") SS_AVX2_CHAIN("t5", "a5")
                         : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
                           [t0] "=&x"(t0), [t1] "=&x"(t1), [t2] "=&x"(t2), [t3] "=&x"(t3), [t4] "=&x"(t4), [t5] "=&x"(t5)
                         : [w] "x"(w), [x] "x"(x));
    return iters * 6.0 * 32 / (seconds() - start);
}

#define SS_VNNI_CHAIN(A) "vpdpbusd %[x], %[w], %[" A "]\n\t"

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double int8_peak_vnni(long iters) {
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const double start = seconds();
    for (long i = 0; i < iters; ++i)
        __asm__ volatile(SS_VNNI_CHAIN("a0") SS_VNNI_CHAIN("a1") SS_VNNI_CHAIN("a2") SS_VNNI_CHAIN("a3")
                         SS_VNNI_CHAIN("a4") SS_VNNI_CHAIN("a5") SS_VNNI_CHAIN("a6") SS_VNNI_CHAIN("a7")
                         : [a0] "+v"(a0), [a1] "+v"(a1), [a2] "+v"(a2), [a3] "+v"(a3), [a4] "+v"(a4), [a5] "+v"(a5),
                           [a6] "+v"(a6), [a7] "+v"(a7)
                         : [w] "v"(w), [x] "v"(x));
    return iters * 8.0 * 64 / (seconds() - start);
}
