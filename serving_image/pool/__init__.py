"""Imported as ``kiln.serving.pool``: several engines behind one ``kiln serve`` (docs/pools.md).

``budget`` says how much memory the pool may fill on this host (what each engine counts against it is
``kiln.memory_budget``, and ``kiln.engine_list`` reads ``--engine NAME=URI`` and the engines file: both in kiln's
core, which the operator shares), ``slot`` is one engine's load and unload, ``pool`` places
engines (load on first request, LRU eviction, idle unload, the bounded queue), ``follow`` keeps the pool
equal to the engines file, and ``metrics`` adds the pool's series to the server's registry.
"""
