/* A stub libcuda (the driver API) for tests/cudarc_stub.rs: the few functions cudarc calls on
 * the paths that test takes, each counting its calls (count.h) and, for streams, events,
 * memory and copies, calling the stub runtime's own function (cudart.c), so that a cudarc
 * stream is a handoff stream, a cudarc event a handoff event, and a gate shut on one holds
 * the other as the GPU would. The stub runtime is the one HANDOFF_CUDART_PATH names.
 * Built with the soname libcuda.so, and loaded by the test before cudarc looks for that name,
 * so that cudarc's dlopen("libcuda.so") finds it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "count.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_FOUND = 500 };

STUB_COUNT_FN(cuda)

/* The stub runtime's function `name`, or NULL. */
static void *runtime(const char *name) {
    static void *lib;
    if (!lib) {
        const char *path = getenv("HANDOFF_CUDART_PATH");
        lib = path ? dlopen(path, RTLD_NOW) : NULL;
        if (!lib) return NULL;
    }
    return dlsym(lib, name);
}

/* Calls the stub runtime's `name` with the arguments that follow, as `type`. */
#define FORWARD(type, name, ...)                                                                 \
    do {                                                                                         \
        static __typeof__(type) f_;                                                              \
        if (!f_) f_ = (type)runtime(name);                                                       \
        return f_ ? f_(__VA_ARGS__) : CUDA_ERROR_NOT_FOUND;                                      \
    } while (0)

static __thread void *current_ctx;

CUresult cuInit(unsigned flags) { COUNT(); (void)flags; return CUDA_SUCCESS; }
CUresult cuDeviceGet(int *dev, int ordinal) { COUNT(); *dev = ordinal; return CUDA_SUCCESS; }
/* Every attribute is 1: memory pools (stream-ordered allocation) are supported. */
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) { COUNT(); (void)attr; (void)dev; *v = 1; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { COUNT(); *ctx = (void *)(uintptr_t)(0x1000 + dev); return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { COUNT(); (void)dev; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(void *ctx) { COUNT(); current_ctx = ctx; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(void **ctx) { COUNT(); *ctx = current_ctx; return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) { COUNT(); FORWARD(int (*)(void), "cudaDeviceSynchronize"); }
CUresult cuGetErrorName(CUresult e, const char **s) { COUNT(); (void)e; *s = "CUDA_ERROR_STUB"; return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult e, const char **s) { COUNT(); (void)e; *s = "an error of the stub driver"; return CUDA_SUCCESS; }

CUresult cuStreamCreate(void **s, unsigned flags) { COUNT(); FORWARD(int (*)(void **, unsigned), "cudaStreamCreateWithFlags", s, flags); }
CUresult cuStreamDestroy_v2(void *s) { COUNT(); FORWARD(int (*)(void *), "cudaStreamDestroy", s); }
CUresult cuStreamSynchronize(void *s) { COUNT(); FORWARD(int (*)(void *), "cudaStreamSynchronize", s); }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned flags) { COUNT(); FORWARD(int (*)(void *, void *, unsigned), "cudaStreamWaitEvent", s, e, flags); }
CUresult cuEventCreate(void **e, unsigned flags) { COUNT(); FORWARD(int (*)(void **, unsigned), "cudaEventCreateWithFlags", e, flags); }
CUresult cuEventDestroy_v2(void *e) { COUNT(); FORWARD(int (*)(void *), "cudaEventDestroy", e); }
CUresult cuEventRecord(void *e, void *s) { COUNT(); FORWARD(int (*)(void *, void *), "cudaEventRecord", e, s); }
CUresult cuEventQuery(void *e) { COUNT(); FORWARD(int (*)(void *), "cudaEventQuery", e); }
CUresult cuEventSynchronize(void *e) { COUNT(); FORWARD(int (*)(void *), "cudaEventSynchronize", e); }

CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s) {
    COUNT();
    static int (*f)(void **, size_t, void *);
    if (!f) f = (int (*)(void **, size_t, void *))runtime("cudaMallocAsync");
    if (!f) return CUDA_ERROR_NOT_FOUND;
    void *q = NULL;
    int rc = f(&q, n, s);
    *p = (CUdeviceptr)(uintptr_t)q;
    return rc;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void *s) { COUNT(); FORWARD(int (*)(void *, void *), "cudaFreeAsync", (void *)(uintptr_t)p, s); }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void *s) {
    COUNT();
    FORWARD(int (*)(void *, int, size_t, void *), "cudaMemsetAsync", (void *)(uintptr_t)p, v, n, s);
}
/* cudaMemcpyAsync's kinds: 1 host to device, 2 device to host, 3 device to device. */
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) {
    COUNT();
    FORWARD(int (*)(void *, const void *, size_t, int, void *), "cudaMemcpyAsync", (void *)(uintptr_t)d, h, n, 1, s);
}
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) {
    COUNT();
    FORWARD(int (*)(void *, const void *, size_t, int, void *), "cudaMemcpyAsync", h, (const void *)(uintptr_t)d, n, 2, s);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr src, size_t n, void *s) {
    COUNT();
    FORWARD(int (*)(void *, const void *, size_t, int, void *), "cudaMemcpyAsync", (void *)(uintptr_t)d, (const void *)(uintptr_t)src, n, 3, s);
}
/* Counted only: a test checks that none is queued. */
CUresult cuMemcpyPeerAsync(CUdeviceptr d, void *dc, CUdeviceptr s, void *sc, size_t n, void *st) {
    COUNT(); (void)d; (void)dc; (void)s; (void)sc; (void)n; (void)st;
    return CUDA_SUCCESS;
}
