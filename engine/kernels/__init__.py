"""kiln's own kernels: GPU kernels written in Triton (paged attention, quantized GEMMs), and the CPU
kernels in C (``cpu_kernels.c``, loaded by ``native.py``: paged decode attention).

Triton is a dependency of the GPU path only: no Triton module here is imported on a CPU
serving path, and every Triton kernel is also exercised on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``) by the tests marked ``kernels``.
"""
