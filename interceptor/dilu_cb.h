/* Control block of one instance: layout (from dilu_cb_layout.h), constants and the small helpers
 * that do atomic access, the seqlocks and futex wait/wake.
 *
 * Used by the interceptor (C), and compiled into the cffi API-mode module of the Python binding
 * (dilu.interceptor.control_block), whose cdef declares the same helpers. Everything here is
 * static inline so both get their own copy; nothing is exported.
 *
 * Atomics use the GCC/Clang __atomic builtins on plain fields (the layout has no _Atomic, so cffi
 * can parse it). Seqlocks: the single writer makes the sequence odd, writes, makes it even;
 * readers retry while it is odd or changed. A writer killed mid-write leaves the sequence odd for
 * good: readers wait it out for at most DILU_SEQ_GIVE_UP_NS, then report the read as torn (the
 * caller falls back to a safe value) and, while the sequence still holds that same odd value,
 * give up at once; the next writer (the same one restarted, or a new one) finds it odd and
 * repairs it (odd -> odd + 2 while writing -> even). The grant epoch is a 32-bit futex word in shared
 * memory (FUTEX_WAIT without FUTEX_PRIVATE_FLAG, since waiter and waker are different processes).
 */
#ifndef DILU_CB_H
#define DILU_CB_H

#include <stdint.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <sched.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#include "dilu_cb_layout.h"

#define DILU_CB_MAGIC 0x31424355494c4944ULL /* "DILUCB1\0" little endian */
#define DILU_CB_LAYOUT_VERSION 1u
#define DILU_PPM 1000000ull
#define DILU_CB_FLAG_STALE 1ull
#define DILU_CB_FLAG_TORN_GRANT 2ull /* the grant writer died mid-write: running at the request quota */

/* How long (ns) a reader waits out a seqlock writer before taking it for dead. A live writer holds
 * the sequence odd for a few dozen stores; only one preempted for this long, or killed, holds it
 * longer (a preempted one costs a reader one fail-safe answer, never a hang). */
#define DILU_SEQ_GIVE_UP_NS 5000000ull

#if defined(__x86_64__) || defined(__i386__)
#define DILU_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define DILU_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define DILU_CPU_RELAX() do { } while (0)
#endif

static inline uint64_t dilu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- atomics on plain fields ---- */
static inline uint64_t dilu_load_u64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void dilu_store_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t dilu_load_u32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void dilu_store_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint64_t dilu_fetch_add_u64(uint64_t *p, uint64_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
static inline uint32_t dilu_fetch_add_u32(uint32_t *p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }

/* ---- seqlock (single writer; a dead writer's odd sequence is repaired by the next) ---- */
static inline void dilu_seq_write_begin(uint64_t *seq)
{
    uint64_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    /* odd: the previous writer died mid-write; stay odd (writing) but move on, so a reader that
     * gave up on the dead value waits for this write, and write_end makes it even */
    __atomic_store_n(seq, (s & 1u) ? s + 2 : s + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void dilu_seq_write_end(uint64_t *seq)
{
    uint64_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    __atomic_store_n(seq, s + 1, __ATOMIC_RELEASE);
}

/* Starts a read: returns 0 with *start = the (even) sequence to pass to dilu_seq_read_retry.
 * Waits out a writer in progress for at most DILU_SEQ_GIVE_UP_NS (spinning, then yielding the
 * CPU so a preempted writer can finish); returns 1 with *start = the odd sequence when it held
 * that long, or at once when it holds `dead` (odd: the value a previous read gave up on; pass 0
 * for none). Never blocks longer than the bound. */
static inline int dilu_seq_read_begin_bounded(const uint64_t *seq, uint64_t dead, uint64_t *start)
{
    uint64_t s = __atomic_load_n(seq, __ATOMIC_ACQUIRE), deadline = 0;
    for (uint32_t n = 0; s & 1u; n++) {
        if (s == dead)
            break;
        if (n >= 256) {
            uint64_t now = dilu_now_ns();
            if (!deadline)
                deadline = now + DILU_SEQ_GIVE_UP_NS;
            else if (now >= deadline)
                break;
            sched_yield();
        } else {
            DILU_CPU_RELAX();
        }
        s = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
    }
    *start = s;
    return (int)(s & 1u);
}

static inline int dilu_seq_read_retry(const uint64_t *seq, uint64_t start)
{
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(seq, __ATOMIC_RELAXED) != start;
}

/* ---- futex on a shared 32-bit word ---- */

/* Sleeps while *addr == expected, at most timeout_ns (< 0: no timeout).
 * Returns 0 when woken or the word changed, ETIMEDOUT on timeout, EINTR on a signal. */
static inline int dilu_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns)
{
    struct timespec ts, *tp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000ll;
        ts.tv_nsec = timeout_ns % 1000000000ll;
        tp = &ts;
    }
    long r = syscall(SYS_futex, addr, FUTEX_WAIT, expected, tp, NULL, 0);
    if (r == 0) return 0;
    if (errno == EAGAIN) return 0;
    return errno;
}

/* Wakes up to n waiters (n < 0: all); returns how many were woken. */
static inline int dilu_futex_wake(uint32_t *addr, int n)
{
    long r = syscall(SYS_futex, addr, FUTEX_WAKE, n < 0 ? 0x7fffffff : n, NULL, NULL, 0);
    return r < 0 ? 0 : (int)r;
}

/* ---- agent side ---- */

/* Fills a zeroed block; magic is stored last (release) so an opener never sees a half-made block.
 * mem_limit_bytes: the instance's device-memory reservation in bytes (0: no limit). */
static inline void dilu_cb_init(struct dilu_cb *cb, const char *instance_id, uint64_t request_ppm,
                                uint64_t width_ppm, uint64_t stale_after_ns, uint64_t mem_limit_bytes)
{
    memset(cb, 0, sizeof *cb);
    cb->layout_version = DILU_CB_LAYOUT_VERSION;
    cb->size = (uint32_t)sizeof *cb;
    strncpy(cb->instance_id, instance_id, sizeof cb->instance_id - 1);
    cb->quota_ppm = request_ppm;
    cb->request_ppm = request_ppm;
    cb->width_ppm = width_ppm;
    cb->stale_after_ns = stale_after_ns;
    cb->mem_limit_bytes = mem_limit_bytes;
    cb->agent_heartbeat_ns = dilu_now_ns();
    __atomic_store_n(&cb->magic, DILU_CB_MAGIC, __ATOMIC_RELEASE);
}

static inline void dilu_cb_heartbeat(struct dilu_cb *cb)
{
    dilu_store_u64(&cb->agent_heartbeat_ns, dilu_now_ns());
}

/* Publishes a new quota, bumps the epoch and wakes every throttled launch; returns the new epoch. */
static inline uint32_t dilu_cb_write_grant(struct dilu_cb *cb, uint64_t quota_ppm)
{
    dilu_seq_write_begin(&cb->grant_seq);
    __atomic_store_n(&cb->quota_ppm, quota_ppm, __ATOMIC_RELAXED);
    dilu_seq_write_end(&cb->grant_seq);
    dilu_cb_heartbeat(cb);
    uint32_t epoch = dilu_fetch_add_u32(&cb->grant_epoch, 1) + 1;
    dilu_futex_wake(&cb->grant_epoch, -1);
    return epoch;
}

/* Reads quota/request/width consistently: returns 0 and sets *torn_seq = 0. When the grant
 * writer holds grant_seq odd past DILU_SEQ_GIVE_UP_NS (killed mid-write), or still holds the odd
 * value *torn_seq names (a previous read gave up on it; 0: none), returns 1 with *torn_seq = that
 * odd value and the fields as they are (each a value once stored, not necessarily together):
 * the caller falls back to its fail-safe rate. Never blocks longer than the bound. */
static inline int dilu_cb_read_grant(const struct dilu_cb *cb, uint64_t *quota_ppm,
                                     uint64_t *request_ppm, uint64_t *width_ppm, uint64_t *torn_seq)
{
    uint64_t s;
    int torn;
    do {
        torn = dilu_seq_read_begin_bounded(&cb->grant_seq, *torn_seq, &s);
        *quota_ppm = __atomic_load_n(&cb->quota_ppm, __ATOMIC_RELAXED);
        *request_ppm = __atomic_load_n(&cb->request_ppm, __ATOMIC_RELAXED);
        *width_ppm = __atomic_load_n(&cb->width_ppm, __ATOMIC_RELAXED);
    } while (!torn && dilu_seq_read_retry(&cb->grant_seq, s));
    *torn_seq = torn ? s : 0;
    return torn;
}

/* Copies the whole block into *out with the grant and telemetry groups each consistent.
 *
 * The copy's grant_seq and t_seq say how each group was read: even, consistently; odd, torn (its
 * writer held the sequence odd past DILU_SEQ_GIVE_UP_NS: killed mid-write), the fields as they
 * were. Snapshotting into the same *out again gives up at once while the block still holds the
 * odd value the copy names, so a dead writer costs one bounded wait, not one per read. */
static inline void dilu_cb_snapshot(const struct dilu_cb *cb, struct dilu_cb *out)
{
    uint64_t s, dead_g = out->grant_seq & 1u ? out->grant_seq : 0;
    uint64_t dead_t = out->t_seq & 1u ? out->t_seq : 0;
    int torn;
    memcpy(out, cb, sizeof *out); /* header and single-field values */
    dilu_cb_read_grant(cb, &out->quota_ppm, &out->request_ppm, &out->width_ppm, &dead_g);
    out->grant_epoch = dilu_load_u32(&cb->grant_epoch);
    out->mem_limit_bytes = dilu_load_u64(&cb->mem_limit_bytes);
    do {
        torn = dilu_seq_read_begin_bounded(&cb->t_seq, dead_t, &s);
        out->t_pid = __atomic_load_n(&cb->t_pid, __ATOMIC_RELAXED);
        out->t_launches = __atomic_load_n(&cb->t_launches, __ATOMIC_RELAXED);
        out->t_throttled = __atomic_load_n(&cb->t_throttled, __ATOMIC_RELAXED);
        out->t_busy_us = __atomic_load_n(&cb->t_busy_us, __ATOMIC_RELAXED);
        out->t_wait_us = __atomic_load_n(&cb->t_wait_us, __ATOMIC_RELAXED);
        out->t_cycles = __atomic_load_n(&cb->t_cycles, __ATOMIC_RELAXED);
        out->t_last_cycle_us = __atomic_load_n(&cb->t_last_cycle_us, __ATOMIC_RELAXED);
        out->t_baseline_cycle_us = __atomic_load_n(&cb->t_baseline_cycle_us, __ATOMIC_RELAXED);
        out->t_tokens_us = __atomic_load_n(&cb->t_tokens_us, __ATOMIC_RELAXED);
        out->t_last_launch_ns = __atomic_load_n(&cb->t_last_launch_ns, __ATOMIC_RELAXED);
        out->t_applied_epoch = __atomic_load_n(&cb->t_applied_epoch, __ATOMIC_RELAXED);
        out->t_applied_ns = __atomic_load_n(&cb->t_applied_ns, __ATOMIC_RELAXED);
        out->t_flags = __atomic_load_n(&cb->t_flags, __ATOMIC_RELAXED);
        out->t_samples = __atomic_load_n(&cb->t_samples, __ATOMIC_RELAXED);
        out->t_quota_ppm = __atomic_load_n(&cb->t_quota_ppm, __ATOMIC_RELAXED);
        out->t_mem_used_bytes = __atomic_load_n(&cb->t_mem_used_bytes, __ATOMIC_RELAXED);
        out->t_mem_peak_bytes = __atomic_load_n(&cb->t_mem_peak_bytes, __ATOMIC_RELAXED);
        out->t_oom_refusals = __atomic_load_n(&cb->t_oom_refusals, __ATOMIC_RELAXED);
        out->t_torn_grant_reads = __atomic_load_n(&cb->t_torn_grant_reads, __ATOMIC_RELAXED);
    } while (!torn && dilu_seq_read_retry(&cb->t_seq, s));
    out->grant_seq = dead_g; /* odd: torn at that value; 0: consistent */
    out->t_seq = s;          /* odd: torn at that value; even: consistent */
    out->r_ready = dilu_load_u64(&cb->r_ready);
    out->r_requests = dilu_load_u64(&cb->r_requests);
    out->r_latency_us_ewma = dilu_load_u64(&cb->r_latency_us_ewma);
    out->r_queue_depth = dilu_load_u64(&cb->r_queue_depth);
}

/* Instance runtime fields (one writer: the instance's Python runtime). */
static inline void dilu_cb_set_runtime(struct dilu_cb *cb, uint64_t ready, uint64_t requests,
                                       uint64_t latency_us_ewma, uint64_t queue_depth)
{
    dilu_store_u64(&cb->r_ready, ready);
    dilu_store_u64(&cb->r_requests, requests);
    dilu_store_u64(&cb->r_latency_us_ewma, latency_us_ewma);
    dilu_store_u64(&cb->r_queue_depth, queue_depth);
}

#endif /* DILU_CB_H */
