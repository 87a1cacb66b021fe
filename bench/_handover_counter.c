/* Counts, per thread, how often the interpreter is let go of through PyEval_SaveThread: what torch,
 * numpy and C extensions call around their work, and what a training thread beside them pays a
 * hand-over for. Loaded with LD_PRELOAD by bench/handovers.py (which compiles it), it stands in
 * for CPython's function and calls the real one; handover_count(tid) reads a thread's count.
 * Linux only (gettid). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SLOTS 1024

static long long counts[SLOTS];
static int tids[SLOTS];
static __thread int slot = -1;

typedef void *(*save_fn)(void);

void *PyEval_SaveThread(void) {
    static save_fn real = 0;
    if (!real) real = (save_fn)dlsym(RTLD_NEXT, "PyEval_SaveThread");
    if (slot < 0) {
        int tid = (int)syscall(SYS_gettid);
        for (int i = 0; i < SLOTS; i++) {
            int free_slot = 0;
            if (__atomic_compare_exchange_n(&tids[i], &free_slot, tid, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                slot = i;
                break;
            }
        }
    }
    if (slot >= 0) counts[slot]++;
    return real();
}

long long handover_count(int tid) {
    for (int i = 0; i < SLOTS; i++)
        if (tids[i] == tid) return counts[i];
    return 0;
}
