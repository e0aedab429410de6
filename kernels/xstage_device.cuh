// Device helpers shared by the Burst–Gap producers of remote_store_burst.cu,
// visibility_latency.cu and host_store_load.cu. NVRTC finds this header through the -I of
// kernel_sources.cuda_options, which also puts its hash into the options: CuPy's cache key is
// the source text plus the options, so an edit here recompiles them all.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u32 sm_id() {
    u32 smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    return smid;
}

// Relaxed, for grid barriers, which order no data, only time: a release would add a fence that
// waits until this SM's outstanding remote stores complete.
__device__ __forceinline__ u32 load_relaxed_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void add_relaxed_gpu(u32* p, u32 v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The 16-byte vector a producer stores: four words from which (burst, producer, vector index)
// can be read back (w1 gives vec, w0 then the burst's tag, w2 the producer: odd multipliers are
// bijections mod 2^32), so that the destination check can tell which burst last wrote each line
// and catch misplaced or stale stores. Every word varies across the warp's lanes and spans all
// 32 bits, as data does: small-integer words issue measurably slower (71 ns of a 0.45 µs burst,
// data/records/issue_time_probe).
__device__ __forceinline__ uint4 burst_pattern(u32 seed, u32 burst, u32 producer, u32 vec) {
    const u32 tag = seed ^ (burst * 0x9E3779B1u);
    const u32 w1 = vec * 0x85EBCA77u;
    const u32 w2 = (producer * 0xC2B2AE3Du) ^ w1;
    return make_uint4(tag ^ w1, w1, w2, (tag ^ w2) * 0x27D4EB2Fu);
}

#define XSTAGE_ERR_BARRIER_TIMEOUT 1u

// Grid barrier among the K co-resident CTAs (thread 0 of each calls it). The arrival counter only grows:
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
