/* Layer-completion signal in POSIX shared memory, and send_cache, its CUDA-stream trigger
 * (kvcache.ops._send_cache).
 *
 * A prefill worker writes each layer's KV on a CUDA stream; the cache messager, another process,
 * must learn that layer L of step S is written as soon as the GPU has finished it. send_cache
 * enqueues a host function (cudaLaunchHostFunc) behind the layer's kernels. That function is
 * plain C on the CUDA runtime's callback thread (no Python, never the GIL): it stamps the layer
 * in a shared record and wakes the waiters with FUTEX_WAKE. Waiters sleep in FUTEX_WAIT with the
 * GIL released; an idle one wakes twice a second (writer liveness, Python signal handlers) and
 * otherwise costs no CPU.
 *
 * The CUDA runtime is found at run time (dlopen), so this builds with no CUDA toolkit and imports
 * on machines without a GPU; only send_cache with a stream needs it. The runtime prototypes used
 * are declared below.
 *
 * Record layout, native byte order, one record per (rank, device), a file in /dev/shm:
 *   header, 128 bytes: line 1 identity and the writer's liveness data; line 2 what every
 *     completion touches: seq (the futex word, bumped on every completion), waiters (how many
 *     sleep on seq, so a completion with none skips the syscall), the current step, progress
 *     ((step << 32) | highest completed layer + 1) and the step's start time;
 *   layers[num_layers], 16 bytes each: state ((1 << 32) | step of its last completion; 0 = never)
 *     and done_ns (CLOCK_MONOTONIC time of that completion, comparable across processes).
 * Steps are uint32 and wrap; they are compared with serial-number arithmetic (RFC 1982), so any
 * two steps less than 2**31 apart compare right.
 *
 * A host function carries the step current when it was enqueued, not when it runs: the worker's
 * CPU runs ahead of its GPU, and may begin step S+1 while step S's layers are still queued.
 * The mapping is reference-counted: the Python object holds one reference and every queued host
 * function and every wait in progress another, so closing the signal never unmaps memory that a
 * callback or a waiter still uses.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAGIC 0x314C474953564B43ULL /* "CKVSIGL1" read as little-endian bytes */
#define VERSION 1u
#define HEADER_BYTES 128
#define MAX_LAYERS 65536
#define MAX_NAME 200
#define STATE_VALID (1ULL << 32)
#define SIGNAL_CHECK_NS 500000000LL /* a waiter runs Python's signal handlers at least this often */

/* Wait results; the first four are kvcache.transfer.WaitStatus. */
enum { DONE = 0, TIMEOUT = 1, WRITER_DEAD = 2, STALE = 3, PENDING = -1, INTERRUPTED = -2 /* or a slice ended */ };

typedef struct {
    _Atomic uint64_t magic; /* stored last at creation: an opener never sees a half-made record */
    uint32_t version;
    uint32_t num_layers;
    uint64_t total_bytes;
    _Atomic int32_t writer_pid; /* 0: no writer to watch */
    _Atomic uint32_t writer_closed;
    _Atomic uint64_t writer_start; /* /proc/<pid>/stat start time: a reused pid is not the writer */
    _Atomic uint64_t writer_pidns; /* the writer's pid namespace: pids mean nothing across them */
    int64_t created_ns;
    uint8_t pad0[8];
    _Atomic uint32_t seq;
    _Atomic uint32_t waiters;
    _Atomic uint32_t step;
    uint32_t pad1;
    _Atomic uint64_t progress;
    _Atomic int64_t step_begin_ns;
    uint8_t pad2[32];
} header_t;

typedef struct {
    _Atomic uint64_t state;
    _Atomic int64_t done_ns;
} layer_t;

_Static_assert(sizeof(header_t) == HEADER_BYTES, "header must be two cache lines");
_Static_assert(sizeof(layer_t) == 16, "layer entry must be 16 bytes");

typedef struct {
    _Atomic long refs;
    header_t *h;
    layer_t *layers;
    size_t size;
    uint32_t num_layers; /* validated copy: the shared header is writable by any process that opens it */
} shared_t;

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int serial_gt(uint32_t a, uint32_t b) { return (int32_t)(a - b) > 0; }

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void shared_release(shared_t *s)
{
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        munmap(s->h, s->size);
        free(s);
    }
}

/* ------------------------------------------------------------------------------ completion */

/* Make the changes before it visible to waiters, waking any that sleep. */
static void publish(header_t *h)
{
    /* seq_cst on both sides (here: bump seq, then read waiters; a waiter: count itself, then
     * FUTEX_WAIT compares seq) means either the waiter sees the new seq or we see the waiter. */
    atomic_fetch_add(&h->seq, 1);
    if (atomic_load(&h->waiters) != 0) {
        syscall(SYS_futex, (uint32_t *)&h->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

/* Layer `layer` of step `step` is complete: stamp it, raise progress, wake waiters. No Python. */
static void mark_done(shared_t *s, uint32_t layer, uint32_t step)
{
    header_t *h = s->h;
    layer_t *l = &s->layers[layer];
    atomic_store_explicit(&l->done_ns, now_ns(), memory_order_relaxed);
    atomic_store_explicit(&l->state, STATE_VALID | step, memory_order_release);
    uint64_t old = atomic_load(&h->progress), want = ((uint64_t)step << 32) | (layer + 1u);
    for (;;) {
        uint32_t old_step = (uint32_t)(old >> 32), old_layers = (uint32_t)old;
        if (old_step == step ? old_layers >= layer + 1u : !serial_gt(step, old_step)) {
            break;
        }
        if (atomic_compare_exchange_weak(&h->progress, &old, want)) {
            break;
        }
    }
    publish(h);
}

static int layer_status(const shared_t *s, uint32_t layer, uint32_t step)
{
    uint64_t state = atomic_load_explicit(&s->layers[layer].state, memory_order_acquire);
    if (!(state & STATE_VALID)) {
        return PENDING;
    }
    uint32_t done_step = (uint32_t)state;
    return done_step == step ? DONE : serial_gt(done_step, step) ? STALE : PENDING;
}

/* ------------------------------------------------------------------------------ writer liveness */

static uint64_t own_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* Start time (clock ticks since boot) and state letter of pid from /proc; 0 if unreadable. */
static uint64_t proc_start(pid_t pid, char *state)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return 0;
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) {
        return 0;
    }
    buf[n] = '\0';
    /* The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'. */
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] != ' ') {
        return 0;
    }
    p += 2;
    *state = *p;
    for (int field = 3; field < 22; field++) { /* field 22 is starttime */
        p = strchr(p, ' ');
        if (p == NULL) {
            return 0;
        }
        p++;
    }
    return strtoull(p, NULL, 10);
}

static void record_writer(header_t *h)
{
    char state = 0;
    pid_t pid = getpid();
    atomic_store(&h->writer_start, proc_start(pid, &state));
    atomic_store(&h->writer_pidns, own_pidns());
    atomic_store(&h->writer_closed, 0);
    atomic_store(&h->writer_pid, (int32_t)pid);
}

/* 0 when the writer has closed, exited, is a zombie or its pid now names another process; 1 if it
 * is alive or that can't be told (no pid recorded, another pid namespace). */
static int writer_alive(header_t *h, uint64_t my_pidns)
{
    if (atomic_load(&h->writer_closed)) {
        return 0;
    }
    pid_t pid = atomic_load(&h->writer_pid);
    if (pid <= 0 || atomic_load(&h->writer_pidns) != my_pidns) {
        return 1;
    }
    if (kill(pid, 0) == -1 && errno == ESRCH) {
        return 0;
    }
    char state = 0;
    uint64_t start = proc_start(pid, &state);
    if (start == 0) {
        return 1; /* no /proc here, or it exited just now: kill() decides next time */
    }
    if (state == 'Z' || state == 'X') {
        return 0;
    }
    uint64_t recorded = atomic_load(&h->writer_start);
    return recorded == 0 || recorded == start;
}

/* ------------------------------------------------------------------------------ waiting */

/* Sleep on seq until layer's status for step is known, the deadline passes, a signal arrives or a
 * sleep slice (at most SIGNAL_CHECK_NS) ends. Runs without the GIL. Liveness is checked every
 * liveness_ns of no progress and at the deadline. */
static int wait_until(shared_t *s, uint32_t layer, uint32_t step, int64_t deadline, int64_t liveness_ns,
                      int64_t *next_check, uint64_t my_pidns)
{
    header_t *h = s->h;
    for (;;) {
        uint32_t seq = atomic_load_explicit(&h->seq, memory_order_acquire);
        int status = layer_status(s, layer, step);
        if (status != PENDING) {
            return status;
        }
        if (atomic_load(&h->writer_closed)) {
            return WRITER_DEAD;
        }
        int64_t now = now_ns();
        if (now >= *next_check || now >= deadline) {
            if (!writer_alive(h, my_pidns)) {
                status = layer_status(s, layer, step); /* its last act may have been this layer */
                return status != PENDING ? status : WRITER_DEAD;
            }
            if (now >= deadline) {
                return TIMEOUT;
            }
            *next_check = now + liveness_ns;
        }
        int64_t wake = deadline < *next_check ? deadline : *next_check;
        int64_t sleep_ns = (wake - now < SIGNAL_CHECK_NS ? wake - now : SIGNAL_CHECK_NS);
        struct timespec ts = {sleep_ns / 1000000000LL, sleep_ns % 1000000000LL};
        atomic_fetch_add(&h->waiters, 1);
        long rc = syscall(SYS_futex, (uint32_t *)&h->seq, FUTEX_WAIT, seq, &ts, NULL, 0);
        int err = errno;
        atomic_fetch_sub(&h->waiters, 1);
        if (rc == -1 && (err == EINTR || err == ETIMEDOUT)) {
            /* Back to the caller to run Python's signal handlers: a SIGINT taken by another thread
             * of this process sets Python's flag without interrupting this thread's futex. */
            return INTERRUPTED;
        }
    }
}

/* ------------------------------------------------------------------------------ CUDA runtime */

typedef int (*launch_host_func_t)(void *stream, void (*fn)(void *), void *data);
typedef const char *(*get_error_string_t)(int error);

static launch_host_func_t cuda_launch_host_func;
static get_error_string_t cuda_get_error_string;
static char cuda_origin[PATH_MAX];
static int cuda_searched;

static const char *const CUDART_NAMES[] = {"libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"};

static int take_runtime(void *handle, const char *origin)
{
    void *launch = dlsym(handle, "cudaLaunchHostFunc");
    if (launch == NULL) {
        return 0;
    }
    cuda_launch_host_func = (launch_host_func_t)launch;
    cuda_get_error_string = (get_error_string_t)dlsym(handle, "cudaGetErrorString");
    Dl_info info;
    const char *where = dladdr(launch, &info) && info.dli_fname != NULL ? info.dli_fname : origin;
    snprintf(cuda_origin, sizeof cuda_origin, "%s", where);
    return 1;
}

/* dl_iterate_phdr callback: adopt a libcudart that the process (PyTorch, Paddle) already loaded. */
static int find_loaded_cudart(struct dl_phdr_info *info, size_t size, void *found)
{
    (void)size;
    const char *base = info->dlpi_name != NULL ? strrchr(info->dlpi_name, '/') : NULL;
    base = base != NULL ? base + 1 : info->dlpi_name;
    if (base == NULL || strncmp(base, "libcudart", 9) != 0 || strstr(base, ".so") == NULL) {
        return 0;
    }
    void *handle = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
    *(int *)found = handle != NULL && take_runtime(handle, info->dlpi_name);
    return *(int *)found;
}

/* Find cudaLaunchHostFunc, preferring the runtime this process already uses: $KVCACHE_CUDART, the
 * global symbol scope, any libcudart already loaded, then the usual library names. Once. */
static int load_cuda(void)
{
    if (cuda_searched) {
        return cuda_launch_host_func != NULL;
    }
    cuda_searched = 1;
    const char *env = getenv("KVCACHE_CUDART");
    if (env != NULL && *env != '\0') {
        void *handle = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (handle != NULL && take_runtime(handle, env)) {
            return 1;
        }
    }
    if (take_runtime(RTLD_DEFAULT, "the process")) {
        return 1;
    }
    int found = 0;
    dl_iterate_phdr(find_loaded_cudart, &found);
    if (found) {
        return 1;
    }
    for (size_t i = 0; i < sizeof CUDART_NAMES / sizeof CUDART_NAMES[0]; i++) {
        void *handle = dlopen(CUDART_NAMES[i], RTLD_NOW | RTLD_LOCAL);
        if (handle != NULL && take_runtime(handle, CUDART_NAMES[i])) {
            return 1;
        }
    }
    return 0;
}

static int require_cuda(const char *who)
{
    if (load_cuda()) {
        return 0;
    }
    PyErr_Format(PyExc_RuntimeError,
                 "%s: a CUDA stream was given but no CUDA runtime was found (looked for cudaLaunchHostFunc in "
                 "$KVCACHE_CUDART, the process, any loaded libcudart, libcudart.so, libcudart.so.12 and "
                 "libcudart.so.13); pass stream=None to signal at once",
                 who);
    return -1;
}

static PyObject *cuda_error(const char *who, int err)
{
    const char *text = cuda_get_error_string != NULL ? cuda_get_error_string(err) : "unknown error";
    return PyErr_Format(PyExc_RuntimeError, "%s: cudaLaunchHostFunc failed: %s (cudaError %d)", who, text, err);
}

/* A stream argument: a Python int holding a cudaStream_t (0 is the legacy default stream). */
static int parse_stream(PyObject *obj, void **stream, const char *who)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: stream must be an int cudaStream_t, got %.100s", who, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *stream = PyLong_AsVoidPtr(obj);
    return PyErr_Occurred() ? -1 : 0;
}

typedef struct {
    shared_t *shared;
    uint32_t layer;
    uint32_t step;
} job_t;

static void on_layer_done(void *data)
{
    job_t *job = (job_t *)data;
    mark_done(job->shared, job->layer, job->step);
    shared_release(job->shared);
    free(job);
}

/* ------------------------------------------------------------------------------ Record */

typedef struct {
    PyObject_HEAD
    shared_t *shared; /* NULL once closed */
    PyObject *name;
    int is_writer;
} RecordObject;

static PyTypeObject RecordType;

static shared_t *open_shared(RecordObject *self)
{
    if (self->shared == NULL) {
        PyErr_SetString(PyExc_ValueError, "the layer signal is closed");
    }
    return self->shared;
}

static int check_layer(shared_t *s, long layer)
{
    if (layer < 0 || (unsigned long)layer >= s->num_layers) {
        PyErr_Format(PyExc_ValueError, "layer %ld out of range: the signal has %u layers", layer, s->num_layers);
        return -1;
    }
    return 0;
}

static int shm_path(PyObject *name, char *path)
{
    Py_ssize_t len;
    const char *text = PyUnicode_AsUTF8AndSize(name, &len);
    if (text == NULL) {
        return -1;
    }
    if (len < 1 || len > MAX_NAME || strchr(text, '/') != NULL || (Py_ssize_t)strlen(text) != len) {
        PyErr_Format(PyExc_ValueError, "signal name must be 1 to %d characters without '/' or NUL, got %R", MAX_NAME,
                     name);
        return -1;
    }
    path[0] = '/';
    memcpy(path + 1, text, (size_t)len + 1);
    return 0;
}

static PyObject *wrap_shared(shared_t *s, PyObject *name, int is_writer)
{
    RecordObject *self = PyObject_New(RecordObject, &RecordType);
    if (self == NULL) {
        shared_release(s);
        return NULL;
    }
    self->shared = s;
    Py_INCREF(name);
    self->name = name;
    self->is_writer = is_writer;
    return (PyObject *)self;
}

static shared_t *new_shared(void *base, size_t size)
{
    shared_t *s = malloc(sizeof *s);
    if (s == NULL) {
        munmap(base, size);
        PyErr_NoMemory();
        return NULL;
    }
    atomic_init(&s->refs, 1);
    s->h = (header_t *)base;
    s->layers = (layer_t *)((char *)base + HEADER_BYTES);
    s->size = size;
    s->num_layers = (uint32_t)((size - HEADER_BYTES) / sizeof(layer_t));
    return s;
}

PyDoc_STRVAR(create_doc,
             "create(name, num_layers, start_step=0, mode=0o600) -> Record\n\n"
             "Create /dev/shm/<name> (it must not exist) as a fresh record; this process becomes its writer.\n"
             "On any failure nothing is left behind.");

static PyObject *record_create(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"name", "num_layers", "start_step", "mode", NULL};
    PyObject *name;
    long num_layers;
    unsigned long long start_step = 0;
    int mode = 0600;
    char path[MAX_NAME + 2];
    (void)type;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ul|Ki:create", keywords, &name, &num_layers, &start_step, &mode)
        || shm_path(name, path) < 0) {
        return NULL;
    }
    if (num_layers < 1 || num_layers > MAX_LAYERS) {
        return PyErr_Format(PyExc_ValueError, "num_layers must be 1 to %d, got %ld", MAX_LAYERS, num_layers);
    }
    size_t size = HEADER_BYTES + (size_t)num_layers * sizeof(layer_t);
    int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, (mode_t)mode);
    if (fd < 0) {
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    }
    void *base = MAP_FAILED;
    if (ftruncate(fd, (off_t)size) == 0) {
        base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    int err = errno;
    close(fd);
    if (base == MAP_FAILED) {
        shm_unlink(path);
        errno = err;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    }
    header_t *h = (header_t *)base; /* ftruncate zero-filled it: every layer reads "never" */
    h->version = VERSION;
    h->num_layers = (uint32_t)num_layers;
    h->total_bytes = size;
    h->created_ns = now_ns();
    atomic_store(&h->step, (uint32_t)start_step);
    atomic_store(&h->progress, (uint64_t)(uint32_t)start_step << 32);
    atomic_store(&h->step_begin_ns, h->created_ns);
    record_writer(h);
    atomic_store(&h->magic, MAGIC);
    shared_t *s = new_shared(base, size);
    if (s == NULL) {
        shm_unlink(path);
        return NULL;
    }
    return wrap_shared(s, name, 1);
}

PyDoc_STRVAR(open_doc, "open(name) -> Record\n\nMap the existing record /dev/shm/<name>, checking that it is one.");

static PyObject *record_open(PyTypeObject *type, PyObject *args)
{
    PyObject *name;
    char path[MAX_NAME + 2];
    struct stat st;
    (void)type;
    if (!PyArg_ParseTuple(args, "U:open", &name) || shm_path(name, path) < 0) {
        return NULL;
    }
    int fd = shm_open(path, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    }
    if (fstat(fd, &st) < 0) {
        int err = errno;
        close(fd);
        errno = err;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    }
    size_t size = (size_t)st.st_size;
    void *base = size >= HEADER_BYTES ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (size < HEADER_BYTES) {
        return PyErr_Format(PyExc_ValueError, "/dev/shm/%U is not a kvcache layer signal (%zu bytes)", name, size);
    }
    if (base == MAP_FAILED) {
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
    }
    header_t *h = (header_t *)base;
    if (atomic_load(&h->magic) != MAGIC || h->version != VERSION || h->total_bytes != size || h->num_layers < 1
        || size != HEADER_BYTES + (size_t)h->num_layers * sizeof(layer_t)) {
        int made = atomic_load(&h->magic) == MAGIC;
        unsigned version = h->version;
        munmap(base, size);
        return made ? PyErr_Format(PyExc_ValueError, "/dev/shm/%U: layer signal version %u, this build reads %u",
                                   name, version, VERSION)
                    : PyErr_Format(PyExc_ValueError,
                                   "/dev/shm/%U is not a kvcache layer signal (or is still being created)", name);
    }
    shared_t *s = new_shared(base, size);
    return s == NULL ? NULL : wrap_shared(s, name, 0);
}

static void record_drop(RecordObject *self)
{
    shared_t *s = self->shared;
    if (s == NULL) {
        return;
    }
    self->shared = NULL;
    if (self->is_writer && atomic_load(&s->h->writer_pid) == (int32_t)getpid()) {
        atomic_store(&s->h->writer_closed, 1);
        publish(s->h);
    }
    shared_release(s);
}

static void record_dealloc(RecordObject *self)
{
    record_drop(self);
    Py_XDECREF(self->name);
    PyObject_Free(self);
}

PyDoc_STRVAR(close_doc,
             "close()\n\nUnmap (once no queued callback needs it); the writer's close also tells waiters it is gone.");

static PyObject *record_close(RecordObject *self, PyObject *unused)
{
    (void)unused;
    record_drop(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(begin_step_doc, "begin_step() -> int\n\nAdvance the step counter (mod 2**32) and return the new step.");

static PyObject *record_begin_step(RecordObject *self, PyObject *unused)
{
    shared_t *s = open_shared(self);
    (void)unused;
    if (s == NULL) {
        return NULL;
    }
    uint32_t step = atomic_fetch_add(&s->h->step, 1) + 1u;
    atomic_store(&s->h->step_begin_ns, now_ns());
    uint64_t old = atomic_load(&s->h->progress);
    while (serial_gt(step, (uint32_t)(old >> 32))
           && !atomic_compare_exchange_weak(&s->h->progress, &old, (uint64_t)step << 32)) {
    }
    return PyLong_FromUnsignedLong(step);
}

PyDoc_STRVAR(mark_doc, "mark(layer)\n\nLayer `layer` of the current step is complete now: stamp it and wake waiters.");

static PyObject *record_mark(RecordObject *self, PyObject *arg)
{
    shared_t *s = open_shared(self);
    long layer = PyLong_AsLong(arg);
    if (s == NULL || (layer == -1 && PyErr_Occurred()) || check_layer(s, layer) < 0) {
        return NULL;
    }
    mark_done(s, (uint32_t)layer, atomic_load(&s->h->step));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(wait_doc,
             "wait(layer, step, timeout=-1.0, liveness=0.5) -> int\n\n"
             "Block (GIL released, no CPU) until layer `layer` of `step` is complete: 0 done, 1 timeout,\n"
             "2 writer dead, 3 stale (the layer has completed a later step). timeout < 0 waits forever;\n"
             "the writer's liveness is checked every `liveness` seconds without progress and at the deadline.");

static PyObject *record_wait(RecordObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"layer", "step", "timeout", "liveness", NULL};
    long layer;
    unsigned long long step;
    double timeout = -1.0, liveness = 0.5;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "lK|dd:wait", keywords, &layer, &step, &timeout, &liveness)) {
        return NULL;
    }
    shared_t *s = open_shared(self);
    if (s == NULL || check_layer(s, layer) < 0) {
        return NULL;
    }
    if (timeout != timeout) {
        return PyErr_Format(PyExc_ValueError, "timeout must be a number of seconds, got nan");
    }
    if (!(liveness > 0.0)) {
        return PyErr_Format(PyExc_ValueError, "liveness must be > 0 seconds, got %g", liveness);
    }
    int status = layer_status(s, (uint32_t)layer, (uint32_t)step);
    if (status != PENDING) {
        return PyLong_FromLong(status);
    }
    int64_t start = now_ns();
    int64_t deadline = timeout < 0.0 || timeout > 1e9 ? INT64_MAX : start + (int64_t)(timeout * 1e9);
    int64_t liveness_ns = liveness > 1e6 ? (int64_t)1e15 : (int64_t)(liveness * 1e9) + 1;
    int64_t next_check = start + liveness_ns;
    uint64_t my_pidns = own_pidns();
    atomic_fetch_add(&s->refs, 1); /* a close() from another thread must not unmap under us */
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        status = wait_until(s, (uint32_t)layer, (uint32_t)step, deadline, liveness_ns, &next_check, my_pidns);
        Py_END_ALLOW_THREADS
        if (status != INTERRUPTED) {
            break;
        }
        if (PyErr_CheckSignals() < 0) {
            shared_release(s);
            return NULL;
        }
    }
    shared_release(s);
    return PyLong_FromLong(status);
}

PyDoc_STRVAR(layer_doc, "layer(layer) -> (step, done_ns)\n\nThe layer's last completion: its step and time; (-1, 0) if never.");

static PyObject *record_layer(RecordObject *self, PyObject *arg)
{
    shared_t *s = open_shared(self);
    long layer = PyLong_AsLong(arg);
    if (s == NULL || (layer == -1 && PyErr_Occurred()) || check_layer(s, layer) < 0) {
        return NULL;
    }
    layer_t *l = &s->layers[layer];
    uint64_t state = atomic_load_explicit(&l->state, memory_order_acquire);
    int64_t ns = atomic_load_explicit(&l->done_ns, memory_order_relaxed);
    if (!(state & STATE_VALID)) {
        return Py_BuildValue("(iL)", -1, 0LL);
    }
    return Py_BuildValue("(kL)", (unsigned long)(uint32_t)state, (long long)ns);
}

PyDoc_STRVAR(layer_times_doc,
             "layer_times() -> (steps, done_ns)\n\n"
             "Every layer's last completion as two packed int64 arrays (step -1 and time 0: never).\n"
             "A layer completing during the read may show its new time with its previous step.");

static PyObject *record_layer_times(RecordObject *self, PyObject *unused)
{
    shared_t *s = open_shared(self);
    (void)unused;
    if (s == NULL) {
        return NULL;
    }
    Py_ssize_t n = s->num_layers;
    PyObject *steps = PyBytes_FromStringAndSize(NULL, n * 8), *times = PyBytes_FromStringAndSize(NULL, n * 8);
    if (steps == NULL || times == NULL) {
        Py_XDECREF(steps);
        Py_XDECREF(times);
        return NULL;
    }
    int64_t *st = (int64_t *)PyBytes_AS_STRING(steps), *ns = (int64_t *)PyBytes_AS_STRING(times);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t state;
        do {
            state = atomic_load_explicit(&s->layers[i].state, memory_order_acquire);
            ns[i] = atomic_load_explicit(&s->layers[i].done_ns, memory_order_acquire);
        } while (state != atomic_load_explicit(&s->layers[i].state, memory_order_acquire));
        st[i] = state & STATE_VALID ? (int64_t)(uint32_t)state : -1;
        ns[i] = state & STATE_VALID ? ns[i] : 0;
    }
    return Py_BuildValue("(NN)", steps, times);
}

PyDoc_STRVAR(progress_doc,
             "progress() -> (step, layers_done, step_begin_ns)\n\n"
             "The newest step seen and its highest completed layer + 1, and when the current step began.");

static PyObject *record_progress(RecordObject *self, PyObject *unused)
{
    shared_t *s = open_shared(self);
    (void)unused;
    if (s == NULL) {
        return NULL;
    }
    uint64_t p = atomic_load(&s->h->progress);
    return Py_BuildValue("(kkL)", (unsigned long)(uint32_t)(p >> 32), (unsigned long)(uint32_t)p,
                         (long long)atomic_load(&s->h->step_begin_ns));
}

PyDoc_STRVAR(claim_writer_doc, "claim_writer()\n\nRecord this process as the writer that waiters watch for liveness.");

static PyObject *record_claim_writer(RecordObject *self, PyObject *unused)
{
    shared_t *s = open_shared(self);
    (void)unused;
    if (s == NULL) {
        return NULL;
    }
    record_writer(s->h);
    self->is_writer = 1;
    Py_RETURN_NONE;
}

static PyObject *get_step(RecordObject *self, void *closure)
{
    shared_t *s = open_shared(self);
    (void)closure;
    return s == NULL ? NULL : PyLong_FromUnsignedLong(atomic_load(&s->h->step));
}

static PyObject *get_num_layers(RecordObject *self, void *closure)
{
    shared_t *s = open_shared(self);
    (void)closure;
    return s == NULL ? NULL : PyLong_FromUnsignedLong(s->num_layers);
}

static PyObject *get_writer_pid(RecordObject *self, void *closure)
{
    shared_t *s = open_shared(self);
    (void)closure;
    return s == NULL ? NULL : PyLong_FromLong(atomic_load(&s->h->writer_pid));
}

static PyObject *get_writer_alive(RecordObject *self, void *closure)
{
    shared_t *s = open_shared(self);
    (void)closure;
    return s == NULL ? NULL : PyBool_FromLong(writer_alive(s->h, own_pidns()));
}

static PyObject *get_closed(RecordObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->shared == NULL);
}

static PyObject *get_name(RecordObject *self, void *closure)
{
    (void)closure;
    Py_INCREF(self->name);
    return self->name;
}

static PyMethodDef record_methods[] = {
    {"create", (PyCFunction)(void (*)(void))record_create, METH_VARARGS | METH_KEYWORDS | METH_CLASS, create_doc},
    {"open", (PyCFunction)(void (*)(void))record_open, METH_VARARGS | METH_CLASS, open_doc},
    {"close", (PyCFunction)record_close, METH_NOARGS, close_doc},
    {"begin_step", (PyCFunction)record_begin_step, METH_NOARGS, begin_step_doc},
    {"mark", (PyCFunction)record_mark, METH_O, mark_doc},
    {"wait", (PyCFunction)(void (*)(void))record_wait, METH_VARARGS | METH_KEYWORDS, wait_doc},
    {"layer", (PyCFunction)record_layer, METH_O, layer_doc},
    {"layer_times", (PyCFunction)record_layer_times, METH_NOARGS, layer_times_doc},
    {"progress", (PyCFunction)record_progress, METH_NOARGS, progress_doc},
    {"claim_writer", (PyCFunction)record_claim_writer, METH_NOARGS, claim_writer_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef record_getset[] = {
    {"step", (getter)get_step, NULL, "the current step (uint32, wraps)", NULL},
    {"num_layers", (getter)get_num_layers, NULL, "layers in the record", NULL},
    {"writer_pid", (getter)get_writer_pid, NULL, "pid of the writer waiters watch (0: none)", NULL},
    {"writer_alive", (getter)get_writer_alive, NULL, "False once the writer closed, exited or crashed", NULL},
    {"closed", (getter)get_closed, NULL, "True after close()", NULL},
    {"name", (getter)get_name, NULL, "the name under /dev/shm", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcache.ops._send_cache.Record",
    .tp_basicsize = sizeof(RecordObject),
    .tp_dealloc = (destructor)record_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A layer-completion record in POSIX shared memory (make one with Record.create or Record.open).",
    .tp_methods = record_methods,
    .tp_getset = record_getset,
};

/* ------------------------------------------------------------------------------ module functions */

PyDoc_STRVAR(send_cache_doc,
             "send_cache(stream, record, layer)\n\n"
             "Mark layer `layer` of the current step complete once the work queued so far on `stream`\n"
             "(an int cudaStream_t) is done, through cudaLaunchHostFunc; stream None marks it now.");

static PyObject *send_cache(PyObject *module, PyObject *args)
{
    PyObject *stream_obj;
    RecordObject *record;
    long layer;
    void *stream;
    (void)module;
    if (!PyArg_ParseTuple(args, "OO!l:send_cache", &stream_obj, &RecordType, &record, &layer)) {
        return NULL;
    }
    shared_t *s = open_shared(record);
    if (s == NULL || check_layer(s, layer) < 0) {
        return NULL;
    }
    if (stream_obj == Py_None) {
        mark_done(s, (uint32_t)layer, atomic_load(&s->h->step));
        Py_RETURN_NONE;
    }
    if (parse_stream(stream_obj, &stream, "send_cache") < 0 || require_cuda("send_cache") < 0) {
        return NULL;
    }
    job_t *job = malloc(sizeof *job);
    if (job == NULL) {
        return PyErr_NoMemory();
    }
    job->shared = s;
    job->layer = (uint32_t)layer;
    job->step = atomic_load(&s->h->step);
    atomic_fetch_add(&s->refs, 1);
    /* The GIL stays held: the launch takes a few microseconds, as every framework's kernel launch does. */
    int err = cuda_launch_host_func(stream, on_layer_done, job);
    if (err != 0) {
        shared_release(s);
        free(job);
        return cuda_error("send_cache", err);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_runtime_doc,
             "cuda_runtime() -> str | None\n\n"
             "Path of the CUDA runtime send_cache uses (searched for on the first call), or None if there is none.");

static PyObject *cuda_runtime(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (!load_cuda()) {
        Py_RETURN_NONE;
    }
    return PyUnicode_DecodeFSDefault(cuda_origin);
}

PyDoc_STRVAR(unlink_doc, "unlink(name) -> bool\n\nRemove /dev/shm/<name>; False if it did not exist. Mappings stay valid.");

static PyObject *unlink_record(PyObject *module, PyObject *args)
{
    PyObject *name;
    char path[MAX_NAME + 2];
    (void)module;
    if (!PyArg_ParseTuple(args, "U:unlink", &name) || shm_path(name, path) < 0) {
        return NULL;
    }
    if (shm_unlink(path) == 0) {
        Py_RETURN_TRUE;
    }
    if (errno == ENOENT) {
        Py_RETURN_FALSE;
    }
    return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
}

/* The benchmark's floor: the bare host function, which only writes the time it ran. */
static void on_floor(void *slot) { atomic_store_explicit((_Atomic int64_t *)slot, now_ns(), memory_order_release); }

PyDoc_STRVAR(floor_launch_doc,
             "_floor_launch(stream, address)\n\n"
             "Benchmark floor: cudaLaunchHostFunc of a C function that writes CLOCK_MONOTONIC ns to the int64 at\n"
             "`address` (which must stay valid until it has run).");

static PyObject *floor_launch(PyObject *module, PyObject *args)
{
    PyObject *stream_obj;
    unsigned long long address;
    void *stream;
    (void)module;
    if (!PyArg_ParseTuple(args, "OK:_floor_launch", &stream_obj, &address)
        || parse_stream(stream_obj, &stream, "_floor_launch") < 0 || require_cuda("_floor_launch") < 0) {
        return NULL;
    }
    int err = cuda_launch_host_func(stream, on_floor, (void *)(uintptr_t)address);
    if (err != 0) {
        return cuda_error("_floor_launch", err);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(spin_doc,
             "_spin_until(address, value, timeout) -> int\n\n"
             "Benchmark probe: spin (GIL released) until the int32 at `address` equals `value`; the\n"
             "CLOCK_MONOTONIC ns when it was seen, or 0 after `timeout` seconds.");

static PyObject *spin_until(PyObject *module, PyObject *args)
{
    unsigned long long address;
    long value;
    double timeout;
    int64_t seen = 0;
    (void)module;
    if (!PyArg_ParseTuple(args, "Kld:_spin_until", &address, &value, &timeout)) {
        return NULL;
    }
    _Atomic int32_t *word = (_Atomic int32_t *)(uintptr_t)address;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ns() + (int64_t)(timeout * 1e9);
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) == (int32_t)value) {
            seen = now_ns();
            break;
        }
        if ((i & 1023) == 0 && now_ns() > deadline) {
            break;
        }
        cpu_relax();
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(seen);
}

static PyMethodDef methods[] = {
    {"send_cache", send_cache, METH_VARARGS, send_cache_doc},
    {"cuda_runtime", cuda_runtime, METH_NOARGS, cuda_runtime_doc},
    {"unlink", unlink_record, METH_VARARGS, unlink_doc},
    {"_floor_launch", floor_launch, METH_VARARGS, floor_launch_doc},
    {"_spin_until", spin_until, METH_VARARGS, spin_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_send_cache", "Layer-completion signal in shared memory and its CUDA-stream trigger.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__send_cache(void)
{
    if (PyType_Ready(&RecordType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&RecordType);
    if (PyModule_AddObject(m, "Record", (PyObject *)&RecordType) < 0) {
        Py_DECREF(&RecordType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
