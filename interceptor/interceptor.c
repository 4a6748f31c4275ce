/* libdilu_intercept.so: meters and throttles one process's CUDA kernel launches (LD_PRELOAD).
 *
 * Paths into the driver that are covered (DESIGN.md section 6):
 *   - symbols linked directly: this library exports cuLaunchKernel & co., so with LD_PRELOAD
 *     it wins symbol resolution over libcuda.so.1;
 *   - dlopen + dlsym (also Python ctypes): dlsym is exported here; the real one is found with
 *     dlvsym; any result that is a real driver entry point we wrap is swapped for our wrapper;
 *   - cuGetProcAddress (4 args) and cuGetProcAddress_v2 (5 args), any flags: routed by the real
 *     pointer the driver returns, so versions and _ptsz flavours stay right; asked for
 *     cuGetProcAddress itself, they return our wrapper.
 * cuGetExportTable is never touched.
 *
 * Throttling: tokens are µs of GPU-busy time, refilled at q/w per µs of wall time (q: quota in
 * effect, w: width), capped at DILU_BURST_US. A launch goes when the balance is >= 0 and is charged
 * its estimated cost; otherwise it sleeps on the grant-epoch futex for exactly the time the
 * refill needs (a new grant wakes it early). The cost of a launch is estimated per key (a
 * CUfunction with its launch geometry, or a CUgraphExec) from launches timed with events, never
 * on a capturing stream: every launch until 3 samples, then every DILU_SAMPLE_EVERY-th and at
 * least every DILU_SAMPLE_FLOOR_MS (250). The estimate is the least recent sample (see learn(): it meters SM-time,
 * not time stretched by other processes). Launches of a key not measured yet are charged the
 * larger of the default and the running estimate, all timed, and trued up when their timing
 * arrives; such a launch goes only when no other one is in flight and a timing slot is free (it
 * waits for that at most DILU_FIRST_WAIT_MS), so the untrued work is at most one kernel and a
 * tenant holds its quota from its first 1 s window, however long or many its kernels. One that
 * still cannot be timed is charged the largest estimate known (it is never trued up).
 *
 * Memory: every device allocation entry point (cuMemAlloc(_v2), cuMemAllocManaged,
 * cuMemAllocPitch_v2, cuMemAllocAsync and cuMemAllocFromPoolAsync (+_ptsz), cuMemCreate,
 * cuArrayCreate_v2, cuArray3DCreate_v2) is counted against the instance's reservation (the block's
 * mem_limit_bytes, else DILU_MEMORY_LIMIT_BYTES, else none), reserved before the driver is called
 * and given back if the call fails; past the reservation the call returns
 * CUDA_ERROR_OUT_OF_MEMORY without reaching the driver. Frees (cuMemFree(_v2), cuMemFreeAsync
 * (+_ptsz), cuMemRelease, cuArrayDestroy) credit what the pointer was charged. cuMemGetInfo(_v2)
 * reports the reservation as total and min(reservation - used, the driver's free) as free. The
 * count is in the MAP_SHARED page (a forked child draws on the same reservation; what a dead
 * process of the tree held is reclaimed), the pointer sizes per process under the same lock.
 *
 * Fail safe: with no usable control block the rate is the last grant seen, or before any
 * DILU_REQUEST_QUOTA; a quota is never below DILU_MIN_QUOTA so no wait is unbounded. A stale
 * heartbeat only raises a telemetry flag (the block's last grant stays in force). Fork safe: the
 * bucket, counters and lock are in a MAP_SHARED page, so a forked child shares the quota.
 *
 * Environment: DILU_CB (control block path), DILU_REQUEST_QUOTA (fraction), DILU_WIDTH or
 * CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (width when there is no block), DILU_MIN_QUOTA (default
 * 0.01), DILU_BURST_US (2000), DILU_MIN_WAIT_US (200), DILU_CYCLE_GAP_US (1000), DILU_DEFAULT_COST_US (100),
 * DILU_SAMPLE_EVERY (128), DILU_FIRST_WAIT_MS (100), DILU_REAL_LIBCUDA (path of the real driver), DILU_INTERCEPT_DEBUG,
 * DILU_MEMORY_LIMIT_BYTES (reservation without a block; 0 or unset: count only).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dilu_cb.h"
#include "dilu_cuda_min.h"

#ifdef cuGetProcAddress /* CUDA 13's cuda.h maps it to _v2; we export both names ourselves */
#undef cuGetProcAddress
#endif

#define API __attribute__((visibility("default")))

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, unsigned, CUstream, void **);
typedef CUresult (*graph_fn)(CUgraphExec, CUstream);
typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*begin_fn)(CUstream);
typedef CUresult (*begin2_fn)(CUstream, int);
typedef CUresult (*end_fn)(CUstream, CUgraph *);
typedef CUresult (*malloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*malloc_v1_fn)(CUdeviceptr_v1 *, unsigned int);
typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*pitch_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
typedef CUresult (*malloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*malloc_pool_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*mem_create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                  unsigned long long);
typedef CUresult (*array_fn)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
typedef CUresult (*array3d_fn)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*free_v1_fn)(CUdeviceptr_v1);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*array_destroy_fn)(CUarray);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef CUresult (*info_v1_fn)(unsigned int *, unsigned int *);

/* ------------------------------------------------------------------ hook slots */

enum kind { K_LAUNCH, K_LAUNCH_EX, K_COOP, K_GRAPH, K_GPA, K_GPA2, K_BEGIN, K_BEGIN2, K_END, K_SYNC, K_MEM };

struct slot {
    const char *name; /* exported driver symbol */
    const char *base; /* name given to cuGetProcAddress */
    enum kind kind;
    int ptsz;
    void *real;
    void *wrapper;
};

#define NPRIMARY 20
#define NSLOTS (2 * NPRIMARY) /* slot i + NPRIMARY: an alternative real pointer of slot i */

static struct slot g_slot[NSLOTS] = {
    {"cuLaunchKernel", "cuLaunchKernel", K_LAUNCH, 0, 0, 0},
    {"cuLaunchKernel_ptsz", "cuLaunchKernel", K_LAUNCH, 1, 0, 0},
    {"cuLaunchKernelEx", "cuLaunchKernelEx", K_LAUNCH_EX, 0, 0, 0},
    {"cuLaunchKernelEx_ptsz", "cuLaunchKernelEx", K_LAUNCH_EX, 1, 0, 0},
    {"cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel", K_COOP, 0, 0, 0},
    {"cuLaunchCooperativeKernel_ptsz", "cuLaunchCooperativeKernel", K_COOP, 1, 0, 0},
    {"cuGraphLaunch", "cuGraphLaunch", K_GRAPH, 0, 0, 0},
    {"cuGraphLaunch_ptsz", "cuGraphLaunch", K_GRAPH, 1, 0, 0},
    {"cuGetProcAddress", "cuGetProcAddress", K_GPA, 0, 0, 0},
    {"cuGetProcAddress_v2", "cuGetProcAddress_v2", K_GPA2, 0, 0, 0},
    {"cuStreamBeginCapture", NULL, K_BEGIN, 0, 0, 0},
    {"cuStreamBeginCapture_v2", "cuStreamBeginCapture", K_BEGIN2, 0, 0, 0},
    {"cuStreamBeginCapture_ptsz", NULL, K_BEGIN, 1, 0, 0},
    {"cuStreamBeginCapture_v2_ptsz", "cuStreamBeginCapture", K_BEGIN2, 1, 0, 0},
    {"cuStreamEndCapture", "cuStreamEndCapture", K_END, 0, 0, 0},
    {"cuStreamEndCapture_ptsz", "cuStreamEndCapture", K_END, 1, 0, 0},
    /* synchronisations: their return marks the end of the GPU work of a kernel-launch cycle */
    {"cuStreamSynchronize", "cuStreamSynchronize", K_SYNC, 0, 0, 0},
    {"cuStreamSynchronize_ptsz", "cuStreamSynchronize", K_SYNC, 1, 0, 0},
    {"cuCtxSynchronize", "cuCtxSynchronize", K_SYNC, 0, 0, 0},
    {"cuEventSynchronize", "cuEventSynchronize", K_SYNC, 0, 0, 0},
};

/* Memory hooks: a second table of the same shape (slot i + NMPRIMARY: an alternative real
 * pointer of slot i). The legacy names (32-bit pointers and sizes) have no base: cuGetProcAddress
 * hands out the _v2 entry points for them. */
enum {
    M_ALLOC, M_ALLOC_V1, M_MANAGED, M_PITCH, M_ASYNC, M_ASYNC_PTSZ, M_POOL, M_POOL_PTSZ, M_CREATE,
    M_ARRAY, M_ARRAY3D, M_FREE, M_FREE_V1, M_FREE_ASYNC, M_FREE_ASYNC_PTSZ, M_RELEASE,
    M_ARRAY_DESTROY, M_INFO, M_INFO_V1, NMPRIMARY
};
#define NMSLOTS (2 * NMPRIMARY)

static struct slot g_mslot[NMSLOTS] = {
    [M_ALLOC] = {"cuMemAlloc_v2", "cuMemAlloc", K_MEM, 0, 0, 0},
    [M_ALLOC_V1] = {"cuMemAlloc", NULL, K_MEM, 0, 0, 0},
    [M_MANAGED] = {"cuMemAllocManaged", "cuMemAllocManaged", K_MEM, 0, 0, 0},
    [M_PITCH] = {"cuMemAllocPitch_v2", "cuMemAllocPitch", K_MEM, 0, 0, 0},
    [M_ASYNC] = {"cuMemAllocAsync", "cuMemAllocAsync", K_MEM, 0, 0, 0},
    [M_ASYNC_PTSZ] = {"cuMemAllocAsync_ptsz", "cuMemAllocAsync", K_MEM, 1, 0, 0},
    [M_POOL] = {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", K_MEM, 0, 0, 0},
    [M_POOL_PTSZ] = {"cuMemAllocFromPoolAsync_ptsz", "cuMemAllocFromPoolAsync", K_MEM, 1, 0, 0},
    [M_CREATE] = {"cuMemCreate", "cuMemCreate", K_MEM, 0, 0, 0},
    [M_ARRAY] = {"cuArrayCreate_v2", "cuArrayCreate", K_MEM, 0, 0, 0},
    [M_ARRAY3D] = {"cuArray3DCreate_v2", "cuArray3DCreate", K_MEM, 0, 0, 0},
    [M_FREE] = {"cuMemFree_v2", "cuMemFree", K_MEM, 0, 0, 0},
    [M_FREE_V1] = {"cuMemFree", NULL, K_MEM, 0, 0, 0},
    [M_FREE_ASYNC] = {"cuMemFreeAsync", "cuMemFreeAsync", K_MEM, 0, 0, 0},
    [M_FREE_ASYNC_PTSZ] = {"cuMemFreeAsync_ptsz", "cuMemFreeAsync", K_MEM, 1, 0, 0},
    [M_RELEASE] = {"cuMemRelease", "cuMemRelease", K_MEM, 0, 0, 0},
    [M_ARRAY_DESTROY] = {"cuArrayDestroy", "cuArrayDestroy", K_MEM, 0, 0, 0},
    [M_INFO] = {"cuMemGetInfo_v2", "cuMemGetInfo", K_MEM, 0, 0, 0},
    [M_INFO_V1] = {"cuMemGetInfo", NULL, K_MEM, 0, 0, 0},
};

/* real driver entry points used for calibration */
static CUresult (*r_event_create)(CUevent *, unsigned);
static CUresult (*r_event_destroy)(CUevent);
static CUresult (*r_event_record)(CUevent, CUstream);
static CUresult (*r_event_record_ptsz)(CUevent, CUstream);
static CUresult (*r_event_query)(CUevent);
static CUresult (*r_event_elapsed)(float *, CUevent, CUevent);
static CUresult (*r_is_capturing)(CUstream, int *);
static CUresult (*r_is_capturing_ptsz)(CUstream, int *);
static CUresult (*r_stream_query)(CUstream);
static CUresult (*r_stream_query_ptsz)(CUstream);

static void *(*real_dlsym)(void *, const char *);
static void *g_cuda;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_ready;
static int g_debug;
static int g_capturing; /* streams in capture (through our hooks); > 0 => check each launch */

static int is_own(void *p)
{
    static void *own_base;
    Dl_info a, b;
    if (!own_base && dladdr((void *)&is_own, &a))
        own_base = a.dli_fbase;
    return p && dladdr(p, &b) && b.dli_fbase == own_base;
}

static void *lookup_wrapper(void *real)
{
    if (!real)
        return NULL;
    for (int i = 0; i < NSLOTS; i++)
        if (g_slot[i].real == real)
            return g_slot[i].wrapper;
    for (int i = 0; i < NMSLOTS; i++)
        if (g_mslot[i].real == real)
            return g_mslot[i].wrapper;
    return NULL;
}

/* ------------------------------------------------------------------ throttle state */

struct cost {
    uintptr_t key; /* CUfunction or CUgraphExec */
    double us;     /* estimate: the least of the recent samples (see learn) */
    double recent[8];
    uint32_t samples, pending;
    uint64_t launches;
    uint64_t last_sample_ns;
};

#define COST_SLOTS 8192
#define WARM_CYCLES 16 /* the first cycles set the baseline to their shortest at once (start-up) */
#define MAX_PENDING 64

struct sample {
    uintptr_t key;
    CUevent start0, start, end; /* start0 - start: the record-to-record gap (see poll_samples) */
    double charged_us;
    int provisional; /* charged before the key had any sample: true it up */
    int busy;        /* the stream still had work when the start events were recorded */
    int nolearn;     /* the host was slow between the records: true up only (an overestimate) */
};

#define MEM_PROCS 64 /* processes of one tree holding device memory, tracked each */

/* The token bucket and the counters, in a MAP_SHARED page made at start-up: a forked child
 * draws on the same bucket as its parent (the instance's quota holds for the whole process
 * tree) and its launches count in the telemetry the parent publishes; likewise the device
 * memory the tree holds against the instance's reservation. */
struct shared {
    pthread_mutex_t mu; /* process-shared, robust; guards this page and S */
    double tokens;      /* µs */
    uint64_t refill_ns;
    uint64_t launches, throttled;
    double busy_us, wait_us;
    /* device memory counted against the reservation (bytes), and who of the tree holds it */
    uint64_t mem_used, mem_peak, oom_refusals;
    struct {
        uint32_t pid; /* 0: free entry */
        uint64_t bytes;
    } mem_procs[MEM_PROCS];
};
static struct shared *SH;
static int g_sh_private; /* the shared page could not be made: SH is process-local */

static struct {
    /* configuration */
    uint64_t width_ppm, request_ppm, min_ppm;
    double burst_us, default_cost_us, cycle_gap_ns, max_gap_us, max_host_us, min_wait_us;
    uint64_t first_wait_ns; /* DILU_FIRST_WAIT_MS: the longest wait for a timing to come back */
    uint32_t sample_every;
    uint64_t sample_floor_ns;
    uint64_t mem_limit_env; /* DILU_MEMORY_LIMIT_BYTES: the reservation without a block (0: none) */
    const char *cb_path;
    /* control block */
    struct dilu_cb *cb;
    int writer; /* this process owns the telemetry fields */
    int forked; /* a forked child of the writer (shares its bucket and counters) */
    uint64_t next_open_ns;
    uint64_t next_stale_check_ns;
    uint64_t grant_torn_seq; /* odd grant_seq a grant read gave up on (its writer died mid-write) */
    uint64_t torn_grant_reads;
    /* token bucket */
    uint64_t quota_ppm; /* in effect (floored) */
    double rate;        /* µs of busy time per µs of wall time */
    /* costs and calibration */
    struct cost costs[COST_SLOTS];
    struct sample pending[MAX_PENDING];
    int npending;
    uint64_t next_poll_ns;
    double global_cost_us;
    double max_cost_us; /* the largest estimate of any key: what an unknown kernel may cost */
    /* telemetry (mirrored into the block) */
    uint64_t samples, flags;
    uint64_t cycles, last_cycle_us, baseline_cycle_us;
    uint64_t cycle_start_ns, last_launch_ns, sync_ns, work_end_ns;
    double last_cost_us;
    uint64_t applied_epoch, applied_ns;
} S;

static void lock(void)
{
    if (pthread_mutex_lock(&SH->mu) == EOWNERDEAD) /* a process of the tree died holding it */
        pthread_mutex_consistent(&SH->mu);
}

static void unlock(void) { pthread_mutex_unlock(&SH->mu); }

static void make_shared(void)
{
    static struct shared fallback;
    void *p = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    SH = p == MAP_FAILED ? &fallback : p;
    g_sh_private = SH == &fallback;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    if (SH != &fallback) {
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    }
    pthread_mutex_init(&SH->mu, &a);
    pthread_mutexattr_destroy(&a);
}

static double env_f(const char *name, double dflt)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    double x = strtod(v, &end);
    if (end == v || !isfinite(x)) {
        fprintf(stderr, "dilu interceptor: ignoring %s=%s (not a number)\n", name, v);
        return dflt;
    }
    return x;
}

/* A byte count from the environment (a non-negative integer; 0 when unset or invalid). */
static uint64_t env_bytes(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return 0;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (end == v || *end || errno || *v == '-') {
        fprintf(stderr, "dilu interceptor: ignoring %s=%s (not a number of bytes)\n", name, v);
        return 0;
    }
    return (uint64_t)x;
}

static uint64_t frac_ppm(double f)
{
    if (f < 0.0)
        f = 0.0;
    if (f > 1.0)
        f = 1.0;
    return (uint64_t)llround(f * 1e6);
}

static void set_rate(uint64_t quota_ppm)
{
    if (quota_ppm < S.min_ppm)
        quota_ppm = S.min_ppm; /* never zero: a launch must not wait forever */
    S.quota_ppm = quota_ppm;
    S.rate = (double)quota_ppm / (double)(S.width_ppm ? S.width_ppm : DILU_PPM);
}

/* Writes the telemetry into the block. Always under the lock, which every process of the tree
 * shares, so there is one writer at a time; a forked child writes only the shared counters (its
 * own cycles and grant bookkeeping would overwrite the parent's). */
static void publish(void)
{
    struct dilu_cb *cb = S.cb;
    if (!cb || (!S.writer && !S.forked))
        return;
    dilu_seq_write_begin(&cb->t_seq);
    cb->t_launches = SH->launches;
    cb->t_throttled = SH->throttled;
    cb->t_busy_us = (uint64_t)(SH->busy_us > 0 ? SH->busy_us : 0);
    cb->t_wait_us = (uint64_t)SH->wait_us;
    cb->t_tokens_us = (int64_t)SH->tokens;
    if (S.writer) {
        cb->t_cycles = S.cycles;
        cb->t_last_cycle_us = S.last_cycle_us;
        cb->t_baseline_cycle_us = S.baseline_cycle_us;
        cb->t_last_launch_ns = S.last_launch_ns;
        cb->t_applied_epoch = S.applied_epoch;
        cb->t_applied_ns = S.applied_ns;
        cb->t_flags = S.flags;
        cb->t_samples = S.samples;
        cb->t_quota_ppm = S.quota_ppm;
        cb->t_torn_grant_reads = S.torn_grant_reads;
    }
    dilu_seq_write_end(&cb->t_seq);
}

/* The memory telemetry (shared counters, so a forked child writes them too). Under the lock. */
static void publish_mem(void)
{
    struct dilu_cb *cb = S.cb;
    if (!cb || (!S.writer && !S.forked))
        return;
    dilu_seq_write_begin(&cb->t_seq);
    cb->t_mem_used_bytes = SH->mem_used;
    cb->t_mem_peak_bytes = SH->mem_peak;
    cb->t_oom_refusals = SH->oom_refusals;
    dilu_seq_write_end(&cb->t_seq);
}

static int pid_alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

/* Maps DILU_CB if it is a valid block; called under the lock. */
static void try_open_block(uint64_t now)
{
    if (S.cb || !S.cb_path || now < S.next_open_ns)
        return;
    S.next_open_ns = now + 100000000ull; /* retry every 100 ms while it is missing */
    int fd = open(S.cb_path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    void *p = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct dilu_cb))
        p = mmap(NULL, sizeof(struct dilu_cb), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return;
    struct dilu_cb *cb = p;
    if (dilu_load_u64(&cb->magic) != DILU_CB_MAGIC || cb->layout_version != DILU_CB_LAYOUT_VERSION ||
        cb->size != sizeof(struct dilu_cb)) {
        fprintf(stderr, "dilu interceptor: %s is not a control block of layout %u; "
                        "running at the request quota\n", S.cb_path, DILU_CB_LAYOUT_VERSION);
        munmap(p, sizeof(struct dilu_cb));
        S.next_open_ns = now + 1000000000ull;
        return;
    }
    S.cb = cb;
    pid_t owner = (pid_t)cb->t_pid;
    S.writer = owner == 0 || owner == getpid() || !pid_alive(owner);
    if (S.writer) { /* continue the block's counters so they stay monotonic */
        cb->t_pid = (uint64_t)getpid();
        SH->launches += cb->t_launches;
        SH->throttled += cb->t_throttled;
        SH->busy_us += (double)cb->t_busy_us;
        SH->wait_us += (double)cb->t_wait_us;
        S.cycles += cb->t_cycles;
        S.samples += cb->t_samples;
        S.torn_grant_reads += cb->t_torn_grant_reads;
        SH->oom_refusals += cb->t_oom_refusals;
        if (cb->t_mem_peak_bytes > SH->mem_peak)
            SH->mem_peak = cb->t_mem_peak_bytes;
        publish_mem(); /* used: this process tree's own (a previous process's memory died with it) */
    }
    uint64_t q, r, w;
    if (dilu_cb_read_grant(cb, &q, &r, &w, &S.grant_torn_seq))
        S.torn_grant_reads++; /* width stays the environment's; refresh_grant falls back */
    else if (w)
        S.width_ppm = w;
    S.applied_epoch = (uint64_t)-1; /* force the first refresh to apply the block's grant */
    if (g_debug)
        fprintf(stderr, "dilu interceptor: pid %d block %s quota %.3f width %.3f writer %d\n",
                getpid(), S.cb_path, q / 1e6, w / 1e6, S.writer);
}

/* Applies a new grant if the epoch moved; checks the heartbeat now and then. Under the lock. */
static void refresh_grant(uint64_t now)
{
    struct dilu_cb *cb = S.cb;
    if (!cb) {
        try_open_block(now);
        cb = S.cb;
        if (!cb)
            return;
    }
    uint32_t epoch = dilu_load_u32(&cb->grant_epoch);
    if ((uint64_t)epoch != S.applied_epoch) {
        uint64_t q, r, w;
        if (dilu_cb_read_grant(cb, &q, &r, &w, &S.grant_torn_seq)) {
            /* the agent died mid-write: never wait on it; run at the request quota until a
             * grant writer repairs the sequence and bumps the epoch */
            S.torn_grant_reads++;
            S.flags |= DILU_CB_FLAG_TORN_GRANT;
            set_rate(S.request_ppm);
        } else {
            S.flags &= ~DILU_CB_FLAG_TORN_GRANT;
            set_rate(q);
        }
        S.applied_epoch = epoch;
        S.applied_ns = now;
    }
    if (now >= S.next_stale_check_ns) {
        S.next_stale_check_ns = now + 10000000ull;
        uint64_t hb = dilu_load_u64(&cb->agent_heartbeat_ns);
        uint64_t limit = cb->stale_after_ns ? cb->stale_after_ns : 500000000ull;
        if (now > hb && now - hb > limit)
            S.flags |= DILU_CB_FLAG_STALE; /* keep running at the last grant */
        else
            S.flags &= ~DILU_CB_FLAG_STALE;
    }
}

static void refill(uint64_t now)
{
    if (now > SH->refill_ns) {
        SH->tokens += (double)(now - SH->refill_ns) / 1000.0 * S.rate;
        if (SH->tokens > S.burst_us)
            SH->tokens = S.burst_us;
    }
    SH->refill_ns = now;
}

static struct cost *cost_of(uintptr_t key)
{
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull;
    for (uint32_t n = 0, i = (uint32_t)(h >> 51); n < 32; n++, i = (i + 1) & (COST_SLOTS - 1)) {
        struct cost *c = &S.costs[i];
        if (c->key == key)
            return c;
        if (c->key == 0) {
            c->key = key;
            c->us = S.global_cost_us;
            return c;
        }
    }
    return NULL; /* table crowded: the caller uses the global estimate */
}

/* Folds one measured duration into the key's estimate.
 *
 * The estimate is the least of the last 8 samples of the key (a key is a CUfunction with its
 * launch geometry, or a graph): a kernel stretched by another process sharing the SMs did not
 * use more SM-time than alone (it got fewer SMs for longer), and host hiccups only ever inflate
 * a timing. Charging the uncontended duration therefore meters SM-time, so each instance gets
 * work in proportion to its quota whatever it shares the device with; a kernel that really
 * became slower raises the estimate once all 8 recent samples say so. */
static void learn(struct cost *c, double us)
{
    uint32_t n = c->samples < 8 ? c->samples + 1 : 8;
    c->recent[c->samples % 8] = us;
    c->samples++;
    double least = c->recent[0];
    for (uint32_t i = 1; i < n; i++)
        least = fmin(least, c->recent[i]);
    c->us = least;
}

/* Collects finished timing samples: the estimate per key (learn), true-up of the tokens. Under the lock. */
static void poll_samples(uint64_t now)
{
    if (!S.npending || now < S.next_poll_ns)
        return;
    /* querying events while any stream captures a graph (global capture mode) would invalidate
     * the capture: collect later */
    if (__atomic_load_n(&g_capturing, __ATOMIC_ACQUIRE))
        return;
    S.next_poll_ns = now + 100000ull;
    for (int i = 0; i < S.npending;) {
        struct sample *s = &S.pending[i];
        CUresult q = r_event_query(s->end);
        if (q == CUDA_ERROR_NOT_READY) {
            i++;
            continue;
        }
        float ms = 0.0f, gap_ms = 0.0f;
        struct cost *c = cost_of(s->key);
        if (q == CUDA_SUCCESS && r_event_elapsed(&ms, s->start, s->end) == CUDA_SUCCESS && ms >= 0.0f &&
            r_event_elapsed(&gap_ms, s->start0, s->start) == CUDA_SUCCESS) {
            /* On an idle stream the start event is stamped as soon as it is recorded, and the
             * kernel starts only after the launch call arrives: that host gap is not GPU-busy
             * time. Two start events recorded back to back measure about the same gap (zero when
             * the stream was busy: both are stamped when earlier work ends), so subtract it. */
            double gap_us = gap_ms > 0.0f ? (double)gap_ms * 1000.0 : 0.0;
            double us = (double)ms * 1000.0 - gap_us;
            if (gap_us > S.max_gap_us || us <= 0.0 || s->nolearn) { /* host preempted */
                if (s->provisional) { /* still true it up, on the whole (longer) record span */
                    double fix = (double)ms * 1000.0 - s->charged_us;
                    SH->tokens -= fix;
                    if (SH->tokens > S.burst_us)
                        SH->tokens = S.burst_us;
                    SH->busy_us += fix;
                    if (c && c->samples == 0 && (double)ms * 1000.0 > c->us)
                        c->us = (double)ms * 1000.0; /* the next launch is not charged less */
                }
                if (c && c->pending)
                    c->pending--;
                goto drop;
            }
            /* Behind earlier work the start events are stamped when that work ends, and another
             * process's kernels may run before ours: such a timing can only be too long, so once
             * the key is known it is used only when it is shorter than the estimate. */
            if (c && !(s->busy && c->samples >= 3 && us >= c->us))
                learn(c, us);
            if (c && c->us > S.max_cost_us)
                S.max_cost_us = c->us;
            if (g_debug > 1)
                fprintf(stderr, "dilu interceptor: pid %d sample %.1f us (gap %.1f) est %.1f%s\n",
                        getpid(), us, gap_us, c ? c->us : -1.0, s->provisional ? " provisional" : "");
            S.global_cost_us += (us - S.global_cost_us) / 16.0;
            if (s->provisional) { /* true-up: charge what the launch really used */
                double fix = us - s->charged_us;
                SH->tokens -= fix;
                if (SH->tokens > S.burst_us)
                    SH->tokens = S.burst_us;
                SH->busy_us += fix;
            }
            S.samples++;
        }
        if (c && c->pending)
            c->pending--;
    drop:
        r_event_destroy(s->start0);
        r_event_destroy(s->start);
        r_event_destroy(s->end);
        S.pending[i] = S.pending[--S.npending];
    }
}

/* A kernel-launch cycle is the GPU activity between idle gaps. Its end is the return of a
 * synchronisation that followed its last launch (the GPU had finished it: this includes any
 * time spent behind other processes' kernels, which is what kernel-cycle stretch looks for), or,
 * for an application that never synchronises, the estimated end of its queued work. */
static uint64_t cycle_end(void)
{
    if (S.sync_ns > S.last_launch_ns)
        return S.sync_ns;
    uint64_t est = S.last_launch_ns + (uint64_t)(S.last_cost_us * 1000.0);
    return S.work_end_ns > est ? S.work_end_ns : est;
}

static void note_cycle(uint64_t arrival)
{
    uint64_t end = S.last_launch_ns ? cycle_end() : 0;
    if (S.last_launch_ns && arrival > end && arrival - end > (uint64_t)S.cycle_gap_ns) {
        uint64_t span_us = (end - S.cycle_start_ns) / 1000;
        S.cycles++;
        S.last_cycle_us = span_us;
        int shorter = S.baseline_cycle_us == 0 || span_us < S.baseline_cycle_us;
        if (shorter && (S.cycles <= WARM_CYCLES || 2 * span_us >= S.baseline_cycle_us))
            S.baseline_cycle_us = span_us;
        else /* drift over about a minute, so a lasting change of workload re-baselines while a
              * contention episode still reads as stretch, and a cycle cut short (a launcher
              * preempted mid-cycle ends it early, leaving a fraction of one) does not reset it */
            S.baseline_cycle_us = (uint64_t)((double)S.baseline_cycle_us +
                                             ((double)span_us - (double)S.baseline_cycle_us) *
                                                 fmin(1.0, (double)(arrival - S.cycle_start_ns) / 60e9));
        S.cycle_start_ns = arrival;
    }
    if (!S.cycle_start_ns)
        S.cycle_start_ns = arrival;
}

/* Is a launch charged before its key had any sample still waiting for its timing? */
static int provisional_in_flight(void)
{
    for (int i = 0; i < S.npending; i++)
        if (S.pending[i].provisional)
            return 1;
    return 0;
}

/* Before a launch of a key never timed (it may cost anything): waits, for at most
 * DILU_FIRST_WAIT_MS, until no other such launch is in flight and a timing slot is free, so each
 * is timed and trued up before the next one goes. Returns 1 if it waited. Under the lock. */
static int wait_first_timing(uint64_t *now)
{
    uint64_t t0 = *now, deadline = *now + S.first_wait_ns;
    int waited = 0;
    while ((provisional_in_flight() || S.npending >= MAX_PENDING) && *now < deadline &&
           !__atomic_load_n(&g_capturing, __ATOMIC_ACQUIRE)) {
        waited = 1;
        publish();
        unlock();
        /* short kernels come back soon: poll at half the usual cost, 20 µs to DILU_MIN_WAIT_US */
        double nap_us = fmax(20.0, fmin(S.min_wait_us, S.global_cost_us / 2.0));
        struct timespec ts = {0, (long)(nap_us * 1000.0)};
        nanosleep(&ts, NULL);
        lock();
        *now = dilu_now_ns();
        refresh_grant(*now);
        refill(*now);
        S.next_poll_ns = 0;
        poll_samples(*now);
    }
    if (waited)
        SH->wait_us += (double)(*now - t0) / 1000.0;
    return waited;
}

/* Waits for tokens, charges the launch; returns 1 if this launch should be timed. Under the lock. */
static int admit(uintptr_t key, double *charged, int *provisional)
{
    uint64_t now = dilu_now_ns();
    note_cycle(now);
    refresh_grant(now);
    refill(now);
    poll_samples(now);
    int first_waited = 0;
again:;
    /* q >= w: the kernels may keep the device busy all the time, so let the launches run up
     * to a burst ahead (estimation error must not idle the device); the debt still bounds the
     * queued work, which keeps a later, lower grant quick to take effect */
    double floor_us = S.rate >= 1.0 ? -S.burst_us : 0.0;
    if (SH->tokens < floor_us) {
        uint64_t t0 = now;
        SH->throttled++;
        /* wait until the balance covers this launch, and at least DILU_MIN_WAIT_US of refill:
         * same rate, fewer wake-ups for short kernels (a few launches go per wake-up) */
        struct cost *c0 = cost_of(key);
        double want = c0 ? c0->us : S.global_cost_us;
        if (want < S.min_wait_us * S.rate)
            want = S.min_wait_us * S.rate;
        if (want > S.burst_us / 2) /* leave room under the cap for an oversleep's refill */
            want = S.burst_us / 2;
        double target;
        /* q >= w: wait only until a wake-up quantum of run-ahead is back */
        double ahead = fmin(S.min_wait_us * S.rate, S.burst_us / 2);
        while (SH->tokens < (target = S.rate >= 1.0 ? -S.burst_us + ahead : want)) {
            double need_ns = (target - SH->tokens) / S.rate * 1000.0 + 1000.0;
            int64_t wait = need_ns > 1e9 ? 1000000000ll : (int64_t)need_ns; /* re-check each s */
            struct dilu_cb *cb = S.cb;
            uint32_t epoch = cb ? dilu_load_u32(&cb->grant_epoch) : 0;
            publish();
            unlock();
            if (cb) /* a new grant (epoch bump) wakes us at once */
                dilu_futex_wait(&cb->grant_epoch, epoch, wait);
            else {
                struct timespec ts = {wait / 1000000000ll, wait % 1000000000ll};
                nanosleep(&ts, NULL);
            }
            lock();
            now = dilu_now_ns();
            refresh_grant(now);
            refill(now);
            poll_samples(now);
        }
        SH->wait_us += (double)(now - t0) / 1000.0;
    }
    struct cost *c = cost_of(key);
    int unknown = !c || c->samples == 0;
    if (unknown && !first_waited && S.first_wait_ns && r_event_create) {
        first_waited = 1;
        /* the true-up of the launch waited for may have left a debt: pay it first */
        if (wait_first_timing(&now) && SH->tokens < floor_us)
            goto again;
    }
    double cost = c ? c->us : S.global_cost_us;
    if (unknown) {
        /* what launches were seen to cost so far, at least the default */
        cost = fmax(cost, fmax(S.global_cost_us, S.default_cost_us));
        if (!c || S.npending >= MAX_PENDING || !r_event_create || __atomic_load_n(&g_capturing, __ATOMIC_ACQUIRE))
            cost = fmax(cost, S.max_cost_us); /* it will not be timed, never trued up: the worst known */
    }
    SH->tokens -= cost;
    SH->busy_us += cost;
    SH->launches++;
    S.last_launch_ns = now;
    S.last_cost_us = cost;
    /* the queued work's estimated end: launches run back to back behind earlier ones */
    S.work_end_ns = (S.work_end_ns > now ? S.work_end_ns : now) + (uint64_t)(cost * 1000.0);
    *charged = cost;
    *provisional = !c || c->samples == 0;
    int sample = 0;
    if (c) {
        c->launches++;
        /* every launch while the key has no sample yet (each one is trued up), then until 3
         * samples, then every sample_every-th and at least every DILU_SAMPLE_FLOOR_MS */
        sample = (c->samples == 0 || c->samples + c->pending < 3 || c->launches % S.sample_every == 0 ||
                  (now - c->last_sample_ns > S.sample_floor_ns && !c->pending)) &&
                 S.npending < MAX_PENDING && r_event_create &&
                 /* no stream queries while a graph is captured anywhere in the process: in
                  * global capture mode they would invalidate the capture */
                 !__atomic_load_n(&g_capturing, __ATOMIC_ACQUIRE);
        if (sample) {
            c->pending++;
            c->last_sample_ns = now;
        }
    }
    publish();
    return sample;
}

static int capturing(CUstream h, int ptsz)
{
    if (!__atomic_load_n(&g_capturing, __ATOMIC_ACQUIRE))
        return 0;
    int st = 0;
    CUresult (*f)(CUstream, int *) = ptsz && r_is_capturing_ptsz ? r_is_capturing_ptsz : r_is_capturing;
    if (f && f(h, &st) == CUDA_SUCCESS)
        return st != CU_STREAM_CAPTURE_STATUS_NONE;
    return 0;
}

/* Does the stream still have work queued? (Asked on timed launches only.) */
static int stream_busy(CUstream h, int ptsz)
{
    CUresult (*q)(CUstream) = ptsz && r_stream_query_ptsz ? r_stream_query_ptsz : r_stream_query;
    return q ? q(h) == CUDA_ERROR_NOT_READY : 1;
}

struct timing {
    int on;
    CUevent start0, start, end;
    uintptr_t key;
    double charged;
    int provisional;
    int ptsz;
    uint64_t host0_ns; /* host clock before the start events: a slow launch call spoils a sample */
    int busy;
    CUstream stream;
};

/* Throttles one launch on `h`; fills *t when it is to be timed. Returns 0 if the caller must
 * just forward (capturing stream or not initialised). */
static int before_launch(uintptr_t key, CUstream h, int ptsz, struct timing *t)
{
    t->on = 0;
    if (!g_ready || capturing(h, ptsz))
        return 0;
    lock();
    int sample = admit(key, &t->charged, &t->provisional);
    unlock();
    if (sample) {
        CUresult (*rec)(CUevent, CUstream) = ptsz && r_event_record_ptsz ? r_event_record_ptsz : r_event_record;
        t->start0 = t->start = t->end = NULL;
        if (r_event_create(&t->start0, 0) == CUDA_SUCCESS && r_event_create(&t->start, 0) == CUDA_SUCCESS &&
            r_event_create(&t->end, 0) == CUDA_SUCCESS &&
            ((t->busy = stream_busy(h, ptsz)), (t->host0_ns = dilu_now_ns())) &&
            rec(t->start0, h) == CUDA_SUCCESS && rec(t->start, h) == CUDA_SUCCESS) {
            t->on = 1;
            t->key = key;
            t->ptsz = ptsz;
            t->stream = h;
            return 1;
        }
        if (t->start0)
            r_event_destroy(t->start0);
        if (t->start)
            r_event_destroy(t->start);
        if (t->end)
            r_event_destroy(t->end);
        lock(); /* could not time it: release the reservation */
        struct cost *c = cost_of(key);
        if (c && c->pending)
            c->pending--;
        unlock();
    }
    return 1;
}

static void after_launch(struct timing *t, CUresult r)
{
    if (!t->on)
        return;
    CUresult (*rec)(CUevent, CUstream) = t->ptsz && r_event_record_ptsz ? r_event_record_ptsz : r_event_record;
    /* the host was preempted between the start events and the launch: on an idle stream that
     * delay would read as kernel time, so the sample is dropped */
    int quick = dilu_now_ns() - t->host0_ns <= (uint64_t)(S.max_host_us * 1000.0);
    /* a provisional launch is kept anyway: its true-up then uses the whole record span */
    int ok = (quick || t->provisional) && r == CUDA_SUCCESS && rec(t->end, t->stream) == CUDA_SUCCESS;
    lock();
    if (ok && S.npending < MAX_PENDING) {
        S.pending[S.npending++] = (struct sample){t->key, t->start0, t->start, t->end, t->charged, t->provisional,
                                                  t->busy, !quick};
    } else {
        struct cost *c = cost_of(t->key);
        if (c && c->pending)
            c->pending--;
        r_event_destroy(t->start0);
        r_event_destroy(t->start);
        r_event_destroy(t->end);
    }
    unlock();
}

/* ------------------------------------------------------------------ device memory accounting */

/* What each allocation of this process was charged, by kind of handle (device pointer, generic
 * allocation handle, array) and value: open addressing, linear probing, backward-shift deletion.
 * Process-local (a forked child starts empty: it cannot free its parent's memory), guarded by the
 * lock. */
enum { MC_PTR = 1, MC_HANDLE, MC_ARRAY };

struct mem_entry {
    uint64_t key;
    uint64_t bytes;
    uint32_t cls; /* 0: empty */
};

static struct {
    struct mem_entry *tab;
    uint32_t cap, n; /* cap: a power of two */
    int proc;        /* this process's index in SH->mem_procs, -1 unknown */
    pid_t proc_pid;
} M = {NULL, 0, 0, -1, 0};

static uint32_t mem_home(uint32_t cls, uint64_t key, uint32_t cap)
{
    uint64_t h = (key ^ ((uint64_t)cls << 61)) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(h >> 32) & (cap - 1);
}

static int mem_grow(void)
{
    uint32_t cap = M.cap ? 2 * M.cap : 256;
    struct mem_entry *t = calloc(cap, sizeof *t);
    if (!t)
        return 0;
    for (uint32_t i = 0; i < M.cap; i++) {
        struct mem_entry *e = &M.tab[i];
        if (!e->cls)
            continue;
        uint32_t j = mem_home(e->cls, e->key, cap);
        while (t[j].cls)
            j = (j + 1) & (cap - 1);
        t[j] = *e;
    }
    free(M.tab);
    M.tab = t;
    M.cap = cap;
    return 1;
}

static int mem_find(uint32_t cls, uint64_t key)
{
    if (!M.cap)
        return -1;
    for (uint32_t i = mem_home(cls, key, M.cap);; i = (i + 1) & (M.cap - 1)) {
        if (!M.tab[i].cls)
            return -1;
        if (M.tab[i].cls == cls && M.tab[i].key == key)
            return (int)i;
    }
}

static void mem_erase(uint32_t i)
{
    uint32_t mask = M.cap - 1;
    for (uint32_t j = i;;) {
        j = (j + 1) & mask;
        if (!M.tab[j].cls)
            break;
        uint32_t k = mem_home(M.tab[j].cls, M.tab[j].key, M.cap);
        /* move j back into the hole at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (k <= i || k > j) : (k <= i && k > j)) {
            M.tab[i] = M.tab[j];
            i = j;
        }
    }
    M.tab[i].cls = 0;
    M.n--;
}

/* This process's entry in the shared per-process table (made on first use; -1 if it is full). */
static int mem_proc(int make)
{
    pid_t me = getpid();
    if (M.proc_pid != me) {
        M.proc_pid = me;
        M.proc = -1;
    }
    if (M.proc >= 0 && SH->mem_procs[M.proc].pid == (uint32_t)me)
        return M.proc;
    M.proc = -1;
    int spare = -1;
    for (int i = 0; i < MEM_PROCS; i++) {
        if (SH->mem_procs[i].pid == (uint32_t)me)
            return M.proc = i;
        if (!SH->mem_procs[i].pid && spare < 0)
            spare = i;
    }
    if (!make || spare < 0)
        return -1;
    SH->mem_procs[spare].pid = (uint32_t)me;
    SH->mem_procs[spare].bytes = 0;
    return M.proc = spare;
}

static void mem_count(int64_t delta)
{
    uint64_t d = delta < 0 ? (uint64_t)-delta : (uint64_t)delta;
    if (delta >= 0) {
        SH->mem_used += d;
    } else {
        SH->mem_used -= d < SH->mem_used ? d : SH->mem_used;
    }
    int p = mem_proc(delta > 0);
    if (p >= 0) {
        if (delta >= 0)
            SH->mem_procs[p].bytes += d;
        else
            SH->mem_procs[p].bytes -= d < SH->mem_procs[p].bytes ? d : SH->mem_procs[p].bytes;
    }
}

/* Gives back what processes of the tree that died held (the driver freed it with them). */
static void mem_reclaim_dead(void)
{
    pid_t me = getpid();
    for (int i = 0; i < MEM_PROCS; i++) {
        uint32_t pid = SH->mem_procs[i].pid;
        if (!pid || pid == (uint32_t)me || pid_alive((pid_t)pid))
            continue;
        uint64_t b = SH->mem_procs[i].bytes;
        SH->mem_used -= b < SH->mem_used ? b : SH->mem_used;
        SH->mem_procs[i].pid = 0;
        SH->mem_procs[i].bytes = 0;
    }
}

/* The reservation in effect: the block's (when it is mapped and sets one), else the
 * environment's; 0: none. Under the lock. */
static uint64_t mem_limit(void)
{
    if (!S.cb)
        try_open_block(dilu_now_ns());
    uint64_t limit = S.cb ? dilu_load_u64(&S.cb->mem_limit_bytes) : 0;
    return limit ? limit : S.mem_limit_env;
}

static int mem_fits(uint64_t limit, uint64_t bytes)
{
    if (!limit) /* count only (an absurd size that would wrap the count goes to no device either) */
        return bytes <= UINT64_MAX - SH->mem_used;
    return SH->mem_used <= limit && bytes <= limit - SH->mem_used;
}

/* Reserves `bytes` before the driver is asked for them; 0 (and one refusal counted) when they
 * would go past the reservation. Under the lock. */
static int mem_reserve(uint64_t bytes)
{
    uint64_t limit = mem_limit();
    if (!mem_fits(limit, bytes)) {
        mem_reclaim_dead();
        if (!mem_fits(limit, bytes)) {
            SH->oom_refusals++;
            publish_mem();
            return 0;
        }
    }
    mem_count((int64_t)bytes);
    return 1;
}

/* Records what (cls, key) was charged. Under the lock. */
static void mem_put(uint32_t cls, uint64_t key, uint64_t bytes)
{
    int i = mem_find(cls, key);
    if (i >= 0) { /* handed out again: its earlier allocation was freed by a path not hooked here */
        mem_count(-(int64_t)M.tab[i].bytes);
        M.tab[i].bytes = bytes;
    } else if ((M.n + 1) * 2 <= M.cap || mem_grow()) {
        uint32_t j = mem_home(cls, key, M.cap);
        while (M.tab[j].cls)
            j = (j + 1) & (M.cap - 1);
        M.tab[j] = (struct mem_entry){key, bytes, cls};
        M.n++;
    } /* else: no memory for the entry; the bytes stay counted (never credited) */
}

/* The driver allocated `bytes` reserved before as (cls, key). Under the lock. */
static void mem_commit(uint32_t cls, uint64_t key, uint64_t bytes)
{
    mem_put(cls, key, bytes);
    if (SH->mem_used > SH->mem_peak)
        SH->mem_peak = SH->mem_used;
    publish_mem();
}

/* Before a free: forgets (cls, key) and returns what it was charged (0 if unknown). Under the lock. */
static uint64_t mem_take(uint32_t cls, uint64_t key)
{
    int i = mem_find(cls, key);
    if (i < 0)
        return 0;
    uint64_t bytes = M.tab[i].bytes;
    mem_erase((uint32_t)i);
    return bytes;
}

/* After the driver answered a free of (cls, key) taken with mem_take: credit it, or keep it when
 * the free failed. */
static void mem_settle_free(uint32_t cls, uint64_t key, uint64_t bytes, CUresult r)
{
    if (!SH || !bytes)
        return;
    lock();
    if (r == CUDA_SUCCESS) {
        mem_count(-(int64_t)bytes);
        publish_mem();
    } else {
        mem_put(cls, key, bytes); /* still allocated: still counted */
    }
    unlock();
}

static void mem_forget_all(void)
{
    free(M.tab);
    M.tab = NULL;
    M.cap = M.n = 0;
    M.proc = -1;
    M.proc_pid = 0;
}

/* ------------------------------------------------------------------ init and fork */

static void atfork_prepare(void) { lock(); }
static void atfork_parent(void) { unlock(); }

static void atfork_child(void)
{
    /* The child shares the bucket and counters (the page is MAP_SHARED; the parent's handler
     * releases the lock it took in prepare). It does not write the block (one writer: the
     * parent) and drops the parent's pending timings (their events belong to the parent). */
    if (g_sh_private) /* no shared page: a private copy of a lock held at fork */
        pthread_mutex_init(&SH->mu, NULL);
    S.forked = S.writer && !g_sh_private;
    S.writer = 0;
    S.npending = 0;
    mem_forget_all(); /* its memory is its own: it cannot free what its parent allocated */
    for (int i = 0; i < COST_SLOTS; i++)
        S.costs[i].pending = 0;
}

static void resolve_real_dlsym(void)
{
    if (real_dlsym)
        return;
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !real_dlsym; i++)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

static void *wrapper_for(int i); /* defined with the wrappers below */
static void init_body(void);

/* The driver may hand out entry points through cuGetProcAddress that are not the exported
 * symbols; ask it for each hooked base name of a table (slots 0..n-1, alternatives at i + n) and
 * give any new pointer its own wrapper. */
static void discover_in(struct slot *t, int n, void *(*wrap)(int))
{
    gpa2_fn gpa2 = (gpa2_fn)g_slot[9].real;
    gpa_fn gpa = (gpa_fn)g_slot[8].real;
    int versions[] = {12000, 13000};
    for (int i = 0; i < n; i++) {
        /* cuGetProcAddress itself is routed by its exports only: a versioned entry point of it
         * could have the other signature (4 vs 5 arguments) */
        if (!t[i].base || t[i].kind == K_GPA || t[i].kind == K_GPA2)
            continue;
        for (int v = 0; v < 2; v++) {
            void *p = NULL;
            cuuint64_t flags = t[i].ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                         : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
            int st = 0;
            CUresult r = gpa2 ? gpa2(t[i].base, &p, versions[v], flags, &st)
                              : gpa ? gpa(t[i].base, &p, versions[v], flags) : CUDA_ERROR_NOT_FOUND;
            if (r != CUDA_SUCCESS || !p || lookup_wrapper(p) || is_own(p))
                continue;
            int j = i + n;
            if (!t[j].real) {
                t[j] = t[i];
                t[j].real = p;
                t[j].wrapper = wrap(j);
                if (g_debug)
                    fprintf(stderr, "dilu interceptor: alternative entry for %s\n", t[i].name);
            }
        }
    }
}

static void *mwrapper_for(int i); /* defined with the memory wrappers below */

static void discover_alternatives(void)
{
    discover_in(g_slot, NPRIMARY, wrapper_for);
    discover_in(g_mslot, NMPRIMARY, mwrapper_for);
}

static __thread int t_in_init; /* the driver's own start-up may call dlsym: leave it alone */

static void init(void)
{
    t_in_init = 1;
    init_body();
    t_in_init = 0;
}

static void init_body(void)
{
    resolve_real_dlsym();
    const char *dbg = getenv("DILU_INTERCEPT_DEBUG");
    g_debug = dbg && *dbg && *dbg != '0' ? (*dbg == '2' ? 2 : 1) : 0;
    const char *path = getenv("DILU_REAL_LIBCUDA");
    g_cuda = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!g_cuda || !real_dlsym) {
        fprintf(stderr, "dilu interceptor: cannot open the CUDA driver (%s)\n", dlerror());
        return;
    }
    for (int i = 0; i < NPRIMARY; i++) {
        g_slot[i].real = real_dlsym(g_cuda, g_slot[i].name);
        g_slot[i].wrapper = wrapper_for(i);
    }
    for (int i = 0; i < NMPRIMARY; i++) {
        g_mslot[i].real = real_dlsym(g_cuda, g_mslot[i].name);
        g_mslot[i].wrapper = mwrapper_for(i);
    }
#define REAL(var, name) var = (__typeof__(var))real_dlsym(g_cuda, name)
    REAL(r_event_create, "cuEventCreate");
    REAL(r_event_destroy, "cuEventDestroy_v2");
    REAL(r_event_record, "cuEventRecord");
    REAL(r_event_record_ptsz, "cuEventRecord_ptsz");
    REAL(r_event_query, "cuEventQuery");
    REAL(r_event_elapsed, "cuEventElapsedTime");
    if (!r_event_elapsed)
        REAL(r_event_elapsed, "cuEventElapsedTime_v2");
    REAL(r_is_capturing, "cuStreamIsCapturing");
    REAL(r_is_capturing_ptsz, "cuStreamIsCapturing_ptsz");
    REAL(r_stream_query, "cuStreamQuery");
    REAL(r_stream_query_ptsz, "cuStreamQuery_ptsz");
#undef REAL
    if (!r_event_destroy || !r_event_record || !r_event_query || !r_event_elapsed)
        r_event_create = NULL; /* cannot calibrate: estimates stay at their defaults */

    double width = env_f("DILU_WIDTH", env_f("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", 100.0) / 100.0);
    if (!(width > 0.0) || width > 1.0)
        width = 1.0;
    S.width_ppm = frac_ppm(width);
    S.cb_path = getenv("DILU_CB");
    /* no block and no request quota: an unmanaged process, metered at its full width */
    S.request_ppm = frac_ppm(env_f("DILU_REQUEST_QUOTA", width));
    S.min_ppm = frac_ppm(env_f("DILU_MIN_QUOTA", 0.01));
    if (S.min_ppm == 0)
        S.min_ppm = 1;
    S.burst_us = env_f("DILU_BURST_US", 2000.0);
    S.min_wait_us = env_f("DILU_MIN_WAIT_US", 200.0);
    S.cycle_gap_ns = env_f("DILU_CYCLE_GAP_US", 1000.0) * 1000.0;
    S.default_cost_us = env_f("DILU_DEFAULT_COST_US", 100.0);
    /* two back-to-back event records land within a few µs; a wider gap means the host thread
     * was preempted in between and the sample says nothing about the kernel */
    S.max_gap_us = env_f("DILU_SAMPLE_MAX_GAP_US", 20.0);
    /* from the first start event to the launch call's return: longer means the thread was
     * preempted and, on an idle stream, the delay would read as kernel time */
    S.max_host_us = env_f("DILU_SAMPLE_MAX_HOST_US", 100.0);
    S.global_cost_us = S.default_cost_us;
    S.max_cost_us = S.default_cost_us;
    double first_wait_ms = env_f("DILU_FIRST_WAIT_MS", 100.0); /* 0: never wait */
    S.first_wait_ns = first_wait_ms > 0.0 ? (uint64_t)(fmin(first_wait_ms, 10000.0) * 1e6) : 0;
    double every = env_f("DILU_SAMPLE_EVERY", 128.0);
    S.sample_every = every >= 1.0 ? (uint32_t)every : 128;
    S.sample_floor_ns = (uint64_t)(env_f("DILU_SAMPLE_FLOOR_MS", 250.0) * 1e6);
    S.mem_limit_env = env_bytes("DILU_MEMORY_LIMIT_BYTES");
    make_shared();
    set_rate(S.request_ppm);
    SH->refill_ns = dilu_now_ns();
    try_open_block(SH->refill_ns);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    discover_alternatives();
    __atomic_store_n(&g_ready, 1, __ATOMIC_RELEASE);
    if (g_debug)
        fprintf(stderr, "dilu interceptor: pid %d ready, quota %.3f width %.3f block %s memory limit %llu\n",
                getpid(), S.quota_ppm / 1e6, S.width_ppm / 1e6, S.cb ? "mapped" : "none",
                (unsigned long long)(S.cb && S.cb->mem_limit_bytes ? S.cb->mem_limit_bytes : S.mem_limit_env));
}

static inline void ensure_init(void)
{
    if (__builtin_expect(!__atomic_load_n(&g_ready, __ATOMIC_ACQUIRE), 0))
        pthread_once(&g_once, init);
}

__attribute__((constructor)) static void on_load(void) { resolve_real_dlsym(); }

/* ------------------------------------------------------------------ wrappers */

/* One cost key per kernel and launch geometry: the same CUfunction launched over a bigger grid
 * is a different amount of work. Never 0 (0 marks a free slot). */
static inline uintptr_t geometry_key(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                     unsigned bx, unsigned by, unsigned bz, unsigned sh)
{
    uint64_t h = (uint64_t)(uintptr_t)f;
    uint64_t g[7] = {gx, gy, gz, bx, by, bz, sh};
    for (int i = 0; i < 7; i++)
        h = (h ^ g[i]) * 0x100000001B3ull;
    return (uintptr_t)(h ? h : 1);
}

static CUresult do_launch(int i, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned sh, CUstream h, void **p, void **e)
{
    ensure_init();
    launch_fn real = (launch_fn)g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct timing t;
    before_launch(geometry_key(f, gx, gy, gz, bx, by, bz, sh), h, g_slot[i].ptsz, &t);
    CUresult r = real(f, gx, gy, gz, bx, by, bz, sh, h, p, e);
    after_launch(&t, r);
    return r;
}

static CUresult do_launch_ex(int i, const CUlaunchConfig *cfg, CUfunction f, void **p, void **e)
{
    ensure_init();
    launch_ex_fn real = (launch_ex_fn)g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!cfg)
        return real(cfg, f, p, e);
    struct timing t;
    before_launch(geometry_key(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX,
                               cfg->blockDimY, cfg->blockDimZ, cfg->sharedMemBytes),
                  cfg->hStream, g_slot[i].ptsz, &t);
    CUresult r = real(cfg, f, p, e);
    after_launch(&t, r);
    return r;
}

static CUresult do_coop(int i, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned sh, CUstream h, void **p)
{
    ensure_init();
    coop_fn real = (coop_fn)g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct timing t;
    before_launch(geometry_key(f, gx, gy, gz, bx, by, bz, sh), h, g_slot[i].ptsz, &t);
    CUresult r = real(f, gx, gy, gz, bx, by, bz, sh, h, p);
    after_launch(&t, r);
    return r;
}

static CUresult do_graph(int i, CUgraphExec g, CUstream h)
{
    ensure_init();
    graph_fn real = (graph_fn)g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct timing t; /* charged the graph's estimated cost, calibrated like a kernel */
    before_launch((uintptr_t)g, h, g_slot[i].ptsz, &t);
    CUresult r = real(g, h);
    after_launch(&t, r);
    return r;
}

static CUresult route(CUresult r, void **pfn)
{
    if (r == CUDA_SUCCESS && pfn && *pfn) {
        void *w = lookup_wrapper(*pfn);
        if (w)
            *pfn = w;
    }
    return r;
}

static CUresult do_gpa(int i, const char *sym, void **pfn, int ver, cuuint64_t flags)
{
    ensure_init();
    gpa_fn real = (gpa_fn)g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    return route(real(sym, pfn, ver, flags), pfn);
}

static CUresult do_gpa2(int i, const char *sym, void **pfn, int ver, cuuint64_t flags, int *st)
{
    ensure_init();
    gpa2_fn real = (gpa2_fn)g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    return route(real(sym, pfn, ver, flags, st), pfn);
}

static CUresult do_begin(int i, CUstream h, int mode)
{
    ensure_init();
    void *real = g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = g_slot[i].kind == K_BEGIN2 ? ((begin2_fn)real)(h, mode) : ((begin_fn)real)(h);
    if (r == CUDA_SUCCESS)
        __atomic_add_fetch(&g_capturing, 1, __ATOMIC_ACQ_REL);
    return r;
}

static CUresult do_end(int i, CUstream h, CUgraph *g)
{
    ensure_init();
    end_fn real = (end_fn)g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(h, g);
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) {
        int c = __atomic_load_n(&g_capturing, __ATOMIC_ACQUIRE);
        while (c > 0 && !__atomic_compare_exchange_n(&g_capturing, &c, c - 1, 0, __ATOMIC_ACQ_REL,
                                                     __ATOMIC_ACQUIRE)) {
        }
    }
    return r;
}

static void note_sync(CUresult r)
{
    if (r != CUDA_SUCCESS || !__atomic_load_n(&g_ready, __ATOMIC_ACQUIRE))
        return;
    lock();
    S.sync_ns = dilu_now_ns();
    unlock();
}

static CUresult do_sync(int i, void *arg)
{
    ensure_init();
    void *real = g_slot[i].real;
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    /* one pointer argument for every name: cuCtxSynchronize's CUDA 13 entry point
     * (cuCtxSynchronize_v2, handed out by cuGetProcAddress at version 13000) takes the context,
     * and the legacy (void) one ignores it (the C calling convention leaves it unread) */
    CUresult r = ((CUresult(*)(void *))real)(arg);
    note_sync(r);
    return r;
}

#define LAUNCH_ARGS CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, \
                    unsigned bz, unsigned sh, CUstream h
#define WRAPPERS(I, VIS, LAUNCH, LAUNCH_PTSZ, EX, EX_PTSZ, COOP, COOP_PTSZ, GRAPH, GRAPH_PTSZ, GPA,  \
                 GPA2, BEGIN, BEGIN2, BEGIN_PTSZ, BEGIN2_PTSZ, END, END_PTSZ, SYNC_S, SYNC_S_PTSZ,   \
                 SYNC_EV)                                                                  \
    VIS CUresult LAUNCH(LAUNCH_ARGS, void **p, void **e) { return do_launch(I + 0, f, gx, gy, gz, bx, by, bz, sh, h, p, e); } \
    VIS CUresult LAUNCH_PTSZ(LAUNCH_ARGS, void **p, void **e) { return do_launch(I + 1, f, gx, gy, gz, bx, by, bz, sh, h, p, e); } \
    VIS CUresult EX(const CUlaunchConfig *c, CUfunction f, void **p, void **e) { return do_launch_ex(I + 2, c, f, p, e); } \
    VIS CUresult EX_PTSZ(const CUlaunchConfig *c, CUfunction f, void **p, void **e) { return do_launch_ex(I + 3, c, f, p, e); } \
    VIS CUresult COOP(LAUNCH_ARGS, void **p) { return do_coop(I + 4, f, gx, gy, gz, bx, by, bz, sh, h, p); } \
    VIS CUresult COOP_PTSZ(LAUNCH_ARGS, void **p) { return do_coop(I + 5, f, gx, gy, gz, bx, by, bz, sh, h, p); } \
    VIS CUresult GRAPH(CUgraphExec g, CUstream h) { return do_graph(I + 6, g, h); }                   \
    VIS CUresult GRAPH_PTSZ(CUgraphExec g, CUstream h) { return do_graph(I + 7, g, h); }              \
    VIS CUresult GPA(const char *s, void **pfn, int v, cuuint64_t fl) { return do_gpa(I + 8, s, pfn, v, fl); } \
    VIS CUresult GPA2(const char *s, void **pfn, int v, cuuint64_t fl, int *st) { return do_gpa2(I + 9, s, pfn, v, fl, st); } \
    VIS CUresult BEGIN(CUstream h) { return do_begin(I + 10, h, 0); }                                 \
    VIS CUresult BEGIN2(CUstream h, int m) { return do_begin(I + 11, h, m); }                         \
    VIS CUresult BEGIN_PTSZ(CUstream h) { return do_begin(I + 12, h, 0); }                            \
    VIS CUresult BEGIN2_PTSZ(CUstream h, int m) { return do_begin(I + 13, h, m); }                    \
    VIS CUresult END(CUstream h, CUgraph *g) { return do_end(I + 14, h, g); }                         \
    VIS CUresult END_PTSZ(CUstream h, CUgraph *g) { return do_end(I + 15, h, g); }                  \
    VIS CUresult SYNC_S(CUstream h) { return do_sync(I + 16, h); }                                   \
    VIS CUresult SYNC_S_PTSZ(CUstream h) { return do_sync(I + 17, h); }                              \
    VIS CUresult SYNC_EV(CUevent e) { return do_sync(I + 19, e); }

/* primary slots: the exported driver names */
WRAPPERS(0, API, cuLaunchKernel, cuLaunchKernel_ptsz, cuLaunchKernelEx, cuLaunchKernelEx_ptsz,
         cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz, cuGraphLaunch, cuGraphLaunch_ptsz,
         cuGetProcAddress, cuGetProcAddress_v2, cuStreamBeginCapture, cuStreamBeginCapture_v2,
         cuStreamBeginCapture_ptsz, cuStreamBeginCapture_v2_ptsz, cuStreamEndCapture,
         cuStreamEndCapture_ptsz, cuStreamSynchronize, cuStreamSynchronize_ptsz, cuEventSynchronize)
/* alternative slots: entry points the driver hands out that differ from its exports */
WRAPPERS(NPRIMARY, static, alt_launch, alt_launch_ptsz, alt_ex, alt_ex_ptsz, alt_coop, alt_coop_ptsz,
         alt_graph, alt_graph_ptsz, alt_gpa, alt_gpa2, alt_begin, alt_begin2, alt_begin_ptsz,
         alt_begin2_ptsz, alt_end, alt_end_ptsz, alt_sync_s, alt_sync_s_ptsz, alt_sync_ev)

/* cuCtxSynchronize: the export keeps cuda.h's (void) prototype; the alternative slot holds what
 * cuGetProcAddress hands out, from CUDA 13 on cuCtxSynchronize_v2(CUcontext), so its wrapper
 * forwards the context (a (void) wrapper passed garbage: "context is destroyed" on a real driver) */
API CUresult cuCtxSynchronize(void) { return do_sync(18, NULL); }
static CUresult alt_sync_ctx(CUcontext ctx) { return do_sync(NPRIMARY + 18, ctx); }

static void *wrapper_for(int i)
{
    static void *const table[NSLOTS] = {
        cuLaunchKernel, cuLaunchKernel_ptsz, cuLaunchKernelEx, cuLaunchKernelEx_ptsz,
        cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz, cuGraphLaunch, cuGraphLaunch_ptsz,
        cuGetProcAddress, cuGetProcAddress_v2, cuStreamBeginCapture, cuStreamBeginCapture_v2,
        cuStreamBeginCapture_ptsz, cuStreamBeginCapture_v2_ptsz, cuStreamEndCapture,
        cuStreamEndCapture_ptsz, cuStreamSynchronize, cuStreamSynchronize_ptsz, cuCtxSynchronize,
        cuEventSynchronize,
        alt_launch, alt_launch_ptsz, alt_ex, alt_ex_ptsz, alt_coop, alt_coop_ptsz, alt_graph,
        alt_graph_ptsz, alt_gpa, alt_gpa2, alt_begin, alt_begin2, alt_begin_ptsz, alt_begin2_ptsz,
        alt_end, alt_end_ptsz, alt_sync_s, alt_sync_s_ptsz, alt_sync_ctx, alt_sync_ev,
    };
    return table[i];
}

/* ------------------------------------------------------------------ memory wrappers */

static CUresult mem_missing(void)
{
    return __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE) ? CUDA_ERROR_NOT_FOUND : CUDA_ERROR_NOT_INITIALIZED;
}

/* Before an allocation of `bytes` through memory slot i: CUDA_SUCCESS when they are reserved and
 * the caller may call the driver (then mem_end), else what to return without calling it. */
static CUresult mem_begin(int i, uint64_t bytes)
{
    ensure_init();
    if (!g_mslot[i].real)
        return mem_missing();
    if (!bytes) /* an empty request: the driver answers it */
        return CUDA_SUCCESS;
    lock();
    int ok = mem_reserve(bytes);
    unlock();
    return ok ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* After the driver answered an allocation reserved by mem_begin: record it, or give back. */
static void mem_end(CUresult r, uint32_t cls, uint64_t key, uint64_t bytes)
{
    if (!bytes)
        return;
    lock();
    if (r == CUDA_SUCCESS) {
        mem_commit(cls, key, bytes);
    } else {
        mem_count(-(int64_t)bytes);
        publish_mem();
    }
    unlock();
}

static uint64_t mem_take_locked(uint32_t cls, uint64_t key)
{
    if (!key || !SH)
        return 0;
    lock();
    uint64_t b = mem_take(cls, key);
    unlock();
    return b;
}

static CUresult do_malloc(int i, CUdeviceptr *d, size_t n)
{
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((malloc_fn)g_mslot[i].real)(d, n);
    mem_end(r, MC_PTR, r == CUDA_SUCCESS && d ? *d : 0, n);
    return r;
}

static CUresult do_malloc_v1(int i, CUdeviceptr_v1 *d, unsigned int n)
{
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((malloc_v1_fn)g_mslot[i].real)(d, n);
    mem_end(r, MC_PTR, r == CUDA_SUCCESS && d ? *d : 0, n);
    return r;
}

static CUresult do_managed(int i, CUdeviceptr *d, size_t n, unsigned int flags)
{
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((managed_fn)g_mslot[i].real)(d, n, flags);
    mem_end(r, MC_PTR, r == CUDA_SUCCESS && d ? *d : 0, n);
    return r;
}

/* Reserved as rows rounded up to DILU_PITCH_ALIGN; trued up to the pitch the driver chose (a
 * wider pitch that no longer fits is freed and refused). */
static CUresult do_pitch(int i, CUdeviceptr *d, size_t *pitch, size_t w, size_t h, unsigned int elem)
{
    uint64_t est = 0;
    if (w && h) {
        uint64_t row = w > UINT64_MAX - DILU_PITCH_ALIGN ? UINT64_MAX
                                                          : (w + DILU_PITCH_ALIGN - 1) / DILU_PITCH_ALIGN * DILU_PITCH_ALIGN;
        est = h > UINT64_MAX / row ? UINT64_MAX : row * h;
    }
    CUresult r = mem_begin(i, est);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((pitch_fn)g_mslot[i].real)(d, pitch, w, h, elem);
    if (r != CUDA_SUCCESS || !est || !d || !pitch) {
        mem_end(r, MC_PTR, r == CUDA_SUCCESS && d ? *d : 0, est);
        return r;
    }
    uint64_t actual = *pitch && h > UINT64_MAX / *pitch ? UINT64_MAX : (uint64_t)*pitch * h;
    if (actual > est) {
        lock();
        int ok = mem_reserve(actual - est);
        unlock();
        if (!ok) {
            free_fn f = (free_fn)g_mslot[M_FREE].real;
            if (f)
                f(*d);
            mem_end(CUDA_ERROR_OUT_OF_MEMORY, MC_PTR, 0, est);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (actual < est) {
        lock();
        mem_count(-(int64_t)(est - actual));
        unlock();
    }
    mem_end(r, MC_PTR, *d, actual);
    return r;
}

static CUresult do_malloc_async(int i, CUdeviceptr *d, size_t n, CUstream h)
{
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((malloc_async_fn)g_mslot[i].real)(d, n, h);
    mem_end(r, MC_PTR, r == CUDA_SUCCESS && d ? *d : 0, n);
    return r;
}

static CUresult do_malloc_pool(int i, CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream h)
{
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((malloc_pool_fn)g_mslot[i].real)(d, n, pool, h);
    mem_end(r, MC_PTR, r == CUDA_SUCCESS && d ? *d : 0, n);
    return r;
}

static CUresult do_mem_create(int i, CUmemGenericAllocationHandle *hd, size_t n,
                              const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((mem_create_fn)g_mslot[i].real)(hd, n, prop, flags);
    mem_end(r, MC_HANDLE, r == CUDA_SUCCESS && hd ? *hd : 0, n);
    return r;
}

static CUresult do_array(int i, CUarray *a, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    uint64_t n = desc ? dilu_array_bytes(desc->Width, desc->Height, 0, desc->Format, desc->NumChannels) : 0;
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((array_fn)g_mslot[i].real)(a, desc);
    mem_end(r, MC_ARRAY, r == CUDA_SUCCESS && a ? (uint64_t)(uintptr_t)*a : 0, n);
    return r;
}

static CUresult do_array3d(int i, CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    uint64_t n = desc ? dilu_array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
                                         desc->NumChannels) : 0;
    CUresult r = mem_begin(i, n);
    if (r != CUDA_SUCCESS)
        return r;
    r = ((array3d_fn)g_mslot[i].real)(a, desc);
    mem_end(r, MC_ARRAY, r == CUDA_SUCCESS && a ? (uint64_t)(uintptr_t)*a : 0, n);
    return r;
}

static CUresult do_free(int i, CUdeviceptr d)
{
    ensure_init();
    free_fn real = (free_fn)g_mslot[i].real;
    if (!real)
        return mem_missing();
    uint64_t b = mem_take_locked(MC_PTR, d);
    CUresult r = real(d);
    mem_settle_free(MC_PTR, d, b, r);
    return r;
}

static CUresult do_free_v1(int i, CUdeviceptr_v1 d)
{
    ensure_init();
    free_v1_fn real = (free_v1_fn)g_mslot[i].real;
    if (!real)
        return mem_missing();
    uint64_t b = mem_take_locked(MC_PTR, d);
    CUresult r = real(d);
    mem_settle_free(MC_PTR, d, b, r);
    return r;
}

/* Credited when the free is queued (the stream frees it in order, the reservation at once). */
static CUresult do_free_async(int i, CUdeviceptr d, CUstream h)
{
    ensure_init();
    free_async_fn real = (free_async_fn)g_mslot[i].real;
    if (!real)
        return mem_missing();
    uint64_t b = mem_take_locked(MC_PTR, d);
    CUresult r = real(d, h);
    mem_settle_free(MC_PTR, d, b, r);
    return r;
}

static CUresult do_release(int i, CUmemGenericAllocationHandle hd)
{
    ensure_init();
    release_fn real = (release_fn)g_mslot[i].real;
    if (!real)
        return mem_missing();
    uint64_t b = mem_take_locked(MC_HANDLE, hd);
    CUresult r = real(hd);
    mem_settle_free(MC_HANDLE, hd, b, r);
    return r;
}

static CUresult do_array_destroy(int i, CUarray a)
{
    ensure_init();
    array_destroy_fn real = (array_destroy_fn)g_mslot[i].real;
    if (!real)
        return mem_missing();
    uint64_t key = (uint64_t)(uintptr_t)a;
    uint64_t b = mem_take_locked(MC_ARRAY, key);
    CUresult r = real(a);
    mem_settle_free(MC_ARRAY, key, b, r);
    return r;
}

/* With a reservation: total = the reservation, free = min(reservation - used, the driver's free). */
static void mem_clip_info(uint64_t *free_b, uint64_t *total_b)
{
    if (!SH)
        return;
    lock();
    uint64_t limit = mem_limit();
    if (limit)
        mem_reclaim_dead();
    uint64_t used = SH->mem_used;
    unlock();
    if (!limit)
        return;
    uint64_t room = used < limit ? limit - used : 0;
    *total_b = limit;
    if (room < *free_b)
        *free_b = room;
}

static CUresult do_info(int i, size_t *f, size_t *t)
{
    ensure_init();
    info_fn real = (info_fn)g_mslot[i].real;
    if (!real)
        return mem_missing();
    CUresult r = real(f, t);
    if (r != CUDA_SUCCESS || !f || !t)
        return r;
    uint64_t ff = *f, tt = *t;
    mem_clip_info(&ff, &tt);
    *f = (size_t)ff;
    *t = (size_t)tt;
    return r;
}

static CUresult do_info_v1(int i, unsigned int *f, unsigned int *t)
{
    ensure_init();
    info_v1_fn real = (info_v1_fn)g_mslot[i].real;
    if (!real)
        return mem_missing();
    CUresult r = real(f, t);
    if (r != CUDA_SUCCESS || !f || !t)
        return r;
    uint64_t ff = *f, tt = *t;
    mem_clip_info(&ff, &tt);
    *f = ff > UINT32_MAX ? UINT32_MAX : (unsigned int)ff;
    *t = tt > UINT32_MAX ? UINT32_MAX : (unsigned int)tt;
    return r;
}

#define MEM_WRAPPERS(I, VIS, ALLOC, ALLOC_V1, MANAGED, PITCH, ASYNC, ASYNC_PTSZ, POOL, POOL_PTSZ,       \
                     CREATE, ARRAY, ARRAY3D, FREE, FREE_V1, FREE_ASYNC, FREE_ASYNC_PTSZ, RELEASE,       \
                     ARRAY_DESTROY, INFO, INFO_V1)                                                     \
    VIS CUresult ALLOC(CUdeviceptr *d, size_t n) { return do_malloc(I + M_ALLOC, d, n); }              \
    VIS CUresult ALLOC_V1(CUdeviceptr_v1 *d, unsigned int n) { return do_malloc_v1(I + M_ALLOC_V1, d, n); } \
    VIS CUresult MANAGED(CUdeviceptr *d, size_t n, unsigned int fl) { return do_managed(I + M_MANAGED, d, n, fl); } \
    VIS CUresult PITCH(CUdeviceptr *d, size_t *p, size_t w, size_t h, unsigned int e) { return do_pitch(I + M_PITCH, d, p, w, h, e); } \
    VIS CUresult ASYNC(CUdeviceptr *d, size_t n, CUstream h) { return do_malloc_async(I + M_ASYNC, d, n, h); } \
    VIS CUresult ASYNC_PTSZ(CUdeviceptr *d, size_t n, CUstream h) { return do_malloc_async(I + M_ASYNC_PTSZ, d, n, h); } \
    VIS CUresult POOL(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream h) { return do_malloc_pool(I + M_POOL, d, n, p, h); } \
    VIS CUresult POOL_PTSZ(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream h) { return do_malloc_pool(I + M_POOL_PTSZ, d, n, p, h); } \
    VIS CUresult CREATE(CUmemGenericAllocationHandle *hd, size_t n, const CUmemAllocationProp *p, unsigned long long fl) { return do_mem_create(I + M_CREATE, hd, n, p, fl); } \
    VIS CUresult ARRAY(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *desc) { return do_array(I + M_ARRAY, a, desc); } \
    VIS CUresult ARRAY3D(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *desc) { return do_array3d(I + M_ARRAY3D, a, desc); } \
    VIS CUresult FREE(CUdeviceptr d) { return do_free(I + M_FREE, d); }                                \
    VIS CUresult FREE_V1(CUdeviceptr_v1 d) { return do_free_v1(I + M_FREE_V1, d); }                    \
    VIS CUresult FREE_ASYNC(CUdeviceptr d, CUstream h) { return do_free_async(I + M_FREE_ASYNC, d, h); } \
    VIS CUresult FREE_ASYNC_PTSZ(CUdeviceptr d, CUstream h) { return do_free_async(I + M_FREE_ASYNC_PTSZ, d, h); } \
    VIS CUresult RELEASE(CUmemGenericAllocationHandle hd) { return do_release(I + M_RELEASE, hd); }   \
    VIS CUresult ARRAY_DESTROY(CUarray a) { return do_array_destroy(I + M_ARRAY_DESTROY, a); }         \
    VIS CUresult INFO(size_t *f, size_t *t) { return do_info(I + M_INFO, f, t); }                     \
    VIS CUresult INFO_V1(unsigned int *f, unsigned int *t) { return do_info_v1(I + M_INFO_V1, f, t); }

/* primary memory slots: the exported driver names */
MEM_WRAPPERS(0, API, cuMemAlloc_v2, cuMemAlloc, cuMemAllocManaged, cuMemAllocPitch_v2, cuMemAllocAsync,
             cuMemAllocAsync_ptsz, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz, cuMemCreate,
             cuArrayCreate_v2, cuArray3DCreate_v2, cuMemFree_v2, cuMemFree, cuMemFreeAsync,
             cuMemFreeAsync_ptsz, cuMemRelease, cuArrayDestroy, cuMemGetInfo_v2, cuMemGetInfo)
/* alternative memory slots */
MEM_WRAPPERS(NMPRIMARY, static, alt_mem_alloc, alt_mem_alloc_v1, alt_mem_managed, alt_mem_pitch,
             alt_mem_async, alt_mem_async_ptsz, alt_mem_pool, alt_mem_pool_ptsz, alt_mem_create,
             alt_array, alt_array3d, alt_mem_free, alt_mem_free_v1, alt_mem_free_async,
             alt_mem_free_async_ptsz, alt_mem_release, alt_array_destroy, alt_mem_info, alt_mem_info_v1)

static void *mwrapper_for(int i)
{
#define BOTH(M, PRIMARY, ALT) [M] = (void *)PRIMARY, [NMPRIMARY + M] = (void *)ALT
    static void *const table[NMSLOTS] = {
        BOTH(M_ALLOC, cuMemAlloc_v2, alt_mem_alloc),
        BOTH(M_ALLOC_V1, cuMemAlloc, alt_mem_alloc_v1),
        BOTH(M_MANAGED, cuMemAllocManaged, alt_mem_managed),
        BOTH(M_PITCH, cuMemAllocPitch_v2, alt_mem_pitch),
        BOTH(M_ASYNC, cuMemAllocAsync, alt_mem_async),
        BOTH(M_ASYNC_PTSZ, cuMemAllocAsync_ptsz, alt_mem_async_ptsz),
        BOTH(M_POOL, cuMemAllocFromPoolAsync, alt_mem_pool),
        BOTH(M_POOL_PTSZ, cuMemAllocFromPoolAsync_ptsz, alt_mem_pool_ptsz),
        BOTH(M_CREATE, cuMemCreate, alt_mem_create),
        BOTH(M_ARRAY, cuArrayCreate_v2, alt_array),
        BOTH(M_ARRAY3D, cuArray3DCreate_v2, alt_array3d),
        BOTH(M_FREE, cuMemFree_v2, alt_mem_free),
        BOTH(M_FREE_V1, cuMemFree, alt_mem_free_v1),
        BOTH(M_FREE_ASYNC, cuMemFreeAsync, alt_mem_free_async),
        BOTH(M_FREE_ASYNC_PTSZ, cuMemFreeAsync_ptsz, alt_mem_free_async_ptsz),
        BOTH(M_RELEASE, cuMemRelease, alt_mem_release),
        BOTH(M_ARRAY_DESTROY, cuArrayDestroy, alt_array_destroy),
        BOTH(M_INFO, cuMemGetInfo_v2, alt_mem_info),
        BOTH(M_INFO_V1, cuMemGetInfo, alt_mem_info_v1),
    };
#undef BOTH
    return table[i];
}

/* A normal exit: the driver frees the process's memory, so the tree's count drops what it held. */
__attribute__((destructor)) static void mem_at_exit(void)
{
    if (!SH || !__atomic_load_n(&g_ready, __ATOMIC_ACQUIRE))
        return;
    int r = EBUSY;
    for (int i = 0; i < 50 && (r = pthread_mutex_trylock(&SH->mu)) == EBUSY; i++)
        usleep(1000); /* bounded: never hang an exiting process */
    if (r == EOWNERDEAD)
        pthread_mutex_consistent(&SH->mu);
    else if (r != 0)
        return;
    int p = mem_proc(0);
    if (p >= 0 && SH->mem_procs[p].bytes) {
        mem_count(-(int64_t)SH->mem_procs[p].bytes);
        publish_mem();
    }
    if (p >= 0)
        SH->mem_procs[p].pid = 0;
    unlock();
}

/* dlsym: every lookup goes to the real one; a real driver entry point we wrap comes back as our
 * wrapper. Lookups are only inspected once libcuda is loaded (a pointer cannot be the driver's
 * before that), so processes that never use CUDA are left alone. */
API void *dlsym(void *handle, const char *name)
{
    resolve_real_dlsym();
    if (!real_dlsym)
        return NULL;
    void *p = real_dlsym(handle, name);
    if (!p || name[0] != 'c' || name[1] != 'u' || t_in_init)
        return p;
    if (!__atomic_load_n(&g_ready, __ATOMIC_ACQUIRE)) {
        const char *path = getenv("DILU_REAL_LIBCUDA");
        void *h = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!h)
            return p;
        dlclose(h);
        ensure_init();
    }
    void *w = lookup_wrapper(p);
    return w ? w : p;
}
