/* Call counting shared by the stub libraries of tests/hotpath.rs: every stub function counts
 * itself, per calling thread and in all, by name. Not CUDA or NCCL: each call returns at once. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#define STUB_MAX 96
static const char *_Atomic stub_names[STUB_MAX];
static pthread_mutex_t stub_names_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic long stub_all[STUB_MAX];
static __thread long stub_mine[STUB_MAX];

/* Index of a name, registered at its function's first call. */
static int stub_index(const char *name) {
    pthread_mutex_lock(&stub_names_lock);
    int i = 0;
    for (; i < STUB_MAX - 1 && stub_names[i]; i++)
        if (strcmp(stub_names[i], name) == 0) break;
    if (!stub_names[i]) stub_names[i] = name;
    pthread_mutex_unlock(&stub_names_lock);
    return i;
}

#define COUNT()                                                                                  \
    do {                                                                                         \
        static _Atomic int idx_ = -1;                                                            \
        if (idx_ < 0) idx_ = stub_index(__func__);                                               \
        stub_mine[idx_]++;                                                                       \
        atomic_fetch_add(&stub_all[idx_], 1);                                                    \
    } while (0)

/* The calling thread's count of `name`, or every thread's (`all`). */
#define STUB_COUNT_FN(prefix)                                                                    \
    long prefix##_stub_count(const char *name, int all) {                                        \
        for (int i = 0; i < STUB_MAX && stub_names[i]; i++)                                      \
            if (strcmp(stub_names[i], name) == 0) return all ? atomic_load(&stub_all[i]) : stub_mine[i]; \
        return 0;                                                                                \
    }                                                                                            \
    /* Writes "name=count " for every function this thread called, into buf. */               \
    void prefix##_stub_dump(char *buf, unsigned long len) {                                      \
        unsigned long at = 0;                                                                    \
        if (len) buf[0] = 0;                                                                     \
        for (int i = 0; i < STUB_MAX && stub_names[i]; i++) {                                    \
            if (!stub_mine[i]) continue;                                                         \
            int n = snprintf(buf + at, len - at, "%s=%ld ", stub_names[i], stub_mine[i]);        \
            if (n < 0 || (unsigned long)n >= len - at) break;                                    \
            at += (unsigned long)n;                                                              \
        }                                                                                        \
    }
