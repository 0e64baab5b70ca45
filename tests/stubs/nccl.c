/* A stub libnccl.so.2 for tests/hotpath.rs: every function the crate binds, each returning
 * ncclSuccess at once and counting its calls (count.h). Moves no data. */
#include <stdio.h>
#include <dlfcn.h>
#include <errno.h>
#include <time.h>
#include <stdlib.h>
#include "count.h"

typedef int res_t;
typedef struct { char internal[128]; } unique_id;
struct comm { int nranks, rank; };

static _Atomic int async_error;
static _Atomic int version = 22803;
static _Atomic int last_type = -1;

STUB_COUNT_FN(nccl)
/* What ncclCommGetAsyncError reports from now on, for every communicator. */
void nccl_stub_set_async_error(int rc) { atomic_store(&async_error, rc); }

/* What ncclGetVersion reports from now on (the crate reads it at load, then once for fp8). */
void nccl_stub_set_version(int v) { atomic_store(&version, v); }
/* The data type given to the last call that takes one (a send, a receive, a collective). */
int nccl_stub_last_type(void) { return atomic_load(&last_type); }

res_t ncclGetVersion(int *v) { COUNT(); *v = atomic_load(&version); return 0; }
res_t ncclGetUniqueId(unique_id *id) { COUNT(); memset(id, 0, sizeof *id); return 0; }
static res_t make(struct comm **c, int nranks, int rank) {
    *c = calloc(1, sizeof **c);
    (*c)->nranks = nranks;
    (*c)->rank = rank;
    return 0;
}
res_t ncclCommInitRankConfig(struct comm **c, int nranks, unique_id id, int rank, void *config) {
    COUNT(); (void)id; (void)config;
    return make(c, nranks, rank);
}
res_t ncclCommInitRank(struct comm **c, int nranks, unique_id id, int rank) { COUNT(); (void)id; return make(c, nranks, rank); }
res_t ncclCommInitAll(struct comm **c, int n, const int *devs) {
    COUNT(); (void)devs;
    for (int i = 0; i < n; i++) make(&c[i], n, i);
    return 0;
}
res_t ncclCommSplit(struct comm *c, int color, int key, struct comm **out, void *config) {
    COUNT(); (void)color; (void)config;
    return make(out, c->nranks, key < c->nranks ? key : 0);
}
res_t ncclCommFinalize(struct comm *c) { COUNT(); (void)c; return 0; }
res_t ncclCommDestroy(struct comm *c) { COUNT(); free(c); return 0; }
/* An abort ends the communicator's kernels: the stub runtime's blocked waits end. */
res_t ncclCommAbort(struct comm *c) {
    COUNT();
    free(c);
    const char *rt = getenv("HANDOFF_CUDART_PATH");
    void *h = rt ? dlopen(rt, RTLD_NOW | RTLD_NOLOAD) : NULL;
    void (*unblock)(int) = h ? (void (*)(int))dlsym(h, "cudart_stub_block_syncs") : NULL;
    if (unblock) unblock(0);
    if (h) dlclose(h);
    return 0;
}
res_t ncclCommGetAsyncError(struct comm *c, res_t *e) { COUNT(); (void)c; *e = atomic_load(&async_error); return 0; }
res_t ncclCommCount(struct comm *c, int *n) { COUNT(); *n = c->nranks; return 0; }
res_t ncclCommCuDevice(struct comm *c, int *d) { COUNT(); (void)c; *d = 0; return 0; }
res_t ncclCommUserRank(struct comm *c, int *r) { COUNT(); *r = c->rank; return 0; }
const char *ncclGetErrorString(res_t r) { COUNT(); (void)r; return "an error of the stub NCCL"; }
const char *ncclGetLastError(struct comm *c) { COUNT(); (void)c; return ""; }
res_t ncclGroupStart(void) { COUNT(); return 0; }
res_t ncclGroupEnd(void) { COUNT(); return 0; }
res_t ncclSend(const void *b, size_t n, int t, int peer, struct comm *c, void *s) { COUNT(); (void)b; (void)n; last_type = t; (void)peer; (void)c; (void)s; return 0; }
res_t ncclRecv(void *b, size_t n, int t, int peer, struct comm *c, void *s) { COUNT(); (void)b; (void)n; last_type = t; (void)peer; (void)c; (void)s; return 0; }
typedef const void *in_t;
typedef void *out_t;
res_t ncclAllReduce(in_t a, out_t b, size_t n, int t, int op, struct comm *c, void *s) { COUNT(); (void)a; (void)b; (void)n; last_type = t; (void)op; (void)c; (void)s; return 0; }
res_t ncclBroadcast(in_t a, out_t b, size_t n, int t, int root, struct comm *c, void *s) { COUNT(); (void)a; (void)b; (void)n; last_type = t; (void)root; (void)c; (void)s; return 0; }
res_t ncclReduce(in_t a, out_t b, size_t n, int t, int op, int root, struct comm *c, void *s) { COUNT(); (void)a; (void)b; (void)n; last_type = t; (void)op; (void)root; (void)c; (void)s; return 0; }
/* Opt-in (nccl_stub_set_gather(1)): ncclAllGather between communicators of several ranks made
 * in one process (one thread per rank, as tests/tracing_stub.rs runs them) really gathers, so
 * that their creation can settle verification. The call returns once every rank has made it.
 * Off (the default), it moves nothing. */
static _Atomic int gather_on;
void nccl_stub_set_gather(int on) { atomic_store(&gather_on, on); }
static pthread_mutex_t gather_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gather_cond = PTHREAD_COND_INITIALIZER;
static void *gather_data[8];
static int gather_arrived, gather_left, gather_busy, gather_round;
static size_t type_size(int t) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return t >= 0 && t < 12 ? sizes[t] : 1;
}
/* Waits on gather_cond until `deadline`; past it the other ranks are not coming (one failed
 * before its all-gather): the test process ends, loudly, rather than hang. */
static void gather_wait(const struct timespec *deadline) {
    if (pthread_cond_timedwait(&gather_cond, &gather_lock, deadline) == ETIMEDOUT) {
        fprintf(stderr, "stub NCCL: ncclAllGather waited 30 s for the other ranks; ending the test\n");
        abort();
    }
}
static void gather(in_t a, out_t b, size_t n, int t, struct comm *c) {
    size_t bytes = n * type_size(t);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 30;
    pthread_mutex_lock(&gather_lock);
    while (gather_busy) gather_wait(&deadline); /* the last round's readers */
    gather_data[c->rank] = malloc(bytes ? bytes : 1);
    memcpy(gather_data[c->rank], a, bytes);
    if (++gather_arrived == c->nranks) {
        gather_busy = 1;
        gather_round++;
        pthread_cond_broadcast(&gather_cond);
    } else {
        int round = gather_round;
        while (gather_round == round) gather_wait(&deadline);
    }
    for (int r = 0; r < c->nranks; r++) memcpy((char *)b + r * bytes, gather_data[r], bytes);
    if (++gather_left == c->nranks) {
        for (int r = 0; r < c->nranks; r++) free(gather_data[r]);
        gather_arrived = gather_left = gather_busy = 0;
        pthread_cond_broadcast(&gather_cond);
    }
    pthread_mutex_unlock(&gather_lock);
}
res_t ncclAllGather(in_t a, out_t b, size_t n, int t, struct comm *c, void *s) {
    COUNT(); last_type = t; (void)s;
    if (atomic_load(&gather_on) && c->nranks > 1 && c->nranks <= 8) gather(a, b, n, t, c);
    return 0;
}
res_t ncclReduceScatter(in_t a, out_t b, size_t n, int t, int op, struct comm *c, void *s) { COUNT(); (void)a; (void)b; (void)n; last_type = t; (void)op; (void)c; (void)s; return 0; }
res_t ncclAlltoAll(in_t a, out_t b, size_t n, int t, struct comm *c, void *s) { COUNT(); (void)a; (void)b; (void)n; last_type = t; (void)c; (void)s; return 0; }
res_t ncclGather(in_t a, out_t b, size_t n, int t, int root, struct comm *c, void *s) { COUNT(); (void)a; (void)b; (void)n; last_type = t; (void)root; (void)c; (void)s; return 0; }
res_t ncclScatter(in_t a, out_t b, size_t n, int t, int root, struct comm *c, void *s) { COUNT(); (void)a; (void)b; (void)n; last_type = t; (void)root; (void)c; (void)s; return 0; }
res_t ncclRedOpCreatePreMulSum(int *op, void *scalar, int t, int residence, struct comm *c) {
    COUNT(); (void)scalar; last_type = t; (void)residence; (void)c;
    *op = 5;
    return 0;
}
res_t ncclRedOpDestroy(int op, struct comm *c) { COUNT(); (void)op; (void)c; return 0; }
