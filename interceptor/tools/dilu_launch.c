/* dilu_launch: a small driver-API program that launches kernels through one chosen path, for the
 * interceptor's tests and benchmark (no interpreter start-up in the way).
 *
 *   dilu_launch [-m MODE] [-k KERNEL] [-n COUNT] [-t SECONDS] [-s SYNC_EVERY] [-g GRAPH_LEN]
 *               [-p PAUSE_US] [-f] [-b]
 *
 * MODE: direct (linked cuLaunchKernel, default), ptsz (linked cuLaunchKernel_ptsz), dlsym
 * (dlopen + dlsym), gpa0 / gpa2 (cuGetProcAddress_v2 with flags 0 / 2), gpa4 (4-argument
 * cuGetProcAddress), ex (cuLaunchKernelEx), coop (cuLaunchCooperativeKernel), graph (captures
 * GRAPH_LEN kernels into a graph, then launches the graph; COUNT counts graph launches).
 * KERNEL: a fake-driver kernel name, e.g. k_50 (50 µs). Launches COUNT times, or for SECONDS
 * (when -t is given), synchronising every SYNC_EVERY launches (0: only at the end).
 * -p PAUSE_US: sleep that long after each synchronisation (idle gaps between launch cycles).
 * -f: fork after the first half; parent and child each run the second half.
 * -b: overhead mode, prints the mean ns per launch call of the timed loop.
 * Prints one JSON line: pid, mode, launches, start_ns, first_launch_ns, end_ns, errors.
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

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);

static unsigned long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

#define CHECK(call)                                                                  \
    do {                                                                             \
        CUresult r_ = (call);                                                        \
        if (r_ != CUDA_SUCCESS) {                                                    \
            fprintf(stderr, "dilu_launch: %s failed: %d\n", #call, r_);              \
            exit(2);                                                                 \
        }                                                                            \
    } while (0)

int main(int argc, char **argv)
{
    unsigned long long start_ns = now_ns();
    const char *mode = "direct", *kernel = "k_50";
    long count = 1000, sync_every = 0, graph_len = 10;
    double seconds = -1.0;
    int do_fork = 0, bench = 0, c;
    long pause_us = 0;
    while ((c = getopt(argc, argv, "m:k:n:t:s:g:p:fb")) != -1) {
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
        default:
            fprintf(stderr, "usage: dilu_launch [-m MODE] [-k KERNEL] [-n COUNT] [-t SECONDS] "
                            "[-s SYNC_EVERY] [-g GRAPH_LEN] [-p PAUSE_US] [-f] [-b]\n");
            return 1;
        }
    }
    launch_fn launch = cuLaunchKernel;
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
        else
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
            r = launch(fn, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        if (r != CUDA_SUCCESS)
            errors++;
        if (!first_ns)
            first_ns = now_ns();
        done++;
        if (sync_every > 0 && done % sync_every == 0) {
            CHECK(cuCtxSynchronize());
            if (pause_us > 0) /* host-side think time: an idle gap between cycles */
                usleep((useconds_t)pause_us);
        }
    }
    unsigned long long loop_ns = now_ns() - loop_start;
    CHECK(cuCtxSynchronize());
    if (forked)
        while (wait(NULL) > 0) {
        }
    printf("{\"pid\": %d, \"mode\": \"%s\", \"launches\": %ld, \"start_ns\": %llu, "
           "\"first_launch_ns\": %llu, \"end_ns\": %llu, \"errors\": %ld, \"ns_per_launch\": %.1f}\n",
           getpid(), mode, done, start_ns, first_ns, now_ns(), errors,
           bench && done ? (double)loop_ns / (double)done : 0.0);
    return errors ? 3 : 0;
}
