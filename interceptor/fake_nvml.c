/* A fake NVML (libnvidia-ml.so.1) for the emulated node: the node agent loads it in place of
 * the real library (dilu.services.node_agent.nvml.load(fake_dir)) and reads the same GPUs the
 * fake CUDA driver (fake_driver.c) emulates, through the real pynvml.
 *
 * Configuration (the environment, read at the first nvmlInit*; see dilu_fake_gpu.h):
 *   DILU_FAKE_GPU_COUNT, DILU_FAKE_GPU_FIRST_INDEX, DILU_FAKE_GPU_NAME,
 *   DILU_FAKE_GPU_MEMORY_BYTES, DILU_FAKE_GPU_UUID_SEED   the devices, their names, memory, UUIDs
 *   DILU_FAKE_GPU_TIMELINES   comma-separated emulated-GPU names of devices 0..COUNT-1; device i
 *                             reads /dilu-gpu-<name i> (struct gpu_shm, opened read-only, read
 *                             without its lock) for memory used, utilisation and processes.
 *                             An empty name, a missing or foreign segment: an idle device.
 *   DILU_FAKE_NVML_FAULTS     path of a fault file (below)
 *
 * What a device reports (units as in NVML):
 *   memory     total = DILU_FAKE_GPU_MEMORY_BYTES; used = the segment's mem_used less what dead
 *              processes still hold in its procs table (bytes)
 *   utilisation.gpu  percent of the last 1 s (CLOCK_MONOTONIC, the timeline's clock) during which
 *              at least one kernel was on the device: completed kernels of the segment's ring and
 *              the kernels of live processes running now; utilisation.memory = 40 % of that (a
 *              made-up estimate)
 *   power      60 W idle + utilisation x 340 W, in mW; limit 400 W (an A100 SXM4)
 *   temperature  35 C + utilisation x 40 C
 *   clocks event reasons  0x1 (GPU idle) while utilisation is 0, plus any `clocks` fault bits
 *   processes  the segment's procs table (pid, bytes), dead pids left out
 *   MIG disabled (current and pending), compute mode DEFAULT, ECC enabled, compute capability
 *   8.0, driver "570.86.10-dilu-emulated", CUDA driver version 12080 (as the fake driver's
 *   cuDriverGetVersion), UUID dilu_fake_uuid_str(FIRST_INDEX + i).
 *
 * Fault file (DILU_FAKE_NVML_FAULTS), re-read by every query once its mtime, size or inode
 * changes (write a new file and rename it over the old one, or append); one fault a line, `#`
 * starts a comment, unknown lines are ignored, <index> is the NVML index 0..COUNT-1:
 *   <index> xid <code>     one Xid event (nvmlEventTypeXidCriticalError, eventData = code),
 *                          delivered once to each event set the device is registered with, by
 *                          nvmlEventSetWait_v2 (each line is one event; the same line twice is
 *                          two events)
 *   <index> ecc <count>    uncorrected ECC errors of the device (volatile and aggregate)
 *   <index> lost           every query of the device returns NVML_ERROR_GPU_IS_LOST (getting
 *                          its handle still works, as it must to name the device)
 *   <index> clocks <mask>  clocks-event-reason bits (decimal or 0x hex) reported in addition
 * Removing a line (or the file) clears an `ecc`, `lost` or `clocks` fault; an Xid once
 * delivered stays delivered.
 *
 * Symbols are those pynvml (nvidia-ml-py 13) resolves; structs have NVML's layouts.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dilu_fake_gpu.h"

#define API __attribute__((visibility("default")))

/* ------------------------------------------------------------------ NVML types (nvml.h) */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_STRUCT_VERSION(size, ver) ((unsigned int)(size) | ((unsigned int)(ver) << 24))

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 NVML_STRUCT_VERSION(sizeof(nvmlMemory_v2_t), 2)

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct { /* nvmlProcessInfo_v2_t == nvmlProcessInfo_t of the _v3 call */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version;
    int sensorType;
    int temperature;
} nvmlTemperature_v1_t;
#define nvmlTemperature_v1 NVML_STRUCT_VERSION(sizeof(nvmlTemperature_v1_t), 1)

#define NVML_EVENT_XID 0x8ull
#define NVML_CLOCKS_EVENT_GPU_IDLE 0x1ull
#define NVML_VALUE_NA 0xFFFFFFFFu /* gpuInstanceId/computeInstanceId without MIG */

#define FAKE_DRIVER_VERSION_STR "570.86.10-dilu-emulated"
#define FAKE_NVML_VERSION_STR "12.570.86.10-dilu-emulated"
#define FAKE_CUDA_VERSION 12080
#define IDLE_MW 60000u
#define SPAN_MW 340000u
#define LIMIT_MW 400000u
#define UTIL_WINDOW_NS 1000000000ull

/* ------------------------------------------------------------------ state */

#define MAX_DEVS 256

struct nvmlDevice_st { /* a handle points at one of these */
    int index;
    char timeline[128];
    struct gpu_shm *shm; /* mapped read-only, or NULL */
    dev_t shm_dev;
    ino_t shm_ino;
    uint64_t util_at_ns; /* when util_pct was computed (utilisation, power and temperature share it) */
    unsigned int util_pct;
};

struct fault {
    int lost;
    unsigned long long ecc;
    unsigned long long clocks;
};

struct xid_key {
    int dev;
    unsigned int code;
    unsigned int nth; /* n-th line with this device and code */
};

struct nvmlEventSet_st {
    unsigned long long mask[MAX_DEVS];
    struct xid_key *sent;
    int nsent, capsent;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_refs;
static int g_count;
static int g_first;
static char g_name[96];
static unsigned long long g_mem;
static struct nvmlDevice_st g_devs[MAX_DEVS];

static struct fault g_faults[MAX_DEVS];
static struct xid_key *g_xids;
static int g_nxids;
static int g_fault_seen; /* the file existed at the last look */
static struct stat g_fault_st;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ fault file */

static void faults_clear(void)
{
    memset(g_faults, 0, sizeof g_faults);
    free(g_xids);
    g_xids = NULL;
    g_nxids = 0;
}

static void faults_parse(FILE *f)
{
    char line[256];
    int cap = 0;
    while (fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        int idx;
        char kw[16], num[32];
        int n = sscanf(line, "%d %15s %31s", &idx, kw, num);
        if (n < 2 || idx < 0 || idx >= g_count)
            continue;
        unsigned long long arg = 0;
        if (n == 3) {
            char *end = NULL;
            if (num[0] == '-') /* strtoull would wrap a negative count */
                continue;
            int hex = num[0] == '0' && (num[1] == 'x' || num[1] == 'X');
            arg = strtoull(num, &end, hex ? 16 : 10);
            if (!end || *end)
                continue;
        }
        if (strcmp(kw, "lost") == 0) {
            g_faults[idx].lost = 1;
        } else if (strcmp(kw, "ecc") == 0 && n == 3) {
            g_faults[idx].ecc = arg;
        } else if (strcmp(kw, "clocks") == 0 && n == 3) {
            g_faults[idx].clocks |= arg;
        } else if (strcmp(kw, "xid") == 0 && n == 3) {
            if (g_nxids == cap) {
                cap = cap ? cap * 2 : 16;
                struct xid_key *p = realloc(g_xids, (size_t)cap * sizeof *p);
                if (!p)
                    return;
                g_xids = p;
            }
            unsigned int nth = 0;
            for (int i = 0; i < g_nxids; i++)
                nth += g_xids[i].dev == idx && g_xids[i].code == (unsigned int)arg;
            g_xids[g_nxids++] = (struct xid_key){idx, (unsigned int)arg, nth};
        }
    }
}

/* Re-reads the fault file when it changed (caller holds g_mu). */
static void faults_refresh(void)
{
    const char *path = getenv("DILU_FAKE_NVML_FAULTS");
    struct stat st;
    if (!path || !*path || stat(path, &st) != 0) {
        if (g_fault_seen)
            faults_clear();
        g_fault_seen = 0;
        return;
    }
    if (g_fault_seen && st.st_ino == g_fault_st.st_ino && st.st_dev == g_fault_st.st_dev &&
        st.st_size == g_fault_st.st_size && st.st_mtim.tv_sec == g_fault_st.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == g_fault_st.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(path, "r");
    if (!f)
        return; /* keep what we had; try again next query */
    faults_clear();
    faults_parse(f);
    fclose(f);
    g_fault_st = st;
    g_fault_seen = 1;
}

/* ------------------------------------------------------------------ emulated GPU segment */

static void shm_drop(struct nvmlDevice_st *d)
{
    if (d->shm)
        munmap(d->shm, sizeof(struct gpu_shm));
    d->shm = NULL;
}

/* The device's segment, mapped read-only and checked, or NULL (caller holds g_mu). The mapping
 * is kept while the segment's inode stays the same (a GPU removed and made again is remapped). */
static const struct gpu_shm *dev_shm(struct nvmlDevice_st *d)
{
    if (!d->timeline[0])
        return NULL;
    char path[160];
    snprintf(path, sizeof path, "/dilu-gpu-%s", d->timeline);
    int fd = shm_open(path, O_RDONLY, 0);
    if (fd < 0) {
        shm_drop(d);
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(struct gpu_shm)) {
        close(fd);
        shm_drop(d);
        return NULL;
    }
    if (!d->shm || st.st_ino != d->shm_ino || st.st_dev != d->shm_dev) {
        shm_drop(d);
        void *p = mmap(NULL, sizeof(struct gpu_shm), PROT_READ, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
            d->shm = p;
            d->shm_ino = st.st_ino;
            d->shm_dev = st.st_dev;
        }
    }
    close(fd);
    const struct gpu_shm *g = d->shm;
    if (!g || __atomic_load_n(&g->magic, __ATOMIC_ACQUIRE) != GPU_MAGIC || g->version != GPU_VERSION ||
        g->ring_offset != offsetof(struct gpu_shm, ring) || g->ring_cap != GPU_RING ||
        g->rec_size != sizeof(struct gpu_rec))
        return NULL;
    return g;
}

static int pid_alive(uint32_t pid) { return kill((pid_t)pid, 0) == 0 || errno != ESRCH; }

static uint64_t ld64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static uint32_t ld32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

struct span {
    uint64_t s, e;
};

static int span_cmp(const void *a, const void *b)
{
    uint64_t x = ((const struct span *)a)->s, y = ((const struct span *)b)->s;
    return x < y ? -1 : x > y;
}

static int span_add(struct span **v, size_t *n, size_t *cap, uint64_t s, uint64_t e, uint64_t t0, uint64_t t1)
{
    if (s < t0)
        s = t0;
    if (e > t1)
        e = t1;
    if (e <= s)
        return 0;
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 256;
        struct span *p = realloc(*v, c * sizeof *p);
        if (!p)
            return -1;
        *v = p;
        *cap = c;
    }
    (*v)[(*n)++] = (struct span){s, e};
    return 0;
}

/* Percent (0..100) of the last UTIL_WINDOW_NS during which a kernel was on the device. */
static unsigned int util_percent(const struct gpu_shm *g)
{
    uint64_t t1 = now_ns();
    uint64_t t0 = t1 > UTIL_WINDOW_NS ? t1 - UTIL_WINDOW_NS : 0;
    struct span *v = NULL;
    size_t n = 0, cap = 0;
    uint32_t hw = ld32(&g->slot_hw);
    if (hw > GPU_SLOTS)
        hw = GPU_SLOTS;
    for (uint32_t i = 0; i < hw; i++) { /* running now (a dead process's kernel is not) */
        const struct gpu_slot *s = &g->slots[i];
        if (ld32(&s->used) && !ld32(&s->done) && pid_alive(ld32(&s->pid)))
            span_add(&v, &n, &cap, ld64(&s->start_ns), t1, t0, t1);
    }
    const struct gpu_rec *ring = (const struct gpu_rec *)((const char *)g + g->ring_offset);
    uint64_t head = __atomic_load_n(&g->ring_head, __ATOMIC_ACQUIRE);
    uint64_t avail = head < GPU_RING ? head : GPU_RING;
    for (uint64_t k = 0; k < avail; k++) { /* completed, newest first (ends are in order) */
        uint64_t i = head - 1 - k;
        const struct gpu_rec *r = &ring[i % GPU_RING];
        if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != i + 1)
            continue;
        uint64_t s = ld64(&r->start_ns), e = ld64(&r->end_ns);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&r->seq, __ATOMIC_RELAXED) != i + 1)
            continue; /* overwritten while read */
        if (e + UTIL_WINDOW_NS < t0)
            break; /* a second older than the window: nothing before it reaches into it */
        if (span_add(&v, &n, &cap, s, e, t0, t1) != 0)
            break;
    }
    uint64_t busy = 0, cur_s = 0, cur_e = 0;
    if (n) {
        qsort(v, n, sizeof *v, span_cmp);
        cur_s = v[0].s;
        cur_e = v[0].e;
        for (size_t i = 1; i < n; i++) {
            if (v[i].s > cur_e) {
                busy += cur_e - cur_s;
                cur_s = v[i].s;
                cur_e = v[i].e;
            } else if (v[i].e > cur_e) {
                cur_e = v[i].e;
            }
        }
        busy += cur_e - cur_s;
    }
    free(v);
    uint64_t span = t1 - t0;
    unsigned int pct = span ? (unsigned int)((busy * 100 + span / 2) / span) : 0;
    return pct > 100 ? 100 : pct;
}

/* ------------------------------------------------------------------ entry and checks */

static nvmlReturn_t check_init(void) { return g_refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED; }

static int valid_dev(nvmlDevice_t d)
{
    if (!d || d < g_devs || d >= g_devs + g_count)
        return 0;
    return ((const char *)d - (const char *)g_devs) % sizeof(struct nvmlDevice_st) == 0;
}

/* Locks g_mu and checks init, the handle and the device's faults; on success the caller holds
 * g_mu and must call leave(). */
static nvmlReturn_t enter(nvmlDevice_t d)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = check_init();
    if (r == NVML_SUCCESS && !valid_dev(d))
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS) {
        faults_refresh();
        if (g_faults[d->index].lost)
            r = NVML_ERROR_GPU_IS_LOST;
    }
    if (r != NVML_SUCCESS)
        pthread_mutex_unlock(&g_mu);
    return r;
}

static nvmlReturn_t leave(nvmlReturn_t r)
{
    pthread_mutex_unlock(&g_mu);
    return r;
}

static nvmlReturn_t put_str(char *buf, unsigned int len, const char *s)
{
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

/* Utilisation percent of device d now (caller holds g_mu). Computed at most every 20 ms: one
 * telemetry sample asks for utilisation, power and temperature, which all derive from it, and
 * each computation walks the last second of the device's kernels. */
static unsigned int dev_util(nvmlDevice_t d)
{
    uint64_t t = now_ns();
    if (d->util_at_ns && t - d->util_at_ns < 20000000ull)
        return d->util_pct;
    const struct gpu_shm *g = dev_shm(d);
    d->util_pct = g ? util_percent(g) : 0;
    d->util_at_ns = t;
    return d->util_pct;
}

/* ------------------------------------------------------------------ init, system */

static void configure(void)
{
    g_count = dilu_fake_gpu_count();
    if (g_count > MAX_DEVS)
        g_count = MAX_DEVS;
    g_first = dilu_fake_first_index();
    snprintf(g_name, sizeof g_name, "%s", dilu_fake_name());
    g_mem = dilu_fake_memory_bytes();
    const char *tl = getenv("DILU_FAKE_GPU_TIMELINES");
    for (int i = 0; i < MAX_DEVS; i++) {
        shm_drop(&g_devs[i]);
        memset(&g_devs[i], 0, sizeof g_devs[i]);
        g_devs[i].index = i;
    }
    for (int i = 0; tl && *tl && i < g_count; i++) {
        const char *comma = strchr(tl, ',');
        size_t len = comma ? (size_t)(comma - tl) : strlen(tl);
        while (len && (*tl == ' ')) {
            tl++;
            len--;
        }
        while (len && tl[len - 1] == ' ')
            len--;
        if (len >= sizeof g_devs[i].timeline)
            len = sizeof g_devs[i].timeline - 1;
        memcpy(g_devs[i].timeline, tl, len);
        g_devs[i].timeline[len] = '\0';
        if (!comma)
            break;
        tl = comma + 1;
    }
    g_fault_seen = 0;
    faults_clear();
}

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    pthread_mutex_lock(&g_mu);
    if (g_refs++ == 0)
        configure();
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = check_init();
    if (r == NVML_SUCCESS && --g_refs == 0)
        for (int i = 0; i < MAX_DEVS; i++)
            shm_drop(&g_devs[i]);
    pthread_mutex_unlock(&g_mu);
    return r;
}

API const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = check_init();
    pthread_mutex_unlock(&g_mu);
    return r != NVML_SUCCESS ? r : put_str(version, length, FAKE_DRIVER_VERSION_STR);
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return put_str(version, length, FAKE_NVML_VERSION_STR);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = FAKE_CUDA_VERSION;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

/* ------------------------------------------------------------------ devices */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = check_init();
    if (r == NVML_SUCCESS && !count)
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS)
        *count = (unsigned int)g_count;
    pthread_mutex_unlock(&g_mu);
    return r;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = check_init();
    if (r == NVML_SUCCESS && (!device || index >= (unsigned int)g_count))
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS)
        *device = &g_devs[index];
    pthread_mutex_unlock(&g_mu);
    return r;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = check_init();
    if (r == NVML_SUCCESS && (!uuid || !device))
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS) {
        r = NVML_ERROR_NOT_FOUND;
        for (int i = 0; i < g_count; i++) {
            char s[64];
            dilu_fake_uuid_str(g_first + i, s, sizeof s);
            if (strcmp(s, uuid) == 0) {
                *device = &g_devs[i];
                r = NVML_SUCCESS;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!index)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)d->index;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length)
{
    nvmlReturn_t r = enter(d);
    return r != NVML_SUCCESS ? r : leave(put_str(name, length, g_name));
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    char s[64];
    dilu_fake_uuid_str(g_first + d->index, s, sizeof s);
    return leave(put_str(uuid, length, s));
}

/* The segment's mem_used less what dead processes still hold there (the fake driver reclaims
 * their entries lazily; a real driver frees a process's memory when it exits). */
static unsigned long long dev_mem_used(nvmlDevice_t d)
{
    const struct gpu_shm *g = dev_shm(d);
    if (!g)
        return 0;
    unsigned long long used = ld64(&g->mem_used);
    for (int i = 0; i < GPU_MEM_PROCS; i++) {
        uint32_t pid = ld32(&g->procs[i].pid);
        uint64_t bytes = ld64(&g->procs[i].bytes);
        if (pid && bytes && !pid_alive(pid))
            used -= bytes < used ? bytes : used;
    }
    return used > g_mem ? g_mem : used;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!m)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    m->total = g_mem;
    m->used = dev_mem_used(d);
    m->free = m->total - m->used;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!m)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (m->version != nvmlMemory_v2)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    m->total = g_mem;
    m->reserved = 0;
    m->used = dev_mem_used(d);
    m->free = m->total - m->used;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!current || !pending)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *current = *pending = 0; /* NVML_DEVICE_MIG_DISABLE */
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t d, int *mode)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!mode)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *mode = 0; /* NVML_COMPUTEMODE_DEFAULT */
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!major || !minor)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *major = 8;
    *minor = 0;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!pci)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = (unsigned int)(0x10 + d->index) & 0xff;
    pci->device = 0;
    pci->pciDeviceId = 0x20B010DE;    /* A100-SXM4-40GB */
    pci->pciSubSystemId = 0x134F10DE;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:00.0", pci->domain, pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:00.0", pci->domain, pci->bus);
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!u)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    u->gpu = dev_util(d);
    u->memory = u->gpu * 2 / 5;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!mw)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *mw = IDLE_MW + SPAN_MW / 100u * dev_util(d);
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t power_limit(nvmlDevice_t d, unsigned int *mw)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!mw)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *mw = LIMIT_MW;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned int *mw) { return power_limit(d, mw); }
API nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t d, unsigned int *mw) { return power_limit(d, mw); }
API nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *mw) { return power_limit(d, mw); }

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *temp)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!temp || sensor != 0) /* NVML_TEMPERATURE_GPU */
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *temp = 35 + dev_util(d) * 40 / 100;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t d, nvmlTemperature_v1_t *t)
{
    if (!t)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (t->version != nvmlTemperature_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned int c;
    nvmlReturn_t r = nvmlDeviceGetTemperature(d, t->sensorType, &c);
    if (r == NVML_SUCCESS)
        t->temperature = (int)c;
    return r;
}

API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *reasons)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!reasons)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *reasons = (dev_util(d) == 0 ? NVML_CLOCKS_EVENT_GPU_IDLE : 0) | g_faults[d->index].clocks;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *reasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(d, reasons);
}

static nvmlReturn_t running_procs(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!count || (*count && !infos))
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    nvmlProcessInfo_t found[GPU_MEM_PROCS];
    unsigned int n = 0;
    const struct gpu_shm *g = dev_shm(d);
    for (int i = 0; g && i < GPU_MEM_PROCS; i++) {
        uint32_t pid = ld32(&g->procs[i].pid);
        uint64_t bytes = ld64(&g->procs[i].bytes);
        if (pid == 0 || !pid_alive(pid))
            continue;
        found[n++] = (nvmlProcessInfo_t){pid, bytes, NVML_VALUE_NA, NVML_VALUE_NA};
    }
    if (*count < n) {
        *count = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *count = n;
    if (n)
        memcpy(infos, found, n * sizeof *found);
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_procs(d, count, infos);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_procs(d, count, infos);
}

API nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t d, int *current, int *pending)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!current || !pending)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *current = *pending = 1; /* NVML_FEATURE_ENABLED */
    return leave(NVML_SUCCESS);
}

/* errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate. */
API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int errorType, int counterType, unsigned long long *count)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!count || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = errorType == 1 ? g_faults[d->index].ecc : 0;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ events */

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!types)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *types = NVML_EVENT_XID;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = check_init();
    pthread_mutex_unlock(&g_mu);
    if (r != NVML_SUCCESS)
        return r;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mu);
    free(set->sent);
    free(set);
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{
    nvmlReturn_t r = enter(d);
    if (r != NVML_SUCCESS)
        return r;
    if (!set)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (types & ~NVML_EVENT_XID)
        return leave(NVML_ERROR_NOT_SUPPORTED);
    set->mask[d->index] |= types;
    return leave(NVML_SUCCESS);
}

static int was_sent(const nvmlEventSet_t set, const struct xid_key *k)
{
    for (int i = 0; i < set->nsent; i++)
        if (set->sent[i].dev == k->dev && set->sent[i].code == k->code && set->sent[i].nth == k->nth)
            return 1;
    return 0;
}

/* One pending Xid of a registered device into *data; 1 if there was one (caller holds g_mu). */
static int take_xid(nvmlEventSet_t set, nvmlEventData_t *data)
{
    faults_refresh();
    for (int i = 0; i < g_nxids; i++) {
        const struct xid_key *k = &g_xids[i];
        if (!(set->mask[k->dev] & NVML_EVENT_XID) || was_sent(set, k))
            continue;
        if (set->nsent == set->capsent) {
            int c = set->capsent ? set->capsent * 2 : 16;
            struct xid_key *p = realloc(set->sent, (size_t)c * sizeof *p);
            if (!p)
                return 0;
            set->sent = p;
            set->capsent = c;
        }
        set->sent[set->nsent++] = *k;
        data->device = &g_devs[k->dev];
        data->eventType = NVML_EVENT_XID;
        data->eventData = k->code;
        data->gpuInstanceId = NVML_VALUE_NA;
        data->computeInstanceId = NVML_VALUE_NA;
        return 1;
    }
    return 0;
}

/* Waits up to timeoutms for an event (the fault file is looked at every 10 ms meanwhile);
 * NVML_ERROR_TIMEOUT when none came. */
API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (!set || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = now_ns() + (uint64_t)timeoutms * 1000000ull;
    for (;;) {
        pthread_mutex_lock(&g_mu);
        nvmlReturn_t r = check_init();
        int got = r == NVML_SUCCESS && take_xid(set, data);
        pthread_mutex_unlock(&g_mu);
        if (r != NVML_SUCCESS)
            return r;
        if (got)
            return NVML_SUCCESS;
        uint64_t now = now_ns();
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        uint64_t step = deadline - now < 10000000ull ? deadline - now : 10000000ull;
        struct timespec ts = {(time_t)(step / 1000000000ull), (long)(step % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}
