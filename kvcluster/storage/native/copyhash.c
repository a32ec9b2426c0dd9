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

static PyMethodDef methods[] = {
    {"hash", py_hash, METH_O, "hash(src) -> the fletcher64x4 digest of src's bytes."},
    {"copy_hash", py_copy_hash, METH_VARARGS,
     "copy_hash(dst, src) -> digest: copies src into the start of dst and returns the digest of the bytes."},
    {"hash_segments", py_hash_segments, METH_O,
     "hash_segments(buffers) -> the digest of the buffers' bytes as if they were one buffer, in order."},
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
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "KERNEL", kernel.name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
