/* ---- opt-in timers: where a step's time goes inside the library (kiln bench --profile) ----
 *
 * Each entry point the engine calls per layer (kiln_gemm, kiln_paged_attention, the pointwise kernels, the
 * stack's bias add) opens with KILN_TIMED(component) (kiln_cpu.h): when timing is off that is one load of
 * kiln_profile_on and a branch on entry and on return, nothing else. When on, each call adds its wall time
 * (CLOCK_MONOTONIC, a vDSO read: ~20 ns) and one call to its component's totals. The entry points are called
 * from the engine's thread (their parallel regions are inside them), so the totals are a step's own; they
 * are added atomically all the same, as a background tactic timing may run a GEMM on another thread.
 * Python reads the names, the totals and resets them (kernels/kernel_timers.py). */
#include <time.h>

#include "kiln_cpu.h"

static const char *const component_names[KILN_T_COUNT] = {"gemm", "attention", "kv_write", "norm", "rope",
                                                          "activation", "bias"};
int kiln_profile_on;
static int64_t totals_ns[KILN_T_COUNT], totals_calls[KILN_T_COUNT];

int64_t kiln_profile_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Add ns and one call to a component: the entry points' timers, and Python's for a GEMM it runs itself. */
void kiln_profile_add(int component, int64_t ns) {
    if (component < 0 || component >= KILN_T_COUNT) return;
    __atomic_fetch_add(&totals_ns[component], ns, __ATOMIC_RELAXED);
    __atomic_fetch_add(&totals_calls[component], 1, __ATOMIC_RELAXED);
}

int kiln_profile_count(void) { return KILN_T_COUNT; }
const char *kiln_profile_name(int component) {
    return component >= 0 && component < KILN_T_COUNT ? component_names[component] : 0;
}

/* Timing on (1) or off (0); the totals are kept. */
void kiln_profile_enable(int on) { __atomic_store_n(&kiln_profile_on, on != 0, __ATOMIC_RELAXED); }

/* Copy the totals (KILN_T_COUNT each) into ns and calls, then zero them. */
void kiln_profile_take(int64_t *ns, int64_t *calls) {
    for (int c = 0; c < KILN_T_COUNT; c++) {
        ns[c] = __atomic_exchange_n(&totals_ns[c], 0, __ATOMIC_RELAXED);
        calls[c] = __atomic_exchange_n(&totals_calls[c], 0, __ATOMIC_RELAXED);
    }
}
