/* Fused blockwise E4M3 quantize / dequantize for the CPU: one pass per block-row, no temporaries.
 *
 * Same arithmetic as kernels.py (the reference), element by element:
 *   amax  = max |x| over the block                      (integer max of the sign-cleared bits)
 *   scale = amax / 448 (FP32 division); 1 if amax == 0; at least 2**-126; optionally 2**ceil(log2)
 *   v     = clamp(x / scale, -448, 448)                 (FP32 division, not a reciprocal multiply)
 *   q     = v rounded to E4M3, ties to even             (see e4m3_round)
 *   deq   = decode(q) * scale                           (FP32; decode(q) is the rounded v itself)
 * Built with -ffp-contract=off and without -ffast-math, so that the compiler keeps every IEEE
 * operation as written. Blocks whose amax is NaN/inf are not handled here: the functions return 1
 * and the caller runs the reference (which raises or propagates NaN exactly as torch does).
 * Layout: x, q, deq row-major [M, N]; scale row-major [ceil(M/br), ceil(N/bc)].
 */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define E4M3_MAX 448.0f
#define MIN_SCALE_BITS 0x00800000u /* 2**-126, FP32's smallest normal */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* |x| as FP32 bits; x is FP32 (dtype 0) or BF16 (dtype 1). For non-negative floats the order of
 * the bit patterns is the order of the values, and NaN/inf patterns exceed every finite one. */
static inline uint32_t abs_bits(const void *x, int dtype, int64_t i) {
    if (dtype == 0) return ((const uint32_t *)x)[i] & 0x7FFFFFFFu;
    return ((uint32_t)(((const uint16_t *)x)[i] & 0x7FFFu)) << 16;
}

static inline float load(const void *x, int dtype, int64_t i) {
    if (dtype == 0) return ((const float *)x)[i];
    return u2f(((uint32_t)((const uint16_t *)x)[i]) << 16);
}

static inline float block_scale(uint32_t amax_bits, int pow2) {
    if (amax_bits == 0) return 1.0f;
    float s = u2f(amax_bits) / E4M3_MAX;
    uint32_t b = f2u(s);
    if (b < MIN_SCALE_BITS) b = MIN_SCALE_BITS;
    if (pow2 && (b & 0x007FFFFFu)) b = (b & 0x7F800000u) + 0x00800000u;
    else if (pow2) b &= 0x7F800000u;
    return u2f(b);
}

/* v finite, |v| <= 448 -> its E4M3 code (in a uint32); *r = the E4M3 value as FP32 (exact).
 * Normal range (|v| >= 2**-6): round the FP32 mantissa to 3 bits at bit 20, ties to even; the code
 * is the rounded exponent (rebias 127 -> 7) and mantissa. Subnormal range: adding 2**14 leaves an
 * FP32 sum whose last place is 2**-9, the E4M3 subnormal step, so the addition itself rounds
 * (ties to even) and the sum's low mantissa bits are the code (8 = the smallest normal, 0x08).
 * Both are computed and one is selected (no branch), so that the loops vectorize. */
#define INLINE static inline __attribute__((always_inline))
INLINE uint32_t e4m3_round(float v, float *r) {
    uint32_t bits = f2u(v), sign = bits & 0x80000000u, a = bits ^ sign;
    float t = u2f(a) + 16384.0f;
    uint32_t code_sub = f2u(t) - 0x46800000u, rb_sub = f2u(t - 16384.0f); /* 0x46800000 = 2**14 */
    uint32_t rb_nrm = (a + 0x7FFFFu + ((a >> 20) & 1u)) & ~0xFFFFFu, code_nrm = (rb_nrm >> 20) - (120u << 3);
    int small = a < (121u << 23); /* |v| < 2**-6 */
    uint32_t code = small ? code_sub : code_nrm, rb = small ? rb_sub : rb_nrm;
    *r = u2f(rb | sign);
    return code | (sign >> 24);
}

#define CHUNK 64
/* Quantize x[base + c], c in [c0, c1), with scale s[0] (per_col 0) or s[c] (per_col 1). Called with
 * literal dtype/per_col/with_deq, so that each call site compiles to one branch-free loop. The codes
 * go through a 32-bit buffer: a loop that stores bytes directly is vectorized 32 elements wide and
 * spills registers (measured 2x slower). */
INLINE void quant_span(const void *x, const int dtype, int64_t base, int64_t c0, int64_t c1,
                       const float *s, const int per_col, uint8_t *q, float *deq, const int with_deq) {
    uint32_t codes[CHUNK];
    for (int64_t k0 = c0; k0 < c1; k0 += CHUNK) {
        int64_t len = c1 - k0 < CHUNK ? c1 - k0 : CHUNK;
        for (int64_t i = 0; i < len; i++) {
            int64_t c = k0 + i;
            float sc = per_col ? s[c] : s[0], v = load(x, dtype, base + c) / sc, r;
            v = v > E4M3_MAX ? E4M3_MAX : v;
            v = v < -E4M3_MAX ? -E4M3_MAX : v;
            codes[i] = e4m3_round(v, &r);
            if (with_deq) deq[base + c] = r * sc;
        }
        for (int64_t i = 0; i < len; i++) q[base + k0 + i] = (uint8_t)codes[i];
    }
}

static void quant_row(const void *x, int dtype, int64_t base, int64_t n, int64_t bc, const float *srow,
                      uint8_t *q, float *deq) {
    int64_t nb = bc == 1 ? 1 : (n + bc - 1) / bc;
    for (int64_t j = 0; j < nb; j++) {
        int64_t c0 = bc == 1 ? 0 : j * bc, c1 = bc == 1 ? n : ((j + 1) * bc < n ? (j + 1) * bc : n);
        const float *s = bc == 1 ? srow : srow + j;
        int pc = bc == 1;
        if (dtype == 0 && deq) { if (pc) quant_span(x, 0, base, c0, c1, s, 1, q, deq, 1); else quant_span(x, 0, base, c0, c1, s, 0, q, deq, 1); }
        else if (dtype == 0) { if (pc) quant_span(x, 0, base, c0, c1, s, 1, q, deq, 0); else quant_span(x, 0, base, c0, c1, s, 0, q, deq, 0); }
        else if (deq) { if (pc) quant_span(x, 1, base, c0, c1, s, 1, q, deq, 1); else quant_span(x, 1, base, c0, c1, s, 0, q, deq, 1); }
        else { if (pc) quant_span(x, 1, base, c0, c1, s, 1, q, deq, 0); else quant_span(x, 1, base, c0, c1, s, 0, q, deq, 0); }
    }
}

/* Ask for transparent huge pages on a fresh output buffer (Linux, THP in "madvise" mode): first
 * touching 4 KiB pages costs more than the whole kernel on a 4096^2 tensor (measured: 33 MB into
 * fresh memory 33 ms, into a reused buffer 4 ms); 2 MiB pages take 512x fewer faults. A hint only:
 * the aligned interior of the buffer, ignored where unsupported. */
static void hint_huge_pages(void *p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1), b = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
    if (b > a) madvise((void *)a, b - a, MADV_HUGEPAGE);
#else
    (void)p; (void)bytes;
#endif
}

/* amax bits of the blocks of rows [r0, r1) into amax[0 .. nb). */
static void group_amax(const void *x, int dtype, int64_t r0, int64_t r1, int64_t n, int64_t bc,
                       int64_t nb, uint32_t *amax) {
    for (int64_t j = 0; j < nb; j++) amax[j] = 0;
    for (int64_t r = r0; r < r1; r++) {
        int64_t base = r * n;
        if (bc == 1) {
            for (int64_t c = 0; c < n; c++) {
                uint32_t a = abs_bits(x, dtype, base + c);
                amax[c] = a > amax[c] ? a : amax[c];
            }
            continue;
        }
        for (int64_t j = 0; j < nb; j++) {
            int64_t c1 = (j + 1) * bc < n ? (j + 1) * bc : n;
            uint32_t m = amax[j];
            for (int64_t c = j * bc; c < c1; c++) {
                uint32_t a = abs_bits(x, dtype, base + c);
                m = a > m ? a : m;
            }
            amax[j] = m;
        }
    }
}

/* Returns 0 on success, 1 if some block is non-finite (outputs then incomplete). deq may be NULL.
 * work: nthreads * nb uint32 of scratch. */
int fp8rl_quantize(const void *x, int dtype, int64_t m, int64_t n, int64_t br, int64_t bc, int pow2,
                   uint8_t *q, float *scale, float *deq, uint32_t *work, int nthreads) {
    int64_t mb = (m + br - 1) / br, nb = (n + bc - 1) / bc;
    int bad = 0;
    hint_huge_pages(q, m * n);
    if (deq) hint_huge_pages(deq, m * n * 4);
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : bad)
    for (int64_t g = 0; g < mb; g++) {
#ifdef _OPENMP
        extern int omp_get_thread_num(void);
        uint32_t *amax = work + (int64_t)omp_get_thread_num() * nb;
#else
        uint32_t *amax = work;
#endif
        int64_t r0 = g * br, r1 = r0 + br < m ? r0 + br : m;
        group_amax(x, dtype, r0, r1, n, bc, nb, amax);
        float *srow = scale + g * nb;
        for (int64_t j = 0; j < nb; j++) {
            if (amax[j] >= 0x7F800000u) bad = 1;
            srow[j] = block_scale(amax[j], pow2);
        }
        if (bad) continue;
        for (int64_t r = r0; r < r1; r++) quant_row(x, dtype, r * n, n, bc, srow, q, deq);
    }
    return bad;
}

/* E4M3 code -> FP32 value (finite codes; the caller rejects NaN codes 0x7F/0xFF). Branch-free. */
INLINE float e4m3_decode(uint8_t code) {
    uint32_t sign = ((uint32_t)(code & 0x80u)) << 24, mag = code & 0x7Fu;
    float sub = (float)(int32_t)mag * 0.001953125f; /* 2**-9: subnormal codes 0..7 */
    uint32_t v = mag < 8u ? f2u(sub) : (mag << 20) + (120u << 23);
    return u2f(v | sign);
}

/* FP32 -> BF16 bits, round to nearest even (finite inputs). */
INLINE uint16_t to_bf16(float f) {
    uint32_t b = f2u(f);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

INLINE int dequant_span(const uint8_t *q, int64_t base, int64_t c0, int64_t c1, const float *s, const int per_col,
                        void *out, const int out_dtype) {
    int bad = 0;
    for (int64_t c = c0; c < c1; c++) {
        uint8_t code = q[base + c];
        bad |= (code & 0x7Fu) == 0x7Fu;
        float v = e4m3_decode(code) * (per_col ? s[c] : s[0]);
        if (out_dtype == 0) ((float *)out)[base + c] = v;
        else ((uint16_t *)out)[base + c] = to_bf16(v);
    }
    return bad;
}

/* out = decode(q) * scale in FP32, stored as FP32 (out_dtype 0) or BF16 (1). Returns 1 (nothing
 * trustworthy written) if q holds a NaN code. */
int fp8rl_dequantize(const uint8_t *q, const float *scale, int64_t m, int64_t n, int64_t br, int64_t bc,
                     void *out, int out_dtype, int nthreads) {
    int64_t nb = (n + bc - 1) / bc, nj = bc == 1 ? 1 : nb;
    int bad = 0;
    hint_huge_pages(out, m * n * (out_dtype == 0 ? 4 : 2));
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : bad)
    for (int64_t r = 0; r < m; r++) {
        const float *srow = scale + (r / br) * nb;
        for (int64_t j = 0; j < nj; j++) {
            int64_t c0 = bc == 1 ? 0 : j * bc, c1 = bc == 1 ? n : ((j + 1) * bc < n ? (j + 1) * bc : n);
            const float *s = bc == 1 ? srow : srow + j;
            if (bc == 1 && out_dtype == 0) bad |= dequant_span(q, r * n, c0, c1, s, 1, out, 0);
            else if (bc == 1) bad |= dequant_span(q, r * n, c0, c1, s, 1, out, 1);
            else if (out_dtype == 0) bad |= dequant_span(q, r * n, c0, c1, s, 0, out, 0);
            else bad |= dequant_span(q, r * n, c0, c1, s, 0, out, 1);
        }
    }
    return bad;
}
