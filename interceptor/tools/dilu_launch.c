/* dilu_launch: a small driver-API program that launches kernels through one chosen path, for the
 * interceptor's tests and benchmark (no interpreter start-up in the way).
 *
 *   dilu_launch [-m MODE] [-k KERNEL] [-n COUNT] [-t SECONDS] [-s SYNC_EVERY] [-g GRAPH_LEN]
 *               [-p PAUSE_US] [-S STALL_US] [-D KEYS] [-f] [-b]
 *
 * MODE: direct (linked cuLaunchKernel, default), ptsz (linked cuLaunchKernel_ptsz), dlsym
 * (dlopen + dlsym), gpa0 / gpa2 (cuGetProcAddress_v2 with flags 0 / 2), gpa4 (4-argument
 * cuGetProcAddress), gpa13 (cuGetProcAddress_v2 at CUDA version 13000, for the launch and for
 * cuCtxSynchronize, whose CUDA 13 entry point takes the context), ex (cuLaunchKernelEx), coop
 * (cuLaunchCooperativeKernel), graph (captures
 * GRAPH_LEN kernels into a graph, then launches the graph; COUNT counts graph launches).
 * KERNEL: a fake-driver kernel name, e.g. k_50 (50 µs). Launches COUNT times, or for SECONDS
 * (when -t is given), synchronising every SYNC_EVERY launches (0: only at the end).
 * -p PAUSE_US: sleep that long after each synchronisation (idle gaps between launch cycles).
 * -S STALL_US: sleep that long once, after the first launch of cycle STALL_CYCLE + 1 (with -s):
 * a launcher preempted mid-cycle, which cuts one cycle in two.
 * -D KEYS: cycle through KEYS distinct launch geometries (grid x 1..KEYS) of KERNEL, so the
 * interceptor sees KEYS distinct kernels of the same duration (like a model's first forward pass).
 * -f: fork after the first half; parent and child each run the second half.
 * -b: overhead mode, prints the mean ns per launch call of the timed loop.
 * Prints one JSON line: pid, mode, launches, start_ns, first_launch_ns, end_ns, errors.
 *
 * Allocation mode: dilu_launch -A BYTES [-n COUNT] [-m MODE] [-e ENTRY] [-F] [-H] [-L] [-f]
 * makes COUNT allocations of BYTES each (no kernels) through ENTRY, reached by MODE: direct
 * (linked), dlsym, gpa0 / gpa2 (cuGetProcAddress_v2, flags 0 / 2), gpa4 (4-argument
 * cuGetProcAddress). ENTRY: alloc (cuMemAlloc_v2, default), v1 (legacy cuMemAlloc, 32-bit; not
 * reachable by cuGetProcAddress), managed, pitch (width BYTES, 1 row), async, pool
 * (cuMemAllocFromPoolAsync, no pool), create (cuMemCreate), array (BYTES/4 floats), array3d
 * (BYTES/16 floats x 2 x 2). Frees go through the matching entry point, by the same MODE.
 * -F: free each allocation at once (an alloc/free loop); otherwise they are freed at the end.
 * -H: hold: print the JSON line, wait until stdin closes, then free and print a second line.
 * -L: leave the allocations to the process's exit (no frees). -f: fork after half the
 * allocations; parent and child each make the other half, and neither frees anything before both
 * are done allocating (the child frees only its own).
 * JSON: pid, child, mode, entry, ok, oom, errors, last_error (CUresult of the last failure),
 * free, total (cuMemGetInfo_v2 by the same MODE, after the allocations), freed, free_errors.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dilu_cuda_min.h"

CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void **);
CUresult cuCtxSynchronize(void);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, int *);
CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAlloc(CUdeviceptr_v1 *, unsigned int);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFree(CUdeviceptr_v1);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuArrayDestroy(CUarray);
CUresult cuMemGetInfo_v2(size_t *, size_t *);

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*sync13_fn)(CUcontext); /* PFN_cuCtxSynchronize_v13000 */

static unsigned long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

#define STALL_CYCLE 20 /* -S stalls the cycle after this many whole ones */

#define CHECK(call)                                                                  \
    do {                                                                             \
        CUresult r_ = (call);                                                        \
        if (r_ != CUDA_SUCCESS) {                                                    \
            fprintf(stderr, "dilu_launch: %s failed: %d\n", #call, r_);              \
            exit(2);                                                                 \
        }                                                                            \
    } while (0)

/* ------------------------------------------------------------------ allocation mode */

struct mem_entry {
    const char *entry;
    const char *alloc_sym, *alloc_base; /* exported name; name given to cuGetProcAddress */
    const char *free_sym, *free_base;
    void *alloc_direct, *free_direct;
};

static const struct mem_entry g_mem_entries[] = {
    {"alloc", "cuMemAlloc_v2", "cuMemAlloc", "cuMemFree_v2", "cuMemFree", (void *)cuMemAlloc_v2, (void *)cuMemFree_v2},
    {"v1", "cuMemAlloc", NULL, "cuMemFree", NULL, (void *)cuMemAlloc, (void *)cuMemFree},
    {"managed", "cuMemAllocManaged", "cuMemAllocManaged", "cuMemFree_v2", "cuMemFree", (void *)cuMemAllocManaged, (void *)cuMemFree_v2},
    {"pitch", "cuMemAllocPitch_v2", "cuMemAllocPitch", "cuMemFree_v2", "cuMemFree", (void *)cuMemAllocPitch_v2, (void *)cuMemFree_v2},
    {"async", "cuMemAllocAsync", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemFreeAsync", (void *)cuMemAllocAsync, (void *)cuMemFreeAsync},
    {"pool", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuMemFreeAsync", (void *)cuMemAllocFromPoolAsync, (void *)cuMemFreeAsync},
    {"create", "cuMemCreate", "cuMemCreate", "cuMemRelease", "cuMemRelease", (void *)cuMemCreate, (void *)cuMemRelease},
    {"array", "cuArrayCreate_v2", "cuArrayCreate", "cuArrayDestroy", "cuArrayDestroy", (void *)cuArrayCreate_v2, (void *)cuArrayDestroy},
    {"array3d", "cuArray3DCreate_v2", "cuArray3DCreate", "cuArrayDestroy", "cuArrayDestroy", (void *)cuArray3DCreate_v2, (void *)cuArrayDestroy},
};

/* The entry point `sym` (exported name) / `base` (cuGetProcAddress name) reached by `mode`. */
static void *resolve_entry(const char *mode, const char *sym, const char *base, void *direct)
{
    if (strcmp(mode, "direct") == 0)
        return direct;
    if (strcmp(mode, "dlsym") == 0) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        return h ? dlsym(h, sym) : NULL;
    }
    if (!base)
        return NULL;
    void *p = NULL;
    int st = 0;
    if (strcmp(mode, "gpa4") == 0)
        cuGetProcAddress(base, &p, 12000, 0);
    else if (strcmp(mode, "gpa0") == 0 || strcmp(mode, "gpa2") == 0)
        cuGetProcAddress_v2(base, &p, 12000, strcmp(mode, "gpa2") == 0 ? 2 : 0, &st);
    return p;
}

static CUresult mem_alloc_one(const char *entry, void *fn, size_t bytes, unsigned long long *out)
{
    CUdeviceptr d = 0;
    CUresult r;
    if (strcmp(entry, "v1") == 0) {
        CUdeviceptr_v1 d1 = 0;
        r = ((CUresult(*)(CUdeviceptr_v1 *, unsigned int))fn)(&d1, (unsigned int)bytes);
        d = d1;
    } else if (strcmp(entry, "managed") == 0) {
        r = ((CUresult(*)(CUdeviceptr *, size_t, unsigned int))fn)(&d, bytes, CU_MEM_ATTACH_GLOBAL);
    } else if (strcmp(entry, "pitch") == 0) {
        size_t pitch = 0;
        r = ((CUresult(*)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int))fn)(&d, &pitch, bytes, 1, 4);
    } else if (strcmp(entry, "async") == 0) {
        r = ((CUresult(*)(CUdeviceptr *, size_t, CUstream))fn)(&d, bytes, NULL);
    } else if (strcmp(entry, "pool") == 0) {
        r = ((CUresult(*)(CUdeviceptr *, size_t, CUmemoryPool, CUstream))fn)(&d, bytes, NULL, NULL);
    } else if (strcmp(entry, "create") == 0) {
        CUmemGenericAllocationHandle h = 0;
        r = ((CUresult(*)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                          unsigned long long))fn)(&h, bytes, NULL, 0);
        d = h;
    } else if (strcmp(entry, "array") == 0) {
        CUarray a = NULL;
        CUDA_ARRAY_DESCRIPTOR desc = {bytes / 4, 0, CU_AD_FORMAT_FLOAT, 1};
        r = ((CUresult(*)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *))fn)(&a, &desc);
        d = (CUdeviceptr)(uintptr_t)a;
    } else if (strcmp(entry, "array3d") == 0) {
        CUarray a = NULL;
        CUDA_ARRAY3D_DESCRIPTOR desc = {bytes / 16, 2, 2, CU_AD_FORMAT_FLOAT, 1, 0};
        r = ((CUresult(*)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))fn)(&a, &desc);
        d = (CUdeviceptr)(uintptr_t)a;
    } else {
        r = ((CUresult(*)(CUdeviceptr *, size_t))fn)(&d, bytes);
    }
    *out = d;
    return r;
}

static CUresult mem_free_one(const char *entry, void *fn, unsigned long long h)
{
    if (strcmp(entry, "v1") == 0)
        return ((CUresult(*)(CUdeviceptr_v1))fn)((CUdeviceptr_v1)h);
    if (strcmp(entry, "async") == 0 || strcmp(entry, "pool") == 0)
        return ((CUresult(*)(CUdeviceptr, CUstream))fn)((CUdeviceptr)h, NULL);
    if (strcmp(entry, "create") == 0)
        return ((CUresult(*)(CUmemGenericAllocationHandle))fn)((CUmemGenericAllocationHandle)h);
    if (strncmp(entry, "array", 5) == 0)
        return ((CUresult(*)(CUarray))fn)((CUarray)(uintptr_t)h);
    return ((CUresult(*)(CUdeviceptr))fn)((CUdeviceptr)h);
}

static int alloc_main(const char *mode, const char *entry, size_t bytes, long count, int free_each,
                      int hold, int leak, int do_fork)
{
    const struct mem_entry *e = NULL;
    for (size_t i = 0; i < sizeof g_mem_entries / sizeof g_mem_entries[0]; i++)
        if (strcmp(g_mem_entries[i].entry, entry) == 0)
            e = &g_mem_entries[i];
    if (!e) {
        fprintf(stderr, "dilu_launch: unknown entry %s\n", entry);
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate_v2(&ctx, 0, dev));
    void *alloc = resolve_entry(mode, e->alloc_sym, e->alloc_base, e->alloc_direct);
    void *release = resolve_entry(mode, e->free_sym, e->free_base, e->free_direct);
    void *info = resolve_entry(mode, "cuMemGetInfo_v2", "cuMemGetInfo", (void *)cuMemGetInfo_v2);
    if (!alloc || !release || !info) {
        fprintf(stderr, "dilu_launch: no entry point for %s by mode %s\n", entry, mode);
        return 2;
    }
    unsigned long long *held = calloc((size_t)(count > 0 ? count : 1), sizeof *held);
    long nheld = 0, own_from = 0, ok = 0, oom = 0, errors = 0, freed = 0, free_errors = 0;
    int last_error = 0, child = 0;
    pid_t kid = -1;
    int p2c[2] = {-1, -1}, c2p[2] = {-1, -1}; /* after the allocations: each tells the other */
    if (do_fork && (pipe(p2c) != 0 || pipe(c2p) != 0)) {
        perror("dilu_launch: pipe");
        return 2;
    }
    for (long i = 0; i < count; i++) {
        if (do_fork && i == count / 2 && kid < 0) {
            kid = fork();
            if (kid == 0) { /* the child sets up its own driver state, as CUDA requires */
                child = 1;
                own_from = nheld;
                ok = oom = errors = 0;
                CHECK(cuInit(0));
                CHECK(cuCtxCreate_v2(&ctx, 0, dev));
            }
        }
        unsigned long long h = 0;
        CUresult r = mem_alloc_one(entry, alloc, bytes, &h);
        if (r == CUDA_SUCCESS) {
            ok++;
            if (free_each) {
                CUresult f = mem_free_one(entry, release, h);
                freed += f == CUDA_SUCCESS;
                free_errors += f != CUDA_SUCCESS;
            } else {
                held[nheld++] = h;
            }
        } else {
            if (r == CUDA_ERROR_OUT_OF_MEMORY)
                oom++;
            else
                errors++;
            last_error = r;
        }
    }
    size_t mfree = 0, mtotal = 0;
    CUresult ri = ((CUresult(*)(size_t *, size_t *))info)(&mfree, &mtotal);
    if (ri != CUDA_SUCCESS)
        errors++;
    printf("{\"pid\": %d, \"child\": %d, \"mode\": \"%s\", \"entry\": \"%s\", \"ok\": %ld, \"oom\": %ld, "
           "\"errors\": %ld, \"last_error\": %d, \"free\": %zu, \"total\": %zu",
           getpid(), child, mode, entry, ok, oom, errors, last_error, mfree, mtotal);
    if (hold) {
        printf("}\n");
        fflush(stdout);
        while (fgetc(stdin) != EOF) {
        }
    }
    if (kid >= 0) { /* both are done allocating before either frees */
        char c = 'x';
        if (write(child ? c2p[1] : p2c[1], &c, 1) != 1 || read(child ? p2c[0] : c2p[0], &c, 1) != 1)
            errors++;
    }
    if (!leak)
        for (long i = own_from; i < nheld; i++) {
            CUresult f = mem_free_one(entry, release, held[i]);
            freed += f == CUDA_SUCCESS;
            free_errors += f != CUDA_SUCCESS;
        }
    if (hold) {
        ri = ((CUresult(*)(size_t *, size_t *))info)(&mfree, &mtotal);
        printf("{\"pid\": %d, \"child\": %d, \"freed\": %ld, \"free_errors\": %ld, \"free\": %zu, \"total\": %zu}\n",
               getpid(), child, freed, free_errors, mfree, mtotal);
    } else {
        printf(", \"freed\": %ld, \"free_errors\": %ld}\n", freed, free_errors);
    }
    fflush(stdout);
    if (kid > 0)
        waitpid(kid, NULL, 0);
    free(held);
    return errors || free_errors ? 3 : 0;
}

int main(int argc, char **argv)
{
    unsigned long long start_ns = now_ns();
    const char *mode = "direct", *kernel = "k_50";
    long count = 1000, sync_every = 0, graph_len = 10, keys = 1;
    double seconds = -1.0;
    int do_fork = 0, bench = 0, c;
    long pause_us = 0, stall_us = 0;
    long long alloc_bytes = -1;
    const char *entry = "alloc";
    int free_each = 0, hold = 0, leak = 0;
    while ((c = getopt(argc, argv, "m:k:n:t:s:g:p:S:D:fbA:e:FHL")) != -1) {
        switch (c) {
        case 'm': mode = optarg; break;
        case 'k': kernel = optarg; break;
        case 'n': count = atol(optarg); break;
        case 't': seconds = atof(optarg); break;
        case 's': sync_every = atol(optarg); break;
        case 'g': graph_len = atol(optarg); break;
        case 'f': do_fork = 1; break;
        case 'b': bench = 1; break;
        case 'p': pause_us = atol(optarg); break;
        case 'S': stall_us = atol(optarg); break;
        case 'D': keys = atol(optarg); break;
        case 'A': alloc_bytes = atoll(optarg); break;
        case 'e': entry = optarg; break;
        case 'F': free_each = 1; break;
        case 'H': hold = 1; break;
        case 'L': leak = 1; break;
        default:
            fprintf(stderr, "usage: dilu_launch [-m MODE] [-k KERNEL] [-n COUNT] [-t SECONDS] "
                            "[-s SYNC_EVERY] [-g GRAPH_LEN] [-p PAUSE_US] [-S STALL_US] [-D KEYS] [-f] [-b]\n"
                            "       dilu_launch -A BYTES [-n COUNT] [-m MODE] [-e ENTRY] [-F] [-H] [-L] [-f]\n");
            return 1;
        }
    }
    if (keys < 1) {
        fprintf(stderr, "dilu_launch: -D KEYS must be at least 1, got %ld\n", keys);
        return 1;
    }
    if (alloc_bytes >= 0)
        return alloc_main(mode, entry, (size_t)alloc_bytes, count, free_each, hold, leak, do_fork);
    launch_fn launch = cuLaunchKernel;
    sync13_fn sync13 = NULL; /* mode gpa13: cuCtxSynchronize as CUDA 13 hands it out */
    if (strcmp(mode, "ptsz") == 0) {
        launch = cuLaunchKernel_ptsz;
    } else if (strcmp(mode, "dlsym") == 0) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        launch = h ? (launch_fn)dlsym(h, "cuLaunchKernel") : NULL;
    } else if (strncmp(mode, "gpa", 3) == 0) {
        void *p = NULL;
        int st = 0;
        if (strcmp(mode, "gpa4") == 0)
            CHECK(cuGetProcAddress("cuLaunchKernel", &p, 12000, 0));
        else if (strcmp(mode, "gpa13") == 0) {
            void *q = NULL;
            CHECK(cuGetProcAddress_v2("cuLaunchKernel", &p, 13000, 0, &st));
            CHECK(cuGetProcAddress_v2("cuCtxSynchronize", &q, 13000, 0, &st));
            sync13 = (sync13_fn)q;
        } else
            CHECK(cuGetProcAddress_v2("cuLaunchKernel", &p, 12000, strcmp(mode, "gpa2") == 0 ? 2 : 0, &st));
        launch = (launch_fn)p;
    }
    if (!launch) {
        fprintf(stderr, "dilu_launch: no entry point for mode %s\n", mode);
        return 2;
    }
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUstream stream = NULL;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate_v2(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&mod, "fake"));
    CHECK(cuModuleGetFunction(&fn, mod, kernel));
    CUgraphExec exec = NULL;
    if (strcmp(mode, "graph") == 0) {
        CUgraph graph;
        CHECK(cuStreamCreate(&stream, 0));
        CHECK(cuStreamBeginCapture_v2(stream, 0));
        for (long i = 0; i < graph_len; i++) /* captured: not run, not charged */
            CHECK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL));
        CHECK(cuStreamEndCapture(stream, &graph));
        CHECK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    }
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, stream, NULL, 0};
    long done = 0, errors = 0, half = count / 2;
    int forked = 0;
    unsigned long long first_ns = 0, t_end = seconds > 0 ? now_ns() + (unsigned long long)(seconds * 1e9) : 0;
    unsigned long long loop_start = now_ns();
    for (long i = 0; seconds > 0 ? now_ns() < t_end : i < count; i++) {
        if (do_fork && !forked && i == half) {
            forked = 1;
            CHECK(cuCtxSynchronize());
            pid_t pid = fork();
            if (pid == 0) { /* the child sets up its own driver state, as CUDA requires */
                CHECK(cuInit(0));
                CHECK(cuCtxCreate_v2(&ctx, 0, dev));
                CHECK(cuModuleGetFunction(&fn, mod, kernel));
            }
        }
        CUresult r;
        if (strcmp(mode, "ex") == 0)
            r = cuLaunchKernelEx(&cfg, fn, NULL, NULL);
        else if (strcmp(mode, "coop") == 0)
            r = cuLaunchCooperativeKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, NULL);
        else if (exec)
            r = cuGraphLaunch(exec, stream);
        else
            r = launch(fn, 1 + (unsigned)(i % keys), 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        if (r != CUDA_SUCCESS)
            errors++;
        if (!first_ns)
            first_ns = now_ns();
        done++;
        if (stall_us > 0 && sync_every > 0 && done == STALL_CYCLE * sync_every + 1)
            usleep((useconds_t)stall_us); /* one host stall after the first launch of a cycle: a
                                           * launcher preempted mid-cycle */
        if (sync_every > 0 && done % sync_every == 0) {
            CHECK(sync13 ? sync13(ctx) : cuCtxSynchronize());
            if (pause_us > 0) /* host-side think time: an idle gap between cycles */
                usleep((useconds_t)pause_us);
        }
    }
    unsigned long long loop_ns = now_ns() - loop_start;
    CHECK(sync13 ? sync13(ctx) : cuCtxSynchronize());
    if (forked)
        while (wait(NULL) > 0) {
        }
    printf("{\"pid\": %d, \"mode\": \"%s\", \"launches\": %ld, \"start_ns\": %llu, "
           "\"first_launch_ns\": %llu, \"end_ns\": %llu, \"errors\": %ld, \"ns_per_launch\": %.1f}\n",
           getpid(), mode, done, start_ns, first_ns, now_ns(), errors,
           bench && done ? (double)loop_ns / (double)done : 0.0);
    return errors ? 3 : 0;
}
