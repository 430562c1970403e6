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
 * the GIL for the call.
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
