"""The flight recorder's ring: payloads of the last ``keep`` iterations that recorded any, held in memory.

In ``mode="flight"`` every step's statistics go to the store as usual, but tensor bytes wait here.
They are written only when something worth keeping happens: a step produces NaN or Inf, an exception
escapes a step, the process is asked to stop (SIGTERM, SIGINT) or the run ends. Older iterations fall
out of the ring unwritten. The ring is bounded by ``keep`` iterations and by ``max_bytes``; its peak
size is reported in the run's final metadata (``flight_ring_peak_bytes``).

This class keeps the bookkeeping; the bytes are in the items' buffers: process memory, or, under
``pdbg record``, shared memory that the parent process writes out after a hard crash (recorder.shmring).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .items import PayloadItem

Ref = Any  # a payload's content key (tuple) or, for bytes not hashed when captured, its token (int)


class FlightRing:
    """Payload items by iteration; thread-safe (backward hooks may run on autograd's threads)."""

    def __init__(self, keep: int, max_bytes: int) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self._iterations: OrderedDict[int, dict[Ref, PayloadItem]] = OrderedDict()
        self._owners: dict[int, int] = {}  # id(item) -> iterations holding it
        self._held: dict[Ref, PayloadItem] = {}  # every item held, by its reference: find() in one lookup
        self.bytes = 0
        self.peak_bytes = 0
        self.overflowed = 0  # payloads not kept because one iteration alone exceeded max_bytes
        # Reentrant: SIGTERM's handler writes the ring on the training thread, which the signal may
        # have interrupted inside add() (a plain lock would then wait for itself forever).
        self.lock = threading.RLock()

    def find(self, ref: Ref) -> PayloadItem | None:
        """The item holding these contents in any iteration of the ring. A caller that holds the
        item again (``add``) takes ``lock`` around both: between them, a capture on another thread
        could start an iteration that drops the item and hands its buffer back for reuse."""
        return self._held.get(ref)  # one dictionary read: atomic

    def add(self, iteration: int, ref: Ref, item: PayloadItem) -> tuple[list[int], list[PayloadItem]] | None:
        """Hold ``item`` for ``iteration`` (not kept, and counted in ``overflowed``, when the current
        iteration alone is over ``max_bytes``). Older iterations make room when the ring is full.
        Returns None when nothing else changed (the common case), else the iterations dropped for
        it (the writer must forget their records, as for ``start_iteration``: it holds every record
        waiting for bytes until told) and the items no longer held by any iteration, whose buffers
        the caller may reuse."""
        with self.lock:
            items = self._iterations.get(iteration)
            if items is None:
                items = self._iterations[iteration] = {}
            elif ref in items:
                return None
            owners = self._owners.get(id(item), 0)
            dropped: list[int] = []
            freed: list[PayloadItem] = []
            if not owners:
                nbytes = item.nbytes
                while self.bytes + nbytes > self.max_bytes and len(self._iterations) > 1:
                    dropped.append(next(iter(self._iterations)))
                    freed += self._drop_oldest()
                if self.bytes + nbytes > self.max_bytes:
                    self.overflowed += 1
                    return dropped, freed + [item]  # held by nothing: its buffer may be reused too
                self.bytes += nbytes
                if self.bytes > self.peak_bytes:
                    self.peak_bytes = self.bytes
                self._held[ref] = item
            items[ref] = item
            self._owners[id(item)] = owners + 1
            return (dropped, freed) if dropped or freed else None

    def note(self, iteration: int) -> None:
        """Count ``iteration`` among the ring's without holding bytes for it (its payloads are in the
        store already): ``take_all`` lists it, ``start_iteration`` drops it as any other."""
        with self.lock:
            if iteration not in self._iterations:
                self._iterations[iteration] = {}

    def start_iteration(self, iteration: int) -> tuple[list[int], list[PayloadItem]]:
        """Keep room for ``iteration``: drop the oldest iterations until ``keep - 1`` earlier ones are
        left. Counted, not told by their numbers, which may skip: Lightning's global step, which numbers a
        framework callback's iterations, goes up by two a batch under manual optimization with two
        optimizers, and the ring would hold one batch where ``keep=2`` promises two. Returns the dropped
        iteration numbers and the items no longer held."""
        with self.lock:
            dropped: list[int] = []
            freed: list[PayloadItem] = []
            while self._iterations and next(iter(self._iterations)) < iteration \
                    and len(self._iterations) - (iteration in self._iterations) >= self.keep:
                dropped.append(next(iter(self._iterations)))
                freed += self._drop_oldest()
            return dropped, freed

    def take_all(self) -> tuple[list[int], list[PayloadItem]]:
        """Empty the ring: its iterations and their items, each item once, oldest first."""
        with self.lock:
            iterations = list(self._iterations)
            seen: set[int] = set()
            items = []
            for held in self._iterations.values():
                for item in held.values():
                    if id(item) not in seen:
                        seen.add(id(item))
                        items.append(item)
            self._iterations.clear()
            self._owners.clear()
            self._held.clear()
            self.bytes = 0
            return iterations, items

    def take_before(self, iteration: int) -> tuple[list[int], list[PayloadItem]]:
        """Take the iterations before ``iteration`` out of the ring: their numbers and items, each
        item once, oldest first (``take_all`` for those only). An item that a later iteration holds
        too stays held by it."""
        with self.lock:
            iterations: list[int] = []
            seen: set[int] = set()
            items = []
            while self._iterations and next(iter(self._iterations)) < iteration:
                number, held = next(iter(self._iterations.items()))
                iterations.append(number)
                for item in held.values():
                    if id(item) not in seen:
                        seen.add(id(item))
                        items.append(item)
                self._drop_oldest()
            return iterations, items

    def _drop_oldest(self) -> list[PayloadItem]:
        _, items = self._iterations.popitem(last=False)
        freed = []
        for ref, item in items.items():
            left = self._owners[id(item)] - 1
            if left:
                self._owners[id(item)] = left
            else:
                del self._owners[id(item)]
                if self._held.get(ref) is item:
                    del self._held[ref]
                self.bytes -= item.nbytes
                freed.append(item)
        return freed
