/* Large memory copies with streaming (non-temporal) stores, for KV pages moved between pools.
 *
 * glibc's memcpy switches to streaming stores only above a threshold derived from the size of
 * the shared cache that CPUID reports; virtual machines often report the host's (this project's
 * 2-vCPU VMs: 320 MiB, so every KV handoff took the cached path). A cached copy of pages the
 * copying process will not read again reads each destination line before writing it and
 * evicts everything else from the caches. Streaming stores do neither.
 *
 * Plain C, no dependencies: one portable build. The widest vector unit the CPU has is chosen at
 * run time (AVX-512, AVX, SSE2); other CPUs get memcpy. Called through ctypes, which releases
 * the GIL for the call. The second half of this file is the receiving agent's native same-host
 * write (pdserve.kvtransfer.native), which copies with the same routine.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("avx512f")))
static void stream_avx512(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 256) {
        __m512i a = _mm512_loadu_si512((const void *)(src + i));
        __m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + i + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + i + 192));
        _mm512_stream_si512((void *)(dst + i), a);
        _mm512_stream_si512((void *)(dst + i + 64), b);
        _mm512_stream_si512((void *)(dst + i + 128), c);
        _mm512_stream_si512((void *)(dst + i + 192), d);
    }
}

__attribute__((target("avx")))
static void stream_avx(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 256) {
        for (size_t j = 0; j < 256; j += 64) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(src + i + j));
            __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + j + 32));
            _mm256_stream_si256((__m256i *)(dst + i + j), a);
            _mm256_stream_si256((__m256i *)(dst + i + j + 32), b);
        }
    }
}

static void stream_sse2(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 256) {
        for (size_t j = 0; j < 256; j += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i + j));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + j + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + j + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + j + 48));
            _mm_stream_si128((__m128i *)(dst + i + j), a);
            _mm_stream_si128((__m128i *)(dst + i + j + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + j + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + j + 48), d);
        }
    }
}

typedef void (*stream_fn)(char *, const char *, size_t);

static stream_fn pick(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return stream_avx512;
    if (__builtin_cpu_supports("avx")) return stream_avx;
    return stream_sse2;
}

/* Which loop pdserve_stream_copy runs on this CPU: "avx512", "avx", "sse2" or "memcpy". */
const char *pdserve_stream_copy_isa(void) {
    stream_fn f = pick();
    return f == stream_avx512 ? "avx512" : f == stream_avx ? "avx" : "sse2";
}
#else
const char *pdserve_stream_copy_isa(void) { return "memcpy"; }
#endif

/* Copy n bytes from src to dst (they must not overlap). Returns 0. */
int pdserve_stream_copy(void *dst, const void *src, size_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
#if defined(__x86_64__) || defined(__i386__)
    static stream_fn fn = NULL;
    if (fn == NULL) fn = pick();  /* benign race: every thread picks the same */
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;  /* streaming stores want aligned lines */
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t body = n & ~(size_t)255;
    if (body) {
        fn(d, s, body);
        _mm_sfence();  /* the stores are visible before the caller says the pages landed */
    }
    memcpy(d + body, s + body, n - body);
#else
    memcpy(d, s, n);
#endif
    return 0;
}

#if defined(__x86_64__) || defined(__i386__)
/* n bytes, a multiple of 64, to a 64-byte aligned dst: one line at a time. */
__attribute__((target("avx512f")))
static void lines_avx512(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 64)
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
}

__attribute__((target("avx")))
static void lines_avx(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 32)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
}

static void lines_sse2(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 16)
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
}
#endif

/* The re-layout of a handoff between tensor-parallel splits, as one copy. A page is rows of
 * (layer, K/V, token), each row the KV heads side by side, so a rank's heads are a column of
 * every row. Fill `rows` rows of `dst` (`dst_row` bytes apart) from `nsrc` sources: row r's
 * bytes dst_offs[k] .. dst_offs[k] + widths[k] - 1 from srcs[k] + r * src_rows[k] (the
 * column's first byte in source k's row r). Row by row, so the destination is written in
 * order whatever the number of sources (a column at a time writes it in strides, a third
 * slower here). Streaming stores when `stream` and every piece is whole aligned lines (a row
 * piece is heads of 64-128 elements: multiples of 64 bytes); memcpy otherwise. Returns 0. */
int pdserve_gather_rows(void *dst, size_t dst_row, size_t rows, int nsrc, const uintptr_t *srcs,
                        const size_t *src_rows, const size_t *dst_offs, const size_t *widths,
                        int stream) {
    char *d = (char *)dst;
#if defined(__x86_64__) || defined(__i386__)
    static stream_fn lines = NULL;
    if (lines == NULL) {
        stream_fn f = pick();
        lines = f == stream_avx512 ? lines_avx512 : f == stream_avx ? lines_avx : lines_sse2;
    }
    int lined = stream && dst_row % 64 == 0 && ((uintptr_t)d & 63) == 0;
    for (int k = 0; k < nsrc && lined; k++)
        lined = dst_offs[k] % 64 == 0 && widths[k] % 64 == 0;
    if (lined) {
        for (size_t r = 0; r < rows; r++)
            for (int k = 0; k < nsrc; k++)
                lines(d + r * dst_row + dst_offs[k], (const char *)srcs[k] + r * src_rows[k],
                      widths[k]);
        _mm_sfence();  /* the stores are visible before the caller says the pages landed */
        return 0;
    }
#else
    (void)stream;
#endif
    for (size_t r = 0; r < rows; r++)
        for (int k = 0; k < nsrc; k++)
            memcpy(d + r * dst_row + dst_offs[k], (const char *)srcs[k] + r * src_rows[k],
                   widths[k]);
    return 0;
}

/* ---- The receiving agent's native same-host write (pdserve.kvtransfer.native) ------------------
 *
 * A decode agent arms each expected ticket here (its reserved pages as spans, the pool's
 * address, the layout it must match, the lease). A same-host `shm_write` whose header matches an
 * armed ticket exactly is then checked, copied and answered here without the Python
 * interpreter: after a wake-up every step of Python costs several microseconds, and the ~90 us
 * before the copy and ~40 us after it were most of what a handoff added to the copy. Anything
 * that does not match is declined, and the Python path refuses it with the precise reason. The
 * Python ticket book stays the authority: before it decides anything about an armed ticket it
 * takes the ticket back from here (`pdserve_kv_take`), learning whether its pages landed. Pools
 * are registered so that closing one waits for the writes into it and refuses later ones.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#define KV_SLOTS 1024
#define KV_BUCKETS 1024
#define KV_POOLS 64
#define KV_RID_MAX 256
#define KV_POOL_ID_MAX 256
#define KV_FP_MAX 1024
#define KV_SPANS_MAX 16
#define KV_PREFIX 16   /* magic, version, 3 pad, body bytes, runs (wire.py _PREFIX) */
#define KV_VERSION 4   /* wire.py VERSION */
#define KV_FIXED 68    /* xfer_id, ticket epoch, agent epoch, page_bytes, timeout, 7 lengths */

enum { KV_ABSENT = 0, KV_ARMED = 1, KV_WRITING = 2, KV_DONE = 3, KV_ABORTED = 4 };
enum { KV_DECLINED = 0, KV_REPLIED = 1, KV_STOPPED = 2, KV_SEND_FAILED = 3, KV_BROKEN = 4,
       KV_TIMED_OUT = 5 };

typedef struct {
    uintptr_t base;
    uint64_t size;
    uint64_t gen;     /* bumped each time the entry is reused for another pool */
    int open;
    int writers;      /* native writes into it in flight */
} kv_pool;

typedef struct {
    int state;
    int abort;        /* set by a cancel; the copy stops at the next slice */
    uint64_t hash, ticket_epoch, agent_epoch, pool_gen;
    int pool;
    uint32_t rid_len, pool_id_len, fp_len, nspans;
    int64_t page_bytes, deadline_ns, kv_bytes;
    double done_unix_ms;
    int32_t spans[2 * KV_SPANS_MAX];
    char rid[KV_RID_MAX], pool_id[KV_POOL_ID_MAX], fp[KV_FP_MAX];
} kv_slot;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;  /* a write ended, or a pool's last writer left */
    int16_t head[KV_BUCKETS], next[KV_SLOTS], free_head;
    kv_pool pools[KV_POOLS];
    kv_slot slots[KV_SLOTS];
} kv_table;

static int64_t kv_now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint64_t kv_hash(const char *rid, uint32_t n, uint64_t epoch) {
    uint64_t h = 1469598103934665603ULL ^ epoch;
    for (uint32_t i = 0; i < n; i++) h = (h ^ (unsigned char)rid[i]) * 1099511628211ULL;
    return h;
}

static kv_slot *kv_find(kv_table *t, const char *rid, uint32_t n, uint64_t epoch, uint64_t h,
                        int *index) {
    for (int i = t->head[h % KV_BUCKETS]; i >= 0; i = t->next[i]) {
        kv_slot *s = &t->slots[i];
        if (s->hash == h && s->ticket_epoch == epoch && s->rid_len == n &&
            memcmp(s->rid, rid, n) == 0) {
            if (index) *index = i;
            return s;
        }
    }
    return NULL;
}

static void kv_remove(kv_table *t, int i) {
    int16_t *link = &t->head[t->slots[i].hash % KV_BUCKETS];
    while (*link != i) link = &t->next[*link];
    *link = t->next[i];
    t->slots[i].state = KV_ABSENT;
    t->next[i] = t->free_head;
    t->free_head = (int16_t)i;
}

/* A new, empty table (one per agent; never freed: a connection thread may still hold it). */
void *pdserve_kv_table_new(void) {
    kv_table *t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, &attr);
    pthread_condattr_destroy(&attr);
    for (int i = 0; i < KV_BUCKETS; i++) t->head[i] = -1;
    for (int i = 0; i < KV_SLOTS; i++) t->next[i] = (int16_t)(i + 1 < KV_SLOTS ? i + 1 : -1);
    t->free_head = 0;
    return t;
}

/* Register a mapped pool of `size` bytes at `base`: its handle, or -1 when the table is full.
 * The generation (out) tells armed tickets of an earlier pool in the same entry apart. */
int pdserve_kv_pool_open(void *table, uintptr_t base, uint64_t size, uint64_t *gen) {
    kv_table *t = table;
    int handle = -1;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < KV_POOLS && handle < 0; i++) {
        kv_pool *p = &t->pools[i];
        if (!p->open && p->writers == 0) {
            p->base = base, p->size = size, p->open = 1, p->gen++;
            *gen = p->gen;
            handle = i;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return handle;
}

/* No native write goes into the pool from now on; returns once none is in flight. */
void pdserve_kv_pool_close(void *table, int handle) {
    kv_table *t = table;
    if (handle < 0 || handle >= KV_POOLS) return;
    pthread_mutex_lock(&t->mu);
    t->pools[handle].open = 0;
    while (t->pools[handle].writers > 0) pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
}

/* Arm a ticket: a write of exactly `spans` ((start, n) int32 pairs) into the pool, from a pool of
 * the layout `fp`, addressed to `agent_epoch`, before `deadline_ns` (CLOCK_MONOTONIC). 0 when
 * armed, -1 when not (the Python path then serves its write). */
int pdserve_kv_arm(void *table, const char *rid, uint32_t rid_len, uint64_t ticket_epoch,
                   int pool, uint64_t pool_gen, const char *pool_id, uint32_t pool_id_len,
                   uint64_t agent_epoch, const char *fp, uint32_t fp_len, int64_t page_bytes,
                   const int32_t *spans, uint32_t nspans, int64_t deadline_ns) {
    kv_table *t = table;
    if (rid_len > KV_RID_MAX || pool_id_len > KV_POOL_ID_MAX || fp_len > KV_FP_MAX ||
        nspans == 0 || nspans > KV_SPANS_MAX || pool < 0 || pool >= KV_POOLS || page_bytes <= 0)
        return -1;
    uint64_t h = kv_hash(rid, rid_len, ticket_epoch);
    int rc = -1;
    pthread_mutex_lock(&t->mu);
    kv_pool *p = &t->pools[pool];
    if (p->open && p->gen == pool_gen && kv_find(t, rid, rid_len, ticket_epoch, h, NULL) == NULL
        && t->free_head >= 0) {
        int i = t->free_head;
        kv_slot *s = &t->slots[i];
        t->free_head = t->next[i];
        t->next[i] = t->head[h % KV_BUCKETS];
        t->head[h % KV_BUCKETS] = (int16_t)i;
        s->state = KV_ARMED, s->abort = 0, s->hash = h, s->ticket_epoch = ticket_epoch;
        s->agent_epoch = agent_epoch, s->pool = pool, s->pool_gen = pool_gen;
        s->rid_len = rid_len, s->pool_id_len = pool_id_len, s->fp_len = fp_len;
        s->nspans = nspans, s->page_bytes = page_bytes, s->deadline_ns = deadline_ns;
        s->kv_bytes = 0, s->done_unix_ms = 0;
        memcpy(s->rid, rid, rid_len);
        memcpy(s->pool_id, pool_id, pool_id_len);
        memcpy(s->fp, fp, fp_len);
        memcpy(s->spans, spans, 2 * sizeof(int32_t) * nspans);
        rc = 0;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* Take a ticket back: its state (KV_ABSENT when not armed; KV_ARMED: nothing written; KV_DONE:
 * every page landed, out[0] = bytes, done_ms = when; KV_ABORTED: a write stopped for a cancel)
 * and it is forgotten here, except while a write is in flight: `abort` stops that write at its
 * next slice, and this waits up to `wait_ns` for it to end; KV_WRITING if it has not. */
int pdserve_kv_take(void *table, const char *rid, uint32_t rid_len, uint64_t ticket_epoch,
                    int abort, int64_t wait_ns, int64_t *out, double *done_ms) {
    kv_table *t = table;
    uint64_t h = kv_hash(rid, rid_len, ticket_epoch);
    int i = -1, state = KV_ABSENT;
    pthread_mutex_lock(&t->mu);
    kv_slot *s = kv_find(t, rid, rid_len, ticket_epoch, h, &i);
    if (s != NULL) {
        if (s->state == KV_WRITING) {
            if (abort) __atomic_store_n(&s->abort, 1, __ATOMIC_RELAXED);
            int64_t until = kv_now_ns(CLOCK_MONOTONIC) + (wait_ns > 0 ? wait_ns : 0);
            struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
            while (s->state == KV_WRITING && wait_ns > 0 &&
                   pthread_cond_timedwait(&t->cv, &t->mu, &ts) != ETIMEDOUT) {}
        }
        state = s->state;
        if (state != KV_WRITING) {
            out[0] = s->kv_bytes;
            *done_ms = s->done_unix_ms;
            kv_remove(t, i);
        }
    }
    pthread_mutex_unlock(&t->mu);
    return state;
}

static int kv_send_all(int fd, const char *buf, size_t len) {
    size_t sent = 0;
    while (sent < len) {
        ssize_t n = send(fd, buf + sent, len - sent, MSG_NOSIGNAL);
        if (n > 0) {
            sent += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd p = {fd, POLLOUT, 0};  /* a socket with a timeout is non-blocking */
            if (poll(&p, 1, 10000) <= 0) return -1;
        } else {
            return -1;
        }
    }
    return 0;
}

static int kv_reply_done(int fd) {  /* the local socket's frame for {} (localsock.send) */
    static const char frame[10] = {2, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    return kv_send_all(fd, frame, sizeof frame);
}

static uint32_t kv_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t kv_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Check an encoded WriteHeader against its armed ticket and claim the slot for the write
 * (KV_WRITING, the pool's writers counted): the slot, or NULL when anything differs (the Python
 * path answers). `src_runs` ((start, n) int32 pairs, `nruns` of them, inside `src_size` bytes):
 * a same-host write's source, checked against the spans; NULL for a write whose bytes arrive
 * on a socket. `*total`: the write's bytes; `*timeout_s`: the sender's timeout. Little-endian
 * hosts only (the header's byte order). */
static kv_slot *kv_claim(kv_table *t, const uint8_t *hdr, uint64_t hdr_len,
                         const int32_t *src_runs, uint32_t nruns, uint64_t src_size,
                         kv_pool **pool, uint64_t *total, double *timeout_s) {
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    return NULL;
#endif
    if (hdr_len < KV_PREFIX + KV_FIXED || memcmp(hdr, "PDKV", 4) != 0 || hdr[4] != KV_VERSION)
        return NULL;
    uint64_t body_len = kv_u32(hdr + 8), num_runs = kv_u32(hdr + 12);
    if (src_runs == NULL) nruns = (uint32_t)num_runs;
    if (body_len < KV_FIXED || num_runs != nruns || num_runs == 0 || num_runs > KV_SPANS_MAX ||
        KV_PREFIX + body_len + 8 * num_runs > hdr_len)
        return NULL;
    const uint8_t *f = hdr + KV_PREFIX;
    uint64_t ticket_epoch = kv_u64(f + 8), agent_epoch = kv_u64(f + 16);
    int64_t page_bytes = (int64_t)kv_u64(f + 24);
    double timeout_ms;
    memcpy(&timeout_ms, f + 32, 8);
    uint64_t len[7], strings = 0;
    for (int i = 0; i < 7; i++) strings += len[i] = kv_u32(f + 40 + 4 * i);
    if (strings != body_len - KV_FIXED) return NULL;
    const char *rid = (const char *)f + KV_FIXED;
    const char *pool_id = rid + len[0], *fp = pool_id + len[1];
    const uint8_t *runs = hdr + KV_PREFIX + body_len;
    if (len[0] > KV_RID_MAX) return NULL;
    uint64_t h = kv_hash(rid, (uint32_t)len[0], ticket_epoch);

    pthread_mutex_lock(&t->mu);
    kv_slot *s = kv_find(t, rid, (uint32_t)len[0], ticket_epoch, h, NULL);
    kv_pool *p = s ? &t->pools[s->pool] : NULL;
    int ok = s != NULL && s->state == KV_ARMED && p->open && p->gen == s->pool_gen &&
             s->agent_epoch == agent_epoch && s->page_bytes == page_bytes &&
             s->pool_id_len == len[1] && memcmp(s->pool_id, pool_id, len[1]) == 0 &&
             s->fp_len == len[2] && memcmp(s->fp, fp, len[2]) == 0 &&
             s->nspans == nruns && memcmp(s->spans, runs, 8 * nruns) == 0 &&
             kv_now_ns(CLOCK_MONOTONIC) < s->deadline_ns;
    uint64_t bytes = 0;
    for (uint32_t r = 0; ok && r < nruns; r++) {
        int64_t dst = s->spans[2 * r], n = s->spans[2 * r + 1];
        ok = n > 0 && dst >= 0 && (uint64_t)(dst + n) * (uint64_t)page_bytes <= p->size;
        if (ok && src_runs != NULL) {
            int64_t src = src_runs[2 * r], m = src_runs[2 * r + 1];
            ok = m == n && src >= 0 && (uint64_t)(src + n) * (uint64_t)page_bytes <= src_size;
        }
        bytes += (uint64_t)n * (uint64_t)page_bytes;
    }
    if (ok) {
        s->state = KV_WRITING;
        p->writers++;
    }
    pthread_mutex_unlock(&t->mu);
    *pool = p;
    *total = bytes;
    *timeout_s = timeout_ms / 1e3;
    return ok ? s : NULL;
}

/* End a claimed write: the slot DONE with its bytes, or ABORTED (nothing counts as landed). */
static void kv_release(kv_table *t, kv_slot *s, kv_pool *p, int landed, uint64_t total) {
    pthread_mutex_lock(&t->mu);
    p->writers--;
    s->state = landed ? KV_DONE : KV_ABORTED;
    s->kv_bytes = landed ? (int64_t)total : 0;
    s->done_unix_ms = kv_now_ns(CLOCK_REALTIME) / 1e6;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

/* Serve one same-host write: the encoded WriteHeader, the sender's pool as mapped here (its
 * address and size in bytes) and the source runs ((start, n) int32 pairs). KV_DECLINED: nothing
 * was done (not armed, or anything differs: the Python path answers). KV_REPLIED: every byte
 * landed, the ticket is done here, and the reply went on `fd`; out[0] = bytes. KV_STOPPED: a
 * cancel stopped the copy (no reply sent). KV_SEND_FAILED: landed and done, but the reply could
 * not be sent. Little-endian hosts only (the header's byte order); others decline. */
int pdserve_kv_write(void *table, const uint8_t *hdr, uint64_t hdr_len, uintptr_t src_base,
                     uint64_t src_size, const int32_t *src_runs, uint32_t nruns, int fd,
                     uint64_t slice_bytes, uint64_t stream_min, int64_t *out) {
    kv_table *t = table;
    kv_pool *p;
    uint64_t total;
    double timeout_s;
    if (slice_bytes == 0 || src_runs == NULL) return KV_DECLINED;
    kv_slot *s = kv_claim(t, hdr, hdr_len, src_runs, nruns, src_size, &p, &total, &timeout_s);
    if (s == NULL) return KV_DECLINED;

    int stopped = 0;  /* the slot and the pool stay put while a write is in flight */
    for (uint32_t r = 0; r < nruns && !stopped; r++) {
        char *d = (char *)(p->base + (uint64_t)s->spans[2 * r] * (uint64_t)s->page_bytes);
        const char *from = (const char *)(src_base + (uint64_t)src_runs[2 * r] *
                                          (uint64_t)s->page_bytes);
        uint64_t n = (uint64_t)s->spans[2 * r + 1] * (uint64_t)s->page_bytes;
        for (uint64_t at = 0; at < n; at += slice_bytes) {
            if (__atomic_load_n(&s->abort, __ATOMIC_RELAXED)) { stopped = 1; break; }
            uint64_t k = n - at < slice_bytes ? n - at : slice_bytes;
            if (total >= stream_min) pdserve_stream_copy(d + at, from + at, k);
            else memcpy(d + at, from + at, k);
        }
    }
    kv_release(t, s, p, !stopped, total);
    out[0] = (int64_t)total;
    if (stopped) return KV_STOPPED;
    return kv_reply_done(fd) == 0 ? KV_REPLIED : KV_SEND_FAILED;
}

/* Read what has arrived on `fd` into `buf` (at most `n` bytes), waiting at most `slice_ms` for
 * the reader's mark (SO_RCVLOWAT): the bytes read, 0 when none came within the slice, -1 when
 * the connection closed or failed. */
static ssize_t kv_recv_slice(int fd, char *buf, uint64_t n, int slice_ms) {
    struct pollfd pf = {fd, POLLIN, 0};
    int k = poll(&pf, 1, slice_ms);
    if (k <= 0) return k < 0 && errno != EINTR ? -1 : 0;
    ssize_t m = recv(fd, buf, n, MSG_DONTWAIT);
    if (m > 0) return m;
    return m == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ? -1 : 0;
}

/* Serve one TCP handoff whose encoded WriteHeader (`hdr`) was just read from the data connection
 * `fd`: checked against its armed ticket as a same-host write is; "ready" sent first unless the
 * write is at most `eager` bytes (they follow the header at once); the runs read straight into
 * the reserved pages, the reader woken per `lowat` bytes (SO_RCVLOWAT; 0: per segment) and never
 * blocked longer than `slice_ms` between checks of a cancel, the pool closing and the sender's
 * timeout; then `done` sent. `ready` and `done` are the wire's encoded replies. out[0] = bytes
 * read. KV_DECLINED: nothing read (the Python path serves it). KV_REPLIED: every byte landed, the
 * ticket is done here. KV_STOPPED: a cancel stopped it (the stream is in step once the rest,
 * total - out[0], is read away); KV_BROKEN: the sender hung up, the socket failed or the pool
 * closed; KV_TIMED_OUT: the sender's timeout passed (both out of step: close the connection);
 * KV_SEND_FAILED: landed and done, but "done" could not be sent. On anything but KV_REPLIED and
 * KV_SEND_FAILED nothing counts as landed (the ticket may be written again). */
int pdserve_kv_recv(void *table, const uint8_t *hdr, uint64_t hdr_len, int fd, uint64_t eager,
                    const char *ready, uint32_t ready_len, const char *done, uint32_t done_len,
                    uint64_t lowat, int slice_ms, int64_t *out) {
    kv_table *t = table;
    kv_pool *p;
    uint64_t total;
    double timeout_s;
    out[0] = 0;
    kv_slot *s = kv_claim(t, hdr, hdr_len, NULL, 0, 0, &p, &total, &timeout_s);
    if (s == NULL) return KV_DECLINED;
    timeout_s = timeout_s < 0.001 ? 0.001 : timeout_s > 600.0 ? 600.0 : timeout_s;
    int64_t deadline = kv_now_ns(CLOCK_MONOTONIC) + (int64_t)(timeout_s * 1e9);
    int result = KV_REPLIED, mark = 1;
    uint64_t got = 0;
    if (total > eager && kv_send_all(fd, ready, ready_len) != 0) result = KV_BROKEN;
    for (uint32_t r = 0; r < s->nspans && result == KV_REPLIED; r++) {
        char *d = (char *)(p->base + (uint64_t)s->spans[2 * r] * (uint64_t)s->page_bytes);
        uint64_t n = (uint64_t)s->spans[2 * r + 1] * (uint64_t)s->page_bytes, at = 0;
        while (at < n) {
            if (__atomic_load_n(&s->abort, __ATOMIC_RELAXED)) { result = KV_STOPPED; break; }
            if (!__atomic_load_n(&p->open, __ATOMIC_RELAXED)) { result = KV_BROKEN; break; }
            if (kv_now_ns(CLOCK_MONOTONIC) >= deadline) { result = KV_TIMED_OUT; break; }
            int want = lowat ? (int)(lowat < n - at ? lowat : n - at) : 1;
            if (want != mark) {
                if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) != 0) {
                    result = KV_BROKEN;
                    break;
                }
                mark = want;
            }
            ssize_t m = kv_recv_slice(fd, d + at, n - at, slice_ms);
            if (m < 0) { result = KV_BROKEN; break; }
            at += (uint64_t)m;
            got += (uint64_t)m;
        }
    }
    if (mark != 1) {  /* the next read on the connection is a header */
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    }
    kv_release(t, s, p, result == KV_REPLIED, total);
    out[0] = (int64_t)got;
    if (result != KV_REPLIED) return result;
    return kv_send_all(fd, done, done_len) == 0 ? KV_REPLIED : KV_SEND_FAILED;
}

/* pdserve_kv_recv, the header's first KV_PREFIX bytes already read into `buf` (the wait for the
 * next handoff stays in Python): the rest of the header read here into `buf` (`cap` bytes)
 * within HEADER_S, then served as pdserve_kv_recv serves it. out[1] gets the header's length
 * once read whole (Python then serves a DECLINED one from `buf`), 0 when nothing more was
 * read: a prefix that is not a pdserve header, or a header longer than `cap` (DECLINED; Python
 * reads and judges it), or the connection failed (BROKEN). */
#define KV_HEADER_S 10
int pdserve_kv_recv_rest(void *table, uint8_t *buf, uint64_t cap, int fd, uint64_t eager,
                         const char *ready, uint32_t ready_len, const char *done,
                         uint32_t done_len, uint64_t lowat, int slice_ms, int64_t *out) {
    out[0] = out[1] = 0;
    if (memcmp(buf, "PDKV", 4) != 0 || buf[4] != KV_VERSION) return KV_DECLINED;
    uint64_t total = KV_PREFIX + (uint64_t)kv_u32(buf + 8) + 8 * (uint64_t)kv_u32(buf + 12);
    if (total > cap) return KV_DECLINED;
    int64_t deadline = kv_now_ns(CLOCK_MONOTONIC) + (int64_t)KV_HEADER_S * 1000000000;
    for (uint64_t at = KV_PREFIX; at < total;) {
        if (kv_now_ns(CLOCK_MONOTONIC) >= deadline) return KV_TIMED_OUT;
        ssize_t m = kv_recv_slice(fd, (char *)buf + at, total - at, slice_ms);
        if (m < 0) return KV_BROKEN;
        at += (uint64_t)m;
    }
    int result = pdserve_kv_recv(table, buf, total, fd, eager, ready, ready_len, done, done_len,
                                 lowat, slice_ms, out);
    out[1] = (int64_t)total;
    return result;
}

