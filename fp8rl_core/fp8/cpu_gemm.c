/* Exact blockwise-FP8 GEMM on BF16 dot-product instructions (AMX TDPBF16PS, AVX512_BF16 VDPBF16PS),
 * with a portable C path of the same blocking and summation order.
 *
 *   C[m, n] = sum_kb (P_kb[m, n] * sa[kb, m]) * sb[kb, n]   (kb in order: acc = v_0, then acc = acc + v_kb)
 *   P_kb[m, n] = sum_{k in block kb} a[m, k] * b[n, k]   (FP32; pairs (2j, 2j+1) ascending, the odd k first)
 *
 * Why this is the FP8 GEMM's contract: every E4M3 value is exact in BF16 (3 mantissa bits of 7), the
 * product of two is exact in FP32 (8 significant bits of 24, exponents within FP32's normal range: the
 * smallest |product| is 2^-18), and the instructions add each exact product to an FP32 accumulator with
 * round-to-nearest-even. Their denormal flushing (DAZ/FTZ) never applies: the inputs are BF16 normals
 * and every nonzero partial sum is a multiple of 2^-18. Scales are applied per 128-block to the block's
 * partial sums, as DeepSeek-V3's fp8_gemm does, in FP32: (P * sa) * sb, then added.
 *
 * Data layout (prepared by the pack functions, which also decode E4M3 codes to BF16):
 *   A  BF16 in AMX A tiles [Mp/16][Kp/32][16][32] (Mp = M rounded up to 32, Kp = K rounded up to 128;
 *      padding is zero): a tile is 1 KiB in one piece, so a tile load never strides across L1 sets
 *      (row-major rows 2 KiB apart at K = 1024 fell into two sets of L1)
 *   B  BF16 "VNNI" [Np/16][Kp/2][16][2]: for 16 columns, k-pairs (2j, 2j+1) interleaved; one row of an
 *      AMX B tile and one AVX-512 vector are the 16 columns' pair j (64 bytes)
 *   scales: the operands' own FP32 block scales, read in place: A's scale of row m, K-block kb at
 *   sa[(m / ba) * sa_r + kb * sa_k] (ba: the operand's row block, 1 or 128), B's likewise
 * Paths (argument `path`): FP8RL_GEMM_PATH_C (portable), _AVX512_BF16, _AMX. The caller picks by the CPU's
 * flags; fp8rl_gemm_paths() says which were compiled (-march=native decides). Interface (path, return
 * codes, signatures): fp8rl_kernels.h.
 * Output: FP32 or BF16 [M, N] with row stride ldc; bias (FP32 [N] or NULL) is added in FP32 before the
 * one cast to BF16 (round to nearest even), as the reference linear does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8rl_kernels.h"
#if defined(__AVX512F__) || defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define BK FP8RL_GEMM_BK /* K-block */
#define MR FP8RL_GEMM_MR /* rows per micro-block (two AMX A tiles) */
#define NR FP8RL_GEMM_NR /* columns per micro-block (two AMX B tiles / two vectors) */
/* Element (m, k) of a packed A (see the header). */
#define AIDX(m, k, Kp) ((((m) >> 4) * ((Kp) >> 5) + ((k) >> 5)) * 512 + ((m) & 15) * 32 + ((k) & 31))

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* E4M3 code -> the same value in BF16 (exact: the FP32 encoding's low 16 bits are zero). NaN codes
 * (0x7F, 0xFF) map to a BF16 NaN; the caller rejects them before packing. */
static uint16_t e4m3_to_bf16(uint8_t code) {
    uint32_t sign = ((uint32_t)(code & 0x80u)) << 24, mag = code & 0x7Fu, v;
    if (mag == 0x7Fu) return (uint16_t)(0x7FC0u | (sign >> 16));
    if (mag < 8u) v = f2u((float)mag * 0.001953125f); /* subnormal codes: mag * 2^-9 */
    else v = (mag << 20) + (120u << 23);
    return (uint16_t)((v | sign) >> 16);
}

static uint16_t TABLE[256];
static int table_ready;

static void init_table(void) {
    if (table_ready) return;
    for (int c = 0; c < 256; c++) TABLE[c] = e4m3_to_bf16((uint8_t)c);
    table_ready = 1;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; finite inputs */
    uint32_t b = f2u(f);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* The paths this build has (FP8RL_GEMM_HAS_* bits), fixed by the target flags. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAS_AVX512_BF16 FP8RL_GEMM_HAS_AVX512_BF16
#else
#define HAS_AVX512_BF16 0
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#define HAS_AMX FP8RL_GEMM_HAS_AMX
#else
#define HAS_AMX 0
#endif
#define COMPILED_PATHS (FP8RL_GEMM_HAS_C | HAS_AVX512_BF16 | HAS_AMX)
/* The warning builds (tests/fp8rl_core/fp8/test_kernel_builds.py) state the paths their flags must select. */
#if defined(FP8RL_EXPECT_PATHS) && FP8RL_EXPECT_PATHS != COMPILED_PATHS
#error "the target flags did not compile the expected GEMM paths"
#endif

int fp8rl_gemm_paths(void) { return COMPILED_PATHS; }

/* Linux grants AMX tile data per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA = 18).
 * Returns 0 when granted (or already), -1 otherwise (the caller then uses another path). */
int fp8rl_amx_init(void) {
#if defined(__AMX_BF16__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 0 : -1;
#else
    return -1;
#endif
}

/* ---- packing: E4M3 codes (any strides) -> BF16 layouts above --------------------------------------- */

#if defined(__AVX512BW__)
/* 32 E4M3 codes -> their BF16 bits (TABLE's values): two 64-entry permutes by the magnitude's low six
 * bits, the seventh picks one, and the sign is or-ed back. */
static __m512i T4[4];
static int t4_ready;

static void init_t4(void) {
    if (t4_ready) return;
    init_table();
    uint16_t t[128];
    for (int c = 0; c < 128; c++) t[c] = TABLE[c];
    for (int i = 0; i < 4; i++) T4[i] = _mm512_loadu_si512(t + 32 * i);
    t4_ready = 1;
}

static inline __m512i decode32(__m256i codes) {
    const __m512i c = _mm512_cvtepu8_epi16(codes);
    const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi16(0x7F));
    const __m512i lo = _mm512_permutex2var_epi16(T4[0], mag, T4[1]);
    const __m512i hi = _mm512_permutex2var_epi16(T4[2], mag, T4[3]);
    const __mmask32 upper = _mm512_test_epi16_mask(mag, _mm512_set1_epi16(0x40));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(_mm512_mask_blend_epi16(upper, lo, hi), sign);
}
#endif

#if defined(__AVX512BW__)
/* 16 x 16 transpose of 32-bit elements in four stages (blocks of 8, 4, 2, 1 swapped across the
 * diagonal): row i keeps its columns whose bit b is 0 and takes row i + b's there, row i + b the rest. */
static inline void transpose16(__m512i r[16]) {
    for (int b = 8; b >= 1; b /= 2) {
        int lo[16], hi[16];
        for (int c = 0; c < 16; c++) {
            lo[c] = (c & b) ? 16 + c - b : c;
            hi[c] = (c & b) ? 16 + c : c + b;
        }
        const __m512i il = _mm512_loadu_si512(lo), ih = _mm512_loadu_si512(hi);
        for (int i = 0; i < 16; i++) {
            if (i & b) continue;
            const __m512i x = r[i], y = r[i + b];
            r[i] = _mm512_permutex2var_epi32(x, il, y);
            r[i + b] = _mm512_permutex2var_epi32(x, ih, y);
        }
    }
}

/* A[m, k] = codes[k * sk + m] (a transposed source), M a multiple of 16: rows k, k+1 of codes decode to
 * 16 (k, k+1) pairs of 16 output rows; 16 such pair vectors transposed are 16 rows' 32 values. The tail
 * of K (k from a multiple of 32 up to Kp) is written by the scalar loop, padding included. */
static void pack_a_t(const uint8_t *codes, int64_t sk, int64_t M, int64_t K, int64_t Mp, int64_t Kp, uint16_t *out,
                     int nthreads) {
    init_t4();
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t kv = K / 32 * 32;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t k0 = 0; k0 < kv; k0 += 32) { /* 32 source rows stay in L1 while every m block is read */
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            __m512i r[16];
            for (int q = 0; q < 16; q++) {
                const __m128i e = _mm_loadu_si128((const __m128i *)(codes + (k0 + 2 * q) * sk + m0));
                const __m128i f = _mm_loadu_si128((const __m128i *)(codes + (k0 + 2 * q + 1) * sk + m0));
                r[q] = _mm512_permutexvar_epi16(pairs, decode32(_mm256_set_m128i(f, e)));
            }
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(out + AIDX(m0 + c, k0, Kp), r[c]);
        }
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t m = 0; m < Mp; m++)
        for (int64_t k = (m < M ? kv : 0); k < Kp; k++)
            out[AIDX(m, k, Kp)] = (m < M && k < K) ? TABLE[codes[k * sk + m]] : 0;
}
#endif

/* A[m, k] = codes[m * sm + k * sk], m < M, k < K -> out BF16 [Mp, Kp] (zero padding). Tiled 64x64 so
 * that a transposed source (sm = 1) is read a cache line at a time; rows of a contiguous source (sk = 1)
 * decode 32 codes per step. */
void fp8rl_pack_a(const uint8_t *codes, int64_t sm, int64_t sk, int64_t M, int64_t K, int64_t Mp, int64_t Kp,
                  uint16_t *out, int nthreads) {
    init_table();
#if defined(__AVX512BW__)
    if (sk == 1) {
        init_t4();
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t m = 0; m < Mp; m++) {
            int64_t k = 0;
            if (m < M)
                for (; k + 32 <= K; k += 32)
                    _mm512_storeu_si512(out + AIDX(m, k, Kp),
                                        decode32(_mm256_loadu_si256((const __m256i *)(codes + m * sm + k))));
            for (; k < Kp; k++) out[AIDX(m, k, Kp)] = (m < M && k < K) ? TABLE[codes[m * sm + k]] : 0;
        }
        return;
    }
    if (sm == 1 && M % 16 == 0 && K >= 32) { /* a transposed source (wgrad's dY^T): see pack_a_t */
        pack_a_t(codes, sk, M, K, Mp, Kp, out, nthreads);
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t m0 = 0; m0 < Mp; m0 += 64) {
        for (int64_t k0 = 0; k0 < Kp; k0 += 64) {
            for (int64_t m = m0; m < m0 + 64 && m < Mp; m++) {
                for (int64_t k = k0; k < k0 + 64 && k < Kp; k++)
                    out[AIDX(m, k, Kp)] = (m < M && k < K) ? TABLE[codes[m * sm + k * sk]] : 0;
            }
        }
    }
}

/* B[n, k] = codes[n * sn + k * sk] -> out BF16 VNNI [Np/16][Kp/2][16][2] (zero padding). */
void fp8rl_pack_b(const uint8_t *codes, int64_t sn, int64_t sk, int64_t N, int64_t K, int64_t Np, int64_t Kp,
                  uint16_t *out, int nthreads) {
    init_table();
    const int64_t kh = Kp / 2;
#if defined(__AVX512BW__)
    if (sn == 1 && N % 32 == 0 && K % 2 == 0) { /* rows 2j, 2j+1 of a [K, N] source, interleaved */
        init_t4();
        const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t j = 0; j < kh; j++) {
            for (int64_t n0 = 0; n0 < Np; n0 += 32) {
                uint16_t *o0 = out + (n0 / 16) * kh * 32 + j * 32, *o1 = o0 + kh * 32;
                if (n0 >= N || 2 * j >= K) { memset(o0, 0, 64); memset(o1, 0, 64); continue; }
                const __m512i e = decode32(_mm256_loadu_si256((const __m256i *)(codes + 2 * j * sk + n0)));
                const __m512i f = decode32(_mm256_loadu_si256((const __m256i *)(codes + (2 * j + 1) * sk + n0)));
                _mm512_storeu_si512(o0, _mm512_permutex2var_epi16(e, lo_idx, f));
                _mm512_storeu_si512(o1, _mm512_permutex2var_epi16(e, hi_idx, f));
            }
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < Np / 16; nb++) {
        uint16_t *o = out + nb * kh * 32;
        for (int64_t j = 0; j < kh; j++) {
            for (int64_t c = 0; c < 16; c++) {
                const int64_t n = nb * 16 + c, k = 2 * j;
                o[j * 32 + 2 * c] = (n < N && k < K) ? TABLE[codes[n * sn + k * sk]] : 0;
                o[j * 32 + 2 * c + 1] = (n < N && k + 1 < K) ? TABLE[codes[n * sn + (k + 1) * sk]] : 0;
            }
        }
    }
}

/* ---- the accumulate step shared by every path ------------------------------------------------------- */

/* One K-block's contribution to an MR x NR block (row strides NR), v = (p * sa[r]) * sb[c]:
 * first block: acc = v (the sum starts at the first term, not at 0 + v); later blocks: acc = acc + v.
 * With `out` (the last block of a full block): acc + v (+ bias) goes straight to the output instead. */
static inline void scale_step(float *acc, const float *p, const float *sa, const float *sb, int first,
                              void *out, int64_t ldc, const float *bias, int out_bf16) {
#if defined(__AVX512F__)
    for (int r = 0; r < MR; r++) {
        const __m512 s = _mm512_set1_ps(sa[r]);
        for (int h = 0; h < NR; h += 16) {
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(p + r * NR + h), s), _mm512_loadu_ps(sb + h));
            if (!first) v = _mm512_add_ps(_mm512_loadu_ps(acc + r * NR + h), v);
            if (!out) { _mm512_storeu_ps(acc + r * NR + h, v); continue; }
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + h));
            if (!out_bf16) { _mm512_storeu_ps((float *)out + r * ldc + h, v); continue; }
            const __m512i b = _mm512_castps_si512(v);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            const __m512i w = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * ldc + h), _mm512_cvtepi32_epi16(w));
        }
    }
#else
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NR; q++) {
            float v = (p[r * NR + q] * sa[r]) * sb[q];
            if (!first) v = acc[r * NR + q] + v;
            if (!out) { acc[r * NR + q] = v; continue; }
            if (bias) v = v + bias[q];
            if (out_bf16) ((uint16_t *)out)[r * ldc + q] = to_bf16(v);
            else ((float *)out)[r * ldc + q] = v;
        }
#endif
}

/* ---- P_kb for one MR x NR micro-block, three ways ---------------------------------------------------- */

/* Portable: pairs ascending, within a pair the odd k first (VDPBF16PS's order, Intel SDM), one FP32
 * rounding per add (the products are exact). */
/* Not vectorized: gcc 12 -O3 vectorized this loop nest (inlined into the pipelined kb loop) into code
 * that read the wrong A elements (a test's [[3, 3]] came out [[4, 6]]); the reference path wants plain code. */
__attribute__((noinline, optimize("no-tree-vectorize")))
static void block_c(const uint16_t *a, int64_t Kp, const uint16_t *b0, const uint16_t *b1, int64_t j0, float *p) {
    for (int r = 0; r < MR; r++) {
        for (int c = 0; c < NR; c++) {
            const uint16_t *bc = (c < 16 ? b0 : b1) + 2 * (c & 15);
            float s = 0.0f;
            for (int64_t j = j0; j < j0 + BK / 2; j++) {
                const uint16_t *ar = a + AIDX(r, 2 * j, Kp); /* the pair (2j, 2j + 1) of row r */
                s = s + u2f((uint32_t)ar[1] << 16) * u2f((uint32_t)bc[j * 32 + 1] << 16);
                s = s + u2f((uint32_t)ar[0] << 16) * u2f((uint32_t)bc[j * 32] << 16);
            }
            p[r * NR + c] = s;
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* VDPBF16PS: lane c += a[2j] * b[c, 2j] + a[2j+1] * b[c, 2j+1] (see the tests for the order it keeps). */
static void block_avx512(const uint16_t *a, int64_t Kp, const uint16_t *b0, const uint16_t *b1, int64_t j0,
                         float *p) {
    for (int r0 = 0; r0 < MR; r0 += 8) {
        __m512 acc[8][2];
        for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t j = j0; j < j0 + BK / 2; j++) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(b0 + j * 32);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512(b1 + j * 32);
            for (int r = 0; r < 8; r++) {
                uint32_t pair;
                memcpy(&pair, a + AIDX(r0 + r, 2 * j, Kp), 4);
                const __m512bh y = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], y, x0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], y, x1);
            }
        }
        for (int r = 0; r < 8; r++) {
            _mm512_storeu_ps(p + (r0 + r) * NR, acc[r][0]);
            _mm512_storeu_ps(p + (r0 + r) * NR + 16, acc[r][1]);
        }
    }
}
#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void amx_config(void) { /* tiles 0-3: P (16 x 16 FP32), 4-5: A (16 x 32 BF16), 6-7: B (16 pairs x 16) */
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}

static void block_amx(const uint16_t *a, int64_t Kp, const uint16_t *b0, const uint16_t *b1, int64_t j0, float *p) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t j = j0; j < j0 + BK / 2; j += 16) { /* 32 k per step */
        _tile_loadd(4, a + AIDX(0, 2 * j, Kp), 64);
        _tile_loadd(5, a + AIDX(16, 2 * j, Kp), 64);
        _tile_loadd(6, b0 + j * 32, 64);
        _tile_loadd(7, b1 + j * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, p, NR * 4);
    _tile_stored(1, p + 16, NR * 4);
    _tile_stored(2, p + 16 * NR, NR * 4);
    _tile_stored(3, p + 16 * NR + 16, NR * 4);
}
#endif

/* ---- the GEMM ---------------------------------------------------------------------------------------- */

static void store(const float *acc, int64_t m0, int64_t n0, int64_t M, int64_t N, const float *bias, void *c,
                  int64_t ldc, int out_bf16) {
    for (int r = 0; r < MR && m0 + r < M; r++) {
        int q = 0;
#if defined(__AVX512F__)
        for (; q + 16 <= NR && n0 + q + 16 <= N; q += 16) { /* the scalar loop's arithmetic, 16 lanes */
            __m512 v = _mm512_loadu_ps(acc + r * NR + q);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + q));
            if (!out_bf16) { _mm512_storeu_ps((float *)c + (m0 + r) * ldc + n0 + q, v); continue; }
            const __m512i b = _mm512_castps_si512(v);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
            _mm256_storeu_si256((__m256i *)((uint16_t *)c + (m0 + r) * ldc + n0 + q), _mm512_cvtepi32_epi16(h));
        }
#endif
        for (; q < NR && n0 + q < N; q++) {
            float v = acc[r * NR + q];
            if (bias) v = v + bias[n0 + q];
            if (out_bf16) ((uint16_t *)c)[(m0 + r) * ldc + n0 + q] = to_bf16(v);
            else ((float *)c)[(m0 + r) * ldc + n0 + q] = v;
        }
    }
}

/* P_kb of the micro-block at rows m0, columns b0|b1 into p, on the chosen path. */
static inline void block(int path, const uint16_t *a, int64_t Kp, const uint16_t *b0, const uint16_t *b1, int64_t kb,
                         float *p) {
    const int64_t j0 = kb * (BK / 2);
    if (path == FP8RL_GEMM_PATH_C) block_c(a, Kp, b0, b1, j0, p);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    else if (path == FP8RL_GEMM_PATH_AVX512_BF16) block_avx512(a, Kp, b0, b1, j0, p);
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
    else if (path == FP8RL_GEMM_PATH_AMX) block_amx(a, Kp, b0, b1, j0, p);
#endif
}

/* C = A . B^T as in the header. Mp, Np multiples of 32, Kp of 128. Work items: (MC-row chunk, NR-column
 * block) pairs. Within one, K-blocks are the outer loop and the chunk's MC / MR micro-blocks the inner
 * one, so that B's 128 x NR slice stays in L1 while the chunk's rows pass under it; each micro-block's
 * accumulator (acc[i], MR x NR FP32) lives across the K-blocks. The steps are pipelined: step t's
 * products are issued before step t - 1 is scaled and added, so the AMX unit works while the vector
 * unit scales. A full micro-block's last K-block writes the output directly; one at the matrix's edge
 * goes through store. */
#define MC 256

int fp8rl_gemm(const uint16_t *a, const uint16_t *b, fp8rl_scales sa_, fp8rl_scales sb_, int64_t M, int64_t N,
               int64_t Mp, int64_t Np, int64_t Kp, const float *bias, void *c, int64_t ldc, int out_bf16, int path,
               int nthreads) {
    const int64_t kb_n = Kp / BK, n_nb = Np / NR, n_mc = (Mp + MC - 1) / MC;
    if ((path == FP8RL_GEMM_PATH_AVX512_BF16 && !HAS_AVX512_BF16) || (path == FP8RL_GEMM_PATH_AMX && !HAS_AMX))
        return FP8RL_GEMM_NOT_COMPILED;
    if (sa_.block & (sa_.block - 1) || sb_.block & (sb_.block - 1)) /* row blocks are 1 or 128 */
        return FP8RL_GEMM_BAD_BLOCK;
    const int sa_sh = __builtin_ctzll((unsigned long long)sa_.block), sb_sh = __builtin_ctzll((unsigned long long)sb_.block);
#pragma omp parallel num_threads(nthreads)
    {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
        if (path == FP8RL_GEMM_PATH_AMX) amx_config();
#endif
        static __thread float acc[MC / MR][MR * NR] __attribute__((aligned(64)));
        float p[2][MR * NR] __attribute__((aligned(64)));
        float sa[MR], sb[NR];
        int64_t roff[MC], coff[NR];
#pragma omp for schedule(static) collapse(2)
        for (int64_t mc = 0; mc < n_mc; mc++) {
            for (int64_t nb = 0; nb < n_nb; nb++) {
                const int64_t n0 = nb * NR, mbase = mc * MC;
                const int64_t nm = ((mbase + MC < Mp ? mbase + MC : Mp) - mbase) / MR, steps = kb_n * nm;
                const uint16_t *b0 = b + (n0 / 16) * (Kp / 2) * 32, *b1 = b0 + (Kp / 2) * 32;
                for (int64_t r = 0; r < nm * MR; r++) /* scale offsets, once per item (-1: a padding row) */
                    roff[r] = mbase + r < M ? ((mbase + r) >> sa_sh) * sa_.r : -1;
                for (int q = 0; q < NR; q++) coff[q] = n0 + q < N ? ((n0 + q) >> sb_sh) * sb_.r : -1;
                for (int64_t t = 0; t <= steps; t++) {
                    if (t < steps) block(path, a + AIDX(mbase + (t % nm) * MR, 0, Kp), Kp, b0, b1, t / nm, p[t & 1]);
                    if (t == 0) continue;
                    const int64_t kb = (t - 1) / nm, i = (t - 1) % nm, m0 = mbase + i * MR;
                    const int full = m0 + MR <= M && n0 + NR <= N, last = kb == kb_n - 1;
                    char *direct = (char *)c + (m0 * ldc + n0) * (out_bf16 ? 2 : 4);
                    for (int r = 0; r < MR; r++) sa[r] = roff[i * MR + r] < 0 ? 0.0f : sa_.s[roff[i * MR + r] + kb * sa_.k];
                    if (i == 0) /* a new K-block: this column block's scales */
                        for (int q = 0; q < NR; q++) sb[q] = coff[q] < 0 ? 0.0f : sb_.s[coff[q] + kb * sb_.k];
                    scale_step(acc[i], p[(t - 1) & 1], sa, sb, kb == 0, last && full ? direct : NULL,
                               ldc, bias ? bias + n0 : NULL, out_bf16);
                    if (last && !full) store(acc[i], m0, n0, M, N, bias, c, ldc, out_bf16);
                }
            }
        }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (path == FP8RL_GEMM_PATH_AMX) _tile_release();
#endif
    }
    return FP8RL_OK;
}

/* fp8rl_gemm with A given as E4M3 codes (any strides, as fp8rl_pack_a takes them): packed into a scratch
 * buffer here, so that an activation costs one call from Python instead of two and one tensor less.
 * Returns fp8rl_gemm's codes, or FP8RL_GEMM_NO_MEMORY when the scratch cannot be allocated. */
int fp8rl_gemm_codes(const uint8_t *codes, int64_t sm, int64_t sk, const uint16_t *b, fp8rl_scales sa_,
                     fp8rl_scales sb_, int64_t M, int64_t N, int64_t K, int64_t Mp, int64_t Np, int64_t Kp,
                     const float *bias, void *c, int64_t ldc, int out_bf16, int path, int nthreads) {
    uint16_t *a = aligned_alloc(64, (size_t)(Mp * Kp * 2));
    if (!a) return FP8RL_GEMM_NO_MEMORY;
    fp8rl_pack_a(codes, sm, sk, M, K, Mp, Kp, a, nthreads);
    const int rc = fp8rl_gemm(a, b, sa_, sb_, M, N, Mp, Np, Kp, bias, c, ldc, out_bf16, path, nthreads);
    free(a);
    return rc;
}
