/* The all-reduce of a tensor-parallel worker's ranks through shared memory (pdserve.engine.tp).
 *
 * A worker's ranks share a host, so the sum of their partial results needs no network stack:
 * each rank copies its float32 partial into its slot of a segment every rank maps, publishes the
 * call's sequence number, waits until every rank has published it, and sums the slots in rank
 * order into its own tensor (so every rank gets the same bits). Two sets of slots alternate
 * between calls: a rank may fill call k+1's slot while a slower one still reads call k's, and
 * cannot reach call k+2 (which reuses k's set) before every rank has published k+1, i.e. has
 * finished reading k.
 *
 * Segment: (nranks + 1) 64-byte lines (each rank's published sequence number; then the abort
 * flag), then 2 x nranks slots of slot_bytes. Waiting spins briefly (a rank on its own core
 * arrives within microseconds), then sleeps on a futex the publishing rank wakes: a spinning or
 * yielding waiter takes the core from everything else on a busy host (other workers, the
 * process that must get there first), and a worker whose rank died could not even exit in
 * time. It gives up when the abort flag is set (a rank died: -2, seen within 10 ms) or after
 * wait_s (-1). `resume` != 0 goes on waiting for a call already published (the caller waited a
 * short while with the GIL held, then again without it, so its other threads can run
 * meanwhile, the one that sets the abort flag included).
 */
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

typedef struct {
    uint64_t seq;      /* the last call this rank published */
    uint32_t word;     /* seq's low bits: the futex waiters sleep on */
    uint32_t waiters;  /* ranks asleep (or about to be) on word */
    char pad[48];
} line_t;

#define SPINS 4096
#define NAP_S 0.010  /* a sleeping waiter looks at the abort flag and its deadline this often */

static void futex_wait(uint32_t *word, uint32_t expected, double timeout_s) {
    struct timespec t = {(time_t)timeout_s, (long)((timeout_s - (double)(time_t)timeout_s) * 1e9)};
    syscall(SYS_futex, word, FUTEX_WAIT, expected, &t, NULL, 0);  /* shared: no _PRIVATE */
}

static void futex_wake(uint32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int pdserve_shm_allreduce_f32(void *base, int64_t rank, int64_t nranks, float *data, int64_t n,
                              int64_t slot_bytes, int64_t seq, int64_t resume, double wait_s) {
    line_t *lines = (line_t *)base;
    uint64_t *abort_flag = &lines[nranks].seq;
    char *slots = (char *)base + 64 * (nranks + 1);
    int64_t set = seq & 1;
    if (!resume) {
        memcpy(slots + (set * nranks + rank) * slot_bytes, data, (size_t)n * sizeof(float));
        __atomic_store_n(&lines[rank].seq, (uint64_t)seq, __ATOMIC_RELEASE);
        __atomic_store_n(&lines[rank].word, (uint32_t)seq, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&lines[rank].waiters, __ATOMIC_SEQ_CST)) futex_wake(&lines[rank].word);
    }
    double deadline = now_s() + wait_s;
    for (int64_t r = 0; r < nranks; r++) {
        line_t *line = &lines[r];
        for (int spins = 0; __atomic_load_n(&line->seq, __ATOMIC_ACQUIRE) < (uint64_t)seq;) {
            if (__atomic_load_n(abort_flag, __ATOMIC_RELAXED)) return -2;
            if (++spins < SPINS) {
                PAUSE();
                continue;
            }
            double left = deadline - now_s();
            if (left <= 0) return -1;
            /* Announce the sleep, then look once more: a rank publishing after our look sees
             * the announcement and wakes us; one publishing before it changed `word`, and the
             * futex returns at once. */
            __atomic_add_fetch(&line->waiters, 1, __ATOMIC_SEQ_CST);
            uint32_t word = __atomic_load_n(&line->word, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&line->seq, __ATOMIC_ACQUIRE) < (uint64_t)seq)
                futex_wait(&line->word, word, left < NAP_S ? left : NAP_S);
            __atomic_sub_fetch(&line->waiters, 1, __ATOMIC_SEQ_CST);
        }
    }
    const float *first = (const float *)(slots + set * nranks * slot_bytes);
    if (nranks == 2) {
        const float *second = (const float *)(slots + (set * nranks + 1) * slot_bytes);
        for (int64_t i = 0; i < n; i++) data[i] = first[i] + second[i];
        return 0;
    }
    for (int64_t i = 0; i < n; i++) data[i] = first[i];
    for (int64_t r = 1; r < nranks; r++) {
        const float *other = (const float *)(slots + (set * nranks + r) * slot_bytes);
        for (int64_t i = 0; i < n; i++) data[i] += other[i];
    }
    return 0;
}
