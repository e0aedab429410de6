// Remote-visible completion seen from the receiver (issue 8 part 2, paper §3).
//
// visibility_sender (on the source GPU): K producers, one CTA each, store B bytes per burst with
// 16-byte stores into the receiver's buffer, then spin a gap G; after each burst a flag warp
// releases a per-(burst, producer) flag into the receiver's memory with st.release.sys, so that a
// visible flag implies visible data. The flag warp runs beside the store warps: the store warps
// go on to the next burst without waiting for the release (the decoupled issuer).
// visibility_receiver (on the destination GPU): one CTA per producer; a poller thread waits for
// each flag with ld.acquire.sys on local memory and stamps its arrival; checker warps then
// compare the burst's data with the pattern (a visible flag with stale data is a failure).
// Every stamp is %globaltimer; the two GPUs' timers are related by clock_pingpong (NTP style).
//
// Every wait is bounded by a %globaltimer deadline and raises a bit of the error word on expiry.
// Built at run time by CuPy/NVRTC for sm_90 with kernel_sources.cuda_options, and compiled by
// nvcc in the tests with the same options.

#include "xstage_device.cuh"

#define VIS_ERR_BARRIER_TIMEOUT 1u   // sender grid barrier
#define VIS_ERR_RELEASE_TIMEOUT 2u   // sender flag warp waited for a burst that never ended
#define VIS_ERR_READY_TIMEOUT 4u     // start rendezvous: sender for receiver, receiver for its CTAs
#define VIS_ERR_FLAG_TIMEOUT 8u      // receiver poller: a flag never became visible
#define VIS_ERR_CHECK_TIMEOUT 16u    // receiver checkers waited for a poller that gave up
#define VIS_ERR_PINGPONG_TIMEOUT 32u

__device__ __forceinline__ u32 load_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The ping-pong orders no data, only time: relaxed accesses add no fence to the round trip.
__device__ __forceinline__ u32 load_relaxed_sys(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_relaxed_sys(u32* p, u32 v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Hand-over inside a CTA (generic addresses of shared variables).
__device__ __forceinline__ u32 load_acquire_cta(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.cta.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_cta(u32* p, u32 v) {
    asm volatile("st.release.cta.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// A 16-byte load from L2, where the peer's stores land (no L1 copy to go stale).
__device__ __forceinline__ uint4 load_cg(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

// A barrier among the store warps and the timekeeper warp only: the flag warp never joins it.
// barrier.sync, not bar.sync (= barrier.sync.aligned): the timekeeper lane may arrive diverged.
__device__ __forceinline__ void issue_barrier(u32 n_threads) {
    asm volatile("barrier.sync 1, %0;" :: "r"(n_threads) : "memory");
}

// tx:    [n_bursts][K][3] = issue start, issue end (the last store of the CTA issued), return of
//        the flag's release; all %globaltimer of the source GPU
// smids: [K] (the host checks that every producer had an SM of its own)
//
// A CTA is blockDim.x - 64 store threads, one flag warp and one timekeeper warp. Burst b of
// producer p fills vectors [b*K*vpp + p*vpp, +vpp) of dst, so every burst writes fresh lines and
// the receiver can check each after its flag. Dynamic shared memory: at least n_bursts * 24 bytes.
extern "C" __global__ void visibility_sender(
        uint4* __restrict__ dst,
        u32 vecs_per_producer,
        u32 n_bursts,
        u64 gap_cycles,           // producer-side gap G in SM cycles, from issue end
        u32 seed,
        u32* flags,               // receiver's [n_bursts][K], zeroed before launch
        const u32* ready,         // this GPU's; the receiver sets it once all its CTAs poll
        u32* arrivals,            // zeroed before launch
        u32* error,               // zeroed before launch
        u64 timeout_ns,
        u64* __restrict__ tx,
        u32* __restrict__ smids) {
    extern __shared__ u64 stamps[];  // [n_bursts][3]
    __shared__ u32 issued;           // bursts whose stores every store warp has issued
    __shared__ volatile int abort_run;
    const u32 producer = blockIdx.x;
    const u32 n_producers = gridDim.x;
    const u32 store_threads = blockDim.x - 64u;
    const bool flagger = threadIdx.x == store_threads;
    const bool timekeeper = threadIdx.x == store_threads + 32u;
    const u64 slot_vecs = (u64)n_producers * vecs_per_producer;
    for (u32 i = threadIdx.x; i < n_bursts * 3u; i += blockDim.x) stamps[i] = 0ull;
    if (threadIdx.x == 0) {
        issued = 0u;
        abort_run = 0;
    }
    __syncthreads();
    if (threadIdx.x >= store_threads && threadIdx.x < store_threads + 32u) {
        // The flag warp: release burst b's flag once its stores are issued. The release is
        // cumulative over the store warps' writes: they precede (issue barrier) the
        // timekeeper's release of `issued`, which this thread acquires.
        if (flagger) {
            for (u32 b = 0; b < n_bursts; ++b) {
                const u64 deadline = global_timer_ns() + timeout_ns;
                while (load_acquire_cta(&issued) <= b) {
                    if (abort_run) goto flags_done;
                    if (global_timer_ns() > deadline) {
                        atomicOr(error, VIS_ERR_RELEASE_TIMEOUT);
                        goto flags_done;
                    }
                }
                store_release_sys(flags + (u64)b * n_producers + producer, b + 1u);
                stamps[b * 3 + 2] = global_timer_ns();
            }
        }
    flags_done:;
    } else {
        if (timekeeper) {
            smids[producer] = sm_id();
            // Start only once the receiver polls, then together (one grid barrier).
            const u64 deadline = global_timer_ns() + timeout_ns;
            while (load_acquire_sys(ready) == 0u) {
                if (global_timer_ns() > deadline) {
                    atomicOr(error, VIS_ERR_READY_TIMEOUT);
                    abort_run = 1;
                    break;
                }
            }
            if (!abort_run) {
                add_relaxed_gpu(arrivals, 1u);
                while (load_relaxed_gpu(arrivals) < n_producers) {
                    if (global_timer_ns() > deadline || load_relaxed_gpu(error) != 0u) {
                        atomicOr(error, VIS_ERR_BARRIER_TIMEOUT);
                        abort_run = 1;
                        break;
                    }
                }
            }
        }
        for (u32 b = 0; b < n_bursts; ++b) {
            if (timekeeper) stamps[b * 3 + 0] = global_timer_ns();
            issue_barrier(store_threads + 32u);
            if (abort_run) break;
            if (threadIdx.x < store_threads) {
                uint4* out = dst + (u64)b * slot_vecs + (u64)producer * vecs_per_producer;
                for (u32 v = threadIdx.x; v < vecs_per_producer; v += store_threads) {
                    out[v] = burst_pattern(seed, b, producer, v);
                }
            }
            issue_barrier(store_threads + 32u);
            if (timekeeper) {
                stamps[b * 3 + 1] = global_timer_ns();
                store_release_cta(&issued, b + 1u);
                const u64 end = clock64();
                while ((u64)clock64() - end < gap_cycles) { }
            }
        }
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < n_bursts * 3u; i += blockDim.x) {
        tx[((u64)(i / 3u) * n_producers + producer) * 3 + i % 3u] = stamps[i];
    }
}

// rx:         [n_bursts][K] %globaltimer of this GPU when the flag was seen (0: never seen)
// mismatches: [n_bursts][K] 16-byte vectors of the burst that differ from the pattern once its
//             flag was seen
// A CTA is one poller warp (thread 0 polls) and blockDim.x - 32 checker threads.
// Dynamic shared memory: at least n_bursts * 4 bytes.
extern "C" __global__ void visibility_receiver(
        const uint4* __restrict__ buf,
        u32 vecs_per_producer,
        u32 n_bursts,
        u32 seed,
        const u32* flags,         // this GPU's [n_bursts][K], zeroed before launch
        u32* ready_remote,        // the sender GPU's ready word
        u32* arrivals,            // zeroed before launch
        u32* error,               // zeroed before launch
        u64 timeout_ns,
        u64* __restrict__ rx,
        u32* __restrict__ mismatches) {
    extern __shared__ u32 bad[];     // [n_bursts]
    __shared__ u32 seen;             // flags seen so far by the poller
    __shared__ volatile int abort_run;
    const u32 producer = blockIdx.x;
    const u32 n_producers = gridDim.x;
    const u64 slot_vecs = (u64)n_producers * vecs_per_producer;
    for (u32 i = threadIdx.x; i < n_bursts; i += blockDim.x) bad[i] = 0u;
    if (threadIdx.x == 0) {
        seen = 0u;
        abort_run = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        add_relaxed_gpu(arrivals, 1u);
        if (producer == 0) {
            const u64 deadline = global_timer_ns() + timeout_ns;
            while (load_relaxed_gpu(arrivals) < n_producers) {
                if (global_timer_ns() > deadline) {
                    atomicOr(error, VIS_ERR_READY_TIMEOUT);
                    abort_run = 1;
                    break;
                }
            }
            if (!abort_run) store_release_sys(ready_remote, 1u);
        }
        for (u32 b = 0; b < n_bursts && !abort_run; ++b) {
            const u32* flag = flags + (u64)b * n_producers + producer;
            const u64 deadline = global_timer_ns() + timeout_ns;
            // A relaxed poll keeps the loop short (the stamp's resolution); the fence after it
            // makes the observation an acquire, ordering the checkers' data loads after it.
            while (load_relaxed_sys(flag) != b + 1u) {
                if (global_timer_ns() > deadline) {
                    atomicOr(error, VIS_ERR_FLAG_TIMEOUT);
                    abort_run = 1;
                    break;
                }
            }
            if (abort_run) break;
            rx[(u64)b * n_producers + producer] = global_timer_ns();
            asm volatile("fence.acq_rel.sys;" ::: "memory");
            store_release_cta(&seen, b + 1u);
        }
    } else if (threadIdx.x >= 32u) {
        const u32 checkers = blockDim.x - 32u;
        for (u32 b = 0; b < n_bursts; ++b) {
            const u64 deadline = global_timer_ns() + timeout_ns;
            bool ok = true;
            while (load_acquire_cta(&seen) <= b) {
                if (abort_run) { ok = false; break; }
                if (global_timer_ns() > deadline) {
                    atomicOr(error, VIS_ERR_CHECK_TIMEOUT);
                    ok = false;
                    break;
                }
            }
            if (!ok) break;
            const uint4* in = buf + (u64)b * slot_vecs + (u64)producer * vecs_per_producer;
            u32 local = 0;
            for (u32 v = threadIdx.x - 32u; v < vecs_per_producer; v += checkers) {
                const uint4 got = load_cg(in + v);
                const uint4 want = burst_pattern(seed, b, producer, v);
                local += (got.x != want.x) | (got.y != want.y) | (got.z != want.z)
                         | (got.w != want.w);
            }
            if (local) atomicAdd(&bad[b], local);
        }
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < n_bursts; i += blockDim.x) {
        mismatches[(u64)i * n_producers + producer] = bad[i];
    }
}

// Clock alignment by ping-pong (Cristian/NTP), one thread on each GPU, launched together.
// role 0 (initiator): stamp t0, write round i+1 into the peer's flag, wait for the pong in the
// local flag, stamp t3. role 1 (responder): wait for the ping in the local flag, stamp t1, write
// the pong into the peer's flag, stamp t2. stamps: [n_rounds][2] = (t0, t3) or (t1, t2).
// Stamps stay in shared memory until the end (dynamic shared memory: n_rounds * 16 bytes), so
// the rounds carry no memory operation but the two flags.
extern "C" __global__ void clock_pingpong(
        u32 role,
        const u32* local_flag,    // zeroed before launch
        u32* remote_flag,         // the peer's local_flag
        u32 n_rounds,
        u64 timeout_ns,
        u32* error,
        u64* __restrict__ stamps) {
    extern __shared__ u64 s[];
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u32 done = 0;
    for (u32 i = 0; i < n_rounds; ++i) {
        const u64 deadline = global_timer_ns() + timeout_ns;
        bool ok = true;
        if (role == 0u) {
            s[2 * i] = global_timer_ns();
            store_relaxed_sys(remote_flag, i + 1u);
            while (load_relaxed_sys(local_flag) != i + 1u) {
                if (global_timer_ns() > deadline) { ok = false; break; }
            }
            s[2 * i + 1] = global_timer_ns();
        } else {
            while (load_relaxed_sys(local_flag) != i + 1u) {
                if (global_timer_ns() > deadline) { ok = false; break; }
            }
            s[2 * i] = global_timer_ns();
            store_relaxed_sys(remote_flag, i + 1u);
            s[2 * i + 1] = global_timer_ns();
        }
        if (!ok) {
            atomicOr(error, VIS_ERR_PINGPONG_TIMEOUT);
            break;
        }
        done = i + 1u;
    }
    for (u32 i = 0; i < 2u * n_rounds; ++i) stamps[i] = i < 2u * done ? s[i] : 0ull;
}

// The increments of %globaltimer seen by one thread reading it back to back: the first n_steps
// changes (steps[i] = new value − previous value, 0 where the iteration cap ran out).
extern "C" __global__ void globaltimer_steps(u32 n_steps, u64 max_reads, u64* steps) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u64 prev = global_timer_ns();
    u32 k = 0;
    for (u64 r = 0; r < max_reads && k < n_steps; ++r) {
        const u64 t = global_timer_ns();
        if (t != prev) {
            steps[k++] = t - prev;
            prev = t;
        }
    }
    for (; k < n_steps; ++k) steps[k] = 0ull;
}
