/* What both attention kernels share: 16-float vectors, and reading K/V of either pool type
 * (float32, or bfloat16 widened to float32: a bf16 is a float's upper 16 bits). */
#ifndef PDSERVE_KV_TYPES_H
#define PDSERVE_KV_TYPES_H

#include <stdint.h>

/* 16-float vectors (one AVX-512 register, two AVX2 ones): GCC lowers them to what -march has. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  /* unaligned loads */
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint16_t bf16_t;
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));

static inline float ld1_f32(const float *p) { return *p; }
static inline v16 ld16_f32(const float *p) { return *(const v16u *)p; }

static inline float ld1_bf16(const bf16_t *p) {
    const uint32_t bits = (uint32_t)*p << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

static inline v16 ld16_bf16(const bf16_t *p) {
    const i16 wide = __builtin_convertvector(*(const u16x16 *)p, i16) << 16;
    return (v16)wide;
}

/* float32 -> bfloat16, rounded to nearest even (NaN stays NaN). */
static inline bf16_t to_bf16(float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

#endif
