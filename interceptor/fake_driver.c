/* A fake CUDA driver (libcuda.so.1) for tests and emulated GPUs.
 *
 * It implements the part of the driver API that instances and tests use: device and context
 * queries, modules and functions (any name), kernel launches (plain, Ex, cooperative, each also
 * _ptsz), streams, events, stream capture into graphs, graph launch, cuGetProcAddress(_v2).
 *
 * Execution: each stream has a queue drained by its own worker thread. Kernels run on a virtual
 * device shared by every process that names the same emulated GPU (env DILU_FAKE_GPU): a POSIX
 * shared-memory segment holds the set of running kernels and a ring of completed-kernel records
 * (pid, context, stream, start and end in CLOCK_MONOTONIC ns, width). The segment advances a
 * virtual clock under a process-shared robust mutex. Contention is processor sharing, as MPS
 * shares the SMs (DESIGN.md section 7): a process holds its width (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
 * default 100 %) while it has kernels running, every kernel starts at once, and while the widths
 * held sum to W > 1 each progresses W times slower. Processes whose widths sum to <= 1 therefore
 * run side by side (MPS slices); two busy width-1 processes each progress at half speed, and two
 * of widths 0.7 and 0.4 at 1 / 1.1. Kernels of one process running at once share its width. An
 * event recorded just before a launch is stamped when that launch starts; one recorded behind
 * earlier work is stamped when that work ends. Start and end times are computed
 * exactly on that clock, so tests read shares from the timeline, not from sleeps; the worker
 * also sleeps (real time) until the computed end so callers see real latency.
 *
 * A kernel's solo duration (at the process's own width), first match wins:
 *   - function name "k_<us>"            e.g. k_50 lasts 50 µs, k_2.5 lasts 2.5 µs;
 *   - DILU_FAKE_KERNELS="name=us,..."  a per-name table;
 *   - function name starting "p_"       the first kernel parameter points to a float of µs;
 *   - DILU_FAKE_DEFAULT_US (default 100).
 * Width: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (percent, default 100), read at cuInit.
 * SMs: DILU_FAKE_GPU_SMS (default 108); the first process to create the GPU segment fixes it.
 * Devices (dilu_fake_gpu.h): DILU_FAKE_GPU_COUNT devices, named DILU_FAKE_GPU_NAME, with UUIDs of
 * node-level index DILU_FAKE_GPU_FIRST_INDEX + ordinal; all of a process's devices run on its one
 * emulated GPU (DILU_FAKE_GPU).
 *
 * cuInit only reads the environment: the segment is opened (created by the first process) at the
 * first context, allocation, memory query or launch, so a node agent may enumerate devices
 * (count, name, attributes, UUIDs, total memory) without creating one.
 *
 * Device memory: DILU_FAKE_GPU_MEMORY_BYTES per emulated GPU (default 40 GiB; the segment's
 * creator fixes it), shared by every process on it and counted in the segment (total, used, and
 * the bytes each pid holds) under its mutex. An allocation past the total returns
 * CUDA_ERROR_OUT_OF_MEMORY, after reclaiming what dead processes held. Device pointers are fake
 * addresses (a per-process bump counter from 0x200000000000, 512-byte aligned; never
 * dereferenced), and each process maps them to their sizes so a free credits what was charged. A
 * process that exits normally gives its memory back (a destructor); one that is killed has its
 * entry reclaimed by the next allocation that needs the room. Entry points: cuMemAlloc(_v2),
 * cuMemAllocManaged, cuMemAllocPitch_v2 (pitch rounded up to 512 bytes), cuMemAllocAsync and
 * cuMemAllocFromPoolAsync (+_ptsz; the pool is ignored), cuMemCreate, cuArrayCreate_v2 and
 * cuArray3DCreate_v2 (width x height x depth x channels x channel bytes), their frees
 * (cuMemFree(_v2), cuMemFreeAsync(+_ptsz), cuMemRelease, cuArrayDestroy), cuMemGetInfo(_v2).
 * The legacy cuMemAlloc / cuMemFree / cuMemGetInfo take 32-bit values, as the real driver's do.
 * A process's first context (cuCtxCreate*, cuDevicePrimaryCtxRetain) also charges
 * DILU_FAKE_CONTEXT_BYTES (default 0), held until the process ends; past the total it fails with
 * CUDA_ERROR_OUT_OF_MEMORY, as a real context creation does (ctx_charge).
 * Queue depth: DILU_FAKE_QUEUE_DEPTH ops per stream (default 1024); a launch into a full stream
 * waits, as with a real driver's push buffer. DILU_FAKE_NULL_LAUNCH=1 makes launches return at
 * once without running (to measure what a caller of the driver adds per launch).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dilu_cuda_min.h"
#include "dilu_fake_gpu.h"

#define API __attribute__((visibility("default")))
#define FAKE_DRIVER_VERSION 12080

/* ------------------------------------------------------------------ shared virtual device */

static struct gpu_shm *g_gpu;
static uint32_t g_width_ppm = 1000000;
static uint32_t g_pid;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t)
{
    struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static void gpu_lock(void)
{
    int r = pthread_mutex_lock(&g_gpu->mu);
    if (r == EOWNERDEAD) /* a process died holding it; the state is still consistent per step */
        pthread_mutex_consistent(&g_gpu->mu);
}

static void gpu_unlock(void) { pthread_mutex_unlock(&g_gpu->mu); }

static int gpu_open(void)
{
    const char *name = getenv("DILU_FAKE_GPU");
    char path[256];
    snprintf(path, sizeof path, "/dilu-gpu-%s", name && *name ? name : "default");
    size_t size = sizeof(struct gpu_shm);
    int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    int creator = fd >= 0;
    if (!creator)
        fd = shm_open(path, O_RDWR, 0600);
    if (fd < 0) {
        fprintf(stderr, "fake libcuda: shm_open %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (creator && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return -1;
    }
    if (!creator) { /* wait (bounded) for the creator to size the segment */
        struct stat st;
        for (int i = 0; i < 2000 && (fstat(fd, &st) != 0 || (size_t)st.st_size < size); i++)
            usleep(1000);
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return -1;
    struct gpu_shm *g = p;
    if (creator) {
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&g->mu, &a);
        g->version = GPU_VERSION;
        g->sms = (uint32_t)dilu_fake_sms();
        g->mem_total = dilu_fake_memory_bytes();
        g->ring_offset = offsetof(struct gpu_shm, ring);
        g->ring_cap = GPU_RING;
        g->rec_size = sizeof(struct gpu_rec);
        g->sim_now = now_ns();
        __atomic_store_n(&g->magic, GPU_MAGIC, __ATOMIC_RELEASE);
    } else {
        for (int i = 0; i < 2000 && __atomic_load_n(&g->magic, __ATOMIC_ACQUIRE) != GPU_MAGIC; i++)
            usleep(1000);
        if (g->magic != GPU_MAGIC || g->version != GPU_VERSION) {
            fprintf(stderr, "fake libcuda: %s is not a usable emulated GPU\n", path);
            munmap(p, size);
            return -1;
        }
    }
    g_gpu = g;
    if (!creator && !__atomic_load_n(&g->mem_total, __ATOMIC_ACQUIRE)) { /* made before memory was counted */
        gpu_lock();
        if (!g->mem_total)
            g->mem_total = dilu_fake_memory_bytes();
        gpu_unlock();
    }
    return 0;
}

/* Opens (or creates) the emulated GPU's segment once, on first need; never at cuInit. */
static pthread_mutex_t g_open_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_open_tried;

static void gpu_ensure(void)
{
    if (__atomic_load_n(&g_open_tried, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&g_open_mu);
    if (!g_open_tried) {
        gpu_open();
        __atomic_store_n(&g_open_tried, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_open_mu);
}

static void gpu_record(struct gpu_slot *s)
{
    uint64_t i = g_gpu->ring_head++;
    struct gpu_rec *r = &g_gpu->ring[i % GPU_RING];
    __atomic_store_n(&r->seq, 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    r->pid = s->pid;
    r->width_ppm = s->width_ppm;
    r->ctx = s->ctx;
    r->stream = s->stream;
    r->start_ns = s->start_ns;
    r->end_ns = s->end_ns;
    r->func = s->func;
    __atomic_store_n(&r->seq, i + 1, __ATOMIC_RELEASE);
}

static int pid_alive(uint32_t pid) { return kill((pid_t)pid, 0) == 0 || errno != ESRCH; }

static int running(const struct gpu_slot *s) { return s->used && !s->done; }

/* Progress rate of running slot i (solo-ns per ns), processor sharing as MPS shares the SMs
 * (DESIGN.md section 7): a process holds its width while it has kernels running, and when the
 * widths held sum to W > 1 every kernel progresses W times slower; kernels of one process running
 * at once share its width, so each also gets 1 / (its process's running kernels). */
static void gpu_rates(double *rate)
{
    struct gpu_shm *g = g_gpu;
    uint32_t hw = g->slot_hw;
    uint64_t held = 0; /* ppm, each running process counted once */
    for (uint32_t i = 0; i < hw; i++) {
        rate[i] = 0.0;
        if (!running(&g->slots[i]))
            continue;
        uint32_t same = 0, first = 1;
        for (uint32_t j = 0; j < hw; j++)
            if (running(&g->slots[j]) && g->slots[j].pid == g->slots[i].pid) {
                same++;
                first &= j >= i;
            }
        rate[i] = 1.0 / same;
        if (first)
            held += g->slots[i].width_ppm;
    }
    double slow = held > 1000000u ? (double)held / 1e6 : 1.0;
    for (uint32_t i = 0; i < hw; i++)
        rate[i] /= slow;
}

/* Advances the virtual clock to t (never backwards), completing kernels exactly on the way (each
 * completion changes the rates of the rest). */
static void gpu_advance(uint64_t t)
{
    struct gpu_shm *g = g_gpu;
    static __thread double rate[GPU_SLOTS];
    while (g->sim_now < t) {
        gpu_rates(rate);
        uint32_t hw = g->slot_hw;
        double min_dt = INFINITY;
        for (uint32_t i = 0; i < hw; i++)
            if (rate[i] > 0.0) {
                double dt = g->slots[i].remaining_ns / rate[i];
                if (dt < min_dt)
                    min_dt = dt;
            }
        if (min_dt == INFINITY) {
            g->sim_now = t;
            break;
        }
        double span = (double)(t - g->sim_now);
        int completes = min_dt <= span;
        double dt = completes ? min_dt : span;
        uint64_t step = (uint64_t)ceil(dt);
        for (uint32_t i = 0; i < hw; i++) {
            if (rate[i] <= 0.0)
                continue;
            struct gpu_slot *s = &g->slots[i];
            s->remaining_ns -= dt * rate[i];
            if (completes && s->remaining_ns <= 0.5) {
                s->remaining_ns = 0.0;
                s->done = 1;
                s->end_ns = g->sim_now + step;
                gpu_record(s);
            }
        }
        g->sim_now += step;
    }
}

static int gpu_alloc(void)
{
    struct gpu_shm *g = g_gpu;
    for (uint32_t i = 0; i < GPU_SLOTS; i++) {
        struct gpu_slot *s = &g->slots[i];
        /* a slot whose owner died is never collected: reclaim it (and let waiters in) */
        if (s->used && s->done && !pid_alive(s->pid))
            s->used = 0;
        if (!s->used) {
            if (i >= g->slot_hw)
                g->slot_hw = i + 1;
            return (int)i;
        }
    }
    return -1;
}

/* Runs one kernel of dur_ns solo work that may start at `desired` (virtual ns); sets *start and
 * returns its end. The caller's thread sleeps (real time) until the kernel's end. */
static uint64_t gpu_run(uint64_t desired, double dur_ns, uint64_t ctx, uint64_t stream, uint64_t func,
                        uint64_t *start)
{
    if (!g_gpu) { /* no device segment: run alone, unrecorded */
        *start = desired > now_ns() ? desired : now_ns();
        uint64_t end = *start + (uint64_t)dur_ns;
        sleep_until(end);
        return end;
    }
    static __thread double rate[GPU_SLOTS];
    gpu_lock();
    gpu_advance(desired);
    int idx = gpu_alloc();
    if (idx < 0) {
        gpu_unlock();
        fprintf(stderr, "fake libcuda: emulated GPU has no free kernel slot\n");
        *start = now_ns();
        uint64_t end = *start + (uint64_t)dur_ns;
        sleep_until(end);
        return end;
    }
    struct gpu_slot *s = &g_gpu->slots[idx];
    uint64_t gen = ++g_gpu->slot_gen;
    *s = (struct gpu_slot){.used = 1, .pid = g_pid, .width_ppm = g_width_ppm, .gen = gen, .ctx = ctx,
                           .stream = stream, .func = func, .start_ns = g_gpu->sim_now,
                           .remaining_ns = dur_ns > 1.0 ? dur_ns : 1.0};
    for (;;) {
        if (s->gen != gen) { /* reclaimed (cannot happen while we live) */
            gpu_unlock();
            *start = now_ns();
            return *start;
        }
        if (s->done) {
            uint64_t end = s->end_ns;
            *start = s->start_ns;
            s->used = 0;
            gpu_unlock();
            return end;
        }
        gpu_rates(rate);
        /* until its end at the present rates; a kernel starting or ending meanwhile moves it */
        double wait = s->remaining_ns / rate[idx];
        uint64_t projected = g_gpu->sim_now + (uint64_t)ceil(wait);
        gpu_unlock();
        sleep_until(projected);
        gpu_lock();
        uint64_t t = now_ns();
        gpu_advance(t < projected ? t : projected);
    }
}

/* ------------------------------------------------------------------ device memory */

/* What each process holds is counted in the segment (gpu_shm: mem_total, mem_used, procs) under
 * its mutex; the fake NVML reads it. Without a segment (it could not be opened) the process
 * counts alone against DILU_FAKE_GPU_MEMORY_BYTES. */
static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER; /* guards everything below */
static uint64_t g_local_used;
static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER; /* guards g_ctx_charged (ctx_charge) */
static int g_ctx_charged; /* this process's context memory is charged */

static void st32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static void st64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Gives back what dead processes held (their entries are freed). Under the segment's lock. */
static void gpu_reclaim_dead(void)
{
    struct gpu_shm *g = g_gpu;
    for (int i = 0; i < GPU_MEM_PROCS; i++) {
        uint32_t pid = g->procs[i].pid;
        if (!pid || pid == g_pid || pid_alive(pid))
            continue;
        uint64_t b = g->procs[i].bytes;
        st64(&g->mem_used, g->mem_used - (b < g->mem_used ? b : g->mem_used));
        st64(&g->procs[i].bytes, 0);
        st32(&g->procs[i].pid, 0);
    }
}

static int gpu_proc_index(void)
{
    for (int i = 0; i < GPU_MEM_PROCS; i++)
        if (g_gpu->procs[i].pid == g_pid)
            return i;
    return -1;
}

/* Charges `bytes` to this process; CUDA_ERROR_OUT_OF_MEMORY when they do not fit in what is
 * left of the device (after reclaiming what dead processes held). */
static CUresult mem_charge(uint64_t bytes)
{
    gpu_ensure();
    struct gpu_shm *g = g_gpu;
    if (!g) {
        uint64_t total = dilu_fake_memory_bytes();
        pthread_mutex_lock(&g_mem_mu);
        int fits = g_local_used <= total && bytes <= total - g_local_used;
        if (fits)
            g_local_used += bytes;
        pthread_mutex_unlock(&g_mem_mu);
        return fits ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    gpu_lock();
    int me = -1;
    for (int pass = 0;; pass++) {
        me = gpu_proc_index();
        int spare = -1;
        for (int i = 0; me < 0 && spare < 0 && i < GPU_MEM_PROCS; i++)
            if (!g->procs[i].pid)
                spare = i;
        int fits = g->mem_used <= g->mem_total && bytes <= g->mem_total - g->mem_used;
        if (fits && (me >= 0 || spare >= 0)) {
            if (me < 0) {
                me = spare;
                st64(&g->procs[me].bytes, 0);
                st32(&g->procs[me].pid, g_pid);
            }
            break;
        }
        if (pass == 1) {
            gpu_unlock();
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        gpu_reclaim_dead();
    }
    st64(&g->procs[me].bytes, g->procs[me].bytes + bytes);
    st64(&g->mem_used, g->mem_used + bytes);
    gpu_unlock();
    return CUDA_SUCCESS;
}

static void mem_uncharge(uint64_t bytes)
{
    struct gpu_shm *g = g_gpu;
    if (!g) {
        pthread_mutex_lock(&g_mem_mu);
        g_local_used -= bytes < g_local_used ? bytes : g_local_used;
        pthread_mutex_unlock(&g_mem_mu);
        return;
    }
    gpu_lock();
    int me = gpu_proc_index();
    if (me >= 0) {
        uint64_t held = g->procs[me].bytes, b = bytes < held ? bytes : held;
        st64(&g->mem_used, g->mem_used - (b < g->mem_used ? b : g->mem_used));
        st64(&g->procs[me].bytes, held - b);
        if (held == b) /* holds nothing now: the entry is free again */
            st32(&g->procs[me].pid, 0);
    }
    gpu_unlock();
}

/* (total, used) of the emulated GPU, after reclaiming what dead processes held. */
static void mem_info(uint64_t *total, uint64_t *used)
{
    gpu_ensure();
    struct gpu_shm *g = g_gpu;
    if (!g) {
        pthread_mutex_lock(&g_mem_mu);
        *total = dilu_fake_memory_bytes();
        *used = g_local_used;
        pthread_mutex_unlock(&g_mem_mu);
        return;
    }
    gpu_lock();
    gpu_reclaim_dead();
    *total = g->mem_total;
    *used = g->mem_used;
    gpu_unlock();
}

/* A normal exit gives the process's memory back, as the real driver does when a process ends. */
__attribute__((destructor)) static void mem_at_exit(void)
{
    struct gpu_shm *g = g_gpu;
    if (!g || !g_pid || g_pid != (uint32_t)getpid())
        return;
    int r = EBUSY;
    for (int i = 0; i < 50 && (r = pthread_mutex_trylock(&g->mu)) == EBUSY; i++)
        usleep(1000); /* bounded: never hang an exiting process */
    if (r == EOWNERDEAD)
        pthread_mutex_consistent(&g->mu);
    else if (r != 0)
        return;
    int me = gpu_proc_index();
    if (me >= 0) {
        uint64_t b = g->procs[me].bytes;
        st64(&g->mem_used, g->mem_used - (b < g->mem_used ? b : g->mem_used));
        st64(&g->procs[me].bytes, 0);
        st32(&g->procs[me].pid, 0);
    }
    gpu_unlock();
}

/* This process's allocations: fake address (or handle) -> bytes charged. */
enum { MEM_PTR = 1, MEM_HANDLE, MEM_ARRAY };

struct mem_obj {
    uint64_t addr;
    uint64_t bytes;
    int cls;
    struct mem_obj *next;
};

#define MEM_BUCKETS 4096
#define MEM_ALIGN 512ull
static struct mem_obj *g_mem_tab[MEM_BUCKETS];
static uint64_t g_next_addr = 0x200000000000ull; /* never dereferenced */
static uint64_t g_next_addr_v1 = 0x10000000ull;   /* legacy 32-bit pointers */

static unsigned mem_bucket(uint64_t addr) { return (unsigned)((addr * 0x9E3779B97F4A7C15ull) >> 52); }

/* Charges `bytes` and hands out a new address for them. */
static CUresult mem_new(int cls, uint64_t bytes, int v1, uint64_t *addr)
{
    if (bytes > UINT64_MAX - MEM_ALIGN)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = mem_charge(bytes);
    if (r != CUDA_SUCCESS)
        return r;
    struct mem_obj *o = malloc(sizeof *o);
    uint64_t span = (bytes + MEM_ALIGN - 1) & ~(MEM_ALIGN - 1);
    pthread_mutex_lock(&g_mem_mu);
    uint64_t *next = v1 ? &g_next_addr_v1 : &g_next_addr;
    uint64_t room = v1 ? 0xfffff000ull : 0x7ff000000000ull;
    if (!o || *next > room || span > room - *next) {
        pthread_mutex_unlock(&g_mem_mu);
        free(o);
        mem_uncharge(bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *o = (struct mem_obj){*next, bytes, cls, NULL};
    *next += span ? span : MEM_ALIGN;
    unsigned b = mem_bucket(o->addr);
    o->next = g_mem_tab[b];
    g_mem_tab[b] = o;
    pthread_mutex_unlock(&g_mem_mu);
    *addr = o->addr;
    return CUDA_SUCCESS;
}

/* Forgets `addr` and credits what it was charged; an unknown address is an error. */
static CUresult mem_delete(int cls, uint64_t addr)
{
    pthread_mutex_lock(&g_mem_mu);
    struct mem_obj **pp = &g_mem_tab[mem_bucket(addr)], *o;
    while ((o = *pp) && !(o->addr == addr && o->cls == cls))
        pp = &o->next;
    if (o)
        *pp = o->next;
    pthread_mutex_unlock(&g_mem_mu);
    if (!o)
        return cls == MEM_PTR ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
    mem_uncharge(o->bytes);
    free(o);
    return CUDA_SUCCESS;
}

/* A forked child holds none of its parent's allocations (the driver state does not survive). */
static void mem_forget_all(void)
{
    pthread_mutex_init(&g_mem_mu, NULL);
    pthread_mutex_init(&g_ctx_mu, NULL);
    for (unsigned b = 0; b < MEM_BUCKETS; b++) {
        for (struct mem_obj *o = g_mem_tab[b], *n; o; o = n) {
            n = o->next;
            free(o);
        }
        g_mem_tab[b] = NULL;
    }
    g_local_used = 0;
    g_ctx_charged = 0;
}

/* A process's CUDA context takes device memory of its own (its kernels' code, the runtime's state:
 * 622 MiB under PyTorch on an H200, models.CONTEXT_BYTES), apart from any allocation: the first context a process makes
 * (created or primary) charges DILU_FAKE_CONTEXT_BYTES, held until the process ends, so a parked
 * instance, whose process keeps its context, is seen holding it, as on a real GPU. */
static CUresult ctx_charge(void)
{
    uint64_t bytes = dilu_fake_context_bytes();
    if (!bytes)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_ctx_mu);
    CUresult r = g_ctx_charged ? CUDA_SUCCESS : mem_charge(bytes);
    if (r == CUDA_SUCCESS)
        g_ctx_charged = 1;
    pthread_mutex_unlock(&g_ctx_mu);
    return r;
}

/* ------------------------------------------------------------------ process-local objects */

struct kfunc {
    char name[128];
    double fixed_us; /* < 0: read from the first kernel parameter */
    struct kfunc *next;
};

struct graph {
    size_t n, cap;
    double *dur_ns;
    uint64_t *func;
};

struct event {
    int pending; /* records enqueued but not processed */
    int recorded;
    uint64_t time_ns;
};

enum op_kind { OP_KERNEL, OP_EVENT, OP_WAIT };

struct op {
    enum op_kind kind;
    double dur_ns;
    uint64_t func;
    uint64_t submit_ns;
    struct event *ev;
    struct op *next;
};

struct ctx;
struct stream {
    struct ctx *ctx;
    pthread_t thread;
    pthread_cond_t cv;
    struct op *head, *tail;
    int running, stop;
    long depth; /* ops queued */
    uint64_t last_end;
    struct graph *capture;
    struct stream *next_in_ctx;
};

struct ctx {
    struct stream *def; /* default stream, made on first use */
    struct stream *streams;
    int destroyed;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER; /* broadcast when any op completes */
static int g_inited;
static struct ctx *g_primary;
static struct kfunc *g_funcs;
static double g_default_us = 100.0;
static long g_queue_depth = 1024; /* DILU_FAKE_QUEUE_DEPTH */
static int g_event_join = 1;      /* DILU_FAKE_EVENT_JOIN=0: events stamped when reached */
static int g_null_launch;         /* DILU_FAKE_NULL_LAUNCH=1: launches return at once, run nothing */
#define EVENT_JOIN_NS 200000L     /* 200 µs: how long an event waits for a launch behind it */
static __thread struct ctx *t_ctx;

static void *worker(void *arg)
{
    struct stream *s = arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* µs kernels need µs wake-ups */
    struct event *deferred[16];
    int ndeferred = 0;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        while (!s->head && !s->stop) {
            if (ndeferred) { /* give a launch that follows the events a moment to arrive */
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += EVENT_JOIN_NS;
                if (ts.tv_nsec >= 1000000000L) {
                    ts.tv_sec++;
                    ts.tv_nsec -= 1000000000L;
                }
                if (pthread_cond_timedwait(&s->cv, &g_mu, &ts) == ETIMEDOUT && !s->head)
                    break;
            } else {
                pthread_cond_wait(&s->cv, &g_mu);
            }
        }
        if (!s->head) {
            if (ndeferred) { /* no launch followed: the events complete at the stream's time */
                for (int i = 0; i < ndeferred; i++) {
                    deferred[i]->time_ns = s->last_end > deferred[i]->time_ns ? s->last_end : deferred[i]->time_ns;
                    deferred[i]->recorded = 1;
                    deferred[i]->pending--;
                }
                ndeferred = 0;
                s->running = 0;
                pthread_cond_broadcast(&g_done);
                continue;
            }
            if (s->stop)
                break;
            continue;
        }
        struct op *op = s->head;
        s->depth--;
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        s->running = 1;
        uint64_t desired = op->submit_ns > s->last_end ? op->submit_ns : s->last_end;
        if (op->kind == OP_KERNEL) {
            pthread_mutex_unlock(&g_mu);
            uint64_t start;
            uint64_t end = gpu_run(desired, op->dur_ns, (uint64_t)(uintptr_t)s->ctx,
                                   (uint64_t)(uintptr_t)s, op->func, &start);
            pthread_mutex_lock(&g_mu);
            s->last_end = end;
            /* events recorded just before a launch are stamped when the launch gets the device,
             * as on a GPU that time-slices contexts: the stream's commands run in its slice */
            for (int i = 0; i < ndeferred; i++) {
                deferred[i]->time_ns = start;
                deferred[i]->recorded = 1;
                deferred[i]->pending--;
            }
            ndeferred = 0;
        } else if (op->kind == OP_EVENT) {
            if (ndeferred == 16) { /* flush: a long run of events */
                for (int i = 0; i < ndeferred; i++) {
                    deferred[i]->time_ns = desired;
                    deferred[i]->recorded = 1;
                    deferred[i]->pending--;
                }
                ndeferred = 0;
            }
            if (!g_event_join || (op->submit_ns <= s->last_end && !ndeferred)) {
                /* recorded behind earlier work: stamped as that work ends */
                op->ev->time_ns = desired;
                op->ev->recorded = 1;
                op->ev->pending--;
            } else { /* recorded on an idle stream: stamped with the next launch's start */
                op->ev->time_ns = desired;
                deferred[ndeferred++] = op->ev;
            }
        } else { /* OP_WAIT: the stream waits for the event's work */
            for (int i = 0; i < ndeferred; i++) {
                deferred[i]->time_ns = desired;
                deferred[i]->recorded = 1;
                deferred[i]->pending--;
            }
            ndeferred = 0;
            while (op->ev->pending > 0)
                pthread_cond_wait(&g_done, &g_mu);
            if (op->ev->time_ns > s->last_end)
                s->last_end = op->ev->time_ns;
        }
        s->running = ndeferred > 0;
        free(op);
        pthread_cond_broadcast(&g_done);
    }
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

static struct stream *stream_new(struct ctx *c)
{
    struct stream *s = calloc(1, sizeof *s);
    s->ctx = c;
    pthread_cond_init(&s->cv, NULL);
    s->next_in_ctx = c->streams;
    c->streams = s;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 256 * 1024);
    pthread_create(&s->thread, &a, worker, s);
    pthread_attr_destroy(&a);
    return s;
}

static struct ctx *cur_ctx(void)
{
    if (t_ctx)
        return t_ctx;
    if (!g_primary) /* lenient: launching without a context uses the process's primary one */
        g_primary = calloc(1, sizeof *g_primary);
    return g_primary;
}

/* Resolves a stream handle (0, legacy and per-thread all mean the context's default stream). */
static struct stream *resolve(CUstream h)
{
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct ctx *c = cur_ctx();
        if (!c->def)
            c->def = stream_new(c);
        return c->def;
    }
    return (struct stream *)h;
}

static void enqueue(struct stream *s, struct op *op)
{
    /* like a real push buffer: a full queue makes the launch wait (g_mu is held by callers) */
    while (s->depth >= g_queue_depth)
        pthread_cond_wait(&g_done, &g_mu);
    s->depth++;
    op->submit_ns = now_ns();
    op->next = NULL;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    pthread_cond_signal(&s->cv);
}

static int stream_idle(struct stream *s) { return !s->head && !s->running; }

static void atfork_child(void)
{
    /* threads do not survive fork: forget everything; the child starts over with cuInit */
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_done, NULL);
    g_inited = 0;
    g_primary = NULL;
    t_ctx = NULL;
    g_pid = (uint32_t)getpid();
    pthread_mutex_init(&g_open_mu, NULL);
    mem_forget_all();
}

static void init_once(void)
{
    const char *w = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    double pct = w ? atof(w) : 100.0;
    if (!(pct > 0.0) || pct > 100.0)
        pct = 100.0;
    g_width_ppm = (uint32_t)llround(pct * 10000.0);
    const char *d = getenv("DILU_FAKE_DEFAULT_US");
    if (d && atof(d) > 0)
        g_default_us = atof(d);
    const char *ej = getenv("DILU_FAKE_EVENT_JOIN");
    g_event_join = !(ej && *ej == '0');
    const char *nl = getenv("DILU_FAKE_NULL_LAUNCH");
    g_null_launch = nl && *nl == '1';
    const char *q = getenv("DILU_FAKE_QUEUE_DEPTH");
    if (q && atol(q) > 0)
        g_queue_depth = atol(q);
    g_pid = (uint32_t)getpid();
    /* nothing else: the device segment is opened on first need (gpu_ensure) */
}

static double table_us(const char *name)
{
    const char *t = getenv("DILU_FAKE_KERNELS");
    size_t n = strlen(name);
    while (t && *t) {
        const char *eq = strchr(t, '=');
        if (!eq)
            break;
        if ((size_t)(eq - t) == n && strncmp(t, name, n) == 0)
            return atof(eq + 1);
        t = strchr(eq, ',');
        if (t)
            t++;
    }
    return -1.0;
}

static double kernel_ns(CUfunction f, void **params)
{
    struct kfunc *k = (struct kfunc *)f;
    if (!k)
        return g_default_us * 1000.0;
    if (k->fixed_us >= 0.0)
        return k->fixed_us * 1000.0;
    if (params && params[0])
        return (double)*(const float *)params[0] * 1000.0;
    return g_default_us * 1000.0;
}

static CUresult launch(CUfunction f, CUstream h, void **params)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    gpu_ensure();
    double ns = kernel_ns(f, params);
    if (g_null_launch) /* overhead benchmarks: a driver whose launch costs nothing */
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    struct stream *s = resolve(h);
    if (s->capture) {
        struct graph *g = s->capture;
        if (g->n == g->cap) {
            g->cap = g->cap ? 2 * g->cap : 16;
            g->dur_ns = realloc(g->dur_ns, g->cap * sizeof *g->dur_ns);
            g->func = realloc(g->func, g->cap * sizeof *g->func);
        }
        g->dur_ns[g->n] = ns;
        g->func[g->n++] = (uint64_t)(uintptr_t)f;
    } else {
        struct op *op = calloc(1, sizeof *op);
        op->kind = OP_KERNEL;
        op->dur_ns = ns;
        op->func = (uint64_t)(uintptr_t)f;
        enqueue(s, op);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ API: init, device, context */

API CUresult cuInit(unsigned int flags)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    static int registered;
    if (!registered) {
        registered = 1;
        pthread_atfork(NULL, NULL, atfork_child);
    }
    pthread_once(&once, init_once);
    if (!g_pid || g_pid != (uint32_t)getpid()) /* forked child */
        g_pid = (uint32_t)getpid();
    g_inited = 1;
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *v)
{
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *n)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    *n = dilu_fake_gpu_count();
    return CUDA_SUCCESS;
}

static int device_ok(CUdevice d) { return d >= 0 && d < dilu_fake_gpu_count(); }

API CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!device_ok(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!device_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", dilu_fake_name());
    return CUDA_SUCCESS;
}

/* The emulated GPU's memory: the segment's total once it is open, else the environment's. */
API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!device_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    struct gpu_shm *g = g_gpu;
    uint64_t total = g ? __atomic_load_n(&g->mem_total, __ATOMIC_ACQUIRE) : 0;
    *bytes = (size_t)(total ? total : dilu_fake_memory_bytes());
    return CUDA_SUCCESS;
}

/* 16 bytes of dilu_fake_uuid(node-level index), as the fake NVML reports them. */
API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!device_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    unsigned char u[16];
    dilu_fake_uuid(dilu_fake_first_index() + d, u);
    memcpy(uuid->bytes, u, sizeof u);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

/* "0000:BB:00.0" with bus 0x10 + node-level index, as the fake NVML's legacy bus id. */
API CUresult cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!bus_id || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!device_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(bus_id, (size_t)len, "%04X:%02X:00.0", 0u, (unsigned)(0x10 + dilu_fake_first_index() + d) & 0xffu);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    if (!device_ok(d))
        return CUDA_ERROR_INVALID_DEVICE;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: /* the segment's once open (its creator fixed it) */
        *v = g_gpu ? (int)g_gpu->sms : dilu_fake_sms();
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
        *v = 1024;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
        *v = 8;
        return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
        *v = 0;
        return CUDA_SUCCESS;
    default:
        *v = 0;
        return CUDA_SUCCESS;
    }
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    gpu_ensure();
    CUresult r = ctx_charge();
    if (r != CUDA_SUCCESS)
        return r;
    struct ctx *c = calloc(1, sizeof *c);
    t_ctx = c;
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice d) { return cuCtxCreate_v2(pctx, flags, d); }

API CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice d)
{
    return cuCtxCreate_v2(pctx, flags, d);
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    gpu_ensure();
    CUresult r = ctx_charge();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g_mu);
    if (!g_primary)
        g_primary = calloc(1, sizeof *g_primary);
    *pctx = (CUcontext)g_primary;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return CUDA_SUCCESS; }
API CUresult cuDevicePrimaryCtxRelease(CUdevice d) { return CUDA_SUCCESS; }

static void ctx_sync(struct ctx *c)
{
    for (;;) {
        int idle = 1;
        for (struct stream *s = c->streams; s; s = s->next_in_ctx)
            idle &= stream_idle(s);
        if (idle)
            return;
        pthread_cond_wait(&g_done, &g_mu);
    }
}

API CUresult cuCtxDestroy_v2(CUcontext h)
{
    struct ctx *c = (struct ctx *)h;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mu);
    ctx_sync(c);
    for (struct stream *s = c->streams; s; s = s->next_in_ctx) {
        s->stop = 1;
        pthread_cond_signal(&s->cv);
    }
    c->destroyed = 1; /* streams are detached threads; memory is kept (handles may linger) */
    if (t_ctx == c)
        t_ctx = NULL;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuCtxDestroy(CUcontext h) { return cuCtxDestroy_v2(h); }

API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    *pctx = (CUcontext)t_ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext h)
{
    t_ctx = (struct ctx *)h;
    return CUDA_SUCCESS;
}

API CUresult cuCtxPushCurrent_v2(CUcontext h) { return cuCtxSetCurrent(h); }
API CUresult cuCtxPopCurrent_v2(CUcontext *p)
{
    if (p)
        *p = (CUcontext)t_ctx;
    t_ctx = NULL;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_mu);
    ctx_sync(cur_ctx());
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* CUDA 13's entry point for the name cuCtxSynchronize (cuGetProcAddress at version 13000): it
 * takes the context, NULL meaning the current one. Anything but NULL, the current context or the
 * primary one is refused as the real driver refuses a stale handle, so a caller (or an
 * interceptor) that drops the argument fails here as it does on a GPU. */
API CUresult cuCtxSynchronize_v2(CUcontext h)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct ctx *c = h ? (struct ctx *)h : cur_ctx();
    if (h && c != t_ctx && c != g_primary)
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    if (c->destroyed)
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    pthread_mutex_lock(&g_mu);
    ctx_sync(c);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ API: modules, functions */

API CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    *m = (CUmodule)calloc(1, 16);
    return CUDA_SUCCESS;
}

API CUresult cuModuleLoad(CUmodule *m, const char *fname) { return cuModuleLoadData(m, fname); }
API CUresult cuModuleUnload(CUmodule m) { return CUDA_SUCCESS; }

API CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!f || !name || strlen(name) >= sizeof(((struct kfunc *)0)->name))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    struct kfunc *k;
    for (k = g_funcs; k; k = k->next)
        if (strcmp(k->name, name) == 0)
            break;
    if (!k) {
        k = calloc(1, sizeof *k);
        strcpy(k->name, name);
        char *end = NULL;
        double us = -1.0;
        if (strncmp(name, "k_", 2) == 0) {
            us = strtod(name + 2, &end);
            if (end == name + 2 || *end || us < 0)
                us = -1.0;
        }
        if (us < 0)
            us = table_us(name);
        if (us < 0 && strncmp(name, "p_", 2) != 0)
            us = g_default_us;
        k->fixed_us = us;
        k->next = g_funcs;
        g_funcs = k;
    }
    pthread_mutex_unlock(&g_mu);
    *f = (CUfunction)k;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ API: launches */

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shmem, CUstream h, void **params,
                            void **extra)
{
    return launch(f, h, params);
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned shmem, CUstream h,
                                 void **params, void **extra)
{
    return launch(f, h, params);
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra)
{
    if (!cfg)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, cfg->hStream, params);
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params, void **extra)
{
    return cuLaunchKernelEx(cfg, f, params, extra);
}

API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                       unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                       CUstream h, void **params)
{
    return launch(f, h, params);
}

API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                            unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                            CUstream h, void **params)
{
    return launch(f, h, params);
}

/* ------------------------------------------------------------------ API: streams */

API CUresult cuStreamCreate(CUstream *ph, unsigned int flags)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_mu);
    *ph = (CUstream)stream_new(cur_ctx());
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuStreamCreateWithPriority(CUstream *ph, unsigned int flags, int prio)
{
    return cuStreamCreate(ph, flags);
}

API CUresult cuStreamDestroy_v2(CUstream h)
{
    /* the worker drains what is queued, then the stream stays as an idle husk (cheap) */
    return CUDA_SUCCESS;
}

API CUresult cuStreamDestroy(CUstream h) { return cuStreamDestroy_v2(h); }

API CUresult cuStreamSynchronize(CUstream h)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_mu);
    struct stream *s = resolve(h);
    while (!stream_idle(s))
        pthread_cond_wait(&g_done, &g_mu);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize_ptsz(CUstream h) { return cuStreamSynchronize(h); }

API CUresult cuStreamQuery(CUstream h)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_mu);
    int idle = stream_idle(resolve(h));
    pthread_mutex_unlock(&g_mu);
    return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuStreamQuery_ptsz(CUstream h) { return cuStreamQuery(h); }

API CUresult cuStreamWaitEvent(CUstream h, CUevent e, unsigned int flags)
{
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    struct stream *s = resolve(h);
    if (!s->capture) {
        struct op *op = calloc(1, sizeof *op);
        op->kind = OP_WAIT;
        op->ev = (struct event *)e;
        enqueue(s, op);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuStreamWaitEvent_ptsz(CUstream h, CUevent e, unsigned int flags)
{
    return cuStreamWaitEvent(h, e, flags);
}

static CUresult begin_capture(CUstream h)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_mu);
    struct stream *s = resolve(h);
    CUresult r = CUDA_SUCCESS;
    if (s->capture)
        r = CUDA_ERROR_INVALID_VALUE;
    else
        s->capture = calloc(1, sizeof(struct graph));
    pthread_mutex_unlock(&g_mu);
    return r;
}

API CUresult cuStreamBeginCapture(CUstream h) { return begin_capture(h); }
API CUresult cuStreamBeginCapture_v2(CUstream h, int mode) { return begin_capture(h); }
API CUresult cuStreamBeginCapture_ptsz(CUstream h) { return begin_capture(h); }
API CUresult cuStreamBeginCapture_v2_ptsz(CUstream h, int mode) { return begin_capture(h); }

API CUresult cuStreamEndCapture(CUstream h, CUgraph *pg)
{
    pthread_mutex_lock(&g_mu);
    struct stream *s = resolve(h);
    CUresult r = CUDA_SUCCESS;
    if (!s->capture)
        r = CUDA_ERROR_INVALID_VALUE;
    else {
        *pg = (CUgraph)s->capture;
        s->capture = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

API CUresult cuStreamEndCapture_ptsz(CUstream h, CUgraph *pg) { return cuStreamEndCapture(h, pg); }

API CUresult cuStreamIsCapturing(CUstream h, int *status)
{
    pthread_mutex_lock(&g_mu);
    *status = resolve(h)->capture ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuStreamIsCapturing_ptsz(CUstream h, int *status) { return cuStreamIsCapturing(h, status); }

/* ------------------------------------------------------------------ API: events */

API CUresult cuEventCreate(CUevent *pe, unsigned int flags)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    *pe = (CUevent)calloc(1, sizeof(struct event));
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(CUevent e)
{
    struct event *ev = (struct event *)e;
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    int busy = ev->pending > 0;
    pthread_mutex_unlock(&g_mu);
    if (!busy) /* a pending record still points at it: leak rather than use after free */
        free(ev);
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy(CUevent e) { return cuEventDestroy_v2(e); }

API CUresult cuEventRecord(CUevent e, CUstream h)
{
    struct event *ev = (struct event *)e;
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    struct stream *s = resolve(h);
    if (g_null_launch) { /* nothing runs: the event is reached at once */
        ev->time_ns = now_ns();
        ev->recorded = 1;
    } else if (!s->capture) {
        struct op *op = calloc(1, sizeof *op);
        op->kind = OP_EVENT;
        op->ev = ev;
        ev->pending++;
        enqueue(s, op);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord_ptsz(CUevent e, CUstream h) { return cuEventRecord(e, h); }
API CUresult cuEventRecordWithFlags(CUevent e, CUstream h, unsigned int f) { return cuEventRecord(e, h); }

API CUresult cuEventQuery(CUevent e)
{
    struct event *ev = (struct event *)e;
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    int pending = ev->pending;
    pthread_mutex_unlock(&g_mu);
    return pending ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

API CUresult cuEventSynchronize(CUevent e)
{
    struct event *ev = (struct event *)e;
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    while (ev->pending)
        pthread_cond_wait(&g_done, &g_mu);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
    struct event *ea = (struct event *)a, *eb = (struct event *)b;
    if (!ms || !ea || !eb)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    if (ea->pending || eb->pending)
        r = CUDA_ERROR_NOT_READY;
    else if (!ea->recorded || !eb->recorded)
        r = CUDA_ERROR_INVALID_HANDLE;
    else
        *ms = (float)(((double)eb->time_ns - (double)ea->time_ns) / 1e6);
    pthread_mutex_unlock(&g_mu);
    return r;
}

API CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

/* ------------------------------------------------------------------ API: graphs */

API CUresult cuGraphCreate(CUgraph *pg, unsigned int flags)
{
    *pg = (CUgraph)calloc(1, sizeof(struct graph));
    return CUDA_SUCCESS;
}

API CUresult cuGraphDestroy(CUgraph g)
{
    struct graph *gr = (struct graph *)g;
    if (gr) {
        free(gr->dur_ns);
        free(gr->func);
        free(gr);
    }
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g, unsigned long long flags)
{
    struct graph *src = (struct graph *)g;
    if (!pe || !src)
        return CUDA_ERROR_INVALID_VALUE;
    struct graph *x = calloc(1, sizeof *x);
    x->n = x->cap = src->n;
    x->dur_ns = malloc((src->n + 1) * sizeof *x->dur_ns);
    x->func = malloc((src->n + 1) * sizeof *x->func);
    memcpy(x->dur_ns, src->dur_ns, src->n * sizeof *x->dur_ns);
    memcpy(x->func, src->func, src->n * sizeof *x->func);
    *pe = (CUgraphExec)x;
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiate(CUgraphExec *pe, CUgraph g, unsigned long long flags)
{
    return cuGraphInstantiateWithFlags(pe, g, flags);
}

API CUresult cuGraphExecDestroy(CUgraphExec e) { return cuGraphDestroy((CUgraph)e); }

API CUresult cuGraphLaunch(CUgraphExec e, CUstream h)
{
    struct graph *x = (struct graph *)e;
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!x)
        return CUDA_ERROR_INVALID_HANDLE;
    gpu_ensure();
    pthread_mutex_lock(&g_mu);
    struct stream *s = resolve(h);
    for (size_t i = 0; i < x->n; i++) {
        struct op *op = calloc(1, sizeof *op);
        op->kind = OP_KERNEL;
        op->dur_ns = x->dur_ns[i];
        op->func = x->func[i];
        enqueue(s, op);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

API CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream h) { return cuGraphLaunch(e, h); }

/* ------------------------------------------------------------------ API: device memory */

static CUresult alloc_ptr(CUdeviceptr *d, size_t bytes)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!d || !bytes)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = 0;
    CUresult r = mem_new(MEM_PTR, bytes, 0, &a);
    if (r == CUDA_SUCCESS)
        *d = (CUdeviceptr)a;
    return r;
}

static CUresult free_ptr(CUdeviceptr d)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    return d ? mem_delete(MEM_PTR, d) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t bytes) { return alloc_ptr(d, bytes); }
API CUresult cuMemAllocManaged(CUdeviceptr *d, size_t bytes, unsigned int flags) { return alloc_ptr(d, bytes); }
API CUresult cuMemAllocAsync(CUdeviceptr *d, size_t bytes, CUstream h) { return alloc_ptr(d, bytes); }
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t bytes, CUstream h) { return alloc_ptr(d, bytes); }
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *d, size_t bytes, CUmemoryPool pool, CUstream h)
{
    return alloc_ptr(d, bytes);
}
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *d, size_t bytes, CUmemoryPool pool, CUstream h)
{
    return alloc_ptr(d, bytes);
}

/* Rows of WidthInBytes rounded up to 512 bytes. */
API CUresult cuMemAllocPitch_v2(CUdeviceptr *d, size_t *pitch, size_t width, size_t height, unsigned int elem)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!d || !pitch || !width || !height)
        return CUDA_ERROR_INVALID_VALUE;
    if (width > SIZE_MAX - DILU_PITCH_ALIGN)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t p = (width + DILU_PITCH_ALIGN - 1) / DILU_PITCH_ALIGN * DILU_PITCH_ALIGN;
    if (height > SIZE_MAX / p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = alloc_ptr(d, p * height);
    if (r == CUDA_SUCCESS)
        *pitch = p;
    return r;
}

API CUresult cuMemFree_v2(CUdeviceptr d) { return free_ptr(d); }
API CUresult cuMemFreeAsync(CUdeviceptr d, CUstream h) { return free_ptr(d); }
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr d, CUstream h) { return free_ptr(d); }

/* The legacy entry points: 32-bit pointers and sizes (what the real driver exports them with). */
API CUresult cuMemAlloc(CUdeviceptr_v1 *d, unsigned int bytes)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!d || !bytes)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = 0;
    CUresult r = mem_new(MEM_PTR, bytes, 1, &a);
    if (r == CUDA_SUCCESS)
        *d = (CUdeviceptr_v1)a;
    return r;
}

API CUresult cuMemFree(CUdeviceptr_v1 d) { return free_ptr((CUdeviceptr)d); }

API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes, const CUmemAllocationProp *prop,
                         unsigned long long flags)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!h || !bytes)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = 0;
    CUresult r = mem_new(MEM_HANDLE, bytes, 0, &a);
    if (r == CUDA_SUCCESS)
        *h = (CUmemGenericAllocationHandle)a;
    return r;
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    return mem_delete(MEM_HANDLE, (uint64_t)h);
}

static CUresult array_new(CUarray *a, uint64_t bytes, unsigned channels)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!a || !bytes || (channels != 1 && channels != 2 && channels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t h = 0;
    CUresult r = mem_new(MEM_ARRAY, bytes, 0, &h);
    if (r == CUDA_SUCCESS)
        *a = (CUarray)(uintptr_t)h;
    return r;
}

API CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    if (!desc)
        return CUDA_ERROR_INVALID_VALUE;
    return array_new(a, dilu_array_bytes(desc->Width, desc->Height, 0, desc->Format, desc->NumChannels),
                     desc->NumChannels);
}

API CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    if (!desc)
        return CUDA_ERROR_INVALID_VALUE;
    return array_new(a, dilu_array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
                                         desc->NumChannels), desc->NumChannels);
}

API CUresult cuArrayDestroy(CUarray a)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    return mem_delete(MEM_ARRAY, (uint64_t)(uintptr_t)a);
}

/* free / total of the emulated GPU, every process's allocations counted. */
API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!free_bytes || !total_bytes)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t total, used;
    mem_info(&total, &used);
    *total_bytes = (size_t)total;
    *free_bytes = (size_t)(used < total ? total - used : 0);
    return CUDA_SUCCESS;
}

API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    size_t f = 0, t = 0;
    CUresult r = cuMemGetInfo_v2(free_bytes ? &f : NULL, total_bytes ? &t : NULL);
    if (r == CUDA_SUCCESS) {
        *free_bytes = f > UINT32_MAX ? UINT32_MAX : (unsigned int)f;
        *total_bytes = t > UINT32_MAX ? UINT32_MAX : (unsigned int)t;
    }
    return r;
}

/* ------------------------------------------------------------------ API: errors, entry points */

API CUresult cuGetErrorString(CUresult r, const char **s)
{
    static const char *ok = "no error", *nr = "device not ready", *other = "fake driver error";
    *s = r == CUDA_SUCCESS ? ok : r == CUDA_ERROR_NOT_READY ? nr : other;
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorName(CUresult r, const char **s) { return cuGetErrorString(r, s); }

API CUresult cuGetExportTable(const void **table, const void *id)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status);
API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags);

#define ENTRY(name) {#name, (void *)name}
static const struct { const char *name; void *fn; } g_entries[] = {
    ENTRY(cuInit), ENTRY(cuDriverGetVersion), ENTRY(cuDeviceGetCount), ENTRY(cuDeviceGet),
    ENTRY(cuDeviceGetName), ENTRY(cuDeviceTotalMem_v2), ENTRY(cuDeviceGetAttribute),
    ENTRY(cuCtxCreate), ENTRY(cuCtxCreate_v2), ENTRY(cuCtxCreate_v4), ENTRY(cuCtxDestroy),
    ENTRY(cuCtxDestroy_v2), ENTRY(cuDevicePrimaryCtxRetain), ENTRY(cuDevicePrimaryCtxRelease),
    ENTRY(cuDevicePrimaryCtxRelease_v2), ENTRY(cuCtxGetCurrent), ENTRY(cuCtxSetCurrent),
    ENTRY(cuCtxPushCurrent_v2), ENTRY(cuCtxPopCurrent_v2), ENTRY(cuCtxSynchronize), ENTRY(cuCtxSynchronize_v2),
    ENTRY(cuModuleLoadData), ENTRY(cuModuleLoad), ENTRY(cuModuleUnload), ENTRY(cuModuleGetFunction),
    ENTRY(cuLaunchKernel), ENTRY(cuLaunchKernel_ptsz), ENTRY(cuLaunchKernelEx),
    ENTRY(cuLaunchKernelEx_ptsz), ENTRY(cuLaunchCooperativeKernel),
    ENTRY(cuLaunchCooperativeKernel_ptsz), ENTRY(cuStreamCreate), ENTRY(cuStreamCreateWithPriority),
    ENTRY(cuStreamDestroy), ENTRY(cuStreamDestroy_v2), ENTRY(cuStreamSynchronize),
    ENTRY(cuStreamSynchronize_ptsz), ENTRY(cuStreamQuery), ENTRY(cuStreamQuery_ptsz),
    ENTRY(cuStreamWaitEvent), ENTRY(cuStreamWaitEvent_ptsz), ENTRY(cuStreamBeginCapture),
    ENTRY(cuStreamBeginCapture_v2), ENTRY(cuStreamBeginCapture_ptsz),
    ENTRY(cuStreamBeginCapture_v2_ptsz), ENTRY(cuStreamEndCapture), ENTRY(cuStreamEndCapture_ptsz),
    ENTRY(cuStreamIsCapturing), ENTRY(cuStreamIsCapturing_ptsz), ENTRY(cuEventCreate),
    ENTRY(cuEventDestroy), ENTRY(cuEventDestroy_v2), ENTRY(cuEventRecord), ENTRY(cuEventRecord_ptsz),
    ENTRY(cuEventRecordWithFlags), ENTRY(cuEventQuery), ENTRY(cuEventSynchronize),
    ENTRY(cuEventElapsedTime), ENTRY(cuEventElapsedTime_v2), ENTRY(cuGraphCreate),
    ENTRY(cuGraphDestroy), ENTRY(cuGraphInstantiate), ENTRY(cuGraphInstantiateWithFlags),
    ENTRY(cuGraphExecDestroy), ENTRY(cuGraphLaunch), ENTRY(cuGraphLaunch_ptsz),
    ENTRY(cuGetErrorString), ENTRY(cuGetErrorName), ENTRY(cuGetExportTable),
    ENTRY(cuGetProcAddress), ENTRY(cuGetProcAddress_v2),
    ENTRY(cuDeviceGetUuid), ENTRY(cuDeviceGetUuid_v2), ENTRY(cuDeviceGetPCIBusId),
    ENTRY(cuMemAlloc_v2), ENTRY(cuMemAlloc), ENTRY(cuMemAllocManaged), ENTRY(cuMemAllocPitch_v2),
    ENTRY(cuMemAllocAsync), ENTRY(cuMemAllocAsync_ptsz), ENTRY(cuMemAllocFromPoolAsync),
    ENTRY(cuMemAllocFromPoolAsync_ptsz), ENTRY(cuMemFree_v2), ENTRY(cuMemFree), ENTRY(cuMemFreeAsync),
    ENTRY(cuMemFreeAsync_ptsz), ENTRY(cuMemCreate), ENTRY(cuMemRelease), ENTRY(cuArrayCreate_v2),
    ENTRY(cuArray3DCreate_v2), ENTRY(cuArrayDestroy), ENTRY(cuMemGetInfo_v2), ENTRY(cuMemGetInfo),
};

/* Names whose _v2 entry point is what cuGetProcAddress hands out from a CUDA version on (the
 * plain name is the legacy ABI). */
static const struct { const char *name; int since; } g_v2_since[] = {
    {"cuMemAlloc", 3020}, {"cuMemFree", 3020}, {"cuMemGetInfo", 3020}, {"cuMemAllocPitch", 3020},
    {"cuArrayCreate", 3020}, {"cuArray3DCreate", 3020}, {"cuDeviceTotalMem", 3020},
    {"cuDeviceGetUuid", 11040},
};

static void *entry(const char *name)
{
    for (size_t i = 0; i < sizeof g_entries / sizeof g_entries[0]; i++)
        if (strcmp(g_entries[i].name, name) == 0)
            return g_entries[i].fn;
    return NULL;
}

/* Like the real driver: the base name, versioned per the requested CUDA version, and the
 * per-thread-default-stream (_ptsz) flavour when flags ask for it. */
API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status)
{
    if (!sym || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    char name[200], versioned[160];
    void *fn = NULL;
    const char *base = sym;
    for (size_t i = 0; i < sizeof g_v2_since / sizeof g_v2_since[0]; i++)
        if (strcmp(sym, g_v2_since[i].name) == 0 && ver >= g_v2_since[i].since) {
            snprintf(versioned, sizeof versioned, "%s_v2", sym);
            base = versioned;
        }
    if (strcmp(sym, "cuCtxCreate") == 0)
        base = ver >= 13000 ? "cuCtxCreate_v4" : "cuCtxCreate_v2";
    else if (strcmp(sym, "cuStreamBeginCapture") == 0)
        base = "cuStreamBeginCapture_v2";
    else if (strcmp(sym, "cuGraphInstantiate") == 0)
        base = "cuGraphInstantiateWithFlags";
    else if (strcmp(sym, "cuEventElapsedTime") == 0 && ver >= 13000)
        base = "cuEventElapsedTime_v2";
    else if (strcmp(sym, "cuCtxSynchronize") == 0 && ver >= 13000)
        base = "cuCtxSynchronize_v2";
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        snprintf(name, sizeof name, "%s_ptsz", base);
        fn = entry(name);
    }
    if (!fn)
        fn = entry(base);
    if (!fn) {
        snprintf(name, sizeof name, "%s_v2", base);
        fn = entry(name);
    }
    *pfn = fn;
    if (status)
        *status = fn ? 0 : 1;
    return fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
