"""Programmatic dependent launch (PDL, sm_90+) inside the Triton kernels: the device side.

A kernel launched with PDL may start while the kernel before it on the stream is still running. Every
kernel here therefore begins with `pdl_enter`: it lets the *next* kernel launch right away (its programs
become resident and wait) and then waits until the previous kernel has finished and its writes are
visible. Only reads of data no kernel ever writes (weights) may come before the wait; the skinny GEMM
uses that window to load its whole weight tile while the previous kernel finishes. Every write comes
after the wait, so an early kernel never clobbers what a running one still reads.
Host side (whether to launch with PDL): `_common.pdl_launch`.
"""
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL is never switched on (see _common.pdl_supported)
    HAVE_GDC = False


if HAVE_GDC:
    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        """Let the next kernel on the stream launch now (its programs wait in their own pdl_wait)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Block until the previous kernel on the stream is complete and its memory is visible."""
        if PDL:
            gdc_wait()
else:  # pragma: no cover
    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        pass

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        pass


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Start of a kernel with nothing to prefetch: release the next kernel, then wait for the previous one."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
