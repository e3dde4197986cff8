/* Chained SHA-256 block hashing for the prefix cache (kvcache.allocator._chainhash).
 *
 * One call hashes every full block of a prompt: digest_i = SHA256(prev || block_i || extra_i),
 * prev of block 0 being the caller's parent hash. SHA-256 is implemented here (no OpenSSL): a
 * portable compress function and, on x86-64 CPUs that have them, the SHA extensions (SHA-NI),
 * picked at run time by CPUID. Each backend has its own chain loops (no per-block indirect call).
 *
 * The chain is serial (block i's message starts with digest i-1), so its speed is the latency of
 * one SHA-256 compression after another, and anything else on that dependency chain shows. The
 * SHA-NI loops therefore:
 *   - keep the digest in registers: the next block's first message words (plus K) are made from
 *     the last compression's state with a pshufd and an add (shani_chain_end), with no store of
 *     big-endian bytes and reload in between;
 *   - read chain_raw's tokens straight from the caller's buffer when every 16-byte lane of the
 *     message is either digest, tokens or padding (block_size % 4 == 0, no extras): the padding
 *     lanes are constants made once per call, and nothing is stored per block but the digest;
 *   - otherwise assemble block i+1's message (tokens, extras, padding) in one of two scratch
 *     buffers while block i hashes, so those stores have retired when block i+1 loads them (a
 *     load that can't be forwarded from recent stores waits for them to commit).
 *
 * split=True (a list of one bytes per block) holds the GIL and makes the bytes objects inside the
 * loop (see "results" below): the allocator's work then runs in the cycles the serial SHA chain
 * leaves idle instead of after it. split=False (one packed bytes) runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_tokens.h"

#if defined(__x86_64__)
#define KV_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

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

/* pad_message() for the chain loops' buffers, which have 64 bytes of room past the padded
 * message: fixed-size stores instead of a memset call (a call spills the SHA state). */
static inline size_t pad_message_room(uint8_t *msg, size_t len)
{
    size_t total = padded_len(len);
    uint64_t bits = (uint64_t)len * 8;
    msg[len] = 0x80;
    memset(msg + len + 1, 0, 64);
    for (int i = 0; i < 8; i++)
        msg[total - 8 + i] = (uint8_t)(bits >> (56 - 8 * i));
    return total / 64;
}

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
#define SHANI_FN static inline __attribute__((always_inline, target("sha,sse4.1")))
#define SHANI_LOOP static __attribute__((noinline, target("sha,sse4.1")))

/* Four rounds with the SHA extensions. m[] holds the message schedule in four registers:
 * group i uses m[i%4]; sha256msg2 completes the words of group i+1 and sha256msg1 starts those
 * of group i+3, as in Intel's reference sequence. The unrolled code leaves every index constant. */
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

/* The state lives as ABEF / CDGH (the layout sha256rnds2 takes); message words are lanes in word
 * order (lane 0 = W0), i.e. the big-endian message bytes after a per-word byte swap. */
#define BSWAP32_MASK _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL)
#define IV_ABEF _mm_set_epi32((int)0x6a09e667, (int)0xbb67ae85, (int)0x510e527f, (int)0x9b05688c)
#define IV_CDGH _mm_set_epi32((int)0x3c6ef372, (int)0xa54ff53a, (int)0x1f83d9ab, (int)0x5be0cd19)

/* The 64 rounds of one compression of the message words w0..w3 on (s0, s1) = (ABEF, CDGH),
 * without the feed-forward. wk != NULL: W+K of rounds 0-7 come precomputed, rounds 2i, 2i+1 in
 * the low lanes of wk[i], which lets a chained block start from its parent's pre-add state. */
SHANI_FN void shani_rounds(__m128i *s0p, __m128i *s1p, __m128i w0, __m128i w1, __m128i w2, __m128i w3,
                           const __m128i *wk)
{
    __m128i s0 = *s0p, s1 = *s1p;
    __m128i m[4] = {w0, w1, w2, w3};
    if (wk) {
        s1 = _mm_sha256rnds2_epu32(s1, s0, wk[0]);
        s0 = _mm_sha256rnds2_epu32(s0, s1, wk[1]);
        s1 = _mm_sha256rnds2_epu32(s1, s0, wk[2]);
        s0 = _mm_sha256rnds2_epu32(s0, s1, wk[3]);
        m[0] = _mm_sha256msg1_epu32(m[0], m[1]); /* group 1's schedule step */
    } else {
        SHANI_GROUP(0);
        SHANI_GROUP(1);
    }
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
    *s0p = s0;
    *s1p = s1;
}

/* One compression of the 16 message words w0..w3 into (s0, s1). */
SHANI_FN void shani_compress(__m128i *s0p, __m128i *s1p, __m128i w0, __m128i w1, __m128i w2, __m128i w3)
{
    const __m128i abef = *s0p, cdgh = *s1p;
    shani_rounds(s0p, s1p, w0, w1, w2, w3, NULL);
    *s0p = _mm_add_epi32(*s0p, abef);
    *s1p = _mm_add_epi32(*s1p, cdgh);
}

/* Message words of 16 big-endian message bytes at p. */
SHANI_FN __m128i shani_words(const uint8_t *p)
{
    return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), BSWAP32_MASK);
}

/* (ABEF, CDGH) -> the digest as message words, lanes in word order: [A, B, C, D], [E, F, G, H].
 * One shufps each. */
SHANI_FN void shani_digest_words(__m128i s0, __m128i s1, __m128i *w0, __m128i *w1)
{
    *w0 = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(s0), _mm_castsi128_ps(s1), _MM_SHUFFLE(2, 3, 2, 3)));
    *w1 = _mm_castps_si128(_mm_shuffle_ps(_mm_castsi128_ps(s0), _mm_castsi128_ps(s1), _MM_SHUFFLE(0, 1, 0, 1)));
}

/* Digest words -> its 32 big-endian bytes at out. */
SHANI_FN void shani_store_digest(uint8_t *out, __m128i w0, __m128i w1)
{
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(w0, BSWAP32_MASK));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(w1, BSWAP32_MASK));
}

/* The end of a block whose message starts with the digest of the previous one: (s0, s1) hold
 * its last compression before the feed-forward of (base0, base1). Gives the digest as words and
 * the next block's W+K of rounds 0-7 (digest words plus K0..K7, see shani_rounds) summed from the
 * pre-add state with one pshufd and one add each: from one block's last round to the next one's
 * first, the chain goes through two single-cycle ops. The digest words feed the schedule only. */
SHANI_FN void shani_chain_end(__m128i *s0, __m128i *s1, __m128i base0, __m128i base1, __m128i *w0, __m128i *w1,
                              __m128i wk[4])
{
    const __m128i k0 = _mm_load_si128((const __m128i *)K256), k1 = _mm_load_si128((const __m128i *)(K256 + 4));
    /* 0x4B: lanes 3, 2 to 0, 1 (A, B of ABEF; C, D of CDGH); 0x01: lanes 1, 0 (E, F; G, H) */
    wk[0] = _mm_add_epi32(_mm_shuffle_epi32(*s0, 0x4B), _mm_add_epi32(_mm_shuffle_epi32(base0, 0x4B), k0));
    wk[1] = _mm_add_epi32(_mm_shuffle_epi32(*s1, 0x4B),
                          _mm_add_epi32(_mm_shuffle_epi32(base1, 0x4B), _mm_shuffle_epi32(k0, 0x0E)));
    wk[2] = _mm_add_epi32(_mm_shuffle_epi32(*s0, 0x01), _mm_add_epi32(_mm_shuffle_epi32(base0, 0x01), k1));
    wk[3] = _mm_add_epi32(_mm_shuffle_epi32(*s1, 0x01),
                          _mm_add_epi32(_mm_shuffle_epi32(base1, 0x01), _mm_shuffle_epi32(k1, 0x0E)));
    *s0 = _mm_add_epi32(*s0, base0);
    *s1 = _mm_add_epi32(*s1, base1);
    shani_digest_words(*s0, *s1, w0, w1);
}

/* W+K of rounds 0-7 of a block whose first message words w0, w1 are given (the parent's digest). */
SHANI_FN void shani_chain_start(__m128i w0, __m128i w1, __m128i wk[4])
{
    wk[0] = _mm_add_epi32(w0, _mm_load_si128((const __m128i *)K256));
    wk[1] = _mm_shuffle_epi32(wk[0], 0x0E);
    wk[2] = _mm_add_epi32(w1, _mm_load_si128((const __m128i *)(K256 + 4)));
    wk[3] = _mm_shuffle_epi32(wk[2], 0x0E);
}

/* SHA-256 of an already padded message in memory (sha256() and tests of the backend). */
static __attribute__((target("sha,sse4.1"))) void hash_shani(const uint8_t *data, size_t nblocks, uint8_t out[32])
{
    __m128i s0 = IV_ABEF, s1 = IV_CDGH, w0, w1;
    for (; nblocks; nblocks--, data += 64)
        shani_compress(&s0, &s1, shani_words(data), shani_words(data + 16), shani_words(data + 32),
                       shani_words(data + 48));
    shani_digest_words(s0, s1, &w0, &w1);
    shani_store_digest(out, w0, w1);
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

/* ------------------------------------------------------------------ backend selection */

enum { BACKEND_PORTABLE = 0, BACKEND_SHANI = 1 };

static int g_has_shani = 0;
static int g_backend_id = BACKEND_PORTABLE;

static const char *backend_name(int id) { return id == BACKEND_SHANI ? "sha_ni" : "portable"; }

static int select_backend(const char *name)
{
    if (strcmp(name, "auto") == 0) {
        g_backend_id = g_has_shani ? BACKEND_SHANI : BACKEND_PORTABLE;
        return 0;
    }
    if (strcmp(name, "portable") == 0) {
        g_backend_id = BACKEND_PORTABLE;
        return 0;
    }
    if (strcmp(name, "sha_ni") == 0) {
        if (g_has_shani) {
            g_backend_id = BACKEND_SHANI;
            return 0;
        }
        PyErr_SetString(PyExc_ValueError, "backend 'sha_ni' is not available on this CPU");
        return -1;
    }
    PyErr_Format(PyExc_ValueError, "backend must be 'auto', 'portable' or 'sha_ni', got '%.50s'", name);
    return -1;
}

/* SHA-256 of an already padded message with the given backend. */
static void hash_padded(int backend, const uint8_t *msg, size_t nblocks, uint8_t out[32])
{
#ifdef KV_X86
    if (backend == BACKEND_SHANI) {
        hash_shani(msg, nblocks, out);
        return;
    }
#endif
    (void)backend;
    hash_portable(msg, nblocks, out);
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

/* The longest block hashed straight from a list's items (chain_raw, SHA-NI); longer ones copy the list first. */
#define LIST_BLOCK_MAX 64

/* out[j] = items[j] as token ids for j < bs; negative if an item is not one (then out is partly garbage). */
static inline int64_t read_block(PyObject *const *items, Py_ssize_t bs, uint32_t *out)
{
    int64_t bad = 0;
    for (Py_ssize_t j = 0; j < bs; j++) {
        const int64_t v = list_token(items[j]);
        out[j] = (uint32_t)v;
        bad |= v;
    }
    return bad;
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

/* ------------------------------------------------------------------ results */

/* Where block i's digest goes. split=False: 32 bytes at out + 32 * i of the result bytes, and the
 * loops run without the GIL. split=True: the list's item i, a 32-byte bytes object the loop makes
 * itself a little ahead of the hashing, so with the GIL held; made there, the allocations overlap
 * the SHA chain (made before or after the loop they cost ~6 ns a block on their own).
 * Each call out to the allocator costs the chain a spill and reload of its state (~2.5 ns), while
 * a burst of allocations too long for the out-of-order window stalls it: EMIT_EVERY items a call,
 * between a block's first and second compression, measured best (2 and 3 about equal, 1 and 4
 * worse). Every YIELD_EVERY blocks the GIL is released and taken back, which lets a thread that
 * asked for it run (CPython's forced switching), as the eval loop does. */
#define EMIT_EVERY 3
#define YIELD_EVERY 4096

typedef struct {
    PyObject *list; /* split=True: the result list; NULL: packed into out */
    uint8_t *out;
    Py_ssize_t n;    /* blocks */
    Py_ssize_t made; /* list items made so far */
    int hold_gil;    /* never let other threads run (the tokens are a list's items) */
} sink;

/* Makes the list's items [made, upto); their 32 bytes are written by the loop. */
static __attribute__((noinline)) int sink_make(sink *sk, Py_ssize_t upto)
{
    const Py_ssize_t from = sk->made;
    for (Py_ssize_t i = from; i < upto; i++) {
        PyObject *b = PyBytes_FromStringAndSize(NULL, 32);
        if (!b)
            return -1;
        PyList_SET_ITEM(sk->list, i, b);
        sk->made = i + 1;
    }
    if (!sk->hold_gil && from / YIELD_EVERY != upto / YIELD_EVERY) {
        Py_BEGIN_ALLOW_THREADS
        Py_END_ALLOW_THREADS
    }
    return 0;
}

/* Called in block i before its digest is stored (the SHA-NI loops call it between the block's
 * first and second compression, where it hides best); < 0: allocation failed, exception set. */
static inline int sink_prepare(sink *sk, Py_ssize_t i)
{
    if (!sk->list || i % EMIT_EVERY)
        return 0;
    return sink_make(sk, sk->n - i > EMIT_EVERY ? i + EMIT_EVERY : sk->n);
}

static inline uint8_t *sink_slot(const sink *sk, Py_ssize_t i)
{
    if (sk->list)
        return (uint8_t *)PyBytes_AS_STRING(PyList_GET_ITEM(sk->list, i));
    return sk->out + 32 * i;
}

/* ------------------------------------------------------------------ message assembly */

/* Writes tokens_i as uint32 LE and extra_i at msg + 32 and pads; msg[0:32) is the digest's place.
 * Returns the padded message's 64-byte block count. */
static inline size_t raw_fill(const token_buf *t, Py_ssize_t bs, Py_ssize_t i, const extras_buf *e, uint8_t *msg)
{
    const size_t tok_bytes = (size_t)bs * 4;
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
    return pad_message_room(msg, (size_t)(p - msg));
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

/* cbor_head(p, 0, v) for a token: one 8-byte store, no branch (token widths vary at random, so
 * branching on them mispredicts about every other token). Writes up to 3 bytes past the end,
 * which the rest of the message or its padding overwrite; the buffers have room for them. */
static inline uint8_t *cbor_uint32(uint8_t *p, uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const unsigned c = (unsigned)(v >= 24) + (unsigned)(v >= 0x100) + (unsigned)(v >= 0x10000);
    const unsigned nbytes = (0x04020100u >> (8 * c)) & 0xff; /* argument bytes: 0, 1, 2 or 4 */
    const uint64_t first = c ? 0x17u + c : v;                /* v itself, or 0x18 / 0x19 / 0x1a */
    const uint64_t arg = (uint64_t)__builtin_bswap32(v) >> (8 * (4 - nbytes));
    const uint64_t word = first | (arg << 8);
    memcpy(p, &word, 8);
    return p + 1 + nbytes;
#else
    return cbor_head(p, 0, v);
#endif
}

/* msg = cbor([prev, [tokens_i...], extra_i]) with canonical (shortest) heads, as cbor2 writes it:
 * 0x83, 0x58 0x20 prev(32), the token array, then extra_i's pre-encoded CBOR or null (0xf6).
 * Writes from tok_start (after the array head at msg + 35) and pads; returns the block count. */
/* Tokens [j0, j1) of block i as CBOR from p; returns the end. */
static inline uint8_t *cbor_tokens(const token_buf *t, Py_ssize_t bs, Py_ssize_t i, Py_ssize_t j0, Py_ssize_t j1,
                                   uint8_t *p)
{
    /* Locals: p's stores could alias *t as far as the compiler knows, and would reload it. */
    const uint8_t *src = t->data + 4 * (i * bs + j0), *end = t->data + 4 * (i * bs + j1);
    if (t->little_endian) {
        for (; src < end; src += 4)
            p = cbor_uint32(p, (uint32_t)src[0] | ((uint32_t)src[1] << 8) | ((uint32_t)src[2] << 16) |
                                   ((uint32_t)src[3] << 24));
    } else {
        for (; src < end; src += 4)
            p = cbor_uint32(p, load_be32(src));
    }
    return p;
}

static inline size_t cbor_finish(const extras_buf *e, Py_ssize_t i, uint8_t *msg, uint8_t *p)
{
    if (e->ptr && e->ptr[i]) {
        memcpy(p, e->ptr[i], (size_t)e->len[i]);
        p += e->len[i];
    } else {
        *p++ = 0xf6;
    }
    return pad_message_room(msg, (size_t)(p - msg));
}

static inline size_t cbor_fill(const token_buf *t, Py_ssize_t bs, Py_ssize_t i, const extras_buf *e, uint8_t *msg,
                               uint8_t *tok_start)
{
    return cbor_finish(e, i, msg, cbor_tokens(t, bs, i, 0, bs, tok_start));
}

/* Bytes a cbor message of this call can take: prefix 35, array head 9, tokens 5 each, extra or null. */
static inline size_t cbor_longest(Py_ssize_t bs, const extras_buf *e)
{
    return 35 + 9 + 5 * (size_t)bs + (e->max_len ? e->max_len : 1);
}

/* ------------------------------------------------------------------ chain loops: portable */

/* msg = prev(32) || tokens_i as uint32 LE || extra_i; msg[0:32) holds the parent on entry. */
static int raw_portable(const token_buf *t, Py_ssize_t bs, Py_ssize_t n, const extras_buf *e, uint8_t *msg,
                        sink *sk)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sink_prepare(sk, i) < 0)
            return -1;
        uint8_t *dst = sink_slot(sk, i);
        hash_portable(msg, raw_fill(t, bs, i, e, msg), dst);
        memcpy(msg, dst, 32);
    }
    return 0;
}

/* msg[0:35) holds 0x83 0x58 0x20 and the parent on entry. */
static int cbor_portable(const token_buf *t, Py_ssize_t bs, Py_ssize_t n, const extras_buf *e, uint8_t *msg,
                         sink *sk)
{
    uint8_t *tok_start = cbor_head(msg + 35, 4, (uint64_t)bs);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sink_prepare(sk, i) < 0)
            return -1;
        uint8_t *dst = sink_slot(sk, i);
        hash_portable(msg, cbor_fill(t, bs, i, e, msg, tok_start), dst);
        memcpy(msg + 3, dst, 32);
    }
    return 0;
}

/* ------------------------------------------------------------------ chain loops: SHA-NI */

#ifdef KV_X86
/* chain_raw without extras, block_size % 4 == 0: the message's 16-byte lanes are the digest (2),
 * the block's tokens (bs / 4, read in place) and padding (1 to 4, constants of the call). */
SHANI_FN int raw_shani_lanes_body(const uint8_t *tok, const Py_ssize_t bs, Py_ssize_t n, int tok_le,
                                  const uint8_t *parent, sink *sk, PyObject *const *items)
{
    /* items (a list's, GIL held; bs <= LIST_BLOCK_MAX): block i + 1's ids are read into one of two buffers
     * between block i's first and second compression, where the SHA chain leaves the load ports idle. A
     * bad item makes the result -2 (the caller names it). */
    uint32_t ids[2][LIST_BLOCK_MAX] __attribute__((aligned(16)));
    int64_t bad = 0;
    if (items) {
        tok = (const uint8_t *)ids[0];
        tok_le = host_is_le();
        bad |= read_block(items, bs, ids[0]);
    }
    /* The message reads tokens as uint32 LE bytes; its words are big-endian: swap LE input. */
    const __m128i tok_mask = tok_le ? BSWAP32_MASK : _mm_set_epi64x(0x0f0e0d0c0b0a0908ULL, 0x0706050403020100ULL);
    const size_t len = 32 + 4 * (size_t)bs;
    const uint64_t bits = (uint64_t)len * 8;
    const Py_ssize_t data_lanes = 2 + bs / 4;
    const Py_ssize_t chunks = (Py_ssize_t)(padded_len(len) / 64);
    const Py_ssize_t pad_lanes = 4 * chunks - data_lanes; /* 1..4 */
    __m128i pad[4];
    for (int k = 0; k < 4; k++)
        pad[k] = _mm_setzero_si128();
    pad[0] = _mm_insert_epi32(pad[0], (int)0x80000000u, 0);
    pad[pad_lanes - 1] = _mm_insert_epi32(pad[pad_lanes - 1], (int)(uint32_t)(bits >> 32), 2);
    pad[pad_lanes - 1] = _mm_insert_epi32(pad[pad_lanes - 1], (int)(uint32_t)bits, 3);

#define RAW_LANE(j) ((j) < data_lanes ? _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 16 * ((j) - 2))), tok_mask) \
                                      : pad[(j) - data_lanes])
    /* A list's ids read after each compression: all of the next block's after the first where a block takes two
     * (measured faster for block 16), else a share after each. */
    const Py_ssize_t share = chunks <= 2 ? bs : (bs + chunks - 1) / chunks;
    __m128i w0 = shani_words(parent), w1 = shani_words(parent + 16), wk[4];
    shani_chain_start(w0, w1, wk);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *blk = items ? (const uint8_t *)ids[i & 1] : tok + (size_t)i * 4 * (size_t)bs;
        __m128i s0 = IV_ABEF, s1 = IV_CDGH, base0 = s0, base1 = s1;
        shani_rounds(&s0, &s1, w0, w1, RAW_LANE(2), RAW_LANE(3), wk);
        if (sink_prepare(sk, i) < 0)
            return -1;
        /* Block i + 1's ids, a share after each compression of block i (its read spread over the chain). */
        PyObject *const *next = items && i + 1 < n ? items + (i + 1) * bs : NULL;
        uint32_t *next_ids = ids[(i + 1) & 1];
        if (next)
            bad |= read_block(next, share, next_ids);
        for (Py_ssize_t c = 1; c < chunks; c++) {
            s0 = _mm_add_epi32(s0, base0);
            s1 = _mm_add_epi32(s1, base1);
            base0 = s0;
            base1 = s1;
            shani_rounds(&s0, &s1, RAW_LANE(4 * c), RAW_LANE(4 * c + 1), RAW_LANE(4 * c + 2), RAW_LANE(4 * c + 3), NULL);
            if (next && c * share < bs)
                bad |= read_block(next + c * share, (c + 1) * share < bs ? share : bs - c * share, next_ids + c * share);
        }
        shani_chain_end(&s0, &s1, base0, base1, &w0, &w1, wk);
        shani_store_digest(sink_slot(sk, i), w0, w1);
    }
#undef RAW_LANE
    return bad < 0 ? -2 : 0;
}

/* Specialised copies for the common block sizes (the lane layout folds to constants). */
SHANI_LOOP int raw_shani_lanes_16(const uint8_t *tok, Py_ssize_t n, int tok_le, const uint8_t *parent,
                                  sink *sk)
{
    return raw_shani_lanes_body(tok, 16, n, tok_le, parent, sk, NULL);
}

SHANI_LOOP int raw_shani_lanes_32(const uint8_t *tok, Py_ssize_t n, int tok_le, const uint8_t *parent,
                                  sink *sk)
{
    return raw_shani_lanes_body(tok, 32, n, tok_le, parent, sk, NULL);
}

SHANI_LOOP int raw_shani_lanes_64(const uint8_t *tok, Py_ssize_t n, int tok_le, const uint8_t *parent,
                                  sink *sk)
{
    return raw_shani_lanes_body(tok, 64, n, tok_le, parent, sk, NULL);
}

SHANI_LOOP int raw_shani_lanes_any(const uint8_t *tok, Py_ssize_t bs, Py_ssize_t n, int tok_le,
                                   const uint8_t *parent, sink *sk)
{
    return raw_shani_lanes_body(tok, bs, n, tok_le, parent, sk, NULL);
}

/* The same over a list's items (see raw_shani_lanes_body), for block 16 and the others up to LIST_BLOCK_MAX. */
SHANI_LOOP int raw_shani_list_16(PyObject *const *items, Py_ssize_t n, const uint8_t *parent, sink *sk)
{
    return raw_shani_lanes_body(NULL, 16, n, 1, parent, sk, items);
}

SHANI_LOOP int raw_shani_list_any(PyObject *const *items, Py_ssize_t bs, Py_ssize_t n, const uint8_t *parent,
                                  sink *sk)
{
    return raw_shani_lanes_body(NULL, bs, n, 1, parent, sk, items);
}

/* chain_raw in general (extras, any block size, any byte order): block i+1's message is written
 * into one of two buffers while block i hashes; the digest's 32 bytes come from registers.
 * bufs[k][0:32) is never written or read. */
SHANI_LOOP int raw_shani_buffered(const token_buf *t, Py_ssize_t bs, Py_ssize_t n, const extras_buf *e,
                                  uint8_t *bufs[2], const uint8_t *parent, sink *sk)
{
    __m128i w0 = shani_words(parent), w1 = shani_words(parent + 16), wk[4];
    shani_chain_start(w0, w1, wk);
    size_t next_chunks = raw_fill(t, bs, 0, e, bufs[0]);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *msg = bufs[i & 1];
        const size_t chunks = next_chunks;
        if (i + 1 < n)
            next_chunks = raw_fill(t, bs, i + 1, e, bufs[(i + 1) & 1]);
        __m128i s0 = IV_ABEF, s1 = IV_CDGH, base0 = s0, base1 = s1;
        shani_rounds(&s0, &s1, w0, w1, shani_words(msg + 32), shani_words(msg + 48), wk);
        if (sink_prepare(sk, i) < 0)
            return -1;
        for (size_t c = 1; c < chunks; c++) {
            const uint8_t *p = msg + 64 * c;
            s0 = _mm_add_epi32(s0, base0);
            s1 = _mm_add_epi32(s1, base1);
            base0 = s0;
            base1 = s1;
            shani_rounds(&s0, &s1, shani_words(p), shani_words(p + 16), shani_words(p + 32), shani_words(p + 48), NULL);
        }
        shani_chain_end(&s0, &s1, base0, base1, &w0, &w1, wk);
        shani_store_digest(sink_slot(sk, i), w0, w1);
    }
    return 0;
}

/* chain_cbor: as raw_shani_buffered; the message's first 35 bytes (0x83 0x58 0x20 digest) come
 * from registers, shifted in with palignr. bufs[k][0:35) is never read. */
SHANI_LOOP int cbor_shani(const token_buf *t, Py_ssize_t bs, Py_ssize_t n, const extras_buf *e, uint8_t *bufs[2],
                          const uint8_t *parent, sink *sk)
{
    const __m128i bswap = BSWAP32_MASK;
    /* bytes 13..15: 0x83 (array of 3), 0x58 0x20 (byte string of 32) */
    const __m128i head = _mm_set_epi8(0x20, 0x58, (char)0x83, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    uint8_t *tok_start[2];
    for (int k = 0; k < 2; k++)
        tok_start[k] = cbor_head(bufs[k] + 35, 4, (uint64_t)bs);
    __m128i d0 = _mm_loadu_si128((const __m128i *)parent), d1 = _mm_loadu_si128((const __m128i *)(parent + 16));
    size_t chunks = cbor_fill(t, bs, 0, e, bufs[0], tok_start[0]);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *msg = bufs[i & 1];
        /* Block i+1's message is written a piece after each of block i's compressions. */
        const int more = i + 1 < n;
        uint8_t *next = bufs[(i + 1) & 1], *np = tok_start[(i + 1) & 1];
        const size_t this_chunks = chunks;
        __m128i s0 = IV_ABEF, s1 = IV_CDGH, w0, w1;
        const __m128i m0 = _mm_alignr_epi8(d0, head, 13);
        const __m128i m1 = _mm_alignr_epi8(d1, d0, 13);
        const __m128i m2 = _mm_alignr_epi8(_mm_loadu_si128((const __m128i *)(msg + 35)), d1, 13);
        shani_compress(&s0, &s1, _mm_shuffle_epi8(m0, bswap), _mm_shuffle_epi8(m1, bswap),
                       _mm_shuffle_epi8(m2, bswap), shani_words(msg + 48));
        if (sink_prepare(sk, i) < 0)
            return -1;
        if (more)
            np = cbor_tokens(t, bs, i + 1, 0, bs / (Py_ssize_t)this_chunks, np);
        for (size_t c = 1; c < this_chunks; c++) {
            const uint8_t *p = msg + 64 * c;
            shani_compress(&s0, &s1, shani_words(p), shani_words(p + 16), shani_words(p + 32), shani_words(p + 48));
            if (more)
                np = cbor_tokens(t, bs, i + 1, bs * (Py_ssize_t)c / (Py_ssize_t)this_chunks,
                                 bs * (Py_ssize_t)(c + 1) / (Py_ssize_t)this_chunks, np);
        }
        if (more)
            chunks = cbor_finish(e, i + 1, next, np);
        shani_digest_words(s0, s1, &w0, &w1);
        d0 = _mm_shuffle_epi8(w0, bswap);
        d1 = _mm_shuffle_epi8(w1, bswap);
        uint8_t *dst = sink_slot(sk, i);
        _mm_storeu_si128((__m128i *)dst, d0);
        _mm_storeu_si128((__m128i *)(dst + 16), d1);
    }
    return 0;
}
#endif

/* ------------------------------------------------------------------ driver */

/* Runs the chain of one call with the current backend; < 0 (exception set) only when sk->list. */
static int run_chain(int backend, int cbor, const token_buf *t, Py_ssize_t bs, Py_ssize_t n, const extras_buf *e,
                     const uint8_t *parent, uint8_t *scratch, size_t scratch_half, sink *sk)
{
#ifdef KV_X86
    if (backend == BACKEND_SHANI) {
        uint8_t *bufs[2] = {scratch, scratch + scratch_half};
        if (cbor)
            return cbor_shani(t, bs, n, e, bufs, parent, sk);
        if (!e->ptr && bs % 4 == 0) {
            switch (bs) {
            case 16:
                return raw_shani_lanes_16(t->data, n, t->little_endian, parent, sk);
            case 32:
                return raw_shani_lanes_32(t->data, n, t->little_endian, parent, sk);
            case 64:
                return raw_shani_lanes_64(t->data, n, t->little_endian, parent, sk);
            default:
                return raw_shani_lanes_any(t->data, bs, n, t->little_endian, parent, sk);
            }
        }
        return raw_shani_buffered(t, bs, n, e, bufs, parent, sk);
    }
#endif
    (void)backend;
    (void)scratch_half;
    if (cbor) {
        scratch[0] = 0x83;
        scratch[1] = 0x58;
        scratch[2] = 0x20;
        memcpy(scratch + 3, parent, 32);
        return cbor_portable(t, bs, n, e, scratch, sk);
    }
    memcpy(scratch, parent, 32);
    return raw_portable(t, bs, n, e, scratch, sk);
}

/* chain_raw of a list of token ids without extras, straight from its items (SHA-NI, block_size % 4 == 0 and at
 * most LIST_BLOCK_MAX): reading the ids overlaps the SHA chain, where a conversion first would add its whole
 * time. NULL with an exception, or Py_None (new reference) when an item is not a token id. */
static PyObject *chain_list(const chain_args *a)
{
#ifdef KV_X86
    PyObject *const *items = ((PyListObject *)a->tokens_obj)->ob_item;
    const Py_ssize_t bs = a->block_size, count = PyList_GET_SIZE(a->tokens_obj), n = count / bs;
    uint32_t tail[LIST_BLOCK_MAX];
    if (read_block(items + n * bs, count - n * bs, tail) < 0) /* the partial block's ids are checked too */
        Py_RETURN_NONE;
    sink sk = {NULL, NULL, n, 0, 1}; /* the GIL stays held: no other thread may change the list */
    PyObject *result = a->split ? PyList_New(n) : PyBytes_FromStringAndSize(NULL, n * 32);
    if (!result || n == 0)
        return result;
    if (a->split)
        sk.list = result;
    else
        sk.out = (uint8_t *)PyBytes_AS_STRING(result);
    const int rc = bs == 16 ? raw_shani_list_16(items, n, a->parent.buf, &sk)
                            : raw_shani_list_any(items, bs, n, a->parent.buf, &sk);
    if (rc < 0) {
        Py_DECREF(result);
        if (rc == -2)
            Py_RETURN_NONE;
        return NULL;
    }
    return result;
#else
    (void)a;
    Py_RETURN_NONE;
#endif
}

/* Shared driver of chain_raw / chain_cbor: validate, hash, shape the result. */
static PyObject *chain_common(PyObject *args, PyObject *kwargs, int cbor)
{
    chain_args a;
    token_buf t;
    extras_buf e;
    if (parse_chain_args(args, kwargs, &a) < 0)
        return NULL;
    if (PyList_CheckExact(a.tokens_obj)) { /* hashed from the items where that is faster, else None */
        PyObject *result = Py_None;
        if (!cbor && a.extras_obj == Py_None && g_backend_id == BACKEND_SHANI && a.block_size % 4 == 0
            && a.block_size <= LIST_BLOCK_MAX)
            result = chain_list(&a);
        else
            Py_INCREF(result);
        PyBuffer_Release(&a.parent);
        return result;
    }
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
    const int backend = g_backend_id;
    PyObject *result = NULL;
    uint8_t *scratch = NULL;
    sink sk = {NULL, NULL, n, 0, 0};
    if (n == 0) {
        result = a.split ? PyList_New(0) : PyBytes_FromStringAndSize(NULL, 0);
        goto done;
    }
    /* Two message buffers (one for the portable loops), each a multiple of 64 bytes. */
    const size_t longest = cbor ? cbor_longest(bs, &e) : 32 + 4 * (size_t)bs + e.max_len;
    const size_t half = padded_len(longest) + 64;
    scratch = PyMem_Malloc(2 * half);
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    if (a.split) {
        result = PyList_New(n);
        if (!result)
            goto done;
        sk.list = result;
        if (run_chain(backend, cbor, &t, bs, n, &e, a.parent.buf, scratch, half, &sk) < 0)
            Py_CLEAR(result);
    } else {
        result = PyBytes_FromStringAndSize(NULL, n * 32);
        if (!result)
            goto done;
        sk.out = (uint8_t *)PyBytes_AS_STRING(result);
        Py_BEGIN_ALLOW_THREADS
        run_chain(backend, cbor, &t, bs, n, &e, a.parent.buf, scratch, half, &sk);
        Py_END_ALLOW_THREADS
    }
done:
    PyMem_Free(scratch);
    release_extras(&e);
    PyBuffer_Release(&t.view);
    PyBuffer_Release(&a.parent);
    return result;
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

/* One block per parent: block i (tokens [i*bs, (i+1)*bs)) hashed after parents[32*i, 32*i+32), no extra
 * keys; packed digests. A decode step's newly full blocks, one per request, in one call. */
/* Block i of ``t`` (n blocks of bs tokens) hashed after parents[32 i], no extras, into out[32 i]: each_common's
 * loop, also _tables' (through the capsule below). Releases the GIL while it hashes when ``nogil``. 0, or -1 with
 * MemoryError set. */
static int each_blocks(int cbor, const token_buf *t, Py_ssize_t n, Py_ssize_t bs, const uint8_t *parent, uint8_t *out,
                       int nogil)
{
    extras_buf e;
    if (get_extras(Py_None, 1, &e) < 0)
        return -1;
    const size_t longest = cbor ? cbor_longest(bs, &e) : 32 + 4 * (size_t)bs;
    const size_t half = padded_len(longest) + 64;
    uint8_t *scratch = PyMem_Malloc(2 * half);
    if (!scratch) {
        release_extras(&e);
        PyErr_NoMemory();
        return -1;
    }
    const int backend = g_backend_id;
    PyThreadState *saved = nogil ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        token_buf block = *t;
        block.data = t->data + (size_t)i * (size_t)bs * 4;
        block.count = bs;
        sink sk = {NULL, out + 32 * i, 1, 0, 0};
        run_chain(backend, cbor, &block, bs, 1, &e, parent + 32 * i, scratch, half, &sk);
    }
    if (saved)
        PyEval_RestoreThread(saved);
    PyMem_Free(scratch);
    release_extras(&e);
    return 0;
}

/* The capsule's entry: n blocks of bs native-order uint32 tokens (with the GIL held: a decode step's few blocks). */
static int each_native(int cbor, const uint32_t *tokens, Py_ssize_t n, Py_ssize_t bs, const uint8_t *parents,
                       uint8_t *out)
{
    token_buf t;
    memset(&t, 0, sizeof t);
    t.data = (const uint8_t *)tokens;
    t.count = n * bs;
    t.little_endian = host_is_le();
    return each_blocks(cbor, &t, n, bs, parents, out, 0);
}

static PyObject *each_common(PyObject *args, int cbor)
{
    PyObject *tokens_obj;
    Py_ssize_t bs;
    Py_buffer parents;
    token_buf t;
    if (!PyArg_ParseTuple(args, "Ony*", &tokens_obj, &bs, &parents))
        return NULL;
    if (bs < 1 || bs > (PY_SSIZE_T_MAX / 8)) {
        PyErr_Format(PyExc_ValueError, "block_size must be between 1 and %zd, got %zd", PY_SSIZE_T_MAX / 8, bs);
        PyBuffer_Release(&parents);
        return NULL;
    }
    if (get_tokens(tokens_obj, &t) < 0) {
        PyBuffer_Release(&parents);
        return NULL;
    }
    const Py_ssize_t n = parents.len / 32;
    if (parents.len % 32 || t.count != n * bs) {
        PyErr_Format(PyExc_ValueError, "need 32 bytes of parent per block: %zd tokens of block_size %zd, %zd parent bytes",
                     t.count, bs, parents.len);
        PyBuffer_Release(&t.view);
        PyBuffer_Release(&parents);
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, n * 32);
    if (result && each_blocks(cbor, &t, n, bs, parents.buf, (uint8_t *)PyBytes_AS_STRING(result), 1) < 0)
        Py_CLEAR(result);
    PyBuffer_Release(&t.view);
    PyBuffer_Release(&parents);
    return result;
}

static PyObject *each_raw(PyObject *self, PyObject *args)
{
    (void)self;
    return each_common(args, 0);
}

static PyObject *each_cbor(PyObject *self, PyObject *args)
{
    (void)self;
    return each_common(args, 1);
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
    hash_padded(g_backend_id, msg, pad_message(msg, (size_t)b.len), digest);
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
    return PyUnicode_FromString(backend_name(g_backend_id));
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
    {"each_raw", each_raw, METH_VARARGS,
     "each_raw(tokens, block_size, parents) -> bytes: block i of tokens hashed as chain_raw would after parents[i] "
     "(32 bytes each), no extras; packed."},
    {"each_cbor", each_cbor, METH_VARARGS, "each_cbor(tokens, block_size, parents) -> bytes: each_raw for chain_cbor."},
    {"chain_raw", (PyCFunction)(void (*)(void))chain_raw, METH_VARARGS | METH_KEYWORDS,
     "chain_raw(tokens, block_size, parent, extras=None, *, split=False) -> bytes | list[bytes]\n\n"
     "Chained digests of the full blocks: SHA256(prev || tokens as uint32 LE || extra). tokens: a uint32 buffer, or\n"
     "a list of ints, hashed from its items (SHA-NI, no extras, block_size % 4 == 0, <= 64); None for a list\n"
     "otherwise or with an item that is not a token id (convert it, and name the bad item, first)."},
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
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    /* C callers' each_raw/each_cbor (kvcache.allocator._tables): int (*)(int cbor, const uint32_t *tokens,
     * Py_ssize_t n, Py_ssize_t block_size, const uint8_t *parents, uint8_t *out); 0, or -1 with an error set. */
    PyObject *api = PyCapsule_New((void *)each_native, "kvcache.allocator._chainhash._each_api", NULL);
    if (!api || PyModule_AddObject(m, "_each_api", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
