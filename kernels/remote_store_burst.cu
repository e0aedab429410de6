// Remote-store Burst–Gap microbenchmark (paper §3.1).
//
// K producers, one CTA each, repeat: store B bytes with 16-byte stores into the destination
// buffer (a peer GPU's memory, or the issuing GPU's own for the local control), then spin for a
// producer-side gap that issues no remote stores. A timekeeper warp of every CTA records, per
// burst, the SM clock at issue start and issue end and %globaltimer at issue start; the host turns
// cycles into time with the SM clock measured over the same launch (clock64 and %globaltimer read
// together at kernel entry and exit).
//
// Alignment: a grid barrier before the first burst, and before every burst when
// align_each_burst is set, so that the K bursts form one aggregate burst of V = K·B bytes.
// With fence_each_burst the issue interval ends only when the burst is visible at the
// destination (the completion-coupled issuer of §2.3 and §3.4).
//
// Built at run time by CuPy/NVRTC for sm_90 and compiled by nvcc in the tests: no includes.

typedef unsigned int u32;
typedef unsigned long long u64;

#define XSTAGE_ERR_BARRIER_TIMEOUT 1u

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The alignment barrier orders no data, only time, so its atomics are relaxed: a release would
// add a fence, which waits until this SM's outstanding remote stores complete.
__device__ __forceinline__ u32 load_relaxed_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void add_relaxed_gpu(u32* p, u32 v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The value a producer stores: a function of (burst, producer, vector index) so that the
// destination check can tell which burst last wrote each line and catch misplaced stores.
__device__ __forceinline__ uint4 burst_pattern(u32 seed, u32 burst, u32 producer, u32 vec) {
    u32 tag = seed ^ (burst * 0x9E3779B1u);
    return make_uint4(tag, producer, vec, tag ^ (producer << 16) ^ (vec * 0x85EBCA77u));
}

// Grid barrier among the K co-resident CTAs (thread 0 calls it). The arrival counter only grows:
// round r completes when it reaches (r + 1) * K, so no reset races the next round. The wait is
// bounded by timeout_ns of %globaltimer; on expiry it raises the error flag and returns false.
__device__ bool grid_barrier(u32* arrivals, u32 round, u32 n_ctas, u64 timeout_ns, u32* error) {
    add_relaxed_gpu(arrivals, 1u);
    const u32 target = (round + 1u) * n_ctas;
    const u64 deadline = global_timer_ns() + timeout_ns;
    while (load_relaxed_gpu(arrivals) < target) {
        if (global_timer_ns() > deadline || load_relaxed_gpu(error) != 0u) {
            atomicOr(error, XSTAGE_ERR_BARRIER_TIMEOUT);
            return false;
        }
    }
    return true;
}

// trace:  [n_bursts][K][3] = issue-start clock64, issue-end clock64, issue-start %globaltimer
// clocks: [K][5]           = entry %globaltimer, entry clock64, exit %globaltimer, exit clock64,
//                            %smid (the host checks that every producer had an SM of its own)
//
// A CTA is blockDim.x - 32 store threads plus one timekeeper warp (the last), which issues no
// remote stores: it aligns, stamps and spins the gap. Stamps stay in shared memory until the
// end, so between bursts the only memory operations are the barrier's, by the timekeeper.
// Dynamic shared memory: at least n_bursts * 3 * 8 bytes.
extern "C" __global__ void burst_gap(
        uint4* __restrict__ dst,
        u64 slot_vecs,            // 16-byte vectors per rotation slot (K * B / 16)
        u32 n_slots,              // bursts rotate through this many slots (1 rewrites the same lines)
        u32 vecs_per_producer,    // B / 16
        u32 n_bursts,
        u64 gap_cycles,           // producer-side gap G in SM cycles
        u32 align_each_burst,     // grid barrier before every burst (else before the first only)
        u32 fence_each_burst,     // completion-coupled: every store thread waits for visibility
        u32 seed,
        u32* arrivals,            // zeroed before launch
        u32* error,               // zeroed before launch
        u64 timeout_ns,
        u64* __restrict__ trace,
        u64* __restrict__ clocks) {
    extern __shared__ u64 stamps[];  // [n_bursts][3]
    __shared__ int abort_run;
    const u32 producer = blockIdx.x;
    const u32 n_producers = gridDim.x;
    const u32 store_threads = blockDim.x - 32u;
    const bool timekeeper = threadIdx.x == store_threads;  // lane 0 of the last warp
    if (timekeeper) {
        u32 smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        clocks[producer * 5 + 0] = global_timer_ns();
        clocks[producer * 5 + 1] = clock64();
        clocks[producer * 5 + 4] = smid;
        abort_run = 0;
    }
    for (u32 burst = 0; burst < n_bursts; ++burst) {
        if (timekeeper) {
            if ((burst == 0 || align_each_burst) &&
                !grid_barrier(arrivals, align_each_burst ? burst : 0u, n_producers, timeout_ns,
                              error)) {
                abort_run = 1;
            }
            stamps[burst * 3 + 0] = clock64();
            stamps[burst * 3 + 2] = global_timer_ns();
        }
        __syncthreads();
        if (abort_run) break;
        if (threadIdx.x < store_threads) {
            uint4* out = dst + (u64)(burst % n_slots) * slot_vecs
                             + (u64)producer * vecs_per_producer;
            for (u32 v = threadIdx.x; v < vecs_per_producer; v += store_threads) {
                out[v] = burst_pattern(seed, burst, producer, v);
            }
            // The completion-coupled counterfactual (issue 8): a system-scope fence returns only
            // once this thread's stores are visible at the destination.
            if (fence_each_burst) __threadfence_system();
        }
        // Issue ends when every warp of the CTA has issued its stores; completion is not awaited.
        __syncthreads();
        if (timekeeper) {
            const u64 end = clock64();
            stamps[burst * 3 + 1] = end;
            while ((u64)clock64() - end < gap_cycles) { }
        }
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < n_bursts * 3u; i += blockDim.x) {
        trace[((u64)(i / 3u) * n_producers + producer) * 3 + i % 3u] = stamps[i];
    }
    if (timekeeper) {
        clocks[producer * 5 + 2] = global_timer_ns();
        clocks[producer * 5 + 3] = clock64();
    }
}

// Counts vectors of the destination buffer that differ from what the run must have left there:
// each used slot holds the pattern of the last burst that wrote it, the rest still holds poison.
extern "C" __global__ void count_burst_mismatches(
        const uint4* __restrict__ buf,
        u64 buffer_vecs,
        u64 slot_vecs,
        u32 n_slots,
        u32 vecs_per_producer,
        u32 n_bursts,
        u32 seed,
        u32 poison,
        unsigned long long* mismatches) {
    const u32 used_slots = n_bursts < n_slots ? n_bursts : n_slots;
    const u64 written = (u64)used_slots * slot_vecs;
    u64 local = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < buffer_vecs;
         i += (u64)gridDim.x * blockDim.x) {
        const uint4 got = buf[i];
        uint4 want;
        if (i < written) {
            const u32 slot = (u32)(i / slot_vecs);
            const u64 within = i % slot_vecs;
            const u32 last_burst = slot + ((n_bursts - 1u - slot) / n_slots) * n_slots;
            want = burst_pattern(seed, last_burst, (u32)(within / vecs_per_producer),
                                 (u32)(within % vecs_per_producer));
        } else {
            want = make_uint4(poison, poison, poison, poison);
        }
        local += (got.x != want.x) | (got.y != want.y) | (got.z != want.z) | (got.w != want.w);
    }
    if (local) atomicAdd(mismatches, local);
}

// SM clock over a window of %globaltimer: out = {timer start, clock start, timer end, clock end}.
extern "C" __global__ void sample_sm_clock(u64 window_ns, u64* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 t0 = global_timer_ns();
    const u64 c0 = clock64();
    u64 t1 = t0;
    while (t1 - t0 < window_ns) t1 = global_timer_ns();
    out[0] = t0;
    out[1] = c0;
    out[2] = t1;
    out[3] = clock64();
}
