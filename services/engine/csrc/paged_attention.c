/* Attention that reads the paged KV pool in place (fp32, CPU): no gather copy.
 *
 * One call serves one layer of a packed batch: S sequences, sequence s owning query rows
 * q_starts[s] .. q_ends[s]-1 of q (its newest tokens, any number: a decode token, a
 * prefill chunk, or both kinds in one batch), and context_lens[s] tokens of K/V already in
 * its pages (the new ones included). Query row i of s sits at position
 * context_lens[s] - qlen + i and sees keys 0 .. that position (inside the sliding window when
 * window > 0).
 *
 * Pool layout, per page: [num_layers, 2, block, kv_heads, head_dim] contiguous (the wire
 * format). `k_base` points at layer l's K of page 0, `v_base` at its V; page p starts
 * p * page_stride floats later, token t of a page and KV head h at (t * kv_heads + h) *
 * head_dim.
 *
 * Work items are (sequence, tile of query rows, range of KV heads): a page's K (then V) is
 * walked token by token, every KV head of the range at once, so the reads stream through the
 * page's contiguous bytes; the query heads that share a KV head use each K/V row while it is
 * in registers. Scores are an exact two-pass softmax (max, exp, sum), as the reference math.
 *
 * The pool holds float32 or bfloat16 K/V: this file's second half is compiled once per
 * type (kv_instantiate.h includes it twice), reading K/V through `ld1`/`ld16`, which widen
 * bf16 to float32; queries, scores and outputs are float32 either way. Entry points: paged_attention_f32 and
 * paged_attention_bf16.
 */
#ifndef KV_T
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's vector expf (libmvec), so the softmax loop vectorizes without -ffast-math. */
#pragma omp declare simd notinbranch
float expf(float);

#include "kv_types.h"

#define Q_TILE 16
#define MAX_HEAD_DIM 512


static inline v16 pair_sum(v16 x, v16 y, i16 lo, i16 hi) {
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

/* Row sums of 16 vectors, as one vector (lane r = sum of a[r]): a transposing tree of
 * shuffles and adds, 15 steps for 16 sums instead of a horizontal reduction each. */
static inline v16 sum16(v16 *a) {
    const i16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const i16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const i16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i16 hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = pair_sum(a[2 * i], a[2 * i + 1], lo8, hi8);
    for (int i = 0; i < 4; i++) c[i] = pair_sum(b[2 * i], b[2 * i + 1], lo4, hi4);
    for (int i = 0; i < 2; i++) d[i] = pair_sum(c[2 * i], c[2 * i + 1], lo2, hi2);
    return pair_sum(d[0], d[1], lo1, hi1);
}


#include "kv_instantiate.h"

#else /* the part compiled once per K/V type */
/* scores[t] = scale * q . k_t for `count` <= 16 keys k_t = k + t * tok_stride; head_dim a
 * multiple of 16. */
static inline void KV_NAME(dots16)(const float *q, const KV_T *k, int64_t tok_stride, int64_t count,
                          int64_t head_dim, float scale, float *scores) {
    v16 acc[16];
    for (int64_t t = 0; t < 16; t++) {
        v16 a = {0};
        if (t < count)
            for (int64_t d = 0; d < head_dim; d += 16)
                a += *(const v16u *)(q + d) * KV_NAME(ld16)(k + t * tok_stride + d);
        acc[t] = a;
    }
    const v16 sums = sum16(acc) * scale;
    for (int64_t t = 0; t < count; t++) scores[t] = sums[t];
}

/* Ask for a page's rows of the item's heads ahead of use: pages lie anywhere in the pool, so
 * the hardware prefetcher cannot guess the next one. */
static inline void KV_NAME(prefetch_page)(const KV_T *first_row, int64_t block, int64_t tok_stride,
                                 int64_t row_floats) {
    for (int64_t t = 0; t < block; t++)
        for (int64_t f = 0; f < row_floats; f += 16)
            __builtin_prefetch(first_row + t * tok_stride + f);
}

/* Part `part` of `parts` of the next page's cache lines, into L2. An item that covers every KV
 * head reads whole pages (one contiguous run per page): it asks for the next one a slice at a
 * time, one slice per query head it computes, instead of all of it at once (a burst of
 * hundreds of prefetches fills the core's miss buffers and stalls the loads of the page in
 * use). Measured on the 152M shape (16 heads over 4, head_dim 64), 32 sequences of 330
 * tokens, a 12-layer pool, 2 threads: 1.74 -> 1.00 ms per layer (12 -> 21 GB/s of K/V). */
static inline void KV_NAME(prefetch_slice)(const KV_T *page, int64_t lines, int64_t part,
                                  int64_t parts) {
    const char *p = (const char *)page;
    const int64_t per = (lines + parts - 1) / parts;
    for (int64_t l = part * per; l < (part + 1) * per && l < lines; l++)
        __builtin_prefetch(p + 64 * l, 0, 2);
}

/* Query row at position `pos` (keys lo..pos) for KV heads h0..h1-1 and their query heads.
 * HD is a compile-time head_dim (loops unroll and vectorize fully), or 0 for any. */
#define ATTEND_ROW(NAME, HD)                                                                    \
static void NAME(const float *qrow, float *orow, const KV_T *k_base, const KV_T *v_base,       \
                 const int64_t *table, int64_t page_stride, int64_t block, int64_t kv_heads,   \
                 int64_t head_dim_rt, int64_t h0, int64_t h1, int64_t group, int64_t lo,        \
                 int64_t pos, float scale, float *scores) {                                    \
    const int64_t head_dim = HD ? HD : head_dim_rt;                                            \
    const int64_t tok_stride = kv_heads * head_dim;                                            \
    const int64_t n = pos + 1 - lo;                                                            \
    const int64_t nq = (h1 - h0) * group; /* query heads of this item */                       \
    const float *q0 = qrow + h0 * group * head_dim;                                            \
    float *o0 = orow + h0 * group * head_dim;                                                  \
    /* every KV head: a page's K (or V) rows are one contiguous run of page_lines lines */     \
    const int whole = h1 - h0 == kv_heads;                                                     \
    const int64_t page_lines = block * tok_stride * (int64_t)sizeof(KV_T) / 64;               \
    for (int64_t j0 = lo; j0 <= pos;) {                                                        \
        const int64_t page = j0 / block, off = j0 % block;                                     \
        const int64_t count = (block - off) < (pos + 1 - j0) ? (block - off) : (pos + 1 - j0); \
        const KV_T *k = k_base + table[page] * page_stride + off * tok_stride + h0 * head_dim;\
        const KV_T *next_k = j0 + count <= pos                                                 \
            ? k_base + table[(j0 + count) / block] * page_stride + h0 * head_dim : 0;         \
        if (next_k && !whole)                                                                  \
            KV_NAME(prefetch_page)(next_k, block, tok_stride, (h1 - h0) * head_dim);           \
        for (int64_t qh = 0; qh < nq; qh++) {                                                  \
            if (next_k && whole) KV_NAME(prefetch_slice)(next_k, page_lines, qh, nq);          \
            const float *qg = q0 + qh * head_dim;                                              \
            const KV_T *kh = k + (qh / group) * head_dim;                                     \
            float *sq = scores + qh * n + (j0 - lo);                                           \
            if (head_dim % 16 == 0 && count <= 16) {                                           \
                KV_NAME(dots16)(qg, kh, tok_stride, count, head_dim, scale, sq);                        \
                continue;                                                                      \
            }                                                                                  \
            for (int64_t t = 0; t < count; t++, kh += tok_stride) {                            \
                float dot = 0.f;                                                               \
                _Pragma("omp simd reduction(+ : dot)")                                         \
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * KV_NAME(ld1)(kh + d);                   \
                sq[t] = dot * scale;                                                           \
            }                                                                                  \
        }                                                                                      \
        j0 += count;                                                                           \
    }                                                                                          \
    for (int64_t qh = 0; qh < nq; qh++) {                                                      \
        float *sg = scores + qh * n;                                                           \
        float mx = -INFINITY, sum = 0.f;                                                       \
        _Pragma("omp simd reduction(max : mx)")                                                \
        for (int64_t j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;                          \
        _Pragma("omp simd reduction(+ : sum)")                                                 \
        for (int64_t j = 0; j < n; j++) {                                                      \
            sg[j] = expf(sg[j] - mx);                                                          \
            sum += sg[j];                                                                      \
        }                                                                                      \
        const float inv = 1.f / sum;                                                           \
        _Pragma("omp simd")                                                                    \
        for (int64_t j = 0; j < n; j++) sg[j] *= inv;                                          \
        memset(o0 + qh * head_dim, 0, sizeof(float) * head_dim);                               \
    }                                                                                          \
    for (int64_t j0 = lo; j0 <= pos;) {                                                        \
        const int64_t page = j0 / block, off = j0 % block;                                     \
        const int64_t count = (block - off) < (pos + 1 - j0) ? (block - off) : (pos + 1 - j0); \
        const KV_T *v = v_base + table[page] * page_stride + off * tok_stride + h0 * head_dim;\
        const KV_T *next_v = j0 + count <= pos                                                 \
            ? v_base + table[(j0 + count) / block] * page_stride + h0 * head_dim : 0;         \
        if (next_v && !whole)                                                                  \
            KV_NAME(prefetch_page)(next_v, block, tok_stride, (h1 - h0) * head_dim);           \
        for (int64_t qh = 0; qh < nq; qh++) {                                                  \
            if (next_v && whole) KV_NAME(prefetch_slice)(next_v, page_lines, qh, nq);          \
            const float *ps = scores + qh * n + (j0 - lo);                                     \
            const KV_T *vh = v + (qh / group) * head_dim;                                     \
            float *og = o0 + qh * head_dim;                                                    \
            if (HD) { /* the output row in registers, V rows as whole vectors */              \
                v16 acc[HD ? HD / 16 : 1];                                                     \
                for (int c = 0; c < HD / 16; c++) acc[c] = *(v16u *)(og + 16 * c);            \
                for (int64_t t = 0; t < count; t++, vh += tok_stride)                          \
                    for (int c = 0; c < HD / 16; c++)                                          \
                        acc[c] += ps[t] * KV_NAME(ld16)(vh + 16 * c);                          \
                for (int c = 0; c < HD / 16; c++) *(v16u *)(og + 16 * c) = acc[c];            \
                continue;                                                                      \
            }                                                                                  \
            float acc[MAX_HEAD_DIM];                                                           \
            for (int64_t d = 0; d < head_dim; d++) acc[d] = og[d];                             \
            for (int64_t t = 0; t < count; t++, vh += tok_stride) {                            \
                const float p = ps[t];                                                         \
                _Pragma("omp simd")                                                            \
                for (int64_t d = 0; d < head_dim; d++) acc[d] += p * KV_NAME(ld1)(vh + d);    \
            }                                                                                  \
            for (int64_t d = 0; d < head_dim; d++) og[d] = acc[d];                             \
        }                                                                                      \
        j0 += count;                                                                           \
    }                                                                                          \
}

ATTEND_ROW(KV_NAME(attend_row_any), 0)
ATTEND_ROW(KV_NAME(attend_row_32), 32)
ATTEND_ROW(KV_NAME(attend_row_64), 64)
ATTEND_ROW(KV_NAME(attend_row_128), 128)

/* Returns 0, or -2 when out of memory. */
int KV_NAME(paged_attention)(const float *q, float *out, const KV_T *k_base,
                        const KV_T *v_base,
                        const int64_t *q_starts, const int64_t *q_ends,
                        const int64_t *context_lens,
                        const int64_t *block_tables, int64_t num_seqs, int64_t max_pages,
                        int64_t page_stride, int64_t block, int64_t num_heads,
                        int64_t kv_heads, int64_t head_dim, int64_t window, float scale,
                        int64_t max_context, int num_threads) {
    const int64_t group = num_heads / kv_heads;
    int64_t row_items = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        row_items += (q_ends[s] - q_starts[s] + Q_TILE - 1) / Q_TILE;
    /* Few row tiles (a small decode batch): split the KV heads too, so every thread works. */
    const int64_t head_split = row_items >= 4 * num_threads ? 1 : kv_heads;
    const int64_t num_items = row_items * head_split;
    int64_t *items = malloc(sizeof(int64_t) * 3 * (num_items ? num_items : 1));
    if (!items) return -2;
    int64_t w = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t qlen = q_ends[s] - q_starts[s];
        for (int64_t t = 0; t < qlen; t += Q_TILE)
            for (int64_t part = 0; part < head_split; part++) {
                items[3 * w] = s;
                items[3 * w + 1] = t;
                items[3 * w + 2] = part;
                w++;
            }
    }
    const int64_t heads_per_item = kv_heads / head_split;
    const int64_t row_stride = num_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * heads_per_item * group
                               * (max_context > 0 ? max_context : 1));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            if (!scores) continue;
            const int64_t s = items[3 * i], t = items[3 * i + 1], part = items[3 * i + 2];
            const int64_t qlen = q_ends[s] - q_starts[s];
            const int64_t rows = qlen - t < Q_TILE ? qlen - t : Q_TILE;
            const int64_t h0 = part * heads_per_item, h1 = h0 + heads_per_item;
            const int64_t *table = block_tables + s * max_pages;
            for (int64_t r = 0; r < rows; r++) {
                const int64_t row = q_starts[s] + t + r;
                const int64_t pos = context_lens[s] - qlen + t + r;
                const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
#define CALL(F) F(q + row * row_stride, out + row * row_stride, k_base, v_base, table,        \
                  page_stride, block, kv_heads, head_dim, h0, h1, group, lo, pos, scale, scores)
                if (head_dim == 64) CALL(KV_NAME(attend_row_64));
                else if (head_dim == 128) CALL(KV_NAME(attend_row_128));
                else if (head_dim == 32) CALL(KV_NAME(attend_row_32));
                else CALL(KV_NAME(attend_row_any));
#undef CALL
            }
        }
        free(scores);
    }
    free(items);
    return failed ? -2 : 0;
}

#endif /* KV_T */
