"""The build's ``kernels`` stage: kernels compiled and autotuned on this machine, shipped in the artifact.

:func:`kiln.builder.kernel_cache.build_kernel_cache` warms the staged engine up in a fresh process as a
serving pod would load it and packs what it compiled (CUDA: Triton's cache; CPU: kiln's C kernels).
"""

from __future__ import annotations

from kiln.builder.context import BuildContext
from kiln.builder.kernel_cache import build_kernel_cache
from kiln.builder.stages.package import write_engine


def run(ctx: BuildContext) -> None:
    """Warm the artifact up at the build-time pool; the record goes into engine.json's ``kernels``."""
    write_engine(ctx)  # the warm-up loads the artifact as a serving pod will
    ctx.kernels = build_kernel_cache(ctx.out, ctx.device, ctx.work_dir, {"num_kv_blocks": ctx.build_pool})
