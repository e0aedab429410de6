"""Link trickle: one warp storing one 16-byte vector every ``period_ns`` into a target buffer.

Device code only; the host side (launch, checks, the windows it runs beside) is
``xstage_lab/experiments/probes/link.py``.

The probe asks whether NVLink activity as such, whatever the bytes, costs the SMs clock under the
GPU's power cap. The trickle's bytes are nothing (16 bytes per period, at most 8 MB/s at a 2 µs
period); what differs between a trickle aimed at a peer's buffer and one aimed at a local buffer
is only whether each store crosses NVLink.

One program of one warp. The target is entry ``target`` of an int64 table of 16-byte aligned
addresses (the symmetric buffers of every rank, or one local buffer), read as ``moe_fused.py``
reads its peer pointers. Store i goes to 16-byte slot ``i % slots`` and writes the int32 words
``(i, source, i % slots, MAGIC)``: the host, poisoning the buffer first, can then tell from the
count alone what every slot must hold.

Bounded both ways, never a hang: the loop ends at ``run_ns`` of %globaltimer after the program's
entry or after ``max_stores`` stores, whichever comes first; the wait for the next store's time
also ends at that deadline. Store i+1 is due ``period_ns`` after store i was issued (the loop's
own cost adds to the period rather than being caught up in bursts); the host reports the achieved
period from ``result``: int64 ``[RESULT_FIELDS]`` = (stores issued, %globaltimer at entry, at the
last store), written at exit.
"""
import triton
import triton.language as tl

SLOT_WORDS = tl.constexpr(4)  # int32 words per 16-byte slot
# The store's tensor spans the warp, 4 words per thread, and only lane 0's words are unmasked:
# Triton's coalescing gives each thread at most its share of the tensor, so a 4-word tensor would
# go out as four 4-byte stores from four lanes, where this one is a single 16-byte vector store.
WARP_WORDS = tl.constexpr(128)
RESULT_FIELDS = tl.constexpr(3)  # stores issued, %globaltimer at entry, at the last store (ns)
MAGIC = tl.constexpr(0x6C696E6B)  # "link": the fourth word of every slot the trickle wrote


@triton.jit
def _globaltimer():
    # volatile (is_pure=False): every read is a fresh one, never hoisted out of the spin
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


# Not specialized on its integers' values (a rank or target of 1, a period divisible by 16): the
# builds differ only by run_ns's type (int32 or int64), so two launches build every variant.
@triton.jit(do_not_specialize=["target", "slots", "period_ns", "run_ns", "max_stores", "source"])
def link_trickle_kernel(table_ptr, target, result_ptr, slots, period_ns, run_ns, max_stores,
                        source):
    """Launch with grid (1,) and num_warps=1; ``slots`` >= 1, ``period_ns`` >= 1, ``run_ns`` >= 0,
    0 <= ``max_stores`` < 2**31 (host contract)."""
    # The table holds 16-byte aligned addresses (host contract): the slot store is one v4 store.
    dst = tl.multiple_of(tl.load(table_ptr + target).to(tl.pointer_type(tl.int32)), 16)
    words = tl.arange(0, WARP_WORDS)
    start = _globaltimer()
    deadline = start + run_ns.to(tl.int64)
    now = start
    due = start
    last = start
    issued = 0
    while (issued < max_stores) & (now < deadline):
        while (now < due) & (now < deadline):
            now = _globaltimer()
        if now < deadline:
            slot = issued % slots
            value = tl.where(words == 0, issued,
                             tl.where(words == 1, source, tl.where(words == 2, slot, MAGIC)))
            tl.store(dst + slot * SLOT_WORDS + words, value, mask=words < SLOT_WORDS)
            last = now
            due = now + period_ns
            issued += 1
    tl.store(result_ptr, issued.to(tl.int64))
    tl.store(result_ptr + 1, start)
    tl.store(result_ptr + 2, last)
