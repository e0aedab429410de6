// Device helpers shared by the Burst–Gap producers of remote_store_burst.cu and
// visibility_latency.cu. NVRTC finds this header through the -I of kernel_sources.cuda_options,
// which also puts its hash into the options: CuPy's cache key is the source text plus the
// options, so an edit here recompiles both.
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
