/* Causal attention for prompt chunks over the paged KV pool (fp32, CPU), read in place:
 * flash-style (online softmax over key blocks), so no score matrix is ever materialized and
 * no mask tensor is built; keys past a row's position are never visited.
 *
 * Same batch and pool conventions as paged_attention.c (this file is compiled into the same
 * library): sequence s owns query rows q_starts[s] .. q_ends[s]-1, row i at position
 * context_lens[s] - qlen + i, seeing keys lo .. that position (lo > 0 only inside a sliding
 * window).
 *
 * A work item is (sequence, tile of QT query rows, KV head): its QT * group query vectors
 * (every query head that shares the KV head) meet each block of 16 keys once. The block's K
 * is transposed into 16-key columns, so a query's 16 scores are head_dim broadcast FMAs into
 * one register; V rows are read where they lie. Items run longest first (a causal tile's work
 * grows with its position) under OpenMP's dynamic schedule.
 *
 * Like paged_attention.c, the second half is compiled once per pool type (float32, bfloat16;
 * kv_instantiate.h):
 * entry points paged_prefill_f32 and paged_prefill_bf16; queries and outputs are float32.
 */
#ifndef KV_T
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define QT 32   /* query rows of one work item */
#define NB 4    /* 16-float score vectors of one key block */
#define KB (16 * NB)  /* keys of one block */

#include "kv_types.h"


static inline v16 vmax(v16 a, v16 b) {
    const i16 gt = a > b;
    return (v16)((gt & (i16)a) | (~gt & (i16)b));
}

static inline float hmax16(v16 x) {
    const i16 s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const i16 s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const i16 s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const i16 s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    x = vmax(x, __builtin_shuffle(x, s8));
    x = vmax(x, __builtin_shuffle(x, s4));
    x = vmax(x, __builtin_shuffle(x, s2));
    x = vmax(x, __builtin_shuffle(x, s1));
    return x[0];
}

static inline float hsum16(v16 x) {
    const i16 s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const i16 s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const i16 s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const i16 s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    x += __builtin_shuffle(x, s8);
    x += __builtin_shuffle(x, s4);
    x += __builtin_shuffle(x, s2);
    x += __builtin_shuffle(x, s1);
    return x[0];
}

/* Keeps a loaded vector in a register: left alone, GCC folds the load into every FMA that
 * reads it, and the loop then waits on loads instead of FMAs (7-9% of the kernel's time on
 * AVX-512). Elsewhere a 16-float vector spans registers and this does nothing. */
#ifdef __AVX512F__
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

/* Whether any lane of x exceeds y: one compare on AVX-512, the full reduction elsewhere. */
static inline int any_above(v16 x, float y) {
#ifdef __AVX512F__
    return _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(y), _CMP_GT_OQ) != 0;
#else
    return hmax16(x) > y;
#endif
}

/* Transposes the 16x16 block held in r (r[t][d] -> r[d][t]) in place: four butterfly stages
 * that each swap the off-diagonal s x s sub-blocks of every 2s x 2s block (s = 8, 4, 2, 1), one
 * two-source shuffle per row and stage: 64 shuffles where element by element takes 512 moves. */
static inline void transpose16(v16 r[16]) {
#define STAGE(S, LO, HI)                                                                        \
    for (int i = 0; i < 16; i++)                                                               \
        if (!(i & S)) {                                                                        \
            const v16 a = r[i], b = r[i + S];                                                  \
            r[i] = __builtin_shuffle(a, b, LO);                                                \
            r[i + S] = __builtin_shuffle(a, b, HI);                                            \
        }
    const i16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i16 hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i16 lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i16 hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i16 lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i16 hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    STAGE(8, lo8, hi8)
    STAGE(4, lo4, hi4)
    STAGE(2, lo2, hi2)
    STAGE(1, lo1, hi1)
#undef STAGE
}

/* e^x for x <= 0 (scores minus their running max), inline: no call, so the accumulators stay
 * in registers. Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial for e^r
 * (about 1 ulp), 2^n through the exponent bits. x below -87 (and -inf, a masked key) gives
 * e^-87 ~ 1.6e-38: nothing next to the block's largest term, 1. */
static inline v16 exp_le0(v16 x) {
    const v16 zero = {0};
    const v16 lowest = zero - 87.0f;
    x = vmax(x, lowest);
    const v16 magic = zero + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 n = (x * 1.44269504088896341f + magic) - magic;
    const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v16 y = p * r * r + r + 1.0f;
    const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    return y * (v16)bits;
}

#include "kv_instantiate.h"

#else /* the part compiled once per K/V type */

/* One work item. HD: head_dim (a multiple of 16) and QB: query vectors taken together (so
 * every FMA chain has enough independent accumulators to hide its latency, and each K and V
 * load feeds QB FMAs), both fixed at compile time so the loops unroll into registers. A query
 * vector's state is its running max, a vector of partial sums (summed across lanes once, at
 * the end) and its output accumulator. */
#define PREFILL_ITEM(NAME, HD, QB)                                                              \
static void NAME(const float *q, float *out, const KV_T *k_base, const KV_T *v_base,           \
                 const int64_t *table, int64_t page_stride, int64_t block, int64_t kv_heads,   \
                 int64_t row_stride, int64_t group, int64_t h, int64_t first_row,              \
                 int64_t rows, int64_t first_pos, int64_t window, float scale) {               \
    enum { NV = HD / 16 };                                                                     \
    const int64_t nq = rows * group, tok_stride = kv_heads * HD;                               \
    v16 acc[nq][NV], lsum[nq];                                                                 \
    float mx[nq];                                                                              \
    v16 kt[HD][NB]; /* the block's K, transposed: kt[d][b][t] = K[j0 + 16 b + t][d] */          \
    const KV_T *krow[KB], *vrow[KB];                                                            \
    float p[QB][NB * 16] __attribute__((aligned(64)));                                         \
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                   \
    const v16 ninf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,        \
                      -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,        \
                      -INFINITY, -INFINITY, -INFINITY, -INFINITY};                             \
    for (int64_t i = 0; i < nq; i++) {                                                         \
        mx[i] = -INFINITY;                                                                     \
        lsum[i] = (v16){0};                                                                    \
        for (int c = 0; c < NV; c++) acc[i][c] = (v16){0};                                     \
    }                                                                                          \
    const int64_t last_pos = first_pos + rows - 1;                                             \
    int64_t j_lo = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;      \
    j_lo -= j_lo % KB;                                                                         \
    for (int64_t j0 = j_lo; j0 <= last_pos; j0 += KB) {                                        \
        const int64_t cnt = last_pos + 1 - j0 < KB ? last_pos + 1 - j0 : KB;                   \
        for (int64_t t = 0; t < KB; t++) {                                                     \
            const int64_t j = j0 + (t < cnt ? t : 0);                                          \
            const int64_t at = table[j / block] * page_stride + (j % block) * tok_stride       \
                               + h * HD;                                                       \
            krow[t] = k_base + at;                                                             \
            vrow[t] = v_base + at;                                                             \
        }                                                                                      \
        for (int b = 0; b < NB; b++)                                                           \
            for (int c = 0; c < NV; c++) {                                                     \
                v16 r[16];                                                                     \
                for (int t = 0; t < 16; t++) r[t] = KV_NAME(ld16)(krow[16 * b + t] + 16 * c);  \
                transpose16(r);                                                                \
                for (int d = 0; d < 16; d++) kt[16 * c + d][b] = r[d];                         \
            }                                                                                  \
        /* rows before j0's position see none of the block */                                 \
        int64_t i_first = (j0 > first_pos ? j0 - first_pos : 0) * group;                       \
        for (int64_t i0 = i_first - i_first % QB; i0 < nq; i0 += QB) {                        \
            const float *qv[QB];                                                               \
            int64_t pos[QB], lo[QB];                                                           \
            for (int u = 0; u < QB; u++) {                                                     \
                const int64_t i = i0 + u < nq ? i0 + u : nq - 1;                               \
                pos[u] = first_pos + i / group;                                                \
                lo[u] = window > 0 && pos[u] - window + 1 > 0 ? pos[u] - window + 1 : 0;       \
                qv[u] = q + (first_row + i / group) * row_stride + (h * group + i % group) * HD;\
            }                                                                                  \
            v16 s[QB][NB];                                                                     \
            for (int u = 0; u < QB; u++)                                                       \
                for (int b = 0; b < NB; b++) s[u][b] = (v16){0};                               \
            for (int64_t d = 0; d < HD; d++) {                                                 \
                v16 kd[NB]; /* this d's keys, held in registers for every query */             \
                for (int b = 0; b < NB; b++) {                                                 \
                    kd[b] = kt[d][b];                                                          \
                    IN_REGISTER(kd[b]);                                                        \
                }                                                                              \
                for (int u = 0; u < QB; u++) {                                                 \
                    const float x = qv[u][d];                                                  \
                    for (int b = 0; b < NB; b++) s[u][b] += x * kd[b];                         \
                }                                                                              \
            }                                                                                  \
            int live[QB];                                                                      \
            for (int u = 0; u < QB; u++) {                                                     \
                const int64_t i = i0 + u;                                                      \
                live[u] = i < nq && j0 <= pos[u] && j0 + cnt > lo[u];                          \
                if (!live[u]) continue;                                                        \
                const int partial = j0 + KB - 1 > pos[u] || j0 < lo[u];                        \
                v16 m = ninf;                                                                  \
                for (int b = 0; b < NB; b++) {                                                 \
                    s[u][b] *= scale;                                                          \
                    if (partial) {                                                             \
                        const i16 j = lane + (int32_t)(j0 + 16 * b);                           \
                        const i16 off = (j > (int32_t)pos[u]) | (j < (int32_t)lo[u]);          \
                        s[u][b] = (v16)((off & (i16)ninf) | (~off & (i16)s[u][b]));           \
                    }                                                                          \
                    m = vmax(m, s[u][b]);                                                      \
                }                                                                              \
                if (any_above(m, mx[i])) { /* a new max: rescale what was summed so far */     \
                    const float m_blk = hmax16(m);                                             \
                    const float alpha = expf(mx[i] - m_blk);                                   \
                    mx[i] = m_blk;                                                             \
                    lsum[i] *= alpha;                                                          \
                    for (int c = 0; c < NV; c++) acc[i][c] *= alpha;                           \
                }                                                                              \
                for (int b = 0; b < NB; b++)                                                   \
                    *(v16 *)(p[u] + 16 * b) = exp_le0(s[u][b] - mx[i]);                        \
            }                                                                                  \
            v16 o[QB][NV];                                                                     \
            for (int u = 0; u < QB; u++) {                                                     \
                if (!live[u]) { /* contributes nothing: p = 0, and no state to read */         \
                    memset(p[u], 0, sizeof p[u]);                                              \
                    for (int c = 0; c < NV; c++) o[u][c] = (v16){0};                           \
                    continue;                                                                  \
                }                                                                              \
                for (int b = 0; b < NB; b++) lsum[i0 + u] += *(v16 *)(p[u] + 16 * b);          \
                for (int c = 0; c < NV; c++) o[u][c] = acc[i0 + u][c];                         \
            }                                                                                  \
            for (int t = 0; t < cnt; t++) {                                                    \
                v16 vt[NV]; /* this key's V, held in registers for every query */              \
                for (int c = 0; c < NV; c++) {                                                 \
                    vt[c] = KV_NAME(ld16)(vrow[t] + 16 * c);                                   \
                    IN_REGISTER(vt[c]);                                                        \
                }                                                                              \
                for (int u = 0; u < QB; u++) {                                                 \
                    const float pu = p[u][t];                                                  \
                    for (int c = 0; c < NV; c++) o[u][c] += pu * vt[c];                        \
                }                                                                              \
            }                                                                                  \
            for (int u = 0; u < QB; u++)                                                       \
                if (live[u])                                                                   \
                    for (int c = 0; c < NV; c++) acc[i0 + u][c] = o[u][c];                     \
        }                                                                                      \
    }                                                                                          \
    for (int64_t i = 0; i < nq; i++) {                                                         \
        float *ov = out + (first_row + i / group) * row_stride + (h * group + i % group) * HD; \
        const float inv = 1.f / hsum16(lsum[i]);                                               \
        for (int c = 0; c < NV; c++) *(v16u *)(ov + 16 * c) = acc[i][c] * inv;                 \
    }                                                                                          \
}

PREFILL_ITEM(KV_NAME(prefill_item_16), 16, 4)
PREFILL_ITEM(KV_NAME(prefill_item_32), 32, 4)
PREFILL_ITEM(KV_NAME(prefill_item_64), 64, 2)
PREFILL_ITEM(KV_NAME(prefill_item_128), 128, 2)

/* Returns 0; -2 when out of memory; -3 for a head_dim other than 16, 32, 64, 128 or more than 16
 * query heads per KV head (the caller takes another path). */
int KV_NAME(paged_prefill)(const float *q, float *out, const KV_T *k_base, const KV_T *v_base,
                           const int64_t *q_starts, const int64_t *q_ends,
                           const int64_t *context_lens, const int64_t *block_tables,
                           int64_t num_seqs, int64_t max_pages, int64_t page_stride,
                           int64_t block, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                           int64_t window, float scale, int num_threads) {
    const int64_t group = num_heads / kv_heads;
    if ((head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128) || group > 16)
        return -3;
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++) tiles += (q_ends[s] - q_starts[s] + QT - 1) / QT;
    const int64_t num_items = tiles * kv_heads;
    int64_t *items = malloc(sizeof(int64_t) * 3 * (num_items ? num_items : 1));
    if (!items) return -2;
    /* Longest first: the last tile of each sequence (most keys) before its first. */
    int64_t w = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t qlen = q_ends[s] - q_starts[s];
        for (int64_t t = ((qlen + QT - 1) / QT - 1) * QT; t >= 0; t -= QT)
            for (int64_t h = 0; h < kv_heads; h++) {
                items[3 * w] = s;
                items[3 * w + 1] = t;
                items[3 * w + 2] = h;
                w++;
            }
    }
    const int64_t row_stride = num_heads * head_dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < num_items; i++) {
        const int64_t s = items[3 * i], t = items[3 * i + 1], h = items[3 * i + 2];
        const int64_t qlen = q_ends[s] - q_starts[s];
        const int64_t rows = qlen - t < QT ? qlen - t : QT;
        const int64_t first_pos = context_lens[s] - qlen + t;
#define CALL(F) F(q, out, k_base, v_base, block_tables + s * max_pages, page_stride, block,      \
                  kv_heads, row_stride, group, h, q_starts[s] + t, rows, first_pos, window, scale)
        if (head_dim == 16) CALL(KV_NAME(prefill_item_16));
        else if (head_dim == 32) CALL(KV_NAME(prefill_item_32));
        else if (head_dim == 64) CALL(KV_NAME(prefill_item_64));
        else CALL(KV_NAME(prefill_item_128));
#undef CALL
    }
    free(items);
    return 0;
}

#endif /* KV_T */
