/* Token ids from a Python list, read in C (kvcache.allocator._tables, _chainhash). Static: each extension that
 * includes it gets its own copy.
 */
#ifndef KVCACHE_TOKENS_H
#define KVCACHE_TOKENS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* A list item as a token id: 0 <= id < 2**32 from an exact int, or -1 (not an exact int, or out of range). */
static inline int64_t list_token(PyObject *item)
{
    if (!PyLong_CheckExact(item))
        return -1;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) { /* |value| < 2**30: no conversion call */
        const Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        return v >= 0 && (uint64_t)v <= UINT32_MAX ? (int64_t)v : -1;
    }
#else
    const Py_ssize_t size = Py_SIZE(item);
    if (size == 0 || size == 1)
        return size ? (int64_t)((PyLongObject *)item)->ob_digit[0] : 0;
#endif
    const unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return v <= UINT32_MAX ? (int64_t)v : -1;
}

#endif
