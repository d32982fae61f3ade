"""Structured outputs: what a request constrains its output to (``params``, no torch), the
compile of a constraint into a grammar (``compiler``), each request's grammar state and the
batch's token masks (``state``), and the tool-call formats of model families (``tool_format``).
Import the submodules: this package imports nothing, so ``SamplingParams`` stays torch-free."""
