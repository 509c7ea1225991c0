"""The device side of in-kernel split reductions: which program of a split tile reduces it.

Each of a tile's NSPLIT programs stores its partial, then takes a ticket; the one that draws the last ticket
sums every partial (in split order, so the result never depends on who finished last) and resets the
ticket, leaving the workspace all zero for the next kernel (host side: `_common.semaphores`).
"""
import triton
import triton.language as tl


@triton.jit
def last_of_split(C, tile, NSPLIT: tl.constexpr):
    """Call after this program stored its partials; True in the program that must reduce `tile`."""
    tl.debug_barrier()  # every thread's partials are stored before the ticket is taken (release)
    ticket = tl.atomic_add(C + tile, 1, sem="acq_rel", scope="gpu")
    return ticket == NSPLIT - 1


@triton.jit
def reset_ticket(C, tile):
    """The reducing program, when done: the ticket is zero again for the next kernel."""
    tl.atomic_xchg(C + tile, 0, sem="relaxed", scope="gpu")
