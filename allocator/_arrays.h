/* numpy arrays as the C passes take them (kvcache.allocator._tables, _pool, _hashtable): read off the array's
 * head where its layout is the one numpy 1.x and 2.x share, else through a buffer export. Everything here is
 * static: each extension that includes it gets its own copy.
 */
#ifndef KVCACHE_ARRAYS_H
#define KVCACHE_ARRAYS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

/* The leading fields of a numpy array (numpy's PyArrayObject_fields, laid out alike in numpy 1.x and 2.x). Read
 * directly, a small array's data costs a few loads, where a buffer export costs about 0.1 us: 25 us for a decode
 * step's 256 one-token arrays. Checked against an export of a known array at first use; if they disagree, the
 * callers use exports. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} array_head;

#define ARRAY_C_CONTIGUOUS 0x0001 /* numpy's NPY_ARRAY_C_CONTIGUOUS */
#define ARRAY_WRITEABLE 0x0400    /* numpy's NPY_ARRAY_WRITEABLE */

static PyObject *ndarray_type, *uint32_dtype; /* numpy.ndarray and numpy.dtype("uint32"), looked up on first use */

/* numpy.ndarray and numpy.dtype("uint32") into the statics above: 0, or -1 with an exception set. */
static int load_numpy(void)
{
    if (ndarray_type && uint32_dtype)
        return 0;
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (!numpy)
        return -1;
    if (!ndarray_type)
        ndarray_type = PyObject_GetAttrString(numpy, "ndarray");
    if (ndarray_type && !uint32_dtype)
        uint32_dtype = PyObject_CallMethod(numpy, "dtype", "s", "uint32");
    Py_DECREF(numpy);
    return ndarray_type && uint32_dtype ? 0 : -1;
}

/* Whether array_head reads numpy arrays right here: 1 yes, 0 no, -1 with an exception set. */
static int array_heads_usable(void)
{
    static int usable = -1;
    if (usable >= 0)
        return usable;
    if (load_numpy() < 0)
        return -1;
    PyObject *arr = PyObject_CallFunction(ndarray_type, "(n)O", (Py_ssize_t)4, uint32_dtype); /* ndarray(4, uint32) */
    if (!arr)
        return -1;
    PyObject *two = PyLong_FromLong(2);
    PyObject *every_other = two ? PySlice_New(NULL, NULL, two) : NULL;
    PyObject *strided = every_other ? PyObject_GetItem(arr, every_other) : NULL; /* arr[::2]: 2 items 8 bytes apart */
    Py_XDECREF(two);
    Py_XDECREF(every_other);
    PyObject *dtype = PyObject_GetAttrString(arr, "dtype");
    Py_buffer b;
    int ok = 0;
    if (dtype && strided && PyObject_GetBuffer(arr, &b, PyBUF_STRIDES) == 0) {
        const array_head *h = (const array_head *)arr, *s = (const array_head *)strided;
        ok = h->data == b.buf && h->nd == 1 && b.ndim == 1 && h->dimensions[0] == 4 && h->strides[0] == b.strides[0]
             && b.itemsize == 4 && h->descr == dtype && (h->flags & ARRAY_C_CONTIGUOUS) && (h->flags & ARRAY_WRITEABLE)
             && s->data == b.buf
             && s->nd == 1 && s->dimensions[0] == 2 && s->strides[0] == 8 && !(s->flags & ARRAY_C_CONTIGUOUS);
        PyBuffer_Release(&b);
    }
    PyErr_Clear();
    Py_XDECREF(dtype);
    Py_XDECREF(strided);
    Py_DECREF(arr);
    usable = ok;
    return usable;
}

/* Item sizes of the dtypes whose arrays the passes took by export before, by descr (each held: its address is not
 * reused). An array head carries its dtype's descr but not, in a layout common to numpy 1.x and 2.x, its size. */
enum { KNOWN_DTYPES = 16 };
static PyObject *known_descr[KNOWN_DTYPES];
static Py_ssize_t known_itemsize[KNOWN_DTYPES];

static Py_ssize_t itemsize_of(const PyObject *descr)
{
    for (int i = 0; i < KNOWN_DTYPES && known_descr[i]; i++)
        if (known_descr[i] == descr)
            return known_itemsize[i];
    return 0;
}

static void learn_itemsize(PyObject *obj, const Py_buffer *b)
{
    if ((PyObject *)Py_TYPE(obj) != ndarray_type || b->itemsize < 1)
        return;
    PyObject *descr = ((const array_head *)obj)->descr;
    int i = 0;
    while (i < KNOWN_DTYPES && known_descr[i] && known_descr[i] != descr)
        i++;
    if (i < KNOWN_DTYPES && !known_descr[i]) {
        known_descr[i] = Py_NewRef(descr);
        known_itemsize[i] = b->itemsize;
    }
}

/* A PyArg "O&" converter (with cleanup) for a C-contiguous buffer, as "y*" (read_array) or "w*" (write_array)
 * give: an exact numpy array of a known dtype is read off its head (about 0.1 us less than an export, for each of
 * the two dozen arrays a pass takes), anything else exported. A head-read buffer has no object to release. */
static int array_buffer(PyObject *obj, void *addr, int writable)
{
    Py_buffer *b = addr;
    if (!obj) { /* PyArg's cleanup after a later argument failed */
        PyBuffer_Release(b);
        return 1;
    }
    if (array_heads_usable() == 1 && (PyObject *)Py_TYPE(obj) == ndarray_type) {
        const array_head *h = (const array_head *)obj;
        const Py_ssize_t itemsize = itemsize_of(h->descr);
        if (itemsize && (h->flags & ARRAY_C_CONTIGUOUS) && (!writable || (h->flags & ARRAY_WRITEABLE))) {
            Py_ssize_t n = 1;
            for (int i = 0; i < h->nd; i++)
                n *= h->dimensions[i];
            memset(b, 0, sizeof *b);
            b->buf = h->data;
            b->len = n * itemsize;
            b->itemsize = itemsize;
            b->readonly = !(h->flags & ARRAY_WRITEABLE);
            return Py_CLEANUP_SUPPORTED;
        }
    }
    PyErr_Clear(); /* a failed layout check: exports from here on */
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT) < 0)
        return 0;
    learn_itemsize(obj, b);
    return Py_CLEANUP_SUPPORTED;
}

static int read_array(PyObject *obj, void *addr) { return array_buffer(obj, addr, 0); }
static int write_array(PyObject *obj, void *addr) { return array_buffer(obj, addr, 1); }

#endif
