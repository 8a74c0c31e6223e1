"""An engine's KV pages: the device page pools (the target's and, with EAGLE-3, the drafter's, one page id
addressing both), the host's record of which pages are free, and the prefix cache.

The pools' shapes are fixed at construction (`num_pages` of `page_size` tokens), so every pool of an engine of
one configuration compiles the same steps. A live pool (decoding/live.py) takes the pages for its lifetime, one
at a time (`acquire`), gives each sequence pages as it grows (live_plan.py) and returns them when it finishes,
is aborted or preempted. The device arrays live here between operations (`arrays`): each operation donates
them and stores what it returns, so one buffer per layer exists at any time.

Prefix cache: a full page of committed KV is kept under the key of the tokens it holds and everything before them
(`chain_keys`: a sha256 hash chain, since a server exposes the cache to every client), and a later sequence
with the same prefix holds the same page (`lookup`) instead of computing it again. Pages count their holders; a
cached page no sequence holds waits in least-recently-used order and counts as free: taking pages evicts the
oldest of them once no page is free otherwise, so they go before any running sequence is preempted, and a page
in use is never evicted. The cache lives as long as the engine (across its requests).
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Callable, Sequence

import jax

DEFAULT_PAGE_SIZE = 64  # Engine(page_size=None): see BENCHMARKS.md, the paged cache's design decision
# Engine(kv_tokens=None) on a GPU: this share of the device's memory limit after the weights holds KV; the rest is
# the steps' working memory (activations, a call's logits, the prefill's buffers).
KV_SHARE = 0.8
KV_PAGE_QUANTUM = 256  # ... in whole multiples of this many pages, so the pools' shapes move in coarse steps


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-tokens // page_size)


def chain_keys(tokens: Sequence[int], page_size: int, pages: int, with_next: bool) -> list[bytes]:
    """The prefix cache's keys of the first `pages` full pages of a sequence of these tokens: page i's is the
    sha256 of page i - 1's key and page i's tokens, and with_next also of the token after the page (an EAGLE-3
    drafter's entry at a page's last position pairs it with that token, so the page's drafter KV is valid only
    where that token is the same). The caller gives tokens past the last page's end when with_next."""
    keys, key = [], b""
    for i in range(pages):
        end = (i + 1) * page_size
        chunk = tokens[i * page_size : end + 1 if with_next else end]
        key = hashlib.sha256(key + b"".join(int(t).to_bytes(4, "little") for t in chunk)).digest()
        keys.append(key)
    return keys


def device_memory_limit() -> int | None:
    """The default device's allocator limit in bytes (a GPU's: fixed for the device kind and the process's XLA
    settings), or None where the backend reports none (the CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def free_device_bytes() -> int:
    """Free memory of the default device: the allocator's limit less what is in use where it reports them
    (GPUs), else the host's available memory (the CPU backend allocates from it)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_page_size(max_len: int) -> int:
    """Engine(page_size=None): DEFAULT_PAGE_SIZE, or for shorter sequences the smallest power of two from 8 that
    holds max_len (a page longer than any sequence is memory no sequence uses)."""
    return min(DEFAULT_PAGE_SIZE, max(8, 1 << (max_len - 1).bit_length()))


def default_kv_tokens(weight_bytes: int, token_bytes: int, page_size: int, max_batch: int, max_len: int) -> int:
    """Engine(kv_tokens=None): on a GPU, KV_SHARE of the device's memory limit after the weights, in whole
    multiples of KV_PAGE_QUANTUM pages (at least max_len); on the CPU, max_batch x max_len (each sequence in whole
    pages: every slot holds a whole sequence). A function of the configuration and the device kind only, never of
    the moment's free memory: it sets the pools' shapes, and a second engine of the same configuration compiles
    nothing."""
    limit = device_memory_limit()
    if limit is None:
        return max_batch * pages_for(max_len, page_size) * page_size
    pages = int(KV_SHARE * (limit - weight_bytes)) // (token_bytes * page_size)
    return max(pages // KV_PAGE_QUANTUM * KV_PAGE_QUANTUM * page_size, max_len)


class PagePool:
    """The pages of an engine (see the module docstring). make_arrays() -> (target pages, drafter pages or None)
    allocates the device pools, on first use."""

    def __init__(self, num_pages: int, page_size: int, make_arrays: Callable[[], tuple]):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest free id is taken first
        self._holders: dict[int, int] = {}  # page -> sequences holding it (held pages only)
        self._key_of: dict[int, bytes] = {}  # cached page -> its key
        self._page_of: dict[bytes, int] = {}  # key -> its cached page
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unheld; oldest first
        self._make_arrays = make_arrays
        self._arrays: tuple | None = None
        self._holder = threading.Lock()

    @property
    def free(self) -> int:
        """Pages a sequence can take: none holds them (cached ones that wait included)."""
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        """Pages the prefix cache keeps (held or waiting)."""
        return len(self._key_of)

    def take(self, count: int) -> list[int]:
        """`count` pages for a sequence, uncached ones first, then the least recently used cached ones (evicted);
        more than are free is a scheduler bug."""
        if count > self.free:
            raise RuntimeError(f"asked for {count} pages with {self.free} free")
        taken = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._holders[page] = 1
            taken.append(page)
        return taken

    def give_back(self, pages: list[int]) -> None:
        """A sequence's pages, let go: a page no sequence holds any more waits in the cache if it is cached, else it
        is free."""
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                del self._holders[page]
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest run of these keys from the first, each now held once more by the caller
        (and most recently used)."""
        found = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if page in self._idle:
                del self._idle[page]
                self._holders[page] = 1
            else:
                self._holders[page] += 1
            found.append(page)
        return found

    def keep(self, page: int, key: bytes) -> None:
        """Caches a held page of full committed KV under its key (a key already cached keeps its first page)."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key

    def forget(self) -> None:
        """Drops the cache: after a failed operation (a key may name a page its chunk never wrote) and when the
        device pools are allocated anew (their keys are gone)."""
        for page in list(self._idle):
            self._free.append(page)
        self._idle.clear()
        self._key_of.clear()
        self._page_of.clear()

    @property
    def arrays(self) -> tuple:
        """The device pools (allocated on first use, and again if a failed operation consumed them)."""
        if self._arrays is None:
            self._arrays = self._make_arrays()
        elif any(x.is_deleted() for x in _leaves(self._arrays)):
            self.forget()
            self._arrays = self._make_arrays()
        return self._arrays

    @arrays.setter
    def arrays(self, pools: tuple) -> None:
        self._arrays = pools

    def acquire(self) -> None:
        """Takes the pages for one live pool; a second pool at the same time is refused (the engine's KV holds one
        pool's sequences)."""
        if not self._holder.acquire(blocking=False):
            raise RuntimeError("the engine's KV pages are in use by another pool (a generate, stream or server "
                               "running on this engine): one pool runs on an engine at a time")

    def release(self) -> None:
        self._holder.release()


def _leaves(pools: tuple) -> list:
    leaves = []
    for pool in pools:
        if pool is not None:
            leaves += list(pool.k) + list(pool.v)
    return leaves
