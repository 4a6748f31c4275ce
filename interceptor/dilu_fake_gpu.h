/* The emulated node: what the fake CUDA driver (fake_driver.c) and the fake NVML (fake_nvml.c)
 * share, declared once. Both read the same environment, so a process sees one consistent node:
 *
 *   DILU_FAKE_GPU_COUNT         devices reported (default 1)
 *   DILU_FAKE_GPU_FIRST_INDEX   node-level index of device 0 (default 0); an instance that sees
 *                               only its own GPU gets that GPU's index here, so its UUID matches
 *                               the one NVML reports for it
 *   DILU_FAKE_GPU_NAME          model name (default "NVIDIA A100-SXM4-40GB")
 *   DILU_FAKE_GPU_MEMORY_BYTES  device memory per GPU (default 40 GiB)
 *   DILU_FAKE_GPU_SMS           multiprocessor count (default 108, an A100)
 *   DILU_FAKE_CONTEXT_BYTES     device memory a process's CUDA context takes, charged at its first
 *                               context and held until it exits (default 0: not modelled; the
 *                               emulated node sets models.CONTEXT_BYTES, measured on an H200)
 *   DILU_FAKE_GPU_UUID_SEED     string the UUIDs derive from (default "dilu"; the agent uses its
 *                               node name, so two emulated nodes never share a UUID)
 *   DILU_FAKE_GPU               shared-memory name of the device timeline a process runs on
 *   DILU_FAKE_GPU_TIMELINES     comma-separated timeline names of devices 0..COUNT-1 (the fake
 *                               NVML reads utilisation and per-process memory from them)
 *
 * The segment /dilu-gpu-<timeline> (struct gpu_shm) is one emulated GPU: the kernels running, a
 * ring of completed kernels, and the device memory each process holds.
 */
#ifndef DILU_FAKE_GPU_H
#define DILU_FAKE_GPU_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DILU_FAKE_DEFAULT_NAME "NVIDIA A100-SXM4-40GB"
#define DILU_FAKE_DEFAULT_MEMORY_BYTES (40ull << 30)
#define DILU_FAKE_DEFAULT_SMS 108

static inline long long dilu_fake_env_ll(const char *name, long long dflt)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end = NULL;
    long long x = strtoll(v, &end, 10);
    return end && *end == '\0' && x >= 0 ? x : dflt;
}

static inline int dilu_fake_gpu_count(void) { return (int)dilu_fake_env_ll("DILU_FAKE_GPU_COUNT", 1); }
static inline int dilu_fake_first_index(void) { return (int)dilu_fake_env_ll("DILU_FAKE_GPU_FIRST_INDEX", 0); }
static inline uint64_t dilu_fake_memory_bytes(void)
{
    return (uint64_t)dilu_fake_env_ll("DILU_FAKE_GPU_MEMORY_BYTES", (long long)DILU_FAKE_DEFAULT_MEMORY_BYTES);
}
static inline uint64_t dilu_fake_context_bytes(void)
{
    long long v = dilu_fake_env_ll("DILU_FAKE_CONTEXT_BYTES", 0);
    return v > 0 ? (uint64_t)v : 0;
}
static inline int dilu_fake_sms(void)
{
    int n = (int)dilu_fake_env_ll("DILU_FAKE_GPU_SMS", DILU_FAKE_DEFAULT_SMS);
    return n > 0 ? n : DILU_FAKE_DEFAULT_SMS;
}
static inline const char *dilu_fake_name(void)
{
    const char *v = getenv("DILU_FAKE_GPU_NAME");
    return v && *v ? v : DILU_FAKE_DEFAULT_NAME;
}

/* The 16 UUID bytes of node-level GPU `index`: FNV-1a of the seed, then the index (RFC 4122
 * version-4 and variant bits set so tools parse it). */
static inline void dilu_fake_uuid(int index, unsigned char out[16])
{
    const char *seed = getenv("DILU_FAKE_GPU_UUID_SEED");
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = seed && *seed ? seed : "dilu"; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    for (int i = 0; i < 8; i++)
        out[i] = (unsigned char)(h >> (8 * i));
    out[6] = (unsigned char)((out[6] & 0x0f) | 0x40);
    out[8] = 0x80 | 0x11;
    out[9] = 0xd1;
    for (int i = 0; i < 6; i++)
        out[10 + i] = (unsigned char)((uint64_t)index >> (8 * (5 - i)));
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as NVML formats a UUID (buf >= 41 bytes). */
static inline void dilu_fake_uuid_str(int index, char *buf, size_t len)
{
    unsigned char u[16];
    dilu_fake_uuid(index, u);
    snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

/* ------------------------------------------------------------------ the shared device segment */

#define GPU_MAGIC 0x3155504745464c44ULL /* "DLFEGPU1" */
#define GPU_VERSION 4u
#define GPU_SLOTS 4096
#define GPU_RING (1u << 19)

struct gpu_rec { /* one completed kernel; seq = index + 1 once complete (written last) */
    uint64_t seq;
    uint32_t pid;
    uint32_t width_ppm;
    uint64_t ctx;
    uint64_t stream;
    uint64_t start_ns;
    uint64_t end_ns;
    uint64_t func;
};

struct gpu_slot { /* one kernel, running or done and not yet collected */
    uint32_t used, done;
    uint32_t pid, width_ppm;
    uint64_t gen;
    uint64_t ctx, stream, func;
    double remaining_ns; /* solo work left */
    uint64_t start_ns, end_ns;
};

#define GPU_MEM_PROCS 256

struct gpu_mem_proc { /* pid 0: free entry */
    uint32_t pid;
    uint32_t pad;
    uint64_t bytes;
};

struct gpu_shm {
    /* fixed header read by dilu.interceptor.timeline (keep offsets) */
    uint64_t magic;        /* 0 */
    uint32_t version;      /* 8 */
    uint32_t sms;          /* 12 */
    uint64_t ring_offset;  /* 16 */
    uint64_t ring_cap;     /* 24 */
    uint64_t rec_size;     /* 32 */
    uint64_t ring_head;    /* 40: records written so far */
    uint64_t sim_now;      /* 48: virtual clock */
    uint64_t slot_gen;     /* 56 */
    uint32_t slot_hw;      /* 64: slots[0..slot_hw) may be used */
    uint32_t pad;
    pthread_mutex_t mu;
    /* device memory: total, and what each process holds (guarded by mu; the fake driver
     * allocates against it, the fake NVML reads it; a dead pid's entry is reclaimed) */
    uint64_t mem_total;
    uint64_t mem_used;
    struct gpu_mem_proc procs[GPU_MEM_PROCS];
    struct gpu_slot slots[GPU_SLOTS];
    struct gpu_rec ring[GPU_RING] __attribute__((aligned(64)));
};


#endif /* DILU_FAKE_GPU_H */
