"""Loaded adapters in host memory: an LRU of at most ``max_cpu_loras``, safe to use from any thread.

``load`` reads a PEFT directory (disk -> host memory, checked against the base) outside the lock, so a
server loads in a background thread while the engine steps. Room is made before the read, not after it: a
load reserves one of the ``capacity`` places (evicting the least recently used adapter that no request
holds, or refused with ``RequestError`` code ``lora_capacity`` when every place is held or reserved; the
server answers 429), and at most :data:`MAX_READS` reads run at once, so concurrent loads never hold more
than ``capacity`` adapters plus those reads. Two loads of one name read it once. Each load gets a fresh
``int_id``: a name loaded again (after ``remove``) is a new adapter to the device slots and the other ranks.
``versions(name)`` remembers every content digest loaded under a name until ``remove``, evicted or not, so
an unload forgets the prefix blocks of each.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from kiln.engine.errors import RequestError
from kiln.engine.lora.adapter import LoRAAdapter, load_adapter
from kiln.engine.lora.request import LoRARequest

MAX_READS = 2  # adapter files read at once (each holds its file's bytes and tensors until it is cached)


class AdapterStore:
    def __init__(self, base_cfg: dict[str, Any], max_rank: int, capacity: int, dtype: torch.dtype,
                 in_use: Callable[[], set[int]] = set) -> None:
        self.base_cfg, self.max_rank, self.capacity, self.dtype = base_cfg, max_rank, capacity, dtype
        self.in_use = in_use  # int_ids held by requests (waiting or running)
        self._lock = threading.Lock()
        self._by_name: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._ids = itertools.count(1)
        self._reads = threading.BoundedSemaphore(MAX_READS)
        self._loading: dict[str, threading.Event] = {}  # names being read: places reserved in the capacity
        self._versions: dict[str, set[str]] = {}  # name -> content digests loaded under it since its last remove

    def get(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is not None:
                self._by_name.move_to_end(name)
            return adapter

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def load(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter ``lora`` names, from the cache or read from disk (then cached)."""
        while True:
            with self._lock:
                cached = self._by_name.get(lora.lora_name)
                if cached is not None:
                    self._by_name.move_to_end(lora.lora_name)
                    if cached.path != str(lora.lora_path):
                        raise RequestError("lora_name", f"a LoRA adapter named {lora.lora_name!r} is already loaded "
                                                        f"from {cached.path}; unload it first or pick another name")
                    return cached
                reading = self._loading.get(lora.lora_name)
                if reading is None:
                    self._reserve(lora.lora_name)
                    break
            reading.wait()  # another thread reads this name: take its copy (or retry if it failed)
        try:
            with self._reads:
                started = time.monotonic()
                adapter = load_adapter(lora.lora_path, lora.lora_name, next(self._ids), self.base_cfg,
                                       self.max_rank, self.dtype)
                adapter.load_seconds = time.monotonic() - started
            with self._lock:
                self._by_name[lora.lora_name] = adapter
                self._versions.setdefault(lora.lora_name, set()).add(adapter.digest)
        finally:
            with self._lock:
                self._loading.pop(lora.lora_name).set()
        return adapter

    def remove(self, name: str) -> tuple[LoRAAdapter | None, set[str]]:
        """Drop ``name``: (its cached adapter or None, every content digest loaded under it since the last remove)."""
        with self._lock:
            return self._by_name.pop(name, None), self._versions.pop(name, set())

    def _reserve(self, name: str) -> None:
        """Under the lock: a place for ``name`` before it is read, evicting the LRU adapter no request holds."""
        while len(self._by_name) + len(self._loading) >= self.capacity:
            free = self._evictable()
            if not free:
                raise self._full(name)
            del self._by_name[free[0]]  # least recently used first
        self._loading[name] = threading.Event()

    def _evictable(self) -> list[str]:
        held = self.in_use()
        return [n for n, a in self._by_name.items() if a.int_id not in held]

    def _full(self, name: str) -> RequestError:
        return RequestError("lora_name", f"cannot load LoRA adapter {name!r}: all {self.capacity} adapters kept in "
                                         "host memory (--max-cpu-loras) are in use by requests; retry later or "
                                         "raise --max-cpu-loras", code="lora_capacity")
