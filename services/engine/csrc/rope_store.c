/* One layer's rotary embedding and K/V store for a packed batch, in one pass (CPU): the q/k/v
 * GEMM's output row of each new token is read once; its query heads are rotated into `q_out`
 * (float32, what the attention kernels take) and its key heads, rotated, and value heads are
 * written straight into the token's slot of the paged pool.
 *
 * Rotation as transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, with
 * rotate_half([x1, x2]) = [-x2, x1] over the head dimension; in float32 its two products and
 * the sum are each rounded as torch rounds them (no fused multiply-add), so a float32 model's
 * K, V and q are bit-identical to the tensor ops this replaces. A bfloat16 model's inputs are
 * widened, rotated in float32 and its K/V rounded to bfloat16 once (to nearest even).
 *
 * qkv: [N, (H + 2 KVH) * D] (q heads, k heads, v heads); cos, sin: [N, D]. The slot of token
 * i is page slot_pages[i], offset slot_offsets[i]; `k_base` / `v_base` and `page_stride` as
 * in paged_attention.c (one layer's K / V of page 0, elements between pages).
 */
#ifndef KV_T
#include "kv_types.h"

#include "kv_instantiate.h"

#else /* compiled once per model dtype */

/* x * c + rotate_half(x) * s for one head, into float32 `out`. */
__attribute__((optimize("fp-contract=off")))
static void KV_NAME(rotate)(const KV_T *x, const KV_T *cos, const KV_T *sin, int64_t d,
                            float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = KV_NAME(ld1)(x + i) * KV_NAME(ld1)(cos + i);
        const float b = -KV_NAME(ld1)(x + half + i) * KV_NAME(ld1)(sin + i);
        out[i] = a + b;
    }
    for (int64_t i = half; i < d; i++) {
        const float a = KV_NAME(ld1)(x + i) * KV_NAME(ld1)(cos + i);
        const float b = KV_NAME(ld1)(x + i - half) * KV_NAME(ld1)(sin + i);
        out[i] = a + b;
    }
}

int KV_NAME(rope_store)(const KV_T *qkv, const KV_T *cos, const KV_T *sin, float *q_out,
                        KV_T *k_base, KV_T *v_base, const int64_t *slot_pages,
                        const int64_t *slot_offsets, int64_t n, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, int64_t page_stride, int num_threads) {
    if (head_dim % 2 || head_dim > 1024) return -3;
    const int64_t row = (heads + 2 * kv_heads) * head_dim, tok_stride = kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (n >= 64) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const KV_T *x = qkv + i * row, *c = cos + i * head_dim, *s = sin + i * head_dim;
        for (int64_t h = 0; h < heads; h++)
            KV_NAME(rotate)(x + h * head_dim, c, s, head_dim, q_out + (i * heads + h) * head_dim);
        const int64_t slot = slot_pages[i] * page_stride + slot_offsets[i] * tok_stride;
        float k[1024];
        for (int64_t h = 0; h < kv_heads; h++) {
            KV_NAME(rotate)(x + (heads + h) * head_dim, c, s, head_dim, k);
            KV_T *dst = k_base + slot + h * head_dim;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = KV_STORE(k[d]);
        }
        __builtin_memcpy(v_base + slot, x + (heads + kv_heads) * head_dim,
                         sizeof(KV_T) * tok_stride);
    }
    return 0;
}

#endif /* KV_T */
