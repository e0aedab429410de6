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

// The 16-byte vector a producer stores: a function of (burst, producer, vector index), so that
// the destination check can tell which burst last wrote each line and catch misplaced or stale
// stores.
__device__ __forceinline__ uint4 burst_pattern(u32 seed, u32 burst, u32 producer, u32 vec) {
    u32 tag = seed ^ (burst * 0x9E3779B1u);
    return make_uint4(tag, producer, vec, tag ^ (producer << 16) ^ (vec * 0x85EBCA77u));
}
