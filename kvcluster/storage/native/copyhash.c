/* kvcluster.storage._copyhash: copy, read and write with the tiers' checksum computed on the way.
 *
 * Every function takes buffer-protocol objects (numpy arrays, memoryviews, mmaps),
 * releases the GIL while it works, and returns fletcher64x4 digests (see kernel.h)
 * equal to kvcluster.storage.copyhash._hash_py. The AVX2 kernel runs when the CPU has AVX2
 * and KVCLUSTER_NATIVE_KERNEL is not "base" (which forces the portable one).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

uint64_t kvc_hash_base(const void *, size_t);
uint64_t kvc_copy_hash_base(void *, const void *, size_t);
ptrdiff_t kvc_pread_hash_base(int, void *, size_t, int64_t, uint64_t *);
ptrdiff_t kvc_pwrite_hash_base(int, const void *, size_t, int64_t, uint64_t *);
uint64_t kvc_hash_segments_base(const void *const *, const size_t *, size_t);
#if defined(__x86_64__) && defined(__GNUC__)
uint64_t kvc_hash_avx2(const void *, size_t);
uint64_t kvc_copy_hash_avx2(void *, const void *, size_t);
ptrdiff_t kvc_pread_hash_avx2(int, void *, size_t, int64_t, uint64_t *);
ptrdiff_t kvc_pwrite_hash_avx2(int, const void *, size_t, int64_t, uint64_t *);
uint64_t kvc_hash_segments_avx2(const void *const *, const size_t *, size_t);
#endif

typedef struct {
    const char *name;
    uint64_t (*hash)(const void *, size_t);
    uint64_t (*copy_hash)(void *, const void *, size_t);
    ptrdiff_t (*pread_hash)(int, void *, size_t, int64_t, uint64_t *);
    ptrdiff_t (*pwrite_hash)(int, const void *, size_t, int64_t, uint64_t *);
    uint64_t (*hash_segments)(const void *const *, const size_t *, size_t);
} Kernel;

static Kernel kernel = {"base", kvc_hash_base, kvc_copy_hash_base, kvc_pread_hash_base, kvc_pwrite_hash_base,
                        kvc_hash_segments_base};

static PyObject *py_hash(PyObject *self, PyObject *arg) {
    Py_buffer src;
    if (PyObject_GetBuffer(arg, &src, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = kernel.hash(src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyObject *py_copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy_hash", &dst, &src)) return NULL;
    if (dst.len < src.len) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError, "copy_hash: destination holds %zd bytes, source has %zd",
                            dst.len, src.len);
    }
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = kernel.copy_hash(dst.buf, src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyObject *io_result(ptrdiff_t n, uint64_t digest) {
    if (n < 0) {
        errno = (int)-n;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("nK", (Py_ssize_t)n, (unsigned long long)digest);
}

static PyObject *py_pread_hash(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer dst;
    long long offset;
    if (!PyArg_ParseTuple(args, "iw*L:pread_hash", &fd, &dst, &offset)) return NULL;
    uint64_t digest = 0;
    ptrdiff_t n;
    Py_BEGIN_ALLOW_THREADS
    n = kernel.pread_hash(fd, dst.buf, (size_t)dst.len, (int64_t)offset, &digest);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    return io_result(n, digest);
}

static PyObject *py_pwrite_hash(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer src;
    long long offset;
    if (!PyArg_ParseTuple(args, "iy*L:pwrite_hash", &fd, &src, &offset)) return NULL;
    uint64_t digest = 0;
    ptrdiff_t n;
    Py_BEGIN_ALLOW_THREADS
    n = kernel.pwrite_hash(fd, src.buf, (size_t)src.len, (int64_t)offset, &digest);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return io_result(n, digest);
}

static PyObject *py_hash_segments(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "hash_segments: expects a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    const void **srcs = PyMem_Calloc(count ? (size_t)count : 1, sizeof(void *));
    size_t *lens = PyMem_Calloc(count ? (size_t)count : 1, sizeof(size_t));
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    if (views == NULL || srcs == NULL || lens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < count; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_SIMPLE) < 0) goto done;
        srcs[got] = views[got].buf;
        lens[got] = (size_t)views[got].len;
    }
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = kernel.hash_segments(srcs, lens, (size_t)count);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(digest);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(srcs);
    PyMem_Free(lens);
    Py_DECREF(seq);
    return result;
}


/* Background sums: the digests of a list of buffers, computed by one native thread per process that never
 * takes the GIL. Why not a Python pool thread: handing work to one costs the caller a wake-up and then a GIL
 * hand-off each time either thread re-enters Python; why not a thread per job: creating one cost about as
 * much (tens of microseconds each, against a transfer of a few hundred the sums should hide behind). Jobs
 * run in the order queued; a job holds its buffers until `wait` (or until it is freed, after it ran). */
typedef struct SumJob {
    PyObject_HEAD
    Py_buffer *views;
    Py_ssize_t count, held;
    uint64_t *digests;
    int queued;        /* handed to the summing thread and not yet finished */
    unsigned long generation;  /* sums_generation when queued */
    struct SumJob *next;
    PyObject *result;  /* the digests as a list, once waited for */
} SumJob;

static pthread_mutex_t sums_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sums_queued = PTHREAD_COND_INITIALIZER;   /* the summing thread has work */
static pthread_cond_t sums_finished = PTHREAD_COND_INITIALIZER; /* a job finished */
static SumJob *sums_head = NULL, *sums_tail = NULL;
static int sums_thread_up = 0;
static unsigned long sums_generation = 0;  /* one more in each forked child: its parent's queue is gone */

static void sum_job_run(SumJob *job) {
    for (Py_ssize_t i = 0; i < job->count; i++)
        job->digests[i] = kernel.hash(job->views[i].buf, (size_t)job->views[i].len);
}

static void *sums_thread_main(void *unused) {
    pthread_mutex_lock(&sums_lock);
    for (;;) {
        while (sums_head == NULL) pthread_cond_wait(&sums_queued, &sums_lock);
        SumJob *job = sums_head;
        sums_head = job->next;
        if (sums_head == NULL) sums_tail = NULL;
        pthread_mutex_unlock(&sums_lock);
        sum_job_run(job);
        pthread_mutex_lock(&sums_lock);
        job->queued = 0;
        pthread_cond_broadcast(&sums_finished);
    }
    return NULL;
}

/* A forked child has no summing thread (only the forking thread survives a fork): it starts its own, and a
 * job queued in the parent before the fork is summed by whoever waits for it. */
static void sums_after_fork_in_child(void) {
    pthread_mutex_init(&sums_lock, NULL);
    pthread_cond_init(&sums_queued, NULL);
    pthread_cond_init(&sums_finished, NULL);
    sums_head = sums_tail = NULL;
    sums_thread_up = 0;
    sums_generation++;
}

/* Queues the job for the summing thread (started on first use); 0 when there is no thread to be had. Holds
 * the lock while it starts the thread, so two callers never start two. */
static int sums_queue(SumJob *job) {
    pthread_mutex_lock(&sums_lock);
    if (!sums_thread_up) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sums_thread_up = pthread_create(&thread, &attr, sums_thread_main, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!sums_thread_up) {
            pthread_mutex_unlock(&sums_lock);
            return 0;
        }
    }
    job->queued = 1;
    job->generation = sums_generation;
    job->next = NULL;
    if (sums_tail != NULL) sums_tail->next = job;
    else sums_head = job;
    sums_tail = job;
    pthread_cond_signal(&sums_queued);
    pthread_mutex_unlock(&sums_lock);
    return 1;
}

static void sum_job_finish(SumJob *job) {  /* with the GIL, which it lets go while it waits */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&sums_lock);
    if (job->queued && job->generation != sums_generation) {  /* queued before a fork, in the parent's thread */
        job->queued = 0;
        pthread_mutex_unlock(&sums_lock);
        sum_job_run(job);
    } else {
        while (job->queued) pthread_cond_wait(&sums_finished, &sums_lock);
        pthread_mutex_unlock(&sums_lock);
    }
    Py_END_ALLOW_THREADS
}

static void sum_job_release(SumJob *job) {
    for (Py_ssize_t i = 0; i < job->held; i++) PyBuffer_Release(&job->views[i]);
    job->held = 0;
    PyMem_Free(job->views);
    PyMem_Free(job->digests);
    job->views = NULL;
    job->digests = NULL;
}

static void sum_job_dealloc(SumJob *job) {
    sum_job_finish(job);  /* the thread reads the buffers and writes the digests: it is done before they go */
    sum_job_release(job);
    Py_XDECREF(job->result);
    Py_TYPE(job)->tp_free((PyObject *)job);
}

static PyObject *sum_job_wait(SumJob *job, PyObject *unused) {
    if (job->result == NULL) {
        sum_job_finish(job);
        PyObject *list = PyList_New(job->count);
        if (list == NULL) return NULL;
        for (Py_ssize_t i = 0; i < job->count; i++) {
            PyObject *d = PyLong_FromUnsignedLongLong(job->digests[i]);
            if (d == NULL) {
                Py_DECREF(list);
                return NULL;
            }
            PyList_SET_ITEM(list, i, d);
        }
        job->result = list;
        sum_job_release(job);
    }
    Py_INCREF(job->result);
    return job->result;
}

static PyMethodDef sum_job_methods[] = {
    {"wait", (PyCFunction)sum_job_wait, METH_NOARGS, "wait() -> the digests, in the buffers' order (once done)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SumJobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcluster.storage._copyhash.SumJob",
    .tp_basicsize = sizeof(SumJob),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Digests of buffers being summed on the native summing thread; wait() returns them.",
    .tp_dealloc = (destructor)sum_job_dealloc,
    .tp_methods = sum_job_methods,
};

static PyObject *py_hash_in_background(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "hash_in_background: expects a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    SumJob *job = PyObject_New(SumJob, &SumJobType);
    if (job == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    job->count = count;
    job->held = 0;
    job->queued = 0;
    job->next = NULL;
    job->result = NULL;
    job->views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    job->digests = PyMem_Calloc(count ? (size_t)count : 1, sizeof(uint64_t));
    if (job->views == NULL || job->digests == NULL) {
        Py_DECREF(seq);
        Py_DECREF(job);
        return PyErr_NoMemory();
    }
    for (; job->held < count; job->held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, job->held), &job->views[job->held], PyBUF_SIMPLE) < 0) {
            Py_DECREF(seq);
            Py_DECREF(job);
            return NULL;
        }
    }
    Py_DECREF(seq);
    if (count > 0 && !sums_queue(job)) {  /* no thread to be had: summed here, and wait() returns at once */
        Py_BEGIN_ALLOW_THREADS
        sum_job_run(job);
        Py_END_ALLOW_THREADS
    }
    return (PyObject *)job;
}

static PyMethodDef methods[] = {
    {"hash", py_hash, METH_O, "hash(src) -> the fletcher64x4 digest of src's bytes."},
    {"copy_hash", py_copy_hash, METH_VARARGS,
     "copy_hash(dst, src) -> digest: copies src into the start of dst and returns the digest of the bytes."},
    {"hash_segments", py_hash_segments, METH_O,
     "hash_segments(buffers) -> the digest of the buffers' bytes as if they were one buffer, in order."},
    {"hash_in_background", py_hash_in_background, METH_O,
     "hash_in_background(buffers) -> SumJob: their digests computed on a native thread; job.wait() returns them."},
    {"pread_hash", py_pread_hash, METH_VARARGS,
     "pread_hash(fd, dst, offset) -> (bytes_read, digest of those bytes); OSError on a read error."},
    {"pwrite_hash", py_pwrite_hash, METH_VARARGS,
     "pwrite_hash(fd, src, offset) -> (bytes written, digest of src); OSError on a write error."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copyhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copyhash(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    const char *forced = getenv("KVCLUSTER_NATIVE_KERNEL");
    if (__builtin_cpu_supports("avx2") && !(forced != NULL && strcmp(forced, "base") == 0))
        kernel = (Kernel){"avx2", kvc_hash_avx2, kvc_copy_hash_avx2, kvc_pread_hash_avx2, kvc_pwrite_hash_avx2,
                          kvc_hash_segments_avx2};
#endif
    if (PyType_Ready(&SumJobType) < 0) return NULL;
    pthread_atfork(NULL, NULL, sums_after_fork_in_child);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "KERNEL", kernel.name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
