"""kiln's own kernels: GPU kernels written in Triton (paged attention, quantized GEMMs), and the CPU
kernels in C (``csrc/*.c``, loaded by ``native.py``), and the table of what a CPU linear can run
(``candidates.py``), which the layers run by and the tactics time and choose from.

The kernels sit beneath every op: nothing here imports the layers, the models or the tactics (the import
graph test, tests/test_import_graph.py, holds it). Within, ``isa`` < ``cpu_library`` < ``packed`` <
``native`` < ``candidates``: the lower never imports the upper.

Triton is a dependency of the GPU path only: no Triton module here is imported on a CPU
serving path, and every Triton kernel is also exercised on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``) by the tests marked ``kernels``.
"""
