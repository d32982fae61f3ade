"""Imported as ``kiln.serving.pool``: several engines behind one ``kiln serve`` (docs/pools.md).

``budget`` says how much memory the pool may fill and what each engine counts against it, ``engine_list``
reads ``--engine NAME=URI`` and the engines file, ``slot`` is one engine's load and unload, ``pool`` places
engines (load on first request, LRU eviction, idle unload, the bounded queue), ``follow`` keeps the pool
equal to the engines file, and ``metrics`` adds the pool's series to the server's registry.
"""
