// The X-Stage under load (issue 26): remote stores into pinned host memory, sustained, while
// other warps stream a local buffer, in one launch.
//
// One CTA per SM (forced by shared memory), 16 warps each. A warp has one role:
//  - store warp (warps [0, store_warps) of CTAs [0, store_ctas)): 16-byte stores, with no gap,
//    into its own region of the destination (pinned host memory, or the GPU's own memory for the
//    local control), 4 vectors a lane an iteration, its region rewritten cyclically;
//  - load warp (warps [first, first + load_warps) of CTAs [load_from_cta, gridDim.x), first =
//    store_warps in a CTA that also stores, else 0): 16-byte loads of its own region of a local
//    buffer larger than the L2, 8 vectors a lane an iteration, every word summed so that no load
//    can be dropped;
//  - idle otherwise (it only meets the start barrier).
// Every CTA meets one grid barrier, then each warp runs iterations until its own %globaltimer
// deadline (warm_ns + window_ns after it left the barrier) and counts those it issued inside the
// window: at warm_ns the X-Stage is full (the store warps inject faster than the link drains), so
// the window sees the steady state. Lane 0 reads the timer and the warp follows its word, so the
// warp's lanes leave together. The loop is also bounded by max_iters, whose reach is an error.
//
// started (null: not asked): thread 0 of CTA 0 writes 1 there once the grid barrier passed, so
// the host knows every CTA holds its SM before it launches the concurrent work of the
// ``under_gemm`` probe (a volatile store, no fence: only the flag's arrival is waited for).
//
// stamps[warp][4]: %globaltimer at the first iteration inside the window, the iterations issued
// before it, %globaltimer at the end, the iterations issued in all; written by lane 0 of every
// working warp (idle warps leave their poison). sums[warp][32]: each lane's sum of loaded words.
//
// A store warp's vector (iteration i, unroll u, lane l) lands at position
// p = (i mod P)·128 + u·32 + l of its region (P = region_vecs / 128) and holds
// burst_pattern(seed, i / P, warp, p): the host reads back which pass last wrote each position.
// Built at run time by CuPy/NVRTC for sm_90 with kernel_sources.cuda_options, and compiled by
// nvcc in the tests with the same options.

#include "xstage_device.cuh"

#define XSTAGE_ERR_ITERATION_BOUND 4u
#define STORE_UNROLL 4u
#define LOAD_UNROLL 8u

extern "C" __global__ void store_under_load(
        uint4* __restrict__ store_dst,       // host (mapped) or local: store warps' regions
        u64 store_region_vecs,               // per store warp, a multiple of 32 * STORE_UNROLL
        const uint4* __restrict__ load_src,  // local: load warps' regions
        u64 load_region_vecs,                // per load warp, a multiple of 32 * LOAD_UNROLL
        u32 store_ctas,
        u32 store_warps,
        u32 load_from_cta,
        u32 load_warps,
        u64 warm_ns,
        u64 window_ns,
        u64 max_iters,
        u32 seed,
        u32* arrivals,                       // zeroed before launch
        u32* error,                          // zeroed before launch
        u64 timeout_ns,
        u64* __restrict__ stamps,            // [gridDim.x * warps][4], poisoned before launch
        u32* __restrict__ sums,              // [gridDim.x * warps][32], poisoned before launch
        volatile u32* started) {             // mapped host word, zeroed before launch, or null
    __shared__ int abort_run;
    const u32 warps = blockDim.x / 32u;
    const u32 warp = threadIdx.x / 32u;
    const u32 lane = threadIdx.x % 32u;
    const u32 gwarp = blockIdx.x * warps + warp;
    const bool stores = blockIdx.x < store_ctas && warp < store_warps;
    const u32 first_load = blockIdx.x < store_ctas ? store_warps : 0u;
    const bool loads = blockIdx.x >= load_from_cta && warp >= first_load &&
                       warp < first_load + load_warps;
    if (threadIdx.x == 0) {
        abort_run = !grid_barrier(arrivals, 0u, gridDim.x, timeout_ns, error);
    }
    __syncthreads();
    if (threadIdx.x == 0 && blockIdx.x == 0 && !abort_run && started != nullptr) *started = 1u;
    if (abort_run || !(stores || loads)) return;

    // A warp's index among the warps of its role: its region.
    const u32 role_index = stores
        ? blockIdx.x * store_warps + warp
        : (blockIdx.x - load_from_cta) * load_warps + (warp - first_load);
    uint4* out = store_dst + (u64)role_index * store_region_vecs;
    const uint4* in = load_src + (u64)role_index * load_region_vecs;
    const u64 passes = stores ? store_region_vecs / (32u * STORE_UNROLL)
                              : load_region_vecs / (32u * LOAD_UNROLL);
    const u64 begin = __shfl_sync(0xffffffffu, lane == 0 ? global_timer_ns() : 0ull, 0);
    const u64 mark = begin + warm_ns;
    const u64 stop = mark + window_ns;
    u64 now = begin, t_mark = 0, n_mark = 0;
    bool marked = false;
    u32 sum = 0;
    u64 it = 0;
    for (; it < max_iters; ++it) {
        now = __shfl_sync(0xffffffffu, lane == 0 ? global_timer_ns() : 0ull, 0);
        if (!marked && now >= mark) {
            marked = true;
            t_mark = now;
            n_mark = it;
        }
        if (now >= stop) break;
        const u64 base = (it % passes) * 32u;
        if (stores) {
            const u32 pass = (u32)(it / passes);
#pragma unroll
            for (u32 u = 0; u < STORE_UNROLL; ++u) {
                const u64 p = base * STORE_UNROLL + u * 32u + lane;
                out[p] = burst_pattern(seed, pass, role_index, (u32)p);
            }
        } else {
            uint4 v[LOAD_UNROLL];
#pragma unroll
            for (u32 u = 0; u < LOAD_UNROLL; ++u) v[u] = in[base * LOAD_UNROLL + u * 32u + lane];
#pragma unroll
            for (u32 u = 0; u < LOAD_UNROLL; ++u) sum += v[u].x + v[u].y + v[u].z + v[u].w;
        }
    }
    if (now < stop && lane == 0) atomicOr(error, XSTAGE_ERR_ITERATION_BOUND);
    sums[(u64)gwarp * 32u + lane] = sum;
    if (lane == 0) {
        u64* s = stamps + (u64)gwarp * 4u;
        s[0] = t_mark;
        s[1] = n_mark;
        s[2] = now;
        s[3] = it;
    }
}

// The under_gemm probe's clock on the GEMM's stream: one thread writes %globaltimer to *slot,
// before and after each GEMM, so the host can tell which GEMMs ran inside the store window.
extern "C" __global__ void stamp_timer(u64* slot) {
    *slot = global_timer_ns();
}
