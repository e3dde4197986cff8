/* Chained SHA-256 block hashing for the prefix cache (kvcache.allocator._chainhash).
 *
 * One call hashes every full block of a prompt: digest_i = SHA256(prev || block_i || extra_i),
 * prev of block 0 being the caller's parent hash. The per-block loop runs without the GIL and
 * without allocations. SHA-256 is implemented here (no OpenSSL): a portable compress function
 * and, on x86-64 CPUs that have them, the SHA extensions (SHA-NI), picked at run time by CPUID.
 *
 * The chain is serial (block i's message starts with digest i-1), so its speed is the latency of
 * one SHA-256 after another. Each block's padded message is therefore assembled in one scratch
 * buffer and hashed in a single backend call: copying the block's tokens there is off the
 * critical path, while per-call state shuffles and byte-wise digest stores (which defeat
 * store-to-load forwarding into the next block) are on it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#define KV_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

/* SHA-256 from the initial state over nblocks 64-byte blocks of an already padded message. */
typedef void (*hash_fn)(const uint8_t *msg, size_t nblocks, uint8_t out[32]);

static const uint32_t K256[64] __attribute__((aligned(16))) = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

static inline uint32_t load_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline void store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static inline uint32_t rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

/* ------------------------------------------------------------------ portable compress */

static void compress_portable(uint32_t st[8], const uint8_t *data, size_t nblocks)
{
    while (nblocks--) {
        uint32_t w[64];
        for (int i = 0; i < 16; i++)
            w[i] = load_be32(data + 4 * i);
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = rotr32(w[i - 15], 7) ^ rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = rotr32(w[i - 2], 17) ^ rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3];
        uint32_t e = st[4], f = st[5], g = st[6], h = st[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = h + (rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25)) + ((e & f) ^ (~e & g)) +
                          K256[i] + w[i];
            uint32_t t2 = (rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        st[0] += a;
        st[1] += b;
        st[2] += c;
        st[3] += d;
        st[4] += e;
        st[5] += f;
        st[6] += g;
        st[7] += h;
        data += 64;
    }
}

static void hash_portable(const uint8_t *msg, size_t nblocks, uint8_t out[32])
{
    uint32_t st[8];
    memcpy(st, H256, sizeof st);
    compress_portable(st, msg, nblocks);
    for (int i = 0; i < 8; i++)
        store_be32(out + 4 * i, st[i]);
}

/* ------------------------------------------------------------------ SHA-NI compress */

#ifdef KV_X86
/* Four rounds with the SHA extensions. m[] holds the message schedule in four registers:
 * group i uses m[i%4]; sha256msg2 completes the words of group i+1 and sha256msg1 starts those
 * of group i+3, as in Intel's reference sequence. The unrolled loop leaves every index constant. */
#define SHANI_GROUP(i)                                                                             \
    do {                                                                                           \
        __m128i wk = _mm_add_epi32(m[(i) & 3], _mm_load_si128((const __m128i *)&K256[4 * (i)]));  \
        s1 = _mm_sha256rnds2_epu32(s1, s0, wk);                                                    \
        s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(wk, 0x0E));                           \
        if ((i) >= 3 && (i) <= 14) {                                                               \
            __m128i t = _mm_alignr_epi8(m[(i) & 3], m[((i) + 3) & 3], 4);                          \
            m[((i) + 1) & 3] = _mm_sha256msg2_epu32(_mm_add_epi32(m[((i) + 1) & 3], t), m[(i) & 3]); \
        }                                                                                          \
        if ((i) >= 1 && (i) <= 12)                                                                 \
            m[((i) + 3) & 3] = _mm_sha256msg1_epu32(m[((i) + 3) & 3], m[(i) & 3]);                 \
    } while (0)

/* The digest leaves as two byte-swapped 16-byte stores, which the next block's loads forward. */
__attribute__((target("sha,sse4.1"))) static void hash_shani(const uint8_t *data, size_t nblocks, uint8_t out[32])
{
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&H256[0]), 0xB1); /* CDAB */
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&H256[4]), 0x1B);  /* EFGH */
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);                                           /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);                                                /* CDGH */

    while (nblocks--) {
        const __m128i abef = s0, cdgh = s1;
        __m128i m[4];
        for (int j = 0; j < 4; j++)
            m[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * j)), bswap);
        SHANI_GROUP(0);
        SHANI_GROUP(1);
        SHANI_GROUP(2);
        SHANI_GROUP(3);
        SHANI_GROUP(4);
        SHANI_GROUP(5);
        SHANI_GROUP(6);
        SHANI_GROUP(7);
        SHANI_GROUP(8);
        SHANI_GROUP(9);
        SHANI_GROUP(10);
        SHANI_GROUP(11);
        SHANI_GROUP(12);
        SHANI_GROUP(13);
        SHANI_GROUP(14);
        SHANI_GROUP(15);
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
        data += 64;
    }

    tmp = _mm_shuffle_epi32(s0, 0x1B);   /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);    /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0); /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);    /* HGFE */
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(s0, bswap));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(s1, bswap));
}

static int cpu_has_shani(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    if (!(c & (1u << 9)) || !(c & (1u << 19))) /* SSSE3, SSE4.1 */
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return (b >> 29) & 1;
}
#else
static int cpu_has_shani(void) { return 0; }
#endif

/* ------------------------------------------------------------------ padding */

/* Bytes a message of len bytes occupies once padded (0x80, zeros, 64-bit bit length). */
static inline size_t padded_len(size_t len) { return (len + 9 + 63) & ~(size_t)63; }

/* Pads msg[0:len) in place (the buffer holds padded_len(len) bytes); returns its block count. */
static inline size_t pad_message(uint8_t *msg, size_t len)
{
    size_t total = padded_len(len);
    uint64_t bits = (uint64_t)len * 8;
    msg[len] = 0x80;
    memset(msg + len + 1, 0, total - len - 9);
    for (int i = 0; i < 8; i++)
        msg[total - 8 + i] = (uint8_t)(bits >> (56 - 8 * i));
    return total / 64;
}

/* ------------------------------------------------------------------ backend selection */

static int g_has_shani = 0;
static hash_fn g_hash = hash_portable;
static const char *g_backend = "portable";

static int select_backend(const char *name)
{
    if (strcmp(name, "auto") == 0) {
#ifdef KV_X86
        if (g_has_shani) {
            g_hash = hash_shani;
            g_backend = "sha_ni";
            return 0;
        }
#endif
        g_hash = hash_portable;
        g_backend = "portable";
        return 0;
    }
    if (strcmp(name, "portable") == 0) {
        g_hash = hash_portable;
        g_backend = "portable";
        return 0;
    }
    if (strcmp(name, "sha_ni") == 0) {
#ifdef KV_X86
        if (g_has_shani) {
            g_hash = hash_shani;
            g_backend = "sha_ni";
            return 0;
        }
#endif
        PyErr_SetString(PyExc_ValueError, "backend 'sha_ni' is not available on this CPU");
        return -1;
    }
    PyErr_Format(PyExc_ValueError, "backend must be 'auto', 'portable' or 'sha_ni', got '%.50s'", name);
    return -1;
}

/* ------------------------------------------------------------------ argument handling */

typedef struct {
    Py_buffer view;
    const uint8_t *data;
    Py_ssize_t count;
    int little_endian; /* the buffer's bytes are uint32 little-endian */
} token_buf;

static int host_is_le(void)
{
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 1;
}

static int get_tokens(PyObject *obj, token_buf *t)
{
    if (PyObject_GetBuffer(obj, &t->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "tokens must be a C-contiguous uint32 buffer (e.g. numpy uint32 array), got %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *fmt = t->view.format ? t->view.format : "B";
    char order = '@';
    if (*fmt == '@' || *fmt == '=' || *fmt == '<' || *fmt == '>' || *fmt == '!')
        order = *fmt++;
    int is_u32 = t->view.itemsize == 4 && fmt[1] == '\0' && (fmt[0] == 'I' || fmt[0] == 'L');
    if (!is_u32 || t->view.ndim != 1) {
        PyErr_Format(PyExc_TypeError,
                     "tokens must be a 1-D buffer of uint32, got format '%.20s', itemsize %zd, ndim %d",
                     t->view.format ? t->view.format : "B", t->view.itemsize, t->view.ndim);
        PyBuffer_Release(&t->view);
        return -1;
    }
    if (order == '<')
        t->little_endian = 1;
    else if (order == '>' || order == '!')
        t->little_endian = 0;
    else
        t->little_endian = host_is_le();
    t->data = (const uint8_t *)t->view.buf;
    t->count = t->view.len / 4;
    return 0;
}

static inline uint32_t token_at(const token_buf *t, Py_ssize_t i)
{
    const uint8_t *p = t->data + 4 * i;
    if (t->little_endian)
        return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
    return load_be32(p);
}

typedef struct {
    PyObject *seq; /* keeps the items alive while the GIL is released */
    const uint8_t **ptr;
    Py_ssize_t *len;
    size_t max_len;
} extras_buf;

/* extras: None, or a sequence of at least n items, each bytes or None (ptr NULL). */
static int get_extras(PyObject *obj, Py_ssize_t n, extras_buf *e)
{
    e->seq = NULL;
    e->ptr = NULL;
    e->len = NULL;
    e->max_len = 0;
    if (obj == Py_None)
        return 0;
    e->seq = PySequence_Fast(obj, "extras must be None or a sequence of bytes/None");
    if (!e->seq)
        return -1;
    Py_ssize_t have = PySequence_Fast_GET_SIZE(e->seq);
    if (have < n) {
        PyErr_Format(PyExc_ValueError, "extras has %zd items but there are %zd full blocks", have, n);
        goto fail;
    }
    e->ptr = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *e->ptr);
    e->len = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *e->len);
    if (!e->ptr || !e->len) {
        PyErr_NoMemory();
        goto fail;
    }
    PyObject **items = PySequence_Fast_ITEMS(e->seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = items[i];
        if (it == Py_None) {
            e->ptr[i] = NULL;
            e->len[i] = 0;
        } else if (PyBytes_Check(it)) {
            e->ptr[i] = (const uint8_t *)PyBytes_AS_STRING(it);
            e->len[i] = PyBytes_GET_SIZE(it);
            if ((size_t)e->len[i] > e->max_len)
                e->max_len = (size_t)e->len[i];
        } else {
            PyErr_Format(PyExc_TypeError, "extras[%zd] must be bytes or None, got %.100s", i, Py_TYPE(it)->tp_name);
            goto fail;
        }
    }
    return 0;
fail:
    PyMem_Free(e->ptr);
    PyMem_Free(e->len);
    Py_CLEAR(e->seq);
    e->ptr = NULL;
    e->len = NULL;
    return -1;
}

static void release_extras(extras_buf *e)
{
    PyMem_Free(e->ptr);
    PyMem_Free(e->len);
    Py_CLEAR(e->seq);
}

/* Splits n*32 digest bytes into a list of 32-byte bytes objects. */
static PyObject *split_digests(PyObject *out)
{
    Py_ssize_t n = PyBytes_GET_SIZE(out) / 32;
    const char *p = PyBytes_AS_STRING(out);
    PyObject *list = PyList_New(n);
    if (!list)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize(p + 32 * i, 32);
        if (!b) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, b);
    }
    return list;
}

typedef struct {
    PyObject *tokens_obj;
    Py_ssize_t block_size;
    Py_buffer parent;
    PyObject *extras_obj;
    int split;
} chain_args;

static int parse_chain_args(PyObject *args, PyObject *kwargs, chain_args *a)
{
    static char *kwlist[] = {"tokens", "block_size", "parent", "extras", "split", NULL};
    a->extras_obj = Py_None;
    a->split = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ony*|O$p", kwlist, &a->tokens_obj, &a->block_size,
                                     &a->parent, &a->extras_obj, &a->split))
        return -1;
    if (a->parent.len != 32) {
        PyErr_Format(PyExc_ValueError, "parent must be 32 bytes, got %zd", a->parent.len);
        PyBuffer_Release(&a->parent);
        return -1;
    }
    if (a->block_size < 1 || a->block_size > (PY_SSIZE_T_MAX / 8)) {
        PyErr_Format(PyExc_ValueError, "block_size must be between 1 and %zd, got %zd", PY_SSIZE_T_MAX / 8,
                     a->block_size);
        PyBuffer_Release(&a->parent);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ chain loops */

/* msg = prev(32) || tokens_i as uint32 LE || extra_i; msg[0:32) holds the parent on entry. */
static void chain_raw_loop(hash_fn hash, const token_buf *t, Py_ssize_t bs, Py_ssize_t n, const extras_buf *e,
                           uint8_t *msg, uint8_t *out)
{
    const size_t tok_bytes = (size_t)bs * 4;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *p = msg + 32;
        if (t->little_endian) {
            memcpy(p, t->data + (size_t)i * tok_bytes, tok_bytes);
        } else {
            for (Py_ssize_t j = 0; j < bs; j++) {
                uint32_t v = token_at(t, i * bs + j);
                p[4 * j] = (uint8_t)v;
                p[4 * j + 1] = (uint8_t)(v >> 8);
                p[4 * j + 2] = (uint8_t)(v >> 16);
                p[4 * j + 3] = (uint8_t)(v >> 24);
            }
        }
        p += tok_bytes;
        if (e->ptr && e->len[i]) {
            memcpy(p, e->ptr[i], (size_t)e->len[i]);
            p += e->len[i];
        }
        hash(msg, pad_message(msg, (size_t)(p - msg)), out + 32 * i);
        memcpy(msg, out + 32 * i, 32);
    }
}

static inline uint8_t *cbor_head(uint8_t *p, uint8_t major, uint64_t v)
{
    major = (uint8_t)(major << 5);
    if (v < 24) {
        *p++ = major | (uint8_t)v;
    } else if (v < 0x100) {
        *p++ = major | 24;
        *p++ = (uint8_t)v;
    } else if (v < 0x10000) {
        *p++ = major | 25;
        *p++ = (uint8_t)(v >> 8);
        *p++ = (uint8_t)v;
    } else if (v < 0x100000000ULL) {
        *p++ = major | 26;
        store_be32(p, (uint32_t)v);
        p += 4;
    } else {
        *p++ = major | 27;
        for (int i = 7; i >= 0; i--)
            *p++ = (uint8_t)(v >> (8 * i));
    }
    return p;
}

/* msg = cbor([prev, [tokens_i...], extra_i]) with canonical (shortest) heads, as cbor2 writes it:
 * 0x83, 0x58 0x20 prev(32), the token array, then extra_i's pre-encoded CBOR or null (0xf6).
 * msg[0:35) holds 0x83 0x58 0x20 and the parent on entry. */
static void chain_cbor_loop(hash_fn hash, const token_buf *t, Py_ssize_t bs, Py_ssize_t n, const extras_buf *e,
                            uint8_t *msg, uint8_t *out)
{
    uint8_t *tok_start = cbor_head(msg + 35, 4, (uint64_t)bs);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *p = tok_start;
        for (Py_ssize_t j = 0; j < bs; j++)
            p = cbor_head(p, 0, token_at(t, i * bs + j));
        if (e->ptr && e->ptr[i]) {
            memcpy(p, e->ptr[i], (size_t)e->len[i]);
            p += e->len[i];
        } else {
            *p++ = 0xf6;
        }
        hash(msg, pad_message(msg, (size_t)(p - msg)), out + 32 * i);
        memcpy(msg + 3, out + 32 * i, 32);
    }
}

/* Shared driver of chain_raw / chain_cbor: validate, hash without the GIL, shape the result. */
static PyObject *chain_common(PyObject *args, PyObject *kwargs, int cbor)
{
    chain_args a;
    token_buf t;
    extras_buf e;
    if (parse_chain_args(args, kwargs, &a) < 0)
        return NULL;
    if (get_tokens(a.tokens_obj, &t) < 0) {
        PyBuffer_Release(&a.parent);
        return NULL;
    }
    const Py_ssize_t bs = a.block_size;
    const Py_ssize_t n = t.count / bs;
    if (get_extras(a.extras_obj, n, &e) < 0) {
        PyBuffer_Release(&t.view);
        PyBuffer_Release(&a.parent);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 32);
    uint8_t *msg = NULL;
    if (out && n) {
        size_t longest = cbor ? 35 + 9 + 5 * (size_t)bs + (e.max_len ? e.max_len : 1) : 32 + 4 * (size_t)bs + e.max_len;
        msg = PyMem_Malloc(padded_len(longest));
        if (!msg) {
            Py_CLEAR(out);
            PyErr_NoMemory();
        }
    }
    if (msg) {
        hash_fn hash = g_hash;
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        if (cbor) {
            msg[0] = 0x83;
            msg[1] = 0x58;
            msg[2] = 0x20;
            memcpy(msg + 3, a.parent.buf, 32);
        } else {
            memcpy(msg, a.parent.buf, 32);
        }
        Py_BEGIN_ALLOW_THREADS
        if (cbor)
            chain_cbor_loop(hash, &t, bs, n, &e, msg, dst);
        else
            chain_raw_loop(hash, &t, bs, n, &e, msg, dst);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(msg);
    release_extras(&e);
    PyBuffer_Release(&t.view);
    PyBuffer_Release(&a.parent);
    if (out && a.split) {
        PyObject *list = split_digests(out);
        Py_DECREF(out);
        return list;
    }
    return out;
}

static PyObject *chain_raw(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return chain_common(args, kwargs, 0);
}

static PyObject *chain_cbor(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    return chain_common(args, kwargs, 1);
}

/* ------------------------------------------------------------------ small helpers */

static PyObject *sha256_py(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer b;
    uint8_t digest[32];
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    uint8_t *msg = PyMem_Malloc(padded_len((size_t)b.len));
    if (!msg) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    memcpy(msg, b.buf, (size_t)b.len);
    g_hash(msg, pad_message(msg, (size_t)b.len), digest);
    PyMem_Free(msg);
    PyBuffer_Release(&b);
    return PyBytes_FromStringAndSize((const char *)digest, 32);
}

static PyObject *set_backend_py(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "backend must be a str, got %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name || select_backend(name) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *backend_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyUnicode_FromString(g_backend);
}

static PyObject *available_backends_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (g_has_shani)
        return Py_BuildValue("(ss)", "sha_ni", "portable");
    return Py_BuildValue("(s)", "portable");
}

static PyMethodDef methods[] = {
    {"chain_raw", (PyCFunction)(void (*)(void))chain_raw, METH_VARARGS | METH_KEYWORDS,
     "chain_raw(tokens, block_size, parent, extras=None, *, split=False) -> bytes | list[bytes]\n\n"
     "Chained digests of the full blocks: SHA256(prev || tokens as uint32 LE || extra)."},
    {"chain_cbor", (PyCFunction)(void (*)(void))chain_cbor, METH_VARARGS | METH_KEYWORDS,
     "chain_cbor(tokens, block_size, parent, extras=None, *, split=False) -> bytes | list[bytes]\n\n"
     "Chained digests SHA256(cbor((prev, tuple(tokens), extra))), canonical CBOR as cbor2 writes it;\n"
     "extras items are pre-encoded CBOR, None meaning null."},
    {"sha256", sha256_py, METH_O, "sha256(data) -> bytes: one-shot digest with the current backend."},
    {"set_backend", set_backend_py, METH_O, "set_backend('auto' | 'portable' | 'sha_ni'): pick the compress function."},
    {"backend", backend_py, METH_NOARGS, "backend() -> str: the compress function in use ('sha_ni' or 'portable')."},
    {"available_backends", available_backends_py, METH_NOARGS,
     "available_backends() -> tuple[str, ...]: backends this CPU can run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chainhash", "Chained SHA-256 block hashing for the prefix cache.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__chainhash(void)
{
    g_has_shani = cpu_has_shani();
    select_backend("auto");
    return PyModule_Create(&module);
}
