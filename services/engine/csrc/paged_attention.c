/* Attention that reads the paged KV pool in place (fp32, CPU): no gather copy.
 *
 * One call serves one layer of a packed batch: S sequences, sequence s owning query rows
 * q_starts[s] .. q_starts[s+1]-1 of q (its newest tokens, any number: a decode token, a
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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define Q_TILE 16
#define MAX_HEAD_DIM 512

/* Ask for a page's rows of the item's heads ahead of use: pages lie anywhere in the pool, so
 * the hardware prefetcher cannot guess the next one. */
static inline void prefetch_page(const float *first_row, int64_t block, int64_t tok_stride,
                                 int64_t row_floats) {
    for (int64_t t = 0; t < block; t++)
        for (int64_t f = 0; f < row_floats; f += 16)
            __builtin_prefetch(first_row + t * tok_stride + f);
}

/* Query row at position `pos` (keys lo..pos) for KV heads h0..h1-1 and their query heads.
 * HD is a compile-time head_dim (loops unroll and vectorize fully), or 0 for any. */
#define ATTEND_ROW(NAME, HD)                                                                    \
static void NAME(const float *qrow, float *orow, const float *k_base, const float *v_base,     \
                 const int64_t *table, int64_t page_stride, int64_t block, int64_t kv_heads,   \
                 int64_t head_dim_rt, int64_t h0, int64_t h1, int64_t group, int64_t lo,        \
                 int64_t pos, float scale, float *scores) {                                    \
    const int64_t head_dim = HD ? HD : head_dim_rt;                                            \
    const int64_t tok_stride = kv_heads * head_dim;                                            \
    const int64_t n = pos + 1 - lo;                                                            \
    const int64_t nq = (h1 - h0) * group; /* query heads of this item */                       \
    const float *q0 = qrow + h0 * group * head_dim;                                            \
    float *o0 = orow + h0 * group * head_dim;                                                  \
    for (int64_t j0 = lo; j0 <= pos;) {                                                        \
        const int64_t page = j0 / block, off = j0 % block;                                     \
        const int64_t count = (block - off) < (pos + 1 - j0) ? (block - off) : (pos + 1 - j0); \
        const float *k = k_base + table[page] * page_stride + off * tok_stride + h0 * head_dim;\
        if (j0 + count <= pos)                                                                 \
            prefetch_page(k_base + table[(j0 + count) / block] * page_stride + h0 * head_dim,  \
                          block, tok_stride, (h1 - h0) * head_dim);                            \
        for (int64_t qh = 0; qh < nq; qh++) {                                                  \
            const float *qg = q0 + qh * head_dim;                                              \
            const float *kh = k + (qh / group) * head_dim;                                     \
            float *sq = scores + qh * n + (j0 - lo);                                           \
            for (int64_t t = 0; t < count; t++, kh += tok_stride) {                            \
                float dot = 0.f;                                                               \
                _Pragma("omp simd reduction(+ : dot)")                                         \
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * kh[d];                   \
                sq[t] = dot * scale;                                                           \
            }                                                                                  \
        }                                                                                      \
        j0 += count;                                                                           \
    }                                                                                          \
    for (int64_t qh = 0; qh < nq; qh++) {                                                      \
        float *sg = scores + qh * n;                                                           \
        float mx = -INFINITY, sum = 0.f;                                                       \
        for (int64_t j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;                          \
        for (int64_t j = 0; j < n; j++) {                                                      \
            sg[j] = expf(sg[j] - mx);                                                          \
            sum += sg[j];                                                                      \
        }                                                                                      \
        const float inv = 1.f / sum;                                                           \
        for (int64_t j = 0; j < n; j++) sg[j] *= inv;                                          \
        memset(o0 + qh * head_dim, 0, sizeof(float) * head_dim);                               \
    }                                                                                          \
    for (int64_t j0 = lo; j0 <= pos;) {                                                        \
        const int64_t page = j0 / block, off = j0 % block;                                     \
        const int64_t count = (block - off) < (pos + 1 - j0) ? (block - off) : (pos + 1 - j0); \
        const float *v = v_base + table[page] * page_stride + off * tok_stride + h0 * head_dim;\
        if (j0 + count <= pos)                                                                 \
            prefetch_page(v_base + table[(j0 + count) / block] * page_stride + h0 * head_dim,  \
                          block, tok_stride, (h1 - h0) * head_dim);                            \
        for (int64_t qh = 0; qh < nq; qh++) {                                                  \
            const float *ps = scores + qh * n + (j0 - lo);                                     \
            const float *vh = v + (qh / group) * head_dim;                                     \
            float *og = o0 + qh * head_dim;                                                    \
            float acc[HD ? HD : MAX_HEAD_DIM];                                                 \
            for (int64_t d = 0; d < head_dim; d++) acc[d] = og[d];                             \
            for (int64_t t = 0; t < count; t++, vh += tok_stride) {                            \
                const float p = ps[t];                                                         \
                _Pragma("omp simd")                                                            \
                for (int64_t d = 0; d < head_dim; d++) acc[d] += p * vh[d];                    \
            }                                                                                  \
            for (int64_t d = 0; d < head_dim; d++) og[d] = acc[d];                             \
        }                                                                                      \
        j0 += count;                                                                           \
    }                                                                                          \
}

ATTEND_ROW(attend_row_any, 0)
ATTEND_ROW(attend_row_32, 32)
ATTEND_ROW(attend_row_64, 64)
ATTEND_ROW(attend_row_128, 128)

/* Returns 0, or -2 when out of memory. */
int paged_attention_f32(const float *q, float *out, const float *k_base, const float *v_base,
                        const int64_t *q_starts, const int64_t *context_lens,
                        const int64_t *block_tables, int64_t num_seqs, int64_t max_pages,
                        int64_t page_stride, int64_t block, int64_t num_heads,
                        int64_t kv_heads, int64_t head_dim, int64_t window, float scale,
                        int64_t max_context, int num_threads) {
    const int64_t group = num_heads / kv_heads;
    int64_t row_items = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        row_items += (q_starts[s + 1] - q_starts[s] + Q_TILE - 1) / Q_TILE;
    /* Few row tiles (a small decode batch): split the KV heads too, so every thread works. */
    const int64_t head_split = row_items >= 4 * num_threads ? 1 : kv_heads;
    const int64_t num_items = row_items * head_split;
    int64_t *items = malloc(sizeof(int64_t) * 3 * (num_items ? num_items : 1));
    if (!items) return -2;
    int64_t w = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t qlen = q_starts[s + 1] - q_starts[s];
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
            const int64_t qlen = q_starts[s + 1] - q_starts[s];
            const int64_t rows = qlen - t < Q_TILE ? qlen - t : Q_TILE;
            const int64_t h0 = part * heads_per_item, h1 = h0 + heads_per_item;
            const int64_t *table = block_tables + s * max_pages;
            for (int64_t r = 0; r < rows; r++) {
                const int64_t row = q_starts[s] + t + r;
                const int64_t pos = context_lens[s] - qlen + t + r;
                const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
#define CALL(F) F(q + row * row_stride, out + row * row_stride, k_base, v_base, table,        \
                  page_stride, block, kv_heads, head_dim, h0, h1, group, lo, pos, scale, scores)
                if (head_dim == 64) CALL(attend_row_64);
                else if (head_dim == 128) CALL(attend_row_128);
                else if (head_dim == 32) CALL(attend_row_32);
                else CALL(attend_row_any);
#undef CALL
            }
        }
        free(scores);
    }
    free(items);
    return failed ? -2 : 0;
}
