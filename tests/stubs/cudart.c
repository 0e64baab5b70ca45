/* A stub libcudart.so.13 for tests/hotpath.rs: every function the crate binds, each returning
 * success at once and counting its calls (count.h). "Device memory" is host memory (malloc), so
 * copies and fills really happen; streams remember whether they are being captured, and by
 * which capture (a stream that waits for an event recorded in a capture joins it, as in CUDA's
 * cross-stream capture, until the capture ends), so that cudaStreamIsCapturing and graph
 * capture behave as CUDA's do for one thread. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <stdint.h>
#include "count.h"

typedef int err_t;
enum { OK = 0, ERR_INVALID_VALUE = 1, ERR_INVALID_DEVICE = 101, ERR_NOT_READY = 600,
       ERR_ILLEGAL_STATE = 401, ERR_CAPTURE_INVALIDATED = 901 };

/* A gate (cuStreamWaitValue32, GEQ): open once (int32_t)(*word - value) >= 0. */
struct gate { volatile _Atomic unsigned *word; unsigned value; };
enum { MAX_GATES = 512 };
/* `root`: the stream the capture began on (itself, for that one). `gates`: the waits queued on
 * it that were shut when last looked at (work after them has not "run"). */
struct stream { int capturing; struct stream *root; struct gate gates[MAX_GATES]; int ngates; };
/* `root`: the capture its last record was made in, if any. `gates`: its stream's shut gates at
 * the record: the event completes once they open. */
struct event { struct stream *root; struct gate gates[8]; int ngates; };
static int gate_open(const struct gate *g) { return (int)(atomic_load(g->word) - g->value) >= 0; }
/* Drops the open gates of a list; returns how many stay shut. */
static int shut_gates(struct gate *gs, int *n) {
    int k = 0;
    for (int i = 0; i < *n; i++)
        if (!gate_open(&gs[i])) gs[k++] = gs[i];
    *n = k;
    return k;
}
static void wait_gates(struct gate *gs, int *n) {
    while (shut_gates(gs, n)) {
        struct timespec t = {0, 10000};
        nanosleep(&t, NULL);
    }
}
enum { ERR_CAPTURE_ISOLATION = 905, MAX_STREAMS = 1024 };
static struct stream *streams[MAX_STREAMS];
static pthread_mutex_t streams_lock = PTHREAD_MUTEX_INITIALIZER;
typedef struct { unsigned x, y, z; } dim3;

static _Atomic int devices = 1;
static __thread int current;
static _Atomic int query_rc = OK;
static _Atomic int records_to_fail;
static _Atomic int syncs_blocked;

STUB_COUNT_FN(cudart)
void cudart_stub_set_devices(int n) { devices = n; }
/* What cudaEventQuery returns from now on (600: not ready). */
void cudart_stub_set_event_query(int rc) { atomic_store(&query_rc, rc); }
/* The next `n` cudaEventRecord calls fail (cudaErrorMemoryAllocation). */
void cudart_stub_fail_event_records(int n) { atomic_store(&records_to_fail, n); }
/* While `on`, cudaStreamSynchronize waits, as for work that does not end (the stub NCCL's
 * ncclCommAbort ends it: it clears this). */
void cudart_stub_block_syncs(int on) { atomic_store(&syncs_blocked, on); }

err_t cudaGetDeviceCount(int *n) { COUNT(); *n = devices; return OK; }
err_t cudaGetDevice(int *d) { COUNT(); *d = current; return OK; }
err_t cudaSetDevice(int d) {
    COUNT();
    if (d < 0 || d >= devices) return ERR_INVALID_DEVICE;
    current = d;
    return OK;
}
err_t cudaDeviceGetAttribute(int *v, int attr, int dev) { COUNT(); (void)attr; (void)dev; *v = 1; return OK; }
err_t cudaGetDeviceProperties(char *prop, int dev) { COUNT(); (void)dev; strcpy(prop, "stub GPU"); return OK; }
err_t cudaDeviceSynchronize(void) { COUNT(); return OK; }
err_t cudaDeviceGetDefaultMemPool(void **pool, int dev) { COUNT(); (void)dev; *pool = (void *)0x1000; return OK; }
err_t cudaMemPoolSetAttribute(void *pool, int attr, void *v) { COUNT(); (void)pool; (void)attr; (void)v; return OK; }
err_t cudaDriverGetVersion(int *v) { COUNT(); *v = 13000; return OK; }
err_t cudaRuntimeGetVersion(int *v) { COUNT(); *v = 13000; return OK; }
const char *cudaGetErrorName(err_t e) { COUNT(); (void)e; return "cudaErrorStub"; }
const char *cudaGetErrorString(err_t e) { COUNT(); (void)e; return "an error of the stub runtime"; }
err_t cudaGetLastError(void) { COUNT(); return OK; }

err_t cudaStreamCreateWithFlags(struct stream **s, unsigned flags) {
    COUNT(); (void)flags;
    *s = calloc(1, sizeof **s);
    if (!*s) return ERR_INVALID_VALUE;
    pthread_mutex_lock(&streams_lock);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i]) { streams[i] = *s; break; }
    pthread_mutex_unlock(&streams_lock);
    return OK;
}
err_t cudaStreamDestroy(struct stream *s) {
    COUNT();
    pthread_mutex_lock(&streams_lock);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] == s) streams[i] = NULL;
    pthread_mutex_unlock(&streams_lock);
    free(s);
    return OK;
}
err_t cudaStreamSynchronize(struct stream *s) {
    COUNT();
    if (s && s->capturing) return ERR_CAPTURE_INVALIDATED;
    while (atomic_load(&syncs_blocked)) {
        struct timespec t = {0, 1000000};
        nanosleep(&t, NULL);
    }
    if (s) wait_gates(s->gates, &s->ngates);
    return OK;
}
err_t cudaStreamQuery(struct stream *s) { COUNT(); return s && shut_gates(s->gates, &s->ngates) ? ERR_NOT_READY : OK; }
err_t cudaStreamWaitEvent(struct stream *s, struct event *e, unsigned flags) {
    COUNT(); (void)flags;
    struct stream *root = e && e->root && e->root->capturing ? e->root : NULL;
    if (s && s->capturing && root != s->root) return ERR_CAPTURE_ISOLATION;
    if (s && !s->capturing && root) { s->capturing = 1; s->root = root; }
    if (s && e && !s->capturing)
        for (int i = 0; i < e->ngates && s->ngates < MAX_GATES; i++)
            if (!gate_open(&e->gates[i])) s->gates[s->ngates++] = e->gates[i];
    return OK;
}
err_t cudaStreamBeginCapture(struct stream *s, int mode) {
    COUNT(); (void)mode;
    if (!s || s->capturing) return ERR_ILLEGAL_STATE;
    s->capturing = 1;
    s->root = s;
    return OK;
}
err_t cudaStreamEndCapture(struct stream *s, void **graph) {
    COUNT();
    if (!s || !s->capturing || s->root != s) return ERR_ILLEGAL_STATE;
    pthread_mutex_lock(&streams_lock);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] && streams[i]->root == s && streams[i] != s) { streams[i]->capturing = 0; streams[i]->root = NULL; }
    pthread_mutex_unlock(&streams_lock);
    s->capturing = 0;
    s->root = NULL;
    *graph = malloc(8);
    return OK;
}
err_t cudaStreamIsCapturing(struct stream *s, int *status) { COUNT(); *status = s ? s->capturing : 0; return OK; }

err_t cudaEventCreateWithFlags(struct event **e, unsigned flags) { COUNT(); (void)flags; *e = calloc(1, sizeof **e); return OK; }
err_t cudaEventDestroy(void *e) { COUNT(); free(e); return OK; }
err_t cudaEventRecord(struct event *e, struct stream *s) {
    COUNT();
    if (e) e->root = s && s->capturing ? s->root : NULL;
    if (e) {
        e->ngates = 0;
        if (s && !s->capturing)
            for (int i = 0; i < s->ngates && e->ngates < 8; i++)
                if (!gate_open(&s->gates[i])) e->gates[e->ngates++] = s->gates[i];
    }
    int n = atomic_load(&records_to_fail);
    while (n > 0 && !atomic_compare_exchange_weak(&records_to_fail, &n, n - 1)) {}
    return n > 0 ? 2 : OK;
}
/* Only inside a capture, as CUDA's external record (flag 1); the graph's launches then record
 * the event again with no call of their own. */
err_t cudaEventRecordWithFlags(struct event *e, struct stream *s, unsigned flags) {
    COUNT(); (void)e;
    if (flags == 1 && !(s && s->capturing)) return ERR_ILLEGAL_STATE;
    return OK;
}
err_t cudaEventQuery(struct event *e) {
    COUNT();
    if (e && shut_gates(e->gates, &e->ngates)) return ERR_NOT_READY;
    return atomic_load(&query_rc);
}
err_t cudaEventSynchronize(struct event *e) { COUNT(); if (e) wait_gates(e->gates, &e->ngates); return OK; }
err_t cudaEventElapsedTime(float *ms, void *a, void *b) { COUNT(); (void)a; (void)b; *ms = 0; return OK; }

err_t cudaMallocAsync(void **p, size_t n, struct stream *s) { COUNT(); (void)s; *p = malloc(n ? n : 1); return OK; }
err_t cudaFreeAsync(void *p, struct stream *s) { COUNT(); (void)s; free(p); return OK; }
err_t cudaMallocHost(void **p, size_t n) { COUNT(); *p = malloc(n ? n : 1); return OK; }
err_t cudaFreeHost(void *p) { COUNT(); free(p); return OK; }
err_t cudaHostAlloc(void **p, size_t n, unsigned flags) { COUNT(); (void)flags; *p = aligned_alloc(4096, n < 4096 ? 4096 : n); return OK; }
/* "Mapped" memory is where the host has it. */
err_t cudaHostGetDevicePointer(void **d, void *p, unsigned flags) { COUNT(); (void)flags; *d = p; return OK; }
/* The driver's cuStreamWaitValue32 (GEQ): later work on the stream waits for the word. */
static int stub_cuStreamWaitValue32(struct stream *s, unsigned long long addr, unsigned value, unsigned flags) {
    COUNT();
    if (flags != 0 || !s || s->ngates >= MAX_GATES) return 1;
    s->gates[s->ngates].word = (volatile _Atomic unsigned *)(uintptr_t)addr;
    s->gates[s->ngates].value = value;
    s->ngates++;
    shut_gates(s->gates, &s->ngates);
    return 0;
}
err_t cudaGetDriverEntryPointByVersion(const char *sym, void **f, unsigned v, unsigned long long flags, int *status) {
    COUNT(); (void)v; (void)flags;
    if (strcmp(sym, "cuStreamWaitValue32") == 0) { *f = (void *)stub_cuStreamWaitValue32; *status = 0; return OK; }
    *f = NULL; *status = 1;
    return OK;
}
err_t cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, struct stream *s) {
    COUNT(); (void)kind;
    if (!(s && s->capturing)) memmove(dst, src, n);
    return OK;
}
err_t cudaMemcpyPeerAsync(void *dst, int dd, const void *src, int sd, size_t n, struct stream *s) {
    COUNT(); (void)dd; (void)sd;
    if (!(s && s->capturing)) memmove(dst, src, n);
    return OK;
}
err_t cudaMemsetAsync(void *p, int v, size_t n, struct stream *s) {
    COUNT();
    if (!(s && s->capturing)) memset(p, v, n);
    return OK;
}

err_t cudaLibraryLoadData(void **lib, const void *code, void *a, void *b, unsigned c, void *d, void *e, unsigned f) {
    COUNT(); (void)code; (void)a; (void)b; (void)c; (void)d; (void)e; (void)f;
    *lib = malloc(8);
    return OK;
}
err_t cudaLibraryUnload(void *lib) { COUNT(); free(lib); return OK; }
err_t cudaLibraryGetKernel(void **k, void *lib, const char *name) { COUNT(); (void)lib; (void)name; *k = malloc(8); return OK; }
struct func_attrs { size_t shared, constant, local; int max_threads, regs, ptx, binary, cache_ca, max_dynamic_shared; };
err_t cudaFuncGetAttributes(struct func_attrs *a, const void *f) {
    COUNT(); (void)f;
    a->max_threads = 1024;
    a->max_dynamic_shared = 48 * 1024;
    return OK;
}
err_t cudaLaunchKernel(const void *f, dim3 grid, dim3 block, void **args, size_t shared, struct stream *s) {
    COUNT(); (void)f; (void)grid; (void)block; (void)args; (void)shared; (void)s;
    return OK;
}

err_t cudaGraphInstantiateWithFlags(void **exec, void *g, unsigned long long flags) { COUNT(); (void)g; (void)flags; *exec = malloc(8); return OK; }
err_t cudaGraphLaunch(void *exec, struct stream *s) { COUNT(); (void)exec; (void)s; return OK; }
err_t cudaGraphExecDestroy(void *exec) { COUNT(); free(exec); return OK; }
err_t cudaGraphDestroy(void *g) { COUNT(); free(g); return OK; }
