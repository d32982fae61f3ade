"""Tactics: every op with more than one implementation is run by the one measured fastest on the target.

TensorRT's builder times each candidate kernel ("tactic") for each layer on the target GPU and stores the
winners in the engine; kiln does the same for its CPU engines, and a serving host that matches the build's
signature uses the table as is:

- ``kiln.engine.kernels.candidates`` (beneath the layers and these modules, which import it): what a linear can
  run (kiln's FMA and AMX kernels, oneDNN, ATen), what each needs, how to pack and run it;
- ``timing.py``: interleaved timing of the runnable ones per row bucket, pruned and budgeted;
- ``table.py``: the choices (a layout per linear shape, a kernel per bucket), on disk with a checksum;
- ``host_signature.py``: the signature a table was measured on;
- ``resolve.py``: at load, the artifact's table, a re-timed one on another kind of host, or one measured here;
- ``bind.py``: packs a loaded model's linears by the table (and keeps the decoder stack's layout whole);
- ``deferred.py`` / ``swap.py``: ``kiln serve`` without a table for its host: the untimed default at once, this
  host's table timed in the background and swapped in between steps;
- ``report.py``: the table for people.

A build measures it in its ``tactics`` stage (``kiln.builder.stages.tactics``), with the model-level choices
(the decoder stack, the attention backend) timed end to end; docs/tactics.md explains the table.
"""
