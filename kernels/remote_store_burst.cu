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
// burst_gap_fenced ends each issue interval only when the burst is visible at the destination
// (the completion-coupled issuer of §2.3 and §3.4). It is a separate instantiation because even
// an untaken fence branch in the store loop's code adds 31 ns to each burst's issue time
// (data/records/issue_time_probe).
//
// burst_gap_rows stores each producer's burst as row chunks, the pattern of the fused MoE's
// Combine epilogue: C-byte chunks (2^chunk_shift vectors) one per S-byte row, the S / C producers
// of a group side by side in the same rows (as the Linear-2 tiles of one row block, one per
// N-block, fill the same Combine rows). It is its own instantiation, so the contiguous kernels'
// store loop stays as measured.
//
// Built at run time by CuPy/NVRTC for sm_90 with kernel_sources.cuda_options, and compiled by
// nvcc in the tests with the same options.

#include "xstage_device.cuh"

// Kernel exit of both burst kernels: every thread copies the CTA's per-burst stamps (issue start
// cycle, issue end cycle, start %globaltimer) into trace[burst][producer][3], and the timekeeper
// closes the clock pair that converts cycles into time.
__device__ void write_trace(const u64* stamps, u32 n_bursts, u32 producer, u32 n_producers,
                            bool timekeeper, u64* trace, u64* clocks) {
    __syncthreads();
    for (u32 i = threadIdx.x; i < n_bursts * 3u; i += blockDim.x) {
        trace[((u64)(i / 3u) * n_producers + producer) * 3 + i % 3u] = stamps[i];
    }
    if (timekeeper) {
        clocks[producer * 5 + 2] = global_timer_ns();
        clocks[producer * 5 + 3] = clock64();
    }
}

// trace:  [n_bursts][K][3] = issue-start clock64, issue-end clock64, issue-start %globaltimer
// clocks: [K][5]           = entry %globaltimer, entry clock64, exit %globaltimer, exit clock64,
//                            %smid (the host checks that every producer had an SM of its own)
//
// A CTA is blockDim.x - 32 store threads plus one timekeeper warp (the last), which issues no
// remote stores: it aligns, stamps and spins the gap. Stamps stay in shared memory until the
// end, so between bursts the only memory operations are the barrier's, by the timekeeper.
// A burst's issue-end stamp waits in a register and reaches shared memory only after the next
// burst's start stamp: stores still queued in the SM when their warps pass the barrier hold up
// the SM's next shared-memory access (the local staging of §2), and that wait must land in the
// next burst's issue interval, not silently lengthen the gap. (Seen on the host link, where
// bursts of a few KiB per producer pass the barrier at once and the drain then holds up the
// timekeeper's stamp store for the rest of V/R.)
// Dynamic shared memory: at least n_bursts * 3 * 8 bytes.
template <bool FENCED, bool ROWS>
__device__ __forceinline__ void burst_gap_body(
        uint4* __restrict__ dst,
        u64 slot_vecs,            // 16-byte vectors per rotation slot (K * B / 16 contiguous)
        u32 n_slots,              // bursts rotate through this many slots (1 rewrites the same lines)
        u32 vecs_per_producer,    // B / 16
        u32 chunk_shift,          // ROWS: log2 of the 16-byte vectors per chunk (C / 16)
        u32 row_vecs,             // ROWS: 16-byte vectors per row (S / 16)
        u32 n_bursts,
        u64 gap_cycles,           // producer-side gap G in SM cycles
        u32 align_each_burst,     // grid barrier before every burst (else before the first only)
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
        const u32 smid = sm_id();
        clocks[producer * 5 + 0] = global_timer_ns();
        clocks[producer * 5 + 1] = clock64();
        clocks[producer * 5 + 4] = smid;
        abort_run = 0;
    }
    u64 issue_end = 0;  // the timekeeper's last issue-end clock, not yet in shared memory
    for (u32 burst = 0; burst < n_bursts; ++burst) {
        if (timekeeper) {
            if ((burst == 0 || align_each_burst) &&
                !grid_barrier(arrivals, align_each_burst ? burst : 0u, n_producers, timeout_ns,
                              error)) {
                abort_run = 1;
            }
            const u64 start = clock64();
            const u64 start_ns = global_timer_ns();
            if (burst > 0) stamps[(burst - 1) * 3 + 1] = issue_end;
            stamps[burst * 3 + 0] = start;
            stamps[burst * 3 + 2] = start_ns;
        }
        __syncthreads();
        if (abort_run) break;
        if (threadIdx.x < store_threads) {
            uint4* out = dst + (u64)(burst % n_slots) * slot_vecs;
            if (ROWS) {
                const u32 per_row = row_vecs >> chunk_shift;  // producers side by side
                out += (u64)(producer / per_row) * (vecs_per_producer >> chunk_shift) * row_vecs
                       + ((u64)(producer % per_row) << chunk_shift);
            } else {
                out += (u64)producer * vecs_per_producer;
            }
            const u32 chunk_mask = (1u << chunk_shift) - 1u;
            for (u32 v = threadIdx.x; v < vecs_per_producer; v += store_threads) {
                const u64 at = ROWS ? (u64)(v >> chunk_shift) * row_vecs + (v & chunk_mask) : v;
                out[at] = burst_pattern(seed, burst, producer, v);
            }
            // The completion-coupled counterfactual (issue 8): a system-scope fence returns only
            // once this thread's stores are visible at the destination.
            if (FENCED) __threadfence_system();
        }
        // Issue ends when every warp of the CTA has issued its stores; completion is not awaited.
        __syncthreads();
        if (timekeeper) {
            issue_end = clock64();
            while ((u64)clock64() - issue_end < gap_cycles) { }
        }
    }
    if (timekeeper && n_bursts > 0 && !abort_run) stamps[(n_bursts - 1) * 3 + 1] = issue_end;
    write_trace(stamps, n_bursts, producer, n_producers, timekeeper, trace, clocks);
}

extern "C" __global__ void burst_gap(
        uint4* __restrict__ dst, u64 slot_vecs, u32 n_slots, u32 vecs_per_producer,
        u32 n_bursts, u64 gap_cycles, u32 align_each_burst, u32 seed, u32* arrivals, u32* error,
        u64 timeout_ns, u64* __restrict__ trace, u64* __restrict__ clocks) {
    burst_gap_body<false, false>(dst, slot_vecs, n_slots, vecs_per_producer, 0u, 0u, n_bursts,
                                 gap_cycles, align_each_burst, seed, arrivals, error, timeout_ns,
                                 trace, clocks);
}

extern "C" __global__ void burst_gap_fenced(
        uint4* __restrict__ dst, u64 slot_vecs, u32 n_slots, u32 vecs_per_producer,
        u32 n_bursts, u64 gap_cycles, u32 align_each_burst, u32 seed, u32* arrivals, u32* error,
        u64 timeout_ns, u64* __restrict__ trace, u64* __restrict__ clocks) {
    burst_gap_body<true, false>(dst, slot_vecs, n_slots, vecs_per_producer, 0u, 0u, n_bursts,
                                gap_cycles, align_each_burst, seed, arrivals, error, timeout_ns,
                                trace, clocks);
}

extern "C" __global__ void burst_gap_rows(
        uint4* __restrict__ dst, u64 slot_vecs, u32 n_slots, u32 vecs_per_producer,
        u32 chunk_shift, u32 row_vecs, u32 n_bursts, u64 gap_cycles, u32 align_each_burst,
        u32 seed, u32* arrivals, u32* error, u64 timeout_ns, u64* __restrict__ trace,
        u64* __restrict__ clocks) {
    burst_gap_body<false, true>(dst, slot_vecs, n_slots, vecs_per_producer, chunk_shift, row_vecs,
                                n_bursts, gap_cycles, align_each_burst, seed, arrivals, error,
                                timeout_ns, trace, clocks);
}

// Counts vectors of the destination buffer that differ from what the run must have left there:
// each used slot holds the pattern of the last burst that wrote it, the rest still holds poison.
// A slot is rows of row_vecs vectors; a group of row_vecs / chunk_vecs producers fills
// vecs_per_producer / chunk_vecs rows side by side (contiguous bursts: one row per producer,
// chunk_vecs = row_vecs = vecs_per_producer); positions of producers >= n_producers hold poison.
extern "C" __global__ void count_burst_mismatches(
        const uint4* __restrict__ buf,
        u64 buffer_vecs,
        u64 slot_vecs,
        u32 n_slots,
        u32 n_producers,
        u32 vecs_per_producer,
        u32 chunk_vecs,
        u32 row_vecs,
        u32 n_bursts,
        u32 seed,
        u32 poison,
        unsigned long long* mismatches) {
    const u32 used_slots = n_bursts < n_slots ? n_bursts : n_slots;
    const u64 written = (u64)used_slots * slot_vecs;
    const u32 rows_per_group = vecs_per_producer / chunk_vecs;
    const u32 per_row = row_vecs / chunk_vecs;
    u64 local = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < buffer_vecs;
         i += (u64)gridDim.x * blockDim.x) {
        const uint4 got = buf[i];
        uint4 want = make_uint4(poison, poison, poison, poison);
        if (i < written) {
            const u32 slot = (u32)(i / slot_vecs);
            const u64 within = i % slot_vecs;
            const u64 row = within / row_vecs;
            const u32 col = (u32)(within % row_vecs);
            const u32 producer = (u32)(row / rows_per_group) * per_row + col / chunk_vecs;
            const u32 vec = (u32)(row % rows_per_group) * chunk_vecs + col % chunk_vecs;
            const u32 last_burst = slot + ((n_bursts - 1u - slot) / n_slots) * n_slots;
            if (producer < n_producers) want = burst_pattern(seed, last_burst, producer, vec);
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

// ---------------------------------------------------------------------------------------------
// Beyond 16-byte stores to one peer (issue 6): the same Burst–Gap loop with
//  - an operation per burst (OP_*): 4-, 8- or 16-byte stores, remote reductions (red.global.add
//    u32 or f32), bulk copies from shared memory (cp.async.bulk, the copy engine of sm_90) or
//    16-byte remote loads whose words are summed so that they cannot be eliminated;
//  - several destinations: producer p works on dst_table[p % n_dst] (one-to-all splits the
//    producers over the peers);
//  - a start aligned across GPUs: every GPU's producers meet in a grid barrier, CTA 0 reports to
//    the host through pinned memory and waits for the host's go, which comes once every GPU has
//    reported; a second grid barrier releases the rest.
// Buffers are addressed in 32-bit words: a rotation slot holds K·B/4 words, producer p's part of
// it starts at word p·B/4.

#define OP_STORE4 0u
#define OP_STORE8 1u
#define OP_STORE16 2u
#define OP_RED_ADD_U32 3u
#define OP_RED_ADD_F32 4u
#define OP_BULK 5u
#define OP_LOAD16 6u
#define XSTAGE_ERR_START_TIMEOUT 2u

// The word a store (or bulk copy) leaves: a function of (burst, producer, word) as above.
__device__ __forceinline__ u32 word_pattern(u32 seed, u32 burst, u32 producer, u32 word) {
    return seed ^ (burst * 0x9E3779B1u) ^ (producer * 0x85EBCA77u) ^ (word * 0xC2B2AE3Du);
}

// What a reduction adds: the same every burst, so n bursts on a slot add n times it (exact in
// f32 too: small integers).
__device__ __forceinline__ u32 red_addend_u32(u32 producer, u32 word) {
    return 1u + ((producer ^ word) & 0xFFu);
}

__device__ __forceinline__ float red_addend_f32(u32 producer, u32 word) {
    return (float)(1u + ((producer ^ word) & 7u));
}

// The destinations come from a table, so the compiler cannot tell they are global memory: the
// operations below take the global-space address and name the space themselves.
__device__ __forceinline__ u64 to_global(const void* p) {
    u64 g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(p));
    return g;
}

__device__ __forceinline__ u32 to_shared(const void* p) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}

__device__ __forceinline__ void st_global_u32(u32* p, u32 a) {
    asm volatile("st.global.u32 [%0], %1;" :: "l"(to_global(p)), "r"(a) : "memory");
}

__device__ __forceinline__ void st_global_v2(uint2* p, u32 a, u32 b) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" :: "l"(to_global(p)), "r"(a), "r"(b)
                 : "memory");
}

__device__ __forceinline__ void st_global_v4(uint4* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(to_global(p)), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Bursts among n_bursts that use rotation slot `slot` (slot < min(n_bursts, n_slots)).
__device__ __forceinline__ u32 slot_hits(u32 slot, u32 n_slots, u32 n_bursts) {
    return (n_bursts - 1u - slot) / n_slots + 1u;
}

// trace, clocks and the timekeeper warp as in burst_gap. Dynamic shared memory: the stamps
// (n_bursts * 3 * 8 bytes, rounded up to 128) then, for OP_BULK, B bytes of staging.
// load_sums[K]: per producer, the sum of every word it loaded (OP_LOAD16), checked by the host.
extern "C" __global__ void burst_gap_ops(
        const u64* __restrict__ dst_table,
        u32 n_dst,
        u32 op,
        u64 slot_words,           // 32-bit words per rotation slot (K * B / 4)
        u32 n_slots,
        u32 words_per_producer,   // B / 4
        u32 bulk_chunk_bytes,     // OP_BULK: bytes per cp.async.bulk (a multiple of 16)
        u32 n_bursts,
        u64 gap_cycles,
        u32 align_each_burst,
        u32 seed,
        u32* arrivals,            // zeroed before launch
        u32* error,               // zeroed before launch
        volatile u32* host_ready, // pinned host word of this GPU, zeroed before launch
        const volatile u32* host_go,  // pinned host word, set by the host once all GPUs are ready
        u64 timeout_ns,
        unsigned long long* __restrict__ load_sums,
        u64* __restrict__ trace,
        u64* __restrict__ clocks) {
    extern __shared__ __align__(128) u64 ops_stamps[];
    __shared__ int abort_run;
    const u32 producer = blockIdx.x;
    const u32 n_producers = gridDim.x;
    const u32 store_threads = blockDim.x - 32u;
    const bool timekeeper = threadIdx.x == store_threads;
    const bool store_thread = threadIdx.x < store_threads;
    u32* stage = (u32*)(ops_stamps + ((n_bursts * 3u + 15u) & ~15u));
    char* base = (char*)dst_table[producer % n_dst];
    unsigned long long loaded = 0;
    u32 round = 0;
    if (timekeeper) {
        const u32 smid = sm_id();
        clocks[producer * 5 + 0] = global_timer_ns();
        clocks[producer * 5 + 1] = clock64();
        clocks[producer * 5 + 4] = smid;
        abort_run = 0;
        // Start: all producers resident; CTA 0 meets the host; all released together.
        bool ok = grid_barrier(arrivals, round++, n_producers, timeout_ns, error);
        if (ok && producer == 0) {
            *host_ready = 1u;
            __threadfence_system();
            const u64 deadline = global_timer_ns() + timeout_ns;
            while (*host_go == 0u) {
                if (global_timer_ns() > deadline) {
                    atomicOr(error, XSTAGE_ERR_START_TIMEOUT);
                    ok = false;
                    break;
                }
            }
        }
        ok = ok && grid_barrier(arrivals, round++, n_producers, timeout_ns, error);
        if (!ok) abort_run = 1;
    }
    for (u32 burst = 0; burst < n_bursts; ++burst) {
        const u64 word0 = (u64)(burst % n_slots) * slot_words + (u64)producer * words_per_producer;
        // Bulk: the staging is written before issue starts (its reads by the copy engine of the
        // previous burst were awaited), and made visible to the async proxy.
        if (op == OP_BULK && store_thread) {
            for (u32 w = threadIdx.x; w < words_per_producer; w += store_threads) {
                stage[w] = word_pattern(seed, burst, producer, w);
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        }
        __syncthreads();
        if (timekeeper) {
            if (!abort_run && burst > 0 && align_each_burst &&
                !grid_barrier(arrivals, round++, n_producers, timeout_ns, error)) {
                abort_run = 1;
            }
            ops_stamps[burst * 3 + 0] = clock64();
            ops_stamps[burst * 3 + 2] = global_timer_ns();
        }
        __syncthreads();
        if (abort_run) break;
        if (store_thread) {
            const u32 t = threadIdx.x;
            switch (op) {
            case OP_STORE4: {
                u32* out = (u32*)base + word0;
                for (u32 w = t; w < words_per_producer; w += store_threads)
                    st_global_u32(out + w, word_pattern(seed, burst, producer, w));
                break;
            }
            case OP_STORE8: {
                uint2* out = (uint2*)((u32*)base + word0);
                for (u32 v = t; v < words_per_producer / 2u; v += store_threads)
                    st_global_v2(out + v, word_pattern(seed, burst, producer, 2u * v),
                                 word_pattern(seed, burst, producer, 2u * v + 1u));
                break;
            }
            case OP_STORE16: {
                uint4* out = (uint4*)((u32*)base + word0);
                for (u32 v = t; v < words_per_producer / 4u; v += store_threads)
                    st_global_v4(out + v, word_pattern(seed, burst, producer, 4u * v),
                                 word_pattern(seed, burst, producer, 4u * v + 1u),
                                 word_pattern(seed, burst, producer, 4u * v + 2u),
                                 word_pattern(seed, burst, producer, 4u * v + 3u));
                break;
            }
            case OP_RED_ADD_U32: {
                u32* out = (u32*)base + word0;
                for (u32 w = t; w < words_per_producer; w += store_threads)
                    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;"
                                 :: "l"(to_global(out + w)), "r"(red_addend_u32(producer, w))
                                 : "memory");
                break;
            }
            case OP_RED_ADD_F32: {
                float* out = (float*)base + word0;
                for (u32 w = t; w < words_per_producer; w += store_threads)
                    asm volatile("red.relaxed.gpu.global.add.f32 [%0], %1;"
                                 :: "l"(to_global(out + w)), "f"(red_addend_f32(producer, w))
                                 : "memory");
                break;
            }
            case OP_BULK: {
                const u32 bytes = words_per_producer * 4u;
                const u32 n_chunks = (bytes + bulk_chunk_bytes - 1u) / bulk_chunk_bytes;
                bool issued = false;
                for (u32 c = t; c < n_chunks; c += store_threads) {
                    const u32 off = c * bulk_chunk_bytes;
                    const u32 left = bytes - off;
                    const u32 size = left < bulk_chunk_bytes ? left : bulk_chunk_bytes;
                    const u32 src = to_shared((char*)stage + off);
                    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                                 :: "l"(to_global((char*)((u32*)base + word0) + off)), "r"(src),
                                    "r"(size)
                                 : "memory");
                    issued = true;
                }
                if (issued) {
                    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                    // Issue ends when the copy engine has read the staging, not when the bytes
                    // have landed: the bulk analogue of a store leaving the SM.
                    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                }
                break;
            }
            case OP_LOAD16: {
                const uint4* in = (const uint4*)((const u32*)base + word0);
                for (u32 v = t; v < words_per_producer / 4u; v += store_threads) {
                    uint4 x;
                    asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                                 : "l"(to_global(in + v)));
                    loaded += (unsigned long long)x.x + x.y + x.z + x.w;
                }
                break;
            }
            default:
                break;
            }
        }
        // Issue ends when every warp of the CTA has issued (a load: has its data back).
        __syncthreads();
        if (timekeeper) {
            const u64 end = clock64();
            ops_stamps[burst * 3 + 1] = end;
            while ((u64)clock64() - end < gap_cycles) { }
        }
    }
    if (op == OP_LOAD16 && store_thread && loaded) atomicAdd(load_sums + producer, loaded);
    write_trace(ops_stamps, n_bursts, producer, n_producers, timekeeper, trace, clocks);
}

// Counts words of one destination buffer that differ from what a burst_gap_ops run must have
// left there: the producers p with p % n_dst == dst_index wrote their parts of each used slot
// (the last burst's pattern; for a reduction, poison plus hits times the addend), the rest
// still holds poison. Not for loads, which leave their buffer as it was: the host checks the
// sums of what they loaded instead.
extern "C" __global__ void count_ops_mismatches(
        const u32* __restrict__ buf,
        u64 buffer_words,
        u64 slot_words,
        u32 n_slots,
        u32 words_per_producer,
        u32 n_bursts,
        u32 n_dst,
        u32 dst_index,
        u32 op,
        u32 seed,
        u32 poison,
        unsigned long long* mismatches) {
    const u32 used_slots = n_bursts < n_slots ? n_bursts : n_slots;
    const u64 written = (u64)used_slots * slot_words;
    u64 local = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < buffer_words;
         i += (u64)gridDim.x * blockDim.x) {
        u32 want = poison;
        if (i < written) {
            const u32 slot = (u32)(i / slot_words);
            const u64 within = i % slot_words;
            const u32 producer = (u32)(within / words_per_producer);
            const u32 word = (u32)(within % words_per_producer);
            if (producer % n_dst == dst_index) {
                const u32 hits = slot_hits(slot, n_slots, n_bursts);
                if (op == OP_RED_ADD_U32) {
                    want = poison + hits * red_addend_u32(producer, word);
                } else if (op == OP_RED_ADD_F32) {
                    float x = __uint_as_float(poison);
                    for (u32 h = 0; h < hits; ++h) x += red_addend_f32(producer, word);
                    want = __float_as_uint(x);
                } else {
                    want = word_pattern(seed, slot + (hits - 1u) * n_slots, producer, word);
                }
            }
        }
        local += buf[i] != want;
    }
    if (local) atomicAdd(mismatches, local);
}
