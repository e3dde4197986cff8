/* Host memcpy over a whole list of byte ranges in one call (kvcache.transfer._copy).
 *
 * A request's KV blocks are thousands of ranges (one per block, layer and tensor after
 * merging); a Python call per range would cost more than the copy. Here the caller passes three
 * int64 arrays (source addresses, destination addresses, lengths) and C copies them all without
 * the GIL, with memcpy or streaming stores, on up to `threads` threads: the bytes of the whole
 * list, laid end to end, are cut into equal shares (a long range may be cut too), one per thread,
 * the calling thread taking the first. One core's copy is bound by its own memory latency, not the
 * machine's bandwidth; a many-core server copies several times faster with a few threads. A
 * deadline (CLOCK_MONOTONIC ns, the clock of time.monotonic_ns) is checked every few MiB, so a
 * transfer never runs far past it; the return value says how many ranges were copied whole. The
 * addresses are trusted: KVRegion derived them from registered, checked memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define CHECK_EVERY_BYTES (4u << 20)       /* look at the clock after at least this many bytes */
#define PREFETCH_BYTES (64 << 10)           /* how much of the next range to prefetch, a line per page */
#define MIN_BYTES_PER_THREAD (4ll << 20)    /* fewer bytes than this per thread: fewer threads */
#define MAX_THREADS 64

static int64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int int64_array(Py_buffer *b, const char *name, Py_ssize_t *count)
{
    if (b->len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an int64 array, got %zd bytes", name, b->len);
        return -1;
    }
    *count = b->len / (Py_ssize_t)sizeof(int64_t);
    return 0;
}

/* Copy with non-temporal (streaming) stores: the destination's lines are written without being read
 * first, which a plain copy of a 32 KiB range does (glibc streams only copies of several MiB). Head
 * and tail bytes outside whole 64-byte destination lines go through memcpy. */
#if defined(__x86_64__)
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
    }
}

static void stream_sse2(char *d, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

static int have_avx2;

static void copy_streaming(char *d, const char *s, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)d & 63);
    if (head > n) {
        head = n;
    }
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t body = n & ~(size_t)63;
    if (have_avx2) {
        stream_avx2(d, s, body);
    } else {
        stream_sse2(d, s, body);
    }
    memcpy(d + body, s + body, n - body);
}

static void store_fence(void) { _mm_sfence(); }

static void detect_cpu(void)
{
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
}
#else /* elsewhere: plain memcpy, which needs no fence */
static void copy_streaming(char *d, const char *s, size_t n) { memcpy(d, s, n); }
static void store_fence(void) {}
static void detect_cpu(void) {}
#endif

/* Bytes of range i; a length below zero counts as none. */
static inline int64_t range_bytes(const int64_t *l, Py_ssize_t i) { return l[i] > 0 ? l[i] : 0; }

/* One thread's share: the bytes [begin, end) of the list laid end to end. */
typedef struct {
    const int64_t *src, *dst, *len;
    Py_ssize_t n;
    int64_t begin, end;   /* in list bytes */
    int64_t deadline;     /* 0: none */
    int64_t stream_min;   /* ranges (pieces) of at least this many bytes use streaming stores; 0: never */
    Py_ssize_t first;     /* the range holding byte `begin` */
    int64_t first_offset; /* where range `first` starts, in list bytes */
    int64_t reached;      /* out: list bytes [begin, reached) were copied */
} share_t;

static void *copy_share(void *arg)
{
    share_t *sh = (share_t *)arg;
    const int64_t *s = sh->src, *d = sh->dst, *l = sh->len;
    int64_t pos = sh->begin, start = sh->first_offset;
    uint64_t since_check = 0;
    for (Py_ssize_t i = sh->first; i < sh->n && pos < sh->end; start += range_bytes(l, i), i++) {
        if (range_bytes(l, i) == 0 || start + l[i] <= pos) {
            continue;
        }
        if (sh->deadline > 0 && since_check >= CHECK_EVERY_BYTES) {
            if (monotonic_ns() > sh->deadline) {
                break;
            }
            since_check = 0;
        }
        int64_t from = pos - start; /* > 0 only in a range cut at this share's start */
        int64_t to = (start + l[i] < sh->end ? start + l[i] : sh->end) - start;
        if (i + 1 < sh->n && start + l[i] < sh->end) {
            /* Touch each page of the next range: its TLB walks overlap this copy. */
            const char *ns = (const char *)(uintptr_t)s[i + 1], *nd = (const char *)(uintptr_t)d[i + 1];
            for (int64_t off = 0; off < range_bytes(l, i + 1) && off < PREFETCH_BYTES; off += 4096) {
                __builtin_prefetch(ns + off, 0, 0);
                __builtin_prefetch(nd + off, 1, 0);
            }
        }
        /* memcpy lets glibc pick the copy for this CPU and size; streaming stores (the caller's
         * choice) were 1.3-1.6x faster on the 2-core AMD dev VM, and an earlier version half as
         * fast on the H100 host's CPU, so the caller chooses. */
        if (sh->stream_min > 0 && to - from >= sh->stream_min) {
            copy_streaming((char *)(uintptr_t)d[i] + from, (const char *)(uintptr_t)s[i] + from, (size_t)(to - from));
        } else {
            memcpy((char *)(uintptr_t)d[i] + from, (const char *)(uintptr_t)s[i] + from, (size_t)(to - from));
        }
        since_check += (uint64_t)(to - from);
        pos = start + to;
    }
    if (sh->stream_min > 0) {
        store_fence(); /* streaming stores are weakly ordered: make them visible before we report */
    }
    sh->reached = pos;
    return NULL;
}

/* How many ranges lie wholly inside copied bytes. Shares are adjacent and in order; share k copied
 * [begin_k, reached_k). */
static Py_ssize_t ranges_copied(const int64_t *l, Py_ssize_t n, const share_t *sh, int shares)
{
    Py_ssize_t whole = 0;
    int64_t start = 0;
    int k = 0;
    for (Py_ssize_t i = 0; i < n; start += range_bytes(l, i), i++) {
        int64_t end = start + range_bytes(l, i);
        while (k < shares && sh[k].end <= start) {
            k++;
        }
        int ok = 1;
        for (int j = k; j < shares && sh[j].begin < end; j++) {
            int64_t need = end < sh[j].end ? end : sh[j].end;
            if (sh[j].reached < need) {
                ok = 0;
                break;
            }
        }
        whole += ok;
    }
    return whole;
}

PyDoc_STRVAR(copy_doc,
             "copy(src, dst, length, deadline_ns, threads=1, min_share=4 MiB, stream_min=0) -> int\n\n"
             "memcpy length[i] bytes from address src[i] to dst[i] for every i (int64 arrays of one size),\n"
             "without the GIL, on up to `threads` threads, each with at least min_share bytes to copy;\n"
             "pieces of stream_min bytes or more (0: none) are written with streaming stores.\n"
             "Stops early once CLOCK_MONOTONIC passes deadline_ns (0: no deadline); returns how many\n"
             "ranges were copied whole (len(length) when all were).");

static PyObject *copy(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer src, dst, len;
    long long deadline;
    int threads = 1;
    long long min_share = MIN_BYTES_PER_THREAD, stream_min = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*L|iLL", &src, &dst, &len, &deadline, &threads, &min_share, &stream_min)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n_src, n_dst, n_len;
    if (int64_array(&src, "src", &n_src) == 0 && int64_array(&dst, "dst", &n_dst) == 0 &&
        int64_array(&len, "length", &n_len) == 0) {
        if (n_src != n_dst || n_src != n_len) {
            PyErr_Format(PyExc_ValueError, "src, dst and length must have one size, got %zd, %zd, %zd", n_src,
                         n_dst, n_len);
        } else if (threads < 1 || min_share < 1) {
            PyErr_Format(PyExc_ValueError, "threads and min_share must be at least 1, got %d and %lld", threads,
                         min_share);
        } else {
            const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf, *l = (const int64_t *)len.buf;
            Py_ssize_t copied;
            Py_BEGIN_ALLOW_THREADS
            int64_t total = 0;
            for (Py_ssize_t i = 0; i < n_src; i++) {
                total += range_bytes(l, i);
            }
            int shares = threads < MAX_THREADS ? threads : MAX_THREADS;
            if ((int64_t)shares > total / min_share) {
                shares = total / min_share > 1 ? (int)(total / min_share) : 1;
            }
            share_t sh[MAX_THREADS];
            pthread_t tid[MAX_THREADS];
            int started[MAX_THREADS] = {0};
            Py_ssize_t i = 0;
            int64_t start = 0;
            for (int k = 0; k < shares; k++) {
                int64_t begin = total / shares * k, end = k + 1 == shares ? total : total / shares * (k + 1);
                while (i < n_src && start + range_bytes(l, i) <= begin) {
                    start += range_bytes(l, i);
                    i++;
                }
                sh[k] = (share_t){s, d, l, n_src, begin, end, deadline, stream_min, i, start, begin};
            }
            for (int k = 1; k < shares; k++) {
                started[k] = pthread_create(&tid[k], NULL, copy_share, &sh[k]) == 0;
            }
            copy_share(&sh[0]);
            for (int k = 1; k < shares; k++) {
                if (started[k]) {
                    pthread_join(tid[k], NULL);
                } else {
                    copy_share(&sh[k]); /* no thread to be had: copy this share here */
                }
            }
            int all = 1;
            for (int k = 0; k < shares; k++) {
                all &= sh[k].reached >= sh[k].end;
            }
            copied = all ? n_src : ranges_copied(l, n_src, sh, shares);
            Py_END_ALLOW_THREADS
            result = PyLong_FromSsize_t(copied);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&len);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy", "Host memcpy over a list of byte ranges in one call, on a few threads.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    detect_cpu();
    return PyModule_Create(&module);
}
