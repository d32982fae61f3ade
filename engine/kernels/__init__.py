"""GPU kernels written in Triton (paged attention, quantized GEMMs).

Triton is a dependency of the GPU path only: nothing here is imported on a CPU
serving path, and every kernel is also exercised on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``) by the tests marked ``kernels``.
"""
