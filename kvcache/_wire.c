/* The daemon protocol's msgpack codec with its array extension (kvcache._wire).
 *
 * Every scheduler step is packed and unpacked twice (request and reply, by the client and the
 * daemon), and each message carries several numpy arrays. msgpack-python calls back into Python for
 * every array (ext_hook on the way in, default on the way out), a few microseconds each; here the
 * arrays are read and written in C and numpy is called only to wrap a decoded array's bytes.
 * Output is byte for byte msgpack-python's ``packb(obj, use_bin_type=True, default=...)`` for the
 * protocol's types; input is what ``unpackb(data, raw=False, strict_map_key=False, use_list=True)``
 * accepts, with ext type 1 decoded as an array (see kvcache/protocol.py) and every other ext refused.
 * ``configure`` hands over the Python objects used (numpy's frombuffer and types, the dtype table,
 * ProtocolError and the Python fallbacks) once, at kvcache.protocol's import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define ARRAY_EXT 1
#define MAX_DEPTH 511 /* msgpack-python's default nesting limit when packing */
#define MAX_NDIM 4
#define NUM_CODES 11  /* dtype codes 1..10 */

static PyObject *protocol_error; /* kvcache.protocol.ProtocolError */
static PyObject *frombuffer;     /* numpy.frombuffer */
static PyObject *ndarray_type, *integer_type, *floating_type, *ext_type;
static PyObject *dtype_of_code[NUM_CODES]; /* code -> numpy dtype (little-endian) */
static long itemsize_of_code[NUM_CODES];
static PyObject *code_of_dtype;          /* dict: native-order dtype -> code (little-endian hosts only) */
static PyObject *encode_fallback;        /* kvcache.protocol._default: any other object (or array) */
static PyObject *reshape_name, *dtype_name;

/* ------------------------------------------------------------------ packing */

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    int int_lists; /* packb_lists: integer arrays as msgpack arrays of ints, not the array ext */
    PyObject *wide; /* packb_lists: maps of this dict subclass get a map 16 header at least (borrowed), or NULL */
} out_t;

static int reserve(out_t *o, Py_ssize_t extra)
{
    if (o->len + extra <= o->cap)
        return 0;
    Py_ssize_t cap = o->cap ? o->cap : 1024;
    while (cap < o->len + extra)
        cap *= 2;
    char *grown = PyMem_Realloc(o->buf, (size_t)cap);
    if (!grown) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = grown;
    o->cap = cap;
    return 0;
}

static int put(out_t *o, const void *data, Py_ssize_t n)
{
    if (reserve(o, n) < 0)
        return -1;
    memcpy(o->buf + o->len, data, (size_t)n);
    o->len += n;
    return 0;
}

/* A type byte followed by ``size`` big-endian bytes of ``value``. */
static int put_be(out_t *o, uint8_t type, uint64_t value, int size)
{
    uint8_t b[9];
    b[0] = type;
    for (int i = 0; i < size; i++)
        b[1 + i] = (uint8_t)(value >> (8 * (size - 1 - i)));
    return put(o, b, 1 + size);
}

static int put_uint(out_t *o, uint64_t v)
{
    if (v < 0x80) {
        uint8_t b = (uint8_t)v;
        return put(o, &b, 1);
    }
    if (v <= 0xff)
        return put_be(o, 0xcc, v, 1);
    if (v <= 0xffff)
        return put_be(o, 0xcd, v, 2);
    if (v <= 0xffffffffULL)
        return put_be(o, 0xce, v, 4);
    return put_be(o, 0xcf, v, 8);
}

static int put_int(out_t *o, int64_t v)
{
    if (v >= 0)
        return put_uint(o, (uint64_t)v);
    if (v >= -32) {
        uint8_t b = (uint8_t)(int8_t)v;
        return put(o, &b, 1);
    }
    if (v >= INT8_MIN)
        return put_be(o, 0xd0, (uint64_t)v, 1);
    if (v >= INT16_MIN)
        return put_be(o, 0xd1, (uint64_t)v, 2);
    if (v >= INT32_MIN)
        return put_be(o, 0xd2, (uint64_t)v, 4);
    return put_be(o, 0xd3, (uint64_t)v, 8);
}

/* A length header: fix form (if ``fix`` >= 0 and n < fix_limit), else the 8/16/32-bit forms (t8 0: none). */
static int put_len(out_t *o, Py_ssize_t n, int fix, Py_ssize_t fix_limit, uint8_t t8, uint8_t t16, uint8_t t32)
{
    if (fix >= 0 && n < fix_limit) {
        uint8_t b = (uint8_t)(fix | n);
        return put(o, &b, 1);
    }
    if (t8 && n <= 0xff)
        return put_be(o, t8, (uint64_t)n, 1);
    if (n <= 0xffff)
        return put_be(o, t16, (uint64_t)n, 2);
    if ((uint64_t)n <= 0xffffffffULL)
        return put_be(o, t32, (uint64_t)n, 4);
    PyErr_SetString(PyExc_ValueError, "object too large to pack");
    return -1;
}

static int put_bin(out_t *o, const void *data, Py_ssize_t n)
{
    return put_len(o, n, -1, 0, 0xc4, 0xc5, 0xc6) < 0 ? -1 : put(o, data, n);
}

/* An ext header of ``n`` data bytes (fixext where n is 1, 2, 4, 8 or 16, as msgpack-python writes it). */
static int put_ext_header(out_t *o, int8_t code, Py_ssize_t n)
{
    uint8_t b[6];
    int len;
    switch (n) {
    case 1: b[0] = 0xd4; len = 1; break;
    case 2: b[0] = 0xd5; len = 1; break;
    case 4: b[0] = 0xd6; len = 1; break;
    case 8: b[0] = 0xd7; len = 1; break;
    case 16: b[0] = 0xd8; len = 1; break;
    default:
        if (n <= 0xff) {
            b[0] = 0xc7;
            b[1] = (uint8_t)n;
            len = 2;
        } else if (n <= 0xffff) {
            b[0] = 0xc8;
            b[1] = (uint8_t)(n >> 8);
            b[2] = (uint8_t)n;
            len = 3;
        } else if ((uint64_t)n <= 0xffffffffULL) {
            b[0] = 0xc9;
            for (int i = 0; i < 4; i++)
                b[1 + i] = (uint8_t)((uint64_t)n >> (8 * (3 - i)));
            len = 5;
        } else {
            PyErr_SetString(PyExc_ValueError, "ext data too large to pack");
            return -1;
        }
    }
    b[len] = (uint8_t)code;
    return put(o, b, len + 1);
}

/* A C-contiguous numpy array of a wire dtype as the array ext, or 0 (nothing written) when it needs Python. */
static int put_array(out_t *o, PyObject *arr)
{
    PyObject *dtype = PyObject_GetAttr(arr, dtype_name);
    if (!dtype)
        return -1;
    PyObject *code_obj = code_of_dtype ? PyDict_GetItemWithError(code_of_dtype, dtype) : NULL;
    Py_DECREF(dtype);
    if (!code_obj)
        return PyErr_Occurred() ? -1 : 0;
    const long code = PyLong_AsLong(code_obj);
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* not contiguous: Python's path copies it */
        return 0;
    }
    int rc = 0;
    /* a 0-d array goes as shape (1,), as numpy.ascontiguousarray (the Python path) makes it */
    const int ndim = view.ndim ? view.ndim : 1;
    if (ndim <= MAX_NDIM) {
        uint8_t head[2 + 4 * MAX_NDIM];
        head[0] = (uint8_t)code;
        head[1] = (uint8_t)ndim;
        int fits = 1;
        for (int d = 0; d < ndim; d++) {
            const Py_ssize_t n = view.ndim ? view.shape[d] : 1;
            fits &= (uint64_t)n <= 0xffffffffULL;
            for (int i = 0; i < 4; i++)
                head[2 + 4 * d + i] = (uint8_t)((uint64_t)n >> (8 * i)); /* little-endian u32 */
        }
        if (fits) {
            const Py_ssize_t head_len = 2 + 4 * ndim;
            rc = put_ext_header(o, ARRAY_EXT, head_len + view.len) < 0 || put(o, head, head_len) < 0
                         || put(o, view.buf, view.len) < 0
                     ? -1
                     : 1;
        }
    }
    PyBuffer_Release(&view);
    return rc;
}

static int pack_obj(out_t *o, PyObject *obj, int depth, int fallback_allowed);

#define INT_LIST_LOOP(type, writer)                                                                         \
    do {                                                                                                    \
        const type *v = (const type *)view.buf;                                                             \
        for (Py_ssize_t i = 0; i < n && rc == 0; i++)                                                       \
            rc = writer(o, v[i]);                                                                           \
    } while (0)

/* A 1-D integer array as the msgpack array of ints msgpack-python writes for ``arr.tolist()``; 0 (nothing
 * written) for any other array. */
static int put_int_list(out_t *o, PyObject *arr)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view.format ? view.format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    char kind = f[1] == '\0' ? f[0] : '\0';
    if (kind == 'l')
        kind = view.itemsize == 8 ? 'q' : 'i';
    else if (kind == 'L')
        kind = view.itemsize == 8 ? 'Q' : 'I';
    const Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
    if (view.ndim != 1 || kind == '\0' || !strchr("bBhHiIqQ", kind)) {
        PyBuffer_Release(&view);
        return 0;
    }
    int rc = put_len(o, n, 0x90, 16, 0, 0xdc, 0xdd);
    switch (kind) {
    case 'b': INT_LIST_LOOP(int8_t, put_int); break;
    case 'B': INT_LIST_LOOP(uint8_t, put_uint); break;
    case 'h': INT_LIST_LOOP(int16_t, put_int); break;
    case 'H': INT_LIST_LOOP(uint16_t, put_uint); break;
    case 'i': INT_LIST_LOOP(int32_t, put_int); break;
    case 'I': INT_LIST_LOOP(uint32_t, put_uint); break;
    case 'q': INT_LIST_LOOP(int64_t, put_int); break;
    default: INT_LIST_LOOP(uint64_t, put_uint); break;
    }
    PyBuffer_Release(&view);
    return rc < 0 ? -1 : 1;
}

static int pack_fallback(out_t *o, PyObject *obj, int depth, int fallback_allowed)
{
    if (!fallback_allowed || !encode_fallback) {
        PyErr_Format(PyExc_TypeError, "can not serialize '%.200s' object", Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *plain = PyObject_CallOneArg(encode_fallback, obj);
    if (!plain)
        return -1;
    const int rc = pack_obj(o, plain, depth, 0);
    Py_DECREF(plain);
    return rc;
}

static int pack_obj(out_t *o, PyObject *obj, int depth, int fallback_allowed)
{
    if (depth > MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "recursion limit exceeded.");
        return -1;
    }
    if (obj == Py_None) {
        uint8_t b = 0xc0;
        return put(o, &b, 1);
    }
    if (PyBool_Check(obj)) {
        uint8_t b = obj == Py_True ? 0xc3 : 0xc2;
        return put(o, &b, 1);
    }
    if (PyLong_Check(obj)) {
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (!overflow)
            return put_int(o, (int64_t)v);
        if (overflow > 0) {
            const unsigned long long u = PyLong_AsUnsignedLongLong(obj);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                PyErr_SetString(PyExc_OverflowError, "Integer value out of range");
                return -1;
            }
            return put_uint(o, (uint64_t)u);
        }
        PyErr_SetString(PyExc_OverflowError, "Integer value out of range");
        return -1;
    }
    if (PyFloat_Check(obj)) {
        const double d = PyFloat_AS_DOUBLE(obj);
        uint64_t bits;
        memcpy(&bits, &d, sizeof bits);
        return put_be(o, 0xcb, bits, 8);
    }
    if (PyUnicode_Check(obj)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
        if (!s)
            return -1;
        return put_len(o, n, 0xa0, 32, 0xd9, 0xda, 0xdb) < 0 ? -1 : put(o, s, n);
    }
    if (PyBytes_Check(obj))
        return put_bin(o, PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj));
    if (PyByteArray_Check(obj))
        return put_bin(o, PyByteArray_AS_STRING(obj), PyByteArray_GET_SIZE(obj));
    if (PyDict_Check(obj)) {
        /* a ``wide`` map (packb_lists) gets a map 16 header however short, as msgspec writes a struct whose
         * fields and tag could outgrow a fixmap: its header is sized before the fields present are counted */
        const int wide = o->wide != NULL && PyObject_TypeCheck(obj, (PyTypeObject *)o->wide);
        if (put_len(o, PyDict_GET_SIZE(obj), wide ? -1 : 0x80, 16, 0, 0xde, 0xdf) < 0)
            return -1;
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(obj, &pos, &key, &value)) {
            Py_INCREF(key); /* a fallback call could change the dict: hold what is being packed */
            Py_INCREF(value);
            const int rc = pack_obj(o, key, depth + 1, 1) < 0 || pack_obj(o, value, depth + 1, 1) < 0 ? -1 : 0;
            Py_DECREF(key);
            Py_DECREF(value);
            if (rc < 0)
                return -1;
        }
        return 0;
    }
    /* ExtType is a tuple: before the tuples */
    if (ext_type && PyObject_TypeCheck(obj, (PyTypeObject *)ext_type) && PyTuple_GET_SIZE(obj) == 2) {
        PyObject *code = PyTuple_GET_ITEM(obj, 0), *data = PyTuple_GET_ITEM(obj, 1);
        const long c = PyLong_AsLong(code);
        if (c == -1 && PyErr_Occurred())
            return -1;
        if (!PyBytes_Check(data) || c < -128 || c > 127) {
            PyErr_SetString(PyExc_TypeError, "ExtType: code must be an int in [-128, 127] and data bytes");
            return -1;
        }
        return put_ext_header(o, (int8_t)c, PyBytes_GET_SIZE(data)) < 0
                   ? -1
                   : put(o, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
    }
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        const int is_list = PyList_Check(obj);
        const Py_ssize_t n = is_list ? PyList_GET_SIZE(obj) : PyTuple_GET_SIZE(obj);
        if (put_len(o, n, 0x90, 16, 0, 0xdc, 0xdd) < 0)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* a list may change under a callback (default): re-read its size each time */
            if (is_list && i >= PyList_GET_SIZE(obj)) {
                PyErr_SetString(PyExc_RuntimeError, "list changed size during packing");
                return -1;
            }
            PyObject *item = is_list ? PyList_GET_ITEM(obj, i) : PyTuple_GET_ITEM(obj, i);
            Py_INCREF(item);
            const int rc = pack_obj(o, item, depth + 1, 1);
            Py_DECREF(item);
            if (rc < 0)
                return -1;
        }
        return 0;
    }
    if (ndarray_type && PyObject_TypeCheck(obj, (PyTypeObject *)ndarray_type)) {
        if (o->int_lists) {
            const int rc = put_int_list(o, obj);
            if (rc == 0)
                PyErr_SetString(PyExc_TypeError, "packb_lists: an array that is not a 1-D C-contiguous integer array");
            return rc > 0 ? 0 : -1;
        }
        const int rc = put_array(o, obj);
        if (rc != 0)
            return rc < 0 ? -1 : 0;
        return pack_fallback(o, obj, depth, fallback_allowed);
    }
    if (integer_type && PyObject_IsInstance(obj, integer_type) == 1) { /* numpy integers, as _default: int(obj) */
        PyObject *plain = PyNumber_Index(obj);
        const int rc = plain ? pack_obj(o, plain, depth, 0) : -1;
        Py_XDECREF(plain);
        return rc;
    }
    if (floating_type && PyObject_IsInstance(obj, floating_type) == 1) {
        PyObject *plain = PyNumber_Float(obj);
        const int rc = plain ? pack_obj(o, plain, depth, 0) : -1;
        Py_XDECREF(plain);
        return rc;
    }
    if (PyMemoryView_Check(obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        const int rc = put_bin(o, view.buf, view.len);
        PyBuffer_Release(&view);
        return rc;
    }
    return pack_fallback(o, obj, depth, fallback_allowed);
}

PyDoc_STRVAR(packb_doc,
"packb(obj) -> bytes\n\n"
"msgpack of obj as msgpack.packb(obj, use_bin_type=True, default=<the configured fallback>) writes it:\n"
"None, bool, int (int64 or uint64), float (float64), str, bytes, bytearray, memoryview (bin), dict, list\n"
"and tuple, msgpack.ExtType, and numpy arrays of a wire dtype (the array ext, C order); anything else goes\n"
"through the fallback once (numpy scalars, other arrays), else TypeError.");

/* packb's and packb_lists' bytes: obj packed, integer arrays as the ext or (``int_lists``) as msgpack ints. */
static PyObject *pack_to_bytes(PyObject *obj, int int_lists, PyObject *wide)
{
    out_t o = {NULL, 0, 0, int_lists, wide};
    PyObject *result = NULL;
    if (pack_obj(&o, obj, 0, 1) == 0)
        result = PyBytes_FromStringAndSize(o.buf ? o.buf : "", o.len);
    PyMem_Free(o.buf);
    return result;
}

static PyObject *packb(PyObject *self, PyObject *obj)
{
    (void)self;
    return pack_to_bytes(obj, 0, NULL);
}

PyDoc_STRVAR(packb_lists_doc,
"packb_lists(obj, wide=None) -> bytes\n\n"
"packb, except that a 1-D integer numpy array is written as the msgpack array of ints that\n"
"msgpack.packb(arr.tolist()) writes (no Python int per element), and a map of the dict subclass ``wide``\n"
"with a map 16 header however short, as msgspec writes a struct of 16 or more fields: KV event batches in\n"
"vLLM's encoding. Any other array is a TypeError.");

static PyObject *packb_lists(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj, *wide = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:packb_lists", &obj, &wide))
        return NULL;
    if (wide != Py_None && !(PyType_Check(wide) && PyType_IsSubtype((PyTypeObject *)wide, &PyDict_Type))) {
        PyErr_SetString(PyExc_TypeError, "packb_lists: wide must be a dict subclass or None");
        return NULL;
    }
    return pack_to_bytes(obj, 1, wide == Py_None ? NULL : wide);
}

/* ------------------------------------------------------------------ unpacking */

typedef struct {
    const uint8_t *p, *end;
    Py_ssize_t max_items; /* cap on every array and map length */
} in_t;

static PyObject *format_error(const char *message)
{
    PyErr_SetString(PyExc_ValueError, message);
    return NULL;
}

static int need(in_t *in, Py_ssize_t n)
{
    if (in->end - in->p < n) {
        PyErr_SetString(PyExc_ValueError, "Unpack failed: incomplete input");
        return -1;
    }
    return 0;
}

static uint64_t read_be(const uint8_t *p, int size)
{
    uint64_t v = 0;
    for (int i = 0; i < size; i++)
        v = (v << 8) | p[i];
    return v;
}

/* ``n`` bytes of a str/bin/ext body, after the length was read; NULL at the end of input. */
static const uint8_t *take(in_t *in, uint64_t n)
{
    if ((uint64_t)(in->end - in->p) < n) {
        PyErr_SetString(PyExc_ValueError, "Unpack failed: incomplete input");
        return NULL;
    }
    const uint8_t *at = in->p;
    in->p += n;
    return at;
}

static PyObject *decode_array(const uint8_t *data, Py_ssize_t len)
{
    if (len < 2)
        return PyErr_Format(protocol_error, "array: truncated header");
    const int code = data[0], ndim = data[1];
    if (code < 1 || code >= NUM_CODES || !dtype_of_code[code])
        return PyErr_Format(protocol_error, "array: unknown dtype code %d", code);
    if (ndim > MAX_NDIM)
        return PyErr_Format(protocol_error, "array: %d dimensions, at most %d allowed", ndim, MAX_NDIM);
    const Py_ssize_t start = 2 + 4 * ndim;
    if (len < start)
        return PyErr_Format(protocol_error, "array: truncated shape");
    PyObject *shape = PyTuple_New(ndim);
    if (!shape)
        return NULL;
    unsigned long long count = 1;
    int too_big = 0;
    for (int d = 0; d < ndim; d++) {
        const uint8_t *q = data + 2 + 4 * d;
        const uint32_t n = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
        PyObject *dim = PyLong_FromUnsignedLong(n);
        if (!dim) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, d, dim);
        if (n && count > (unsigned long long)PY_SSIZE_T_MAX / n)
            too_big = 1;
        else
            count *= n;
    }
    PyObject *dtype = dtype_of_code[code];
    const long itemsize = itemsize_of_code[code];
    if (too_big || count > (unsigned long long)PY_SSIZE_T_MAX / (unsigned long long)itemsize
        || (Py_ssize_t)(count * (unsigned long long)itemsize) != len - start) {
        PyObject *err = too_big ? NULL : PyObject_Str(shape);
        if (too_big)
            PyErr_Format(protocol_error, "array: shape of %d dimensions is too large", ndim);
        else if (err) {
            PyObject *dtype_text = PyObject_Str(dtype);
            if (dtype_text)
                PyErr_Format(protocol_error, "array: shape %U of %U needs %llu bytes, got %zd", err, dtype_text,
                             count * (unsigned long long)itemsize, len - start);
            Py_XDECREF(dtype_text);
        }
        Py_XDECREF(err);
        Py_DECREF(shape);
        return NULL;
    }
    /* The array's own bytes, as msgpack-python hands an ext hook: a kept array never pins the message. */
    PyObject *buffer = PyBytes_FromStringAndSize((const char *)data + start, len - start);
    PyObject *flat = buffer ? PyObject_CallFunctionObjArgs(frombuffer, buffer, dtype, NULL) : NULL;
    PyObject *result = NULL;
    if (flat) {
        if (ndim == 1) {
            result = flat;
            flat = NULL;
        } else {
            result = PyObject_CallMethodOneArg(flat, reshape_name, shape);
        }
    }
    Py_XDECREF(flat);
    Py_XDECREF(buffer);
    Py_DECREF(shape);
    return result;
}

static PyObject *decode(in_t *in, int depth);

static PyObject *decode_list(in_t *in, uint64_t n, int depth)
{
    if (n > (uint64_t)in->max_items)
        return PyErr_Format(PyExc_ValueError, "%llu exceeds max_array_len(%zd)", (unsigned long long)n,
                            in->max_items);
    if (n > (uint64_t)(in->end - in->p))
        return format_error("Unpack failed: incomplete input"); /* every item takes at least a byte */
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list)
        return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *item = decode(in, depth + 1);
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return list;
}

static PyObject *decode_map(in_t *in, uint64_t n, int depth)
{
    if (n > (uint64_t)in->max_items)
        return PyErr_Format(PyExc_ValueError, "%llu exceeds max_map_len(%zd)", (unsigned long long)n, in->max_items);
    if (n > (uint64_t)(in->end - in->p) / 2)
        return format_error("Unpack failed: incomplete input");
    PyObject *map = PyDict_New();
    if (!map)
        return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *key = decode(in, depth + 1);
        PyObject *value = key ? decode(in, depth + 1) : NULL;
        const int rc = value ? PyDict_SetItem(map, key, value) : -1;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (rc < 0) {
            Py_DECREF(map);
            return NULL;
        }
    }
    return map;
}

static PyObject *decode_str(in_t *in, uint64_t n)
{
    const uint8_t *s = take(in, n);
    return s ? PyUnicode_DecodeUTF8((const char *)s, (Py_ssize_t)n, "strict") : NULL;
}

static PyObject *decode_bin(in_t *in, uint64_t n)
{
    const uint8_t *s = take(in, n);
    return s ? PyBytes_FromStringAndSize((const char *)s, (Py_ssize_t)n) : NULL;
}

static PyObject *decode_ext(in_t *in, uint64_t n)
{
    if (need(in, 1) < 0)
        return NULL;
    const int8_t code = (int8_t)*in->p++;
    const uint8_t *data = take(in, n);
    if (!data)
        return NULL;
    if (code != ARRAY_EXT)
        return PyErr_Format(protocol_error, "unknown ext type %d", (int)code);
    return decode_array(data, (Py_ssize_t)n);
}

static PyObject *decode(in_t *in, int depth)
{
    if (depth > MAX_DEPTH)
        return format_error("Unpack failed: nested too deeply");
    if (need(in, 1) < 0)
        return NULL;
    const uint8_t t = *in->p++;
    if (t < 0x80)
        return PyLong_FromLong(t);
    if (t >= 0xe0)
        return PyLong_FromLong((int8_t)t);
    if (t <= 0x8f)
        return decode_map(in, t & 0x0f, depth);
    if (t <= 0x9f)
        return decode_list(in, t & 0x0f, depth);
    if (t <= 0xbf)
        return decode_str(in, t & 0x1f);
    static const int8_t width[] = {
        /* c0 */ 0, -1, 0, 0, 1, 2, 4, 1, 2, 4, 4, 8, 1, 2, 4, 8,
        /* d0 */ 1, 2, 4, 8, 0, 0, 0, 0, 0, 1, 2, 4, 2, 4, 2, 4,
    };
    const int w = width[t - 0xc0];
    if (w < 0)
        return format_error("Unpack failed: reserved type byte 0xc1");
    if (need(in, w) < 0)
        return NULL;
    const uint64_t v = read_be(in->p, w);
    in->p += w;
    switch (t) {
    case 0xc0: Py_RETURN_NONE;
    case 0xc2: Py_RETURN_FALSE;
    case 0xc3: Py_RETURN_TRUE;
    case 0xc4: case 0xc5: case 0xc6: return decode_bin(in, v);
    case 0xc7: case 0xc8: case 0xc9: return decode_ext(in, v);
    case 0xca: {
        const uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, sizeof f);
        return PyFloat_FromDouble(f);
    }
    case 0xcb: {
        double d;
        memcpy(&d, &v, sizeof d);
        return PyFloat_FromDouble(d);
    }
    case 0xcc: case 0xcd: case 0xce: case 0xcf: return PyLong_FromUnsignedLongLong(v);
    case 0xd0: return PyLong_FromLong((int8_t)v);
    case 0xd1: return PyLong_FromLong((int16_t)v);
    case 0xd2: return PyLong_FromLong((int32_t)v);
    case 0xd3: return PyLong_FromLongLong((int64_t)v);
    case 0xd4: return decode_ext(in, 1);
    case 0xd5: return decode_ext(in, 2);
    case 0xd6: return decode_ext(in, 4);
    case 0xd7: return decode_ext(in, 8);
    case 0xd8: return decode_ext(in, 16);
    case 0xd9: case 0xda: case 0xdb: return decode_str(in, v);
    case 0xdc: case 0xdd: return decode_list(in, v, depth);
    default: return decode_map(in, v, depth); /* 0xde, 0xdf */
    }
}

PyDoc_STRVAR(unpackb_doc,
"unpackb(data, max_items) -> object\n\n"
"One msgpack object filling data (a bytes-like object), as msgpack.unpackb(data, raw=False,\n"
"strict_map_key=False, use_list=True, max_array_len=max_items, max_map_len=max_items) reads it, with ext\n"
"type 1 as a numpy array (read-only, viewing data when it is bytes). ProtocolError for a bad array or any\n"
"other ext type; ValueError, TypeError or UnicodeDecodeError for malformed msgpack.");

static PyObject *unpackb(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer data;
    Py_ssize_t max_items;
    if (!PyArg_ParseTuple(args, "y*n", &data, &max_items))
        return NULL;
    if (!protocol_error || !frombuffer) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_RuntimeError, "kvcache._wire: configure() was not called");
        return NULL;
    }
    in_t in = {data.buf, (const uint8_t *)data.buf + data.len, max_items < 0 ? PY_SSIZE_T_MAX : max_items};
    PyObject *result = decode(&in, 0);
    if (result && in.p != in.end) {
        Py_CLEAR(result);
        PyErr_SetString(PyExc_ValueError, "extra data after the message");
    }
    PyBuffer_Release(&data);
    return result;
}

PyDoc_STRVAR(configure_doc,
"configure(protocol_error, frombuffer, ndarray, integer, floating, ext_type, dtypes, codes, fallback)\n\n"
"The Python objects the codec uses: the error class for bad arrays, numpy.frombuffer, numpy.ndarray,\n"
"numpy.integer and numpy.floating, msgpack.ExtType, dtypes (code -> little-endian dtype, a dict), codes\n"
"(native-order dtype -> code, a dict; None on a big-endian host) and the packing fallback.");

static PyObject *configure(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *err, *fb, *nd, *integer, *floating, *ext, *dtypes, *codes, *fallback;
    if (!PyArg_ParseTuple(args, "OOOOOOO!OO", &err, &fb, &nd, &integer, &floating, &ext, &PyDict_Type, &dtypes, &codes,
                          &fallback))
        return NULL;
    if (codes != Py_None && !PyDict_Check(codes)) {
        PyErr_SetString(PyExc_TypeError, "configure: codes must be a dict or None");
        return NULL;
    }
    PyObject *table[NUM_CODES] = {NULL};
    for (int c = 1; c < NUM_CODES; c++) {
        PyObject *key = PyLong_FromLong(c);
        if (!key)
            goto fail;
        table[c] = PyDict_GetItemWithError(dtypes, key);
        Py_DECREF(key);
        if (!table[c] && PyErr_Occurred())
            goto fail;
        Py_XINCREF(table[c]);
    }
    long sizes[NUM_CODES] = {0};
    for (int c = 1; c < NUM_CODES; c++) {
        PyObject *size = table[c] ? PyObject_GetAttrString(table[c], "itemsize") : NULL;
        sizes[c] = size ? PyLong_AsLong(size) : 0;
        Py_XDECREF(size);
        if (table[c] && sizes[c] <= 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "configure: a dtype without an itemsize");
            goto fail;
        }
    }
    for (int c = 1; c < NUM_CODES; c++) {
        Py_XSETREF(dtype_of_code[c], table[c]);
        itemsize_of_code[c] = sizes[c];
    }
    Py_INCREF(err);
    Py_XSETREF(protocol_error, err);
    Py_INCREF(fb);
    Py_XSETREF(frombuffer, fb);
    Py_INCREF(nd);
    Py_XSETREF(ndarray_type, nd);
    Py_INCREF(integer);
    Py_XSETREF(integer_type, integer);
    Py_INCREF(floating);
    Py_XSETREF(floating_type, floating);
    Py_INCREF(ext);
    Py_XSETREF(ext_type, ext);
    Py_XSETREF(code_of_dtype, codes == Py_None ? NULL : Py_NewRef(codes));
    Py_INCREF(fallback);
    Py_XSETREF(encode_fallback, fallback);
    Py_RETURN_NONE;
fail:
    for (int c = 1; c < NUM_CODES; c++)
        Py_XDECREF(table[c]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, configure_doc},
    {"packb", packb, METH_O, packb_doc},
    {"packb_lists", packb_lists, METH_VARARGS, packb_lists_doc},
    {"unpackb", unpackb, METH_VARARGS, unpackb_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wire", "The daemon protocol's msgpack codec with its array extension.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__wire(void)
{
    if ((!reshape_name && !(reshape_name = PyUnicode_InternFromString("reshape")))
        || (!dtype_name && !(dtype_name = PyUnicode_InternFromString("dtype"))))
        return NULL;
    return PyModule_Create(&module);
}
