/* Fused blockwise E4M3 quantize / dequantize for the CPU: one pass per block-row panel, no temporaries.
 *
 * Same arithmetic as kernels.py (the reference), element by element:
 *   amax  = max |x| over the block                      (integer max of the sign-cleared bits)
 *   scale = amax / 448 (FP32 division); 1 if amax == 0; at least 2**-126; optionally 2**ceil(log2)
 *   v     = clamp(x / scale, -448, 448)                 (FP32 division, not a reciprocal multiply)
 *   q     = v rounded to E4M3, ties to even             (see e4m3_round)
 *   deq   = decode(q) * scale                           (FP32; decode(q) is the rounded v itself)
 * Built with -ffp-contract=off and without -ffast-math, so that the compiler keeps every IEEE
 * operation as written. Blocks whose amax is NaN/inf are not handled here: the functions return FP8RL_DECLINED
 * and the caller runs the reference (which raises or propagates NaN exactly as torch does).
 * Layout: x, q, deq row-major [M, N]; scale row-major [ceil(M/br), ceil(N/bc)].
 *
 * Three paths, fixed at compile time by the target (-march=native; fp8rl_simd_path() says which):
 * AVX-512 F/BW/VL (16 lanes, row tails masked), AVX2 (8 lanes, scalar tails) and portable C, each
 * giving the reference's bits (the tests build all three: -mno-avx512f, -mno-avx2). Memory: a block-row
 * is done in panels of ~64 KiB of x (amax pass, then quantization pass, in the cache), the next
 * panel's x (and outputs) prefetched during this one's arithmetic; codes of >= 8 MiB are streamed
 * (non-temporal stores) on the AVX-512 path. In cache the FP32 division (vdivps, which the bit-identity
 * requires) sets the pace, so power-of-two scales multiply by the exact inverse instead; from memory one
 * core's DRAM bandwidth and the fresh output's page faults do (timings: docs/design.md section 9).
 * Interface (dtype codes, return codes, signatures): fp8rl_kernels.h.
 */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "fp8rl_kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* The vector path, fixed at compile time by the target (-march=native: this CPU's flags). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SIMD FP8RL_SIMD_AVX512
#elif defined(__AVX2__)
#define SIMD FP8RL_SIMD_AVX2
#else
#define SIMD FP8RL_SIMD_SCALAR
#endif
/* The warning builds (tests/fp8rl_core/fp8/test_kernel_builds.py) state the path their flags must select. */
#if defined(FP8RL_EXPECT_SIMD) && FP8RL_EXPECT_SIMD != SIMD
#error "the target flags did not select the expected vector path"
#endif

/* FP8RL_SIMD_AVX512, _AVX2 or _SCALAR: what this build runs. */
int fp8rl_simd_path(void) { return SIMD; }

#define E4M3_MAX 448.0f
#define MIN_SCALE_BITS 0x00800000u /* 2**-126, FP32's smallest normal */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* |x| as FP32 bits; x is FP32 (dtype 0) or BF16 (dtype 1). For non-negative floats the order of
 * the bit patterns is the order of the values, and NaN/inf patterns exceed every finite one. */
static inline uint32_t abs_bits(const void *x, int dtype, int64_t i) {
    if (dtype == FP8RL_DTYPE_F32) return ((const uint32_t *)x)[i] & 0x7FFFFFFFu;
    return ((uint32_t)(((const uint16_t *)x)[i] & 0x7FFFu)) << 16;
}

static inline float load(const void *x, int dtype, int64_t i) {
    if (dtype == FP8RL_DTYPE_F32) return ((const float *)x)[i];
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

#if SIMD == FP8RL_SIMD_AVX2
/* The same quantization, 8 lanes at a time with AVX2 (gcc's own vectorization of the scalar loop
 * below stores bytes one lane at a time and spills registers: ~3x slower). Every step is
 * the scalar one's: the same FP32 division, clamp and integer rounding, so the bits are the same. */
INLINE __m256 load8(const void *x, const int dtype, int64_t i) {
    if (dtype == FP8RL_DTYPE_F32) return _mm256_loadu_ps((const float *)x + i);
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

#if SIMD == FP8RL_SIMD_AVX512
/* The same quantization, 16 lanes at a time with AVX-512 (F, BW, VL); row tails run masked, so no
 * scalar loop is left. The division is the same vdivps; the E4M3 rounding is one FP32 addition:
 * M = 2**(e+20) + 8*(e+6) (e = max(exponent of |v|, -6)) has the last place 2**(e-3), E4M3's step
 * at |v|'s exponent (2**-9 below 2**-6: its subnormals), so |v| + M rounds |v| to E4M3 (ties to
 * even: 8*(e+6) is even), |v| + M - M is the rounded value exactly, and the sum's low byte is the
 * code: 8*(e+6) + |v|/2**(e-3) (0..126). No FP32 subnormal is produced, so flush-to-zero modes do
 * not change it. */
#define I32(v) _mm512_set1_epi32((int)(v))
INLINE __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

INLINE __m512 load16(const void *x, const int dtype, int64_t i, const __mmask16 k) {
    if (dtype == FP8RL_DTYPE_F32) return _mm512_maskz_loadu_ps(k, (const float *)x + i);
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

/* x / scale -> E4M3 codes (the low byte of each int32 lane, 0..255); *deq = decode(code) * scale.
 * inv: 1 / scale where the scale is a power of two (pow2 1): scales lie in [2**-126, 2**120], so inv is
 * exact and x * inv is the real number x / scale rounded once, bit for bit the division. */
INLINE __m512i quant16(const __m512 xv, const __m512 sc, const __m512 inv, const int pow2, __m512 *deq,
                       const int with_deq) {
    const __m512i vb = _mm512_castps_si512(pow2 ? _mm512_mul_ps(xv, inv) : _mm512_div_ps(xv, sc));
    const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(vb, I32(0x7FFFFFFFu))), _mm512_set1_ps(E4M3_MAX));
    const __m512i e = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(a), I32(0x7F800000u)), I32(121u << 23));
    const __m512i mb = _mm512_add_epi32(_mm512_add_epi32(e, _mm512_srli_epi32(e, 20)), I32((20u << 23) - (121u << 3)));
    const __m512 sum = _mm512_add_ps(a, _mm512_castsi512_ps(mb));
    if (with_deq) { /* |rounded| * scale, with v's sign (bit select 0xD8: C ? B : A) */
        const __m512 r = _mm512_mul_ps(_mm512_sub_ps(sum, _mm512_castsi512_ps(mb)), sc);
        *deq = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(r), vb, I32(0x80000000u), 0xD8));
    }
    /* code = bits 0..6 of the sum, bit 7 = v's sign (bit 31 >> 24); 0xE4: C ? A : B */
    return _mm512_ternarylogic_epi32(_mm512_castps_si512(sum), _mm512_srli_epi32(vb, 24), I32(0x7F), 0xE4);
}

/* Quantizes [c0, c1): 64 columns per step (four vectors packed into 64 code bytes), then masked 16s.
 * pow2: the scale s[0] is a power of two (per_col 0). nt: store the codes' full lines past the caches. */
INLINE void quant_span_avx512(const void *x, const int dtype, int64_t base, int64_t c0, int64_t c1,
                              const float *s, const int per_col, const int pow2, uint8_t *q, float *deq,
                              const int with_deq, const int nt) {
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 s0 = _mm512_set1_ps(s[0]), inv = _mm512_set1_ps(1.0f / s[0]);
    int64_t c = c0;
    __m512 d;
    for (; c + 64 <= c1; c += 64) {
        __m512i k[4];
        for (int j = 0; j < 4; j++) {
            const __m512 sc = per_col ? _mm512_loadu_ps(s + c + 16 * j) : s0;
            k[j] = quant16(load16(x, dtype, base + c + 16 * j, 0xFFFF), sc, inv, pow2, &d, with_deq);
            if (with_deq) _mm512_storeu_ps(deq + base + c + 16 * j, d);
        }
        if (q) { /* the packs interleave 128-bit lanes; the permutation puts the 64 bytes in order */
            const __m512i b = _mm512_permutexvar_epi32(
                order, _mm512_packus_epi16(_mm512_packus_epi32(k[0], k[1]), _mm512_packus_epi32(k[2], k[3])));
            if (nt && ((uintptr_t)(q + base + c) & 63) == 0) _mm512_stream_si512((__m512i *)(q + base + c), b);
            else _mm512_storeu_si512(q + base + c, b);
        }
    }
    for (; c < c1; c += 16) {
        const __mmask16 m = tail16(c1 - c);
        const __m512 sc = per_col ? _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), m, s + c) : s0;
        const __m512i code = quant16(load16(x, dtype, base + c, m), sc, inv, pow2, &d, with_deq);
        if (with_deq) _mm512_mask_storeu_ps(deq + base + c, m, d);
        if (q) _mm512_mask_cvtepi32_storeu_epi8(q + base + c, m, code);
    }
}
#endif

#define CHUNK 64
#define PANEL_BYTES 65536
#define NT_MIN_BYTES (8 << 20)
#define PREFETCH_BYTES 32768
/* Quantize x[base + c], c in [c0, c1), with scale s[0] (per_col 0) or s[c] (per_col 1). Called with
 * literal dtype/per_col/with_deq, so that each call site compiles to one branch-free loop. The codes
 * go through a 32-bit buffer: a loop that stores bytes directly is vectorized 32 elements wide and
 * spills registers (about 2x slower). */
INLINE void quant_span(const void *x, const int dtype, int64_t base, int64_t c0, int64_t c1,
                       const float *s, const int per_col, uint8_t *q, float *deq, const int with_deq, const int nt) {
#if SIMD == FP8RL_SIMD_AVX512
    if (!per_col && (f2u(s[0]) & 0x007FFFFFu) == 0) /* a power of two (scales are normal: >= 2**-126) */
        quant_span_avx512(x, dtype, base, c0, c1, s, 0, 1, q, deq, with_deq, nt);
    else
        quant_span_avx512(x, dtype, base, c0, c1, s, per_col, 0, q, deq, with_deq, nt);
    return;
#endif
    (void)nt;
    uint32_t codes[CHUNK];
#if SIMD == FP8RL_SIMD_AVX2
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

/* Row `base`, columns [p0, p1) (block-aligned): each block's span (per-column scales: spans of 256
 * columns), after prefetching the same span `ahead` elements further on (0: none; never past element
 * `total`), i.e. the next panel's data, so that its amax pass finds it in the cache: DRAM reads then
 * overlap this panel's arithmetic. */
static void quant_row(const void *x, int dtype, int64_t base, int64_t p0, int64_t p1, int64_t bc,
                      const float *srow, uint8_t *q, float *deq, int64_t ahead, int64_t total, int nt) {
    const int64_t step = bc == 1 ? 256 : bc, es = dtype == FP8RL_DTYPE_F32 ? 4 : 2;
    for (int64_t c0 = p0; c0 < p1; c0 += step) {
        const int64_t c1 = c0 + step < p1 ? c0 + step : p1;
        const float *s = bc == 1 ? srow : srow + c0 / bc;
        int pc = bc == 1;
        if (ahead) { /* x to read, the outputs to write (not streamed codes); never past element `total` */
            const int64_t i0 = base + ahead + c0, i1 = base + ahead + c1 < total ? base + ahead + c1 : total;
            for (int64_t b = i0 * es; b < i1 * es; b += 64) __builtin_prefetch((const char *)x + b, 0, 3);
            if (q && !nt)
                for (int64_t b = i0; b < i1; b += 64) __builtin_prefetch(q + b, 1, 3);
            if (deq)
                for (int64_t b = i0 * 4; b < i1 * 4; b += 64) __builtin_prefetch((char *)deq + b, 1, 3);
        }
        if (dtype == FP8RL_DTYPE_F32 && deq) { if (pc) quant_span(x, FP8RL_DTYPE_F32, base, c0, c1, s, 1, q, deq, 1, nt); else quant_span(x, FP8RL_DTYPE_F32, base, c0, c1, s, 0, q, deq, 1, nt); }
        else if (dtype == FP8RL_DTYPE_F32) { if (pc) quant_span(x, FP8RL_DTYPE_F32, base, c0, c1, s, 1, q, deq, 0, nt); else quant_span(x, FP8RL_DTYPE_F32, base, c0, c1, s, 0, q, deq, 0, nt); }
        else if (deq) { if (pc) quant_span(x, FP8RL_DTYPE_BF16, base, c0, c1, s, 1, q, deq, 1, nt); else quant_span(x, FP8RL_DTYPE_BF16, base, c0, c1, s, 0, q, deq, 1, nt); }
        else { if (pc) quant_span(x, FP8RL_DTYPE_BF16, base, c0, c1, s, 1, q, deq, 0, nt); else quant_span(x, FP8RL_DTYPE_BF16, base, c0, c1, s, 0, q, deq, 0, nt); }
    }
}

/* Ask for transparent huge pages on a fresh output buffer (Linux, THP in "madvise" mode): first
 * touching 4 KiB pages costs more than the whole kernel on a 4096^2 tensor (docs/design.md section 9);
 * 2 MiB pages take 512x fewer faults. A hint only:
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

#if SIMD == FP8RL_SIMD_AVX512
/* max(m, |x[c]| bits for c in [c0, c1)), in FP32 bit form: FP32 16 lanes, BF16 32 lanes (the 16-bit
 * patterns), the tail masked (zeros do not change a max). */
INLINE uint32_t amax_span(const void *x, const int dtype, int64_t c0, int64_t c1, uint32_t m) {
    __m512i acc = _mm512_setzero_si512();
    int64_t c = c0;
    uint32_t v;
    if (dtype == FP8RL_DTYPE_F32) {
        const uint32_t *p = (const uint32_t *)x;
        const __m512i mask = I32(0x7FFFFFFFu);
        for (; c + 16 <= c1; c += 16) acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_loadu_si512(p + c), mask));
        if (c < c1) acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail16(c1 - c), p + c), mask));
        v = _mm512_reduce_max_epu32(acc);
    } else {
        const uint16_t *p = (const uint16_t *)x;
        const __m512i mask = _mm512_set1_epi16(0x7FFF);
        for (; c + 32 <= c1; c += 32) acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(p + c), mask));
        if (c < c1) {
            const __mmask32 k = c1 - c >= 32 ? ~(__mmask32)0 : (__mmask32)((1ull << (c1 - c)) - 1u);
            acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_maskz_loadu_epi16(k, p + c), mask));
        }
        v = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_and_si512(acc, I32(0xFFFFu)), _mm512_srli_epi32(acc, 16))) << 16;
    }
    return v > m ? v : m;
}

/* amax[c] = max(amax[c], |x[c]| bits) for c in [0, n): one row of per-column blocks (bc == 1). */
INLINE void amax_cols(const void *x, const int dtype, int64_t n, uint32_t *amax) {
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 k = tail16(n - c);
        __m512i a;
        if (dtype == FP8RL_DTYPE_F32) a = _mm512_and_si512(_mm512_maskz_loadu_epi32(k, (const uint32_t *)x + c), I32(0x7FFFFFFFu));
        else a = _mm512_srli_epi32(_mm512_slli_epi32(_mm512_cvtepu16_epi32( /* << 17 >> 1: |BF16| as FP32 bits */
                 _mm256_maskz_loadu_epi16(k, (const uint16_t *)x + c)), 17), 1);
        _mm512_mask_storeu_epi32(amax + c, k, _mm512_max_epu32(_mm512_maskz_loadu_epi32(k, amax + c), a));
    }
}
#else
/* max(m, |x[c]| bits for c in [c0, c1)) for BF16 x, in FP32 bit form (BF16 bits << 16); AVX2 works on
 * the 16-bit patterns directly (16 lanes, two instructions per vector). */
static inline uint32_t amax_span_bf16(const uint16_t *x, int64_t c0, int64_t c1, uint32_t m) {
    int64_t c = c0;
#if SIMD == FP8RL_SIMD_AVX2
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

static inline uint32_t amax_span(const void *x, int dtype, int64_t c0, int64_t c1, uint32_t m) {
    if (dtype == FP8RL_DTYPE_BF16) return amax_span_bf16((const uint16_t *)x, c0, c1, m);
    for (int64_t c = c0; c < c1; c++) {
        uint32_t a = ((const uint32_t *)x)[c] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

static inline void amax_cols(const void *x, int dtype, int64_t n, uint32_t *amax) {
    for (int64_t c = 0; c < n; c++) {
        uint32_t a = abs_bits(x, dtype, c);
        amax[c] = a > amax[c] ? a : amax[c];
    }
}
#endif

/* amax bits of the blocks of rows [r0, r1), columns [p0, p1) (block-aligned) into amax[p0/bc ..). */
static void group_amax(const void *x, int dtype, int64_t r0, int64_t r1, int64_t n, int64_t p0, int64_t p1,
                       int64_t bc, uint32_t *amax) {
    const int64_t es = dtype == FP8RL_DTYPE_F32 ? 4 : 2, j0 = p0 / bc, j1 = (p1 + bc - 1) / bc;
    for (int64_t j = j0; j < j1; j++) amax[j] = 0;
    for (int64_t r = r0; r < r1; r++) {
        const char *row = (const char *)x + r * n * es;
        if (bc == 1) {
            if (dtype == FP8RL_DTYPE_F32) amax_cols(row + p0 * 4, FP8RL_DTYPE_F32, p1 - p0, amax + p0);
            else amax_cols(row + p0 * 2, FP8RL_DTYPE_BF16, p1 - p0, amax + p0);
            continue;
        }
        for (int64_t j = j0; j < j1; j++) {
            int64_t c1 = (j + 1) * bc < p1 ? (j + 1) * bc : p1;
            amax[j] = dtype == FP8RL_DTYPE_F32 ? amax_span(row, FP8RL_DTYPE_F32, j * bc, c1, amax[j]) : amax_span(row, FP8RL_DTYPE_BF16, j * bc, c1, amax[j]);
        }
    }
}

/* Returns FP8RL_OK, or FP8RL_DECLINED if some block is non-finite (outputs then incomplete). deq or q may be NULL
 * (not both): the emulated GEMM consumes only deq, so activations skip the code bytes.
 * work: nthreads * nb uint32 of scratch. */
int fp8rl_quantize(const void *x, int dtype, int64_t m, int64_t n, int64_t br, int64_t bc, int pow2,
                   uint8_t *q, float *scale, float *deq, uint32_t *work, int nthreads) {
    const int64_t mb = (m + br - 1) / br, nb = (n + bc - 1) / bc, es = dtype == FP8RL_DTYPE_F32 ? 4 : 2;
    /* Panels of ~64 KiB of x (br rows x w columns, w a multiple of bc), so that a panel's second pass
     * (quantization) reads what its first (amax) left in the cache; one row is one panel when br == 1. */
    int64_t w = br == 1 ? n : PANEL_BYTES / (br * es);
    w = bc == 1 ? (w < 16 ? 16 : w / 16 * 16) : (w < bc ? bc : w / bc * bc);
    /* rows of one-row blocks are prefetched ~PREFETCH_BYTES ahead (k rows); panels one panel ahead */
    const int64_t k = br == 1 ? (PREFETCH_BYTES + n * es - 1) / (n * es) : 1;
    /* Codes of a large tensor bypass the caches (non-temporal stores: no read-for-ownership of their
     * lines); small ones stay cached for their consumer. */
    const int nt = SIMD == FP8RL_SIMD_AVX512 && q != NULL && m * n >= NT_MIN_BYTES; /* (the 512 path streams) */
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
        const int64_t r0 = g * br, r1 = r0 + br < m ? r0 + br : m;
        float *srow = scale + g * nb;
        for (int64_t p0 = 0; p0 < n && !bad; p0 += w) {
            const int64_t p1 = p0 + w < n ? p0 + w : n;
            group_amax(x, dtype, r0, r1, n, p0, p1, bc, amax);
            for (int64_t j = p0 / bc; j < (p1 + bc - 1) / bc; j++) {
                if (amax[j] >= 0x7F800000u) bad = FP8RL_DECLINED;
                srow[j] = block_scale(amax[j], pow2);
            }
            if (bad) break;
            for (int64_t r = r0; r < r1; r++) { /* prefetch: the next panel, or a later block-row's first */
                const int64_t ahead = p1 < n ? w : (r + k * br < m ? k * br * n - p0 : 0);
                quant_row(x, dtype, r * n, p0, p1, bc, srow, q, deq, ahead, m * n, nt);
            }
        }
#if SIMD == FP8RL_SIMD_AVX512
        if (nt) _mm_sfence(); /* this thread's streamed codes are visible before the parallel loop ends */
#endif
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

#if SIMD == FP8RL_SIMD_AVX2
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
        if (out_dtype == FP8RL_DTYPE_F32) {
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

#if SIMD == FP8RL_SIMD_AVX512
/* decode(16 codes) * scale, 16 lanes; *nan |= the lanes holding a NaN code (0x7F/0xFF). Integer decoding,
 * no FP32 subnormal in sight: a normal code's magnitude << 20 plus 120 << 23 is its FP32 value's bits; a
 * subnormal code k (exponent field 0) gives 2**-6 + k * 2**-9 with 121 << 23, then k * 2**-9 exactly by
 * subtracting 2**-6. The product's sign is the code's (bit select, so that -0 stays -0). */
INLINE __m512 dequant16(const __m128i bytes, const __m512 sc, __mmask16 *nan) {
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20); /* magnitude at bits 20..26, sign 27..31 */
    const __m512i mag = _mm512_and_si512(w, I32(0x07F00000u));
    const __mmask16 sub = _mm512_testn_epi32_mask(w, I32(0x07800000u));
    *nan |= _mm512_cmpeq_epi32_mask(mag, I32(0x07F00000u));
    __m512i t = _mm512_add_epi32(mag, I32(120u << 23));
    t = _mm512_mask_add_epi32(t, sub, t, I32(1u << 23));
    const __m512 f = _mm512_mask_sub_ps(_mm512_castsi512_ps(t), sub, _mm512_castsi512_ps(t), _mm512_set1_ps(0.015625f));
    const __m512i r = _mm512_castps_si512(_mm512_mul_ps(f, sc));
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(r, w, I32(0x80000000u), 0xD8));
}

/* FP32 lanes -> BF16 bits (round to nearest even, as to_bf16), as int32 lanes 0..0xFFFF. */
INLINE __m512i to_bf16_16(const __m512 f) {
    const __m512i b = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), I32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, I32(0x7FFF)), odd), 16);
}

/* Dequantizes [c0, c1): 32 columns per step, then masked 16s; returns 1 if a NaN code was seen. */
INLINE int dequant_span_avx512(const uint8_t *q, int64_t base, int64_t c0, int64_t c1, const float *s,
                               const int per_col, void *out, const int out_dtype) {
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7); /* undo packus' lane interleave */
    const __m512 s0 = _mm512_set1_ps(s[0]);
    __mmask16 nan = 0;
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) {
        const __m512 v0 = dequant16(_mm_loadu_si128((const __m128i *)(q + base + c)), per_col ? _mm512_loadu_ps(s + c) : s0, &nan);
        const __m512 v1 = dequant16(_mm_loadu_si128((const __m128i *)(q + base + c + 16)),
                                    per_col ? _mm512_loadu_ps(s + c + 16) : s0, &nan);
        if (out_dtype == FP8RL_DTYPE_F32) {
            _mm512_storeu_ps((float *)out + base + c, v0);
            _mm512_storeu_ps((float *)out + base + c + 16, v1);
        } else {
            const __m512i h = _mm512_permutexvar_epi64(order, _mm512_packus_epi32(to_bf16_16(v0), to_bf16_16(v1)));
            _mm512_storeu_si512((uint16_t *)out + base + c, h);
        }
    }
    for (; c < c1; c += 16) {
        const __mmask16 k = tail16(c1 - c);
        const __m512 sc = per_col ? _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), k, s + c) : s0;
        const __m512 v = dequant16(_mm_maskz_loadu_epi8(k, q + base + c), sc, &nan);
        if (out_dtype == FP8RL_DTYPE_F32) _mm512_mask_storeu_ps((float *)out + base + c, k, v);
        else _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)out + base + c, k, to_bf16_16(v));
    }
    return nan != 0;
}
#endif

INLINE int dequant_span(const uint8_t *q, int64_t base, int64_t c0, int64_t c1, const float *s, const int per_col,
                        void *out, const int out_dtype) {
#if SIMD == FP8RL_SIMD_AVX512
    return dequant_span_avx512(q, base, c0, c1, s, per_col, out, out_dtype);
#endif
    int bad = 0;
#if SIMD == FP8RL_SIMD_AVX2
    c0 = dequant_span_avx2(q, base, c0, c1, s, per_col, out, out_dtype, &bad);
#endif
    for (int64_t c = c0; c < c1; c++) {
        uint8_t code = q[base + c];
        bad |= (code & 0x7Fu) == 0x7Fu;
        float v = e4m3_decode(code) * (per_col ? s[c] : s[0]);
        if (out_dtype == FP8RL_DTYPE_F32) ((float *)out)[base + c] = v;
        else ((uint16_t *)out)[base + c] = to_bf16(v);
    }
    return bad;
}

/* out = decode(q) * scale in FP32, stored as FP32 (FP8RL_DTYPE_F32) or BF16. Returns FP8RL_DECLINED (nothing
 * trustworthy written) if q holds a NaN code. */
int fp8rl_dequantize(const uint8_t *q, const float *scale, int64_t m, int64_t n, int64_t br, int64_t bc,
                     void *out, int out_dtype, int nthreads) {
    int64_t nb = (n + bc - 1) / bc, nj = bc == 1 ? 1 : nb;
    int bad = 0;
    hint_huge_pages(out, m * n * (out_dtype == FP8RL_DTYPE_F32 ? 4 : 2));
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : bad)
    for (int64_t r = 0; r < m; r++) {
        const float *srow = scale + (r / br) * nb;
        for (int64_t j = 0; j < nj; j++) {
            int64_t c0 = bc == 1 ? 0 : j * bc, c1 = bc == 1 ? n : ((j + 1) * bc < n ? (j + 1) * bc : n);
            const float *s = bc == 1 ? srow : srow + j;
            if (bc == 1 && out_dtype == FP8RL_DTYPE_F32) bad |= dequant_span(q, r * n, c0, c1, s, 1, out, FP8RL_DTYPE_F32);
            else if (bc == 1) bad |= dequant_span(q, r * n, c0, c1, s, 1, out, FP8RL_DTYPE_BF16);
            else if (out_dtype == FP8RL_DTYPE_F32) bad |= dequant_span(q, r * n, c0, c1, s, 0, out, FP8RL_DTYPE_F32);
            else bad |= dequant_span(q, r * n, c0, c1, s, 0, out, FP8RL_DTYPE_BF16);
        }
    }
    return bad;
}
