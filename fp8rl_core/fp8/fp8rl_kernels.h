/* The C kernels' interface: fused_cpu.c (blockwise E4M3 quantize / dequantize) and cpu_gemm.c (the
 * blockwise-FP8 GEMM on BF16 dot products). Both sources include this header, and the Python wrappers
 * (fused_cpu.py, cpu_gemm.py) read every FP8RL_* integer #define below at import (cbuild.constants),
 * so an argument or return code has one definition. Keep each #define a plain integer literal: the
 * Python side parses `#define FP8RL_NAME <integer>` lines and nothing else.
 */
#ifndef FP8RL_KERNELS_H
#define FP8RL_KERNELS_H

#include <stdint.h>

/* ---- fused_cpu.c -------------------------------------------------------------------------------------- */

/* Element types of x (quantize) and out (dequantize). */
#define FP8RL_DTYPE_F32 0
#define FP8RL_DTYPE_BF16 1

/* fp8rl_simd_path(): the vector path a build runs (fixed at compile time by the target). */
#define FP8RL_SIMD_AVX512 512 /* AVX-512 F/BW/VL, 16 lanes */
#define FP8RL_SIMD_AVX2 256   /* AVX2, 8 lanes */
#define FP8RL_SIMD_SCALAR 0   /* portable C */

/* fp8rl_quantize / fp8rl_dequantize return codes. */
#define FP8RL_OK 0
#define FP8RL_DECLINED 1 /* a non-finite block (quantize) or a NaN code (dequantize): run the reference */

int fp8rl_simd_path(void);
/* x [m, n] (dtype) -> q E4M3 [m, n] (or NULL), scale FP32 [ceil(m/br), ceil(n/bc)], deq FP32 [m, n] (or
 * NULL; not both NULL); pow2: scales rounded up to powers of two; work: nthreads * ceil(n/bc) uint32. */
int fp8rl_quantize(const void *x, int dtype, int64_t m, int64_t n, int64_t br, int64_t bc, int pow2, uint8_t *q,
                   float *scale, float *deq, uint32_t *work, int nthreads);
/* out [m, n] (out_dtype) = decode(q) * scale. */
int fp8rl_dequantize(const uint8_t *q, const float *scale, int64_t m, int64_t n, int64_t br, int64_t bc, void *out,
                     int out_dtype, int nthreads);

/* ---- cpu_gemm.c --------------------------------------------------------------------------------------- */

/* Blocking, fixed at compile time: the K-block, and the rows / columns of a micro-block. */
#define FP8RL_GEMM_BK 128
#define FP8RL_GEMM_MR 32
#define FP8RL_GEMM_NR 32

/* The `path` argument of fp8rl_gemm / fp8rl_gemm_codes. */
#define FP8RL_GEMM_PATH_C 0
#define FP8RL_GEMM_PATH_AVX512_BF16 1
#define FP8RL_GEMM_PATH_AMX 2

/* fp8rl_gemm_paths(): a bit per compiled path. */
#define FP8RL_GEMM_HAS_C 1
#define FP8RL_GEMM_HAS_AVX512_BF16 2
#define FP8RL_GEMM_HAS_AMX 4

/* fp8rl_gemm / fp8rl_gemm_codes return codes (0: FP8RL_OK). */
#define FP8RL_GEMM_NOT_COMPILED 1 /* the path asked for is not in this build */
#define FP8RL_GEMM_BAD_BLOCK 2    /* a row block that is not a power of two */
#define FP8RL_GEMM_NO_MEMORY 3    /* fp8rl_gemm_codes could not allocate A's packed copy */

/* An operand's FP32 block scales, read in place: row r, K-block kb at s[(r / block) * r + kb * k]. */
typedef struct {
    const float *s;
    int64_t r, k, block;
} fp8rl_scales;

int fp8rl_gemm_paths(void);
int fp8rl_amx_init(void);
void fp8rl_pack_a(const uint8_t *codes, int64_t sm, int64_t sk, int64_t M, int64_t K, int64_t Mp, int64_t Kp,
                  uint16_t *out, int nthreads);
void fp8rl_pack_b(const uint8_t *codes, int64_t sn, int64_t sk, int64_t N, int64_t K, int64_t Np, int64_t Kp,
                  uint16_t *out, int nthreads);
int fp8rl_gemm(const uint16_t *a, const uint16_t *b, fp8rl_scales sa, fp8rl_scales sb, int64_t M, int64_t N,
               int64_t Mp, int64_t Np, int64_t Kp, const float *bias, void *c, int64_t ldc, int out_bf16, int path,
               int nthreads);
int fp8rl_gemm_codes(const uint8_t *codes, int64_t sm, int64_t sk, const uint16_t *b, fp8rl_scales sa,
                     fp8rl_scales sb, int64_t M, int64_t N, int64_t K, int64_t Mp, int64_t Np, int64_t Kp,
                     const float *bias, void *c, int64_t ldc, int out_bf16, int path, int nthreads);

#endif
