/* The control block of one instance: THE single declaration of its layout.
 *
 * Read as-is by the C code (through dilu_cb.h, which adds <stdint.h> and the guards) and by the
 * cffi cdef of the Python binding, so it holds no preprocessor lines, no _Atomic and no includes.
 * All multi-byte fields are naturally aligned. Atomic access goes through the helpers in dilu_cb.h.
 *
 * One writer per field:
 *   header, grant_*:            the node agent (creates the block, writes grants, heartbeats)
 *   telemetry (t_*):            the interceptor inside the instance process
 *   instance runtime (r_*):     the instance's Python runtime (request-level counters)
 * Quotas are parts per million of one GPU's SM-time (quota 0.25 -> 250000).
 * Times: *_ns are CLOCK_MONOTONIC nanoseconds; *_us are microseconds. Memory: *_bytes are bytes.
 */
struct dilu_cb {
    /* ---- header: written once by the agent at creation ---- */
    uint64_t magic;                /* DILU_CB_MAGIC */
    uint32_t layout_version;       /* DILU_CB_LAYOUT_VERSION */
    uint32_t size;                 /* sizeof(struct dilu_cb) */
    char     instance_id[64];

    /* ---- grant side: agent writes ---- */
    uint32_t grant_epoch;          /* futex word: incremented after each new grant */
    uint32_t grant_pad;
    uint64_t grant_seq;            /* seqlock over quota_ppm/width_ppm/request_ppm (odd = writing) */
    uint64_t quota_ppm;            /* current granted quota */
    uint64_t request_ppm;          /* request quota: fail-safe rate before any grant */
    uint64_t width_ppm;            /* SM width, fixed at launch */
    uint64_t agent_heartbeat_ns;   /* agent's last sign of life; older than stale_after_ns = stale */
    uint64_t stale_after_ns;

    /* ---- telemetry: interceptor writes ---- */
    uint64_t t_seq;                /* seqlock over the t_* fields */
    uint64_t t_pid;
    uint64_t t_launches;           /* kernel + graph launches metered */
    uint64_t t_throttled;          /* launches that waited for tokens */
    uint64_t t_busy_us;            /* estimated GPU-busy time charged (token debits) */
    uint64_t t_wait_us;            /* time launches waited for tokens */
    uint64_t t_cycles;             /* kernel-launch cycles completed */
    uint64_t t_last_cycle_us;      /* span of the last cycle */
    uint64_t t_baseline_cycle_us;  /* baseline (uncontended) cycle span */
    int64_t  t_tokens_us;          /* token balance */
    uint64_t t_last_launch_ns;
    uint64_t t_applied_epoch;      /* last grant epoch the interceptor applied */
    uint64_t t_applied_ns;         /* when it applied it */

    /* ---- instance runtime writes ---- */
    uint64_t r_ready;              /* 1 once the model is loaded and requests are pulled */
    uint64_t r_requests;           /* requests completed */
    uint64_t r_latency_us_ewma;    /* EWMA of request latency from scheduled send */
    uint64_t r_queue_depth;        /* requests held (fetched, not yet answered) */

    /* ---- telemetry added in layout 1 (interceptor writes, under t_seq) ---- */
    uint64_t t_flags;              /* bit 0: agent heartbeat stale (running at the last grant) */
    uint64_t t_samples;            /* launches timed with events to calibrate kernel cost */
    uint64_t t_quota_ppm;          /* quota in effect (after the floor), as applied */

    /* ---- device memory, in what layout 1 left reserved (same size and version: a block made
     *      before these fields existed reads 0 here, i.e. no reservation and nothing counted) ---- */
    uint64_t mem_limit_bytes;      /* agent writes at creation: the instance's reservation; 0 = none */
    uint64_t t_mem_used_bytes;     /* interceptor, under t_seq: bytes held through counted allocations */
    uint64_t t_mem_peak_bytes;     /* interceptor, under t_seq: the most t_mem_used_bytes has been */
    uint64_t t_oom_refusals;       /* interceptor, under t_seq: allocations refused past the reservation */

    uint64_t t_torn_grant_reads;   /* interceptor, under t_seq: grant reads that gave up on a grant
                                      writer holding grant_seq odd (killed mid-write) */

    uint64_t reserved[8];
};
