/* The stub libnccl.so.2 of tests/stubs/nccl.c plus NCCL's functions of registered memory and
 * windows, for tests/registered_stub.rs: one translation unit, so that every call is counted in
 * the same table. "Device memory" is host memory (malloc), as in the stub runtime; a
 * registration or window handle is a malloc'd token, freed when deregistered. */
#include "nccl.c"

/* Page-aligned, as ncclMemAlloc's VMM memory is (windows need 4096 bytes). */
res_t ncclMemAlloc(void **p, size_t n) { COUNT(); *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096); return 0; }
res_t ncclMemFree(void *p) { COUNT(); free(p); return 0; }
res_t ncclCommRegister(struct comm *c, void *b, size_t n, void **handle) {
    COUNT(); (void)c; (void)b; (void)n;
    *handle = malloc(1);
    return 0;
}
res_t ncclCommDeregister(struct comm *c, void *handle) { COUNT(); (void)c; free(handle); return 0; }
res_t ncclCommWindowRegister(struct comm *c, void *b, size_t n, void **win, int flags) {
    COUNT(); (void)c; (void)b; (void)n; (void)flags;
    *win = malloc(1);
    return 0;
}
res_t ncclCommWindowDeregister(struct comm *c, void *win) { COUNT(); (void)c; free(win); return 0; }
