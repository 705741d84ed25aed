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
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

#ifdef __AVX2__
/* The same quantization, 8 lanes at a time with AVX2 (gcc's own vectorization of the scalar loop
 * below runs at ~18 cycles per 8 elements here: byte stores, spills; this one at ~6). Every step is
 * the scalar one's: the same FP32 division, clamp and integer rounding, so the bits are the same. */
INLINE __m256 load8(const void *x, const int dtype, int64_t i) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)x + i);
    __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

/* v (|v| <= 448, finite) -> E4M3 codes (int32 lanes, 0..255); *r = the E4M3 values as FP32. */
INLINE __m256i e4m3_round8(__m256 v, __m256 *r) {
    const __m256i bits = _mm256_castps_si256(v), sign = _mm256_and_si256(bits, _mm256_set1_epi32((int)0x80000000u));
    const __m256i a = _mm256_xor_si256(bits, sign);
    const __m256 big = _mm256_set1_ps(16384.0f);
    const __m256 t = _mm256_add_ps(_mm256_castsi256_ps(a), big);
    const __m256i code_sub = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x46800000));
    const __m256i rb_sub = _mm256_castps_si256(_mm256_sub_ps(t, big));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    const __m256i rb_nrm = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)), odd),
                                            _mm256_set1_epi32((int)~0xFFFFFu));
    const __m256i code_nrm = _mm256_sub_epi32(_mm256_srli_epi32(rb_nrm, 20), _mm256_set1_epi32(120 << 3));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a); /* a < 2**31: signed is fine */
    const __m256i code = _mm256_blendv_epi8(code_nrm, code_sub, small);
    const __m256i rb = _mm256_blendv_epi8(rb_nrm, rb_sub, small);
    *r = _mm256_castsi256_ps(_mm256_or_si256(rb, sign));
    return _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
}

INLINE __m256i quant8(const void *x, const int dtype, int64_t base, int64_t c, const float *s, const int per_col,
                      float *deq, const int with_deq) {
    const __m256 sc = per_col ? _mm256_loadu_ps(s + c) : _mm256_broadcast_ss(s);
    __m256 v = _mm256_div_ps(load8(x, dtype, base + c), sc), r;
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-E4M3_MAX)), _mm256_set1_ps(E4M3_MAX));
    const __m256i code = e4m3_round8(v, &r);
    if (with_deq) _mm256_storeu_ps(deq + base + c, _mm256_mul_ps(r, sc));
    return code;
}

/* Quantizes [c0, c0 + 32k) and returns the first column left for the scalar loop. */
INLINE int64_t quant_span_avx2(const void *x, const int dtype, int64_t base, int64_t c0, int64_t c1,
                               const float *s, const int per_col, uint8_t *q, float *deq, const int with_deq) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lane interleave */
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) {
        __m256i a = quant8(x, dtype, base, c, s, per_col, deq, with_deq);
        __m256i b = quant8(x, dtype, base, c + 8, s, per_col, deq, with_deq);
        __m256i e = quant8(x, dtype, base, c + 16, s, per_col, deq, with_deq);
        __m256i f = quant8(x, dtype, base, c + 24, s, per_col, deq, with_deq);
        __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(e, f));
        if (q) _mm256_storeu_si256((__m256i *)(q + base + c), _mm256_permutevar8x32_epi32(bytes, order));
    }
    return c;
}
#endif

#define CHUNK 64
/* Quantize x[base + c], c in [c0, c1), with scale s[0] (per_col 0) or s[c] (per_col 1). Called with
 * literal dtype/per_col/with_deq, so that each call site compiles to one branch-free loop. The codes
 * go through a 32-bit buffer: a loop that stores bytes directly is vectorized 32 elements wide and
 * spills registers (measured 2x slower). */
INLINE void quant_span(const void *x, const int dtype, int64_t base, int64_t c0, int64_t c1,
                       const float *s, const int per_col, uint8_t *q, float *deq, const int with_deq) {
    uint32_t codes[CHUNK];
#ifdef __AVX2__
    c0 = quant_span_avx2(x, dtype, base, c0, c1, s, per_col, q, deq, with_deq);
#endif
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
        if (q)
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

/* max(m, |x[c]| bits for c in [c0, c1)) for BF16 x, in FP32 bit form (BF16 bits << 16); AVX2 works on
 * the 16-bit patterns directly (16 lanes, two instructions per vector). */
static inline uint32_t amax_span_bf16(const uint16_t *x, int64_t c0, int64_t c1, uint32_t m) {
    int64_t c = c0;
#ifdef __AVX2__
    if (c1 - c0 >= 16) {
        __m256i acc = _mm256_setzero_si256();
        const __m256i mask = _mm256_set1_epi16(0x7FFF);
        for (; c + 16 <= c1; c += 16)
            acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + c)), mask));
        __m128i h = _mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        h = _mm_max_epu16(h, _mm_srli_si128(h, 8));
        h = _mm_max_epu16(h, _mm_srli_si128(h, 4));
        h = _mm_max_epu16(h, _mm_srli_si128(h, 2));
        uint32_t v = ((uint32_t)(uint16_t)_mm_extract_epi16(h, 0)) << 16;
        m = v > m ? v : m;
    }
#endif
    for (; c < c1; c++) {
        uint32_t a = ((uint32_t)(x[c] & 0x7FFFu)) << 16;
        m = a > m ? a : m;
    }
    return m;
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
            if (dtype == 1) {
                amax[j] = amax_span_bf16((const uint16_t *)x + base, j * bc, c1, m);
                continue;
            }
            for (int64_t c = j * bc; c < c1; c++) {
                uint32_t a = abs_bits(x, dtype, base + c);
                m = a > m ? a : m;
            }
            amax[j] = m;
        }
    }
}

/* Returns 0 on success, 1 if some block is non-finite (outputs then incomplete). deq or q may be NULL
 * (not both): the emulated GEMM consumes only deq, so activations skip the code bytes.
 * work: nthreads * nb uint32 of scratch. */
int fp8rl_quantize(const void *x, int dtype, int64_t m, int64_t n, int64_t br, int64_t bc, int pow2,
                   uint8_t *q, float *scale, float *deq, uint32_t *work, int nthreads) {
    int64_t mb = (m + br - 1) / br, nb = (n + bc - 1) / bc;
    int bad = 0;
    if (q) hint_huge_pages(q, m * n);
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

#ifdef __AVX2__
/* decode(q[i .. i+8)) * scale as FP32 lanes; *nan collects the lanes holding a NaN code (0x7F/0xFF). */
INLINE __m256 dequant8(const uint8_t *q, int64_t i, __m256 sc, __m256i *nan) {
    const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)));
    const __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7F));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
    *nan = _mm256_or_si256(*nan, _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.001953125f));
    const __m256i nrm = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
    const __m256i v = _mm256_blendv_epi8(nrm, _mm256_castps_si256(sub), small);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(v, sign)), sc);
}

/* FP32 lanes -> BF16 bits (round to nearest even, as to_bf16), as int32 lanes 0..0xFFFF. */
INLINE __m256i to_bf16_8(__m256 f) {
    const __m256i b = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
}

/* Dequantizes [c0, c0 + 16k); returns the first column left for the scalar loop, *bad |= a NaN code seen. */
INLINE int64_t dequant_span_avx2(const uint8_t *q, int64_t base, int64_t c0, int64_t c1, const float *s,
                                 const int per_col, void *out, const int out_dtype, int *bad) {
    __m256i nan = _mm256_setzero_si256();
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        const __m256 s0 = per_col ? _mm256_loadu_ps(s + c) : _mm256_broadcast_ss(s);
        const __m256 s1 = per_col ? _mm256_loadu_ps(s + c + 8) : s0;
        const __m256 v0 = dequant8(q, base + c, s0, &nan), v1 = dequant8(q, base + c + 8, s1, &nan);
        if (out_dtype == 0) {
            _mm256_storeu_ps((float *)out + base + c, v0);
            _mm256_storeu_ps((float *)out + base + c + 8, v1);
        } else {
            const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(to_bf16_8(v0), to_bf16_8(v1)), 0xD8);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + base + c), h);
        }
    }
    *bad |= !_mm256_testz_si256(nan, nan);
    return c;
}
#endif

INLINE int dequant_span(const uint8_t *q, int64_t base, int64_t c0, int64_t c1, const float *s, const int per_col,
                        void *out, const int out_dtype) {
    int bad = 0;
#ifdef __AVX2__
    c0 = dequant_span_avx2(q, base, c0, c1, s, per_col, out, out_dtype, &bad);
#endif
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
