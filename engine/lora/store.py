"""Loaded adapters in host memory: an LRU of at most ``max_cpu_loras``, safe to use from any thread.

``load`` reads a PEFT directory (disk -> host memory, checked against the base) outside the lock, so a
server loads in a background thread while the engine steps. When the cache is full the least recently used
adapter that no request holds is dropped; if every cached adapter is held by a waiting or running request,
the load is refused (``RequestError`` with code ``lora_capacity``; the server answers 429), never grown past
its budget. Each load gets a fresh ``int_id``: a name loaded again (after ``remove``) is a new adapter to the
device slots and the other ranks.
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


class AdapterStore:
    def __init__(self, base_cfg: dict[str, Any], max_rank: int, capacity: int, dtype: torch.dtype,
                 in_use: Callable[[], set[int]] = set) -> None:
        self.base_cfg, self.max_rank, self.capacity, self.dtype = base_cfg, max_rank, capacity, dtype
        self.in_use = in_use  # int_ids held by requests (waiting or running)
        self._lock = threading.Lock()
        self._by_name: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._ids = itertools.count(1)

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
        cached = self.get(lora.lora_name)
        if cached is not None:
            if cached.path != str(lora.lora_path):
                raise RequestError("lora_name", f"a LoRA adapter named {lora.lora_name!r} is already loaded from "
                                                f"{cached.path}; unload it first or pick another name")
            return cached
        self._check_room(lora.lora_name)
        started = time.monotonic()
        adapter = load_adapter(lora.lora_path, lora.lora_name, next(self._ids), self.base_cfg, self.max_rank,
                               self.dtype)
        adapter.load_seconds = time.monotonic() - started
        with self._lock:
            raced = self._by_name.get(lora.lora_name)
            if raced is not None:  # another thread loaded it meanwhile: one copy
                return raced
            self._evict_for_one()
            self._by_name[lora.lora_name] = adapter
        return adapter

    def remove(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            return self._by_name.pop(name, None)

    def _check_room(self, name: str) -> None:
        with self._lock:
            if len(self._by_name) >= self.capacity and not self._evictable():
                raise self._full(name)

    def _evictable(self) -> list[str]:
        held = self.in_use()
        return [n for n, a in self._by_name.items() if a.int_id not in held]

    def _evict_for_one(self) -> None:
        while len(self._by_name) >= self.capacity:
            free = self._evictable()
            if not free:
                raise self._full("")
            del self._by_name[free[0]]  # least recently used first

    def _full(self, name: str) -> RequestError:
        return RequestError("lora_name", f"cannot load LoRA adapter {name!r}: all {self.capacity} adapters kept in "
                                         "host memory (--max-cpu-loras) are in use by requests; retry later or "
                                         "raise --max-cpu-loras", code="lora_capacity")
