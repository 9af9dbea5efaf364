"""``KVLedger``: the scheduler's KV byte accounting against ``kv_budget_bytes`` (docs/serving.md, "KV
budget").

Three kinds of bytes, at ``bytes_per_token = layers × 2 × kv_heads × head_dim × dtype bytes``:

- **live**: every live context's prefix (its handle), what its readers keep beside it (a decoder at sharing
  depth m: its own K/V in m layers; the compact int8 copy of the C_base: codes and scales;
  ``SharedPrefillEngine.reader_extras``), and the tail slots each admitted request reserves (its own prompt
  tokens + ``max_new_tokens``), from admission to its end;
- **pending store**: with chunked prefill, the full blocks an unfinished prefill will insert into the prefix
  store when it finishes (counted from its start, so requests admitted meanwhile cannot take that room);
- **store**: the prefix store's blocks (``PrefixKVStore.bytes_in_use``), evicted LRU to make room.

Invariant: live + pending + store ≤ budget at every admission (tested with the budget set to the bytes
the requests need).

Live bytes are also kept by *kind* (``live_by_kind``, ``peak_by_kind``): ``context`` (a context's prefix: the
C_base, native or held as int8 codes and scales, or a decoder's own prefill without sharing), ``tail`` (the
requests' tail slots), ``own:NAME`` (decoder NAME's own K/V below its sharing depth) and ``format:FMT`` (a
C_base's copy in format FMT kept beside its native handle), so a benchmark can report the shared part and each
decoder's own part of the peak (``ccft bench serve``).
"""

from __future__ import annotations

__all__ = ["KVLedger"]


class KVLedger:
    """Reserve, release and make room; the one place the bytes and the store's block rounding are computed.

    Args:
        bytes_per_token: KV bytes per token of the engine (``SharedPrefillEngine.kv_bytes_per_token``).
        budget_bytes: the cap (None: unbounded).
        store: the ``PrefixKVStore`` (None: no store).
    """

    def __init__(self, bytes_per_token: int, budget_bytes: int | None = None, store=None):
        self.bytes_per_token = int(bytes_per_token)
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.store = store
        self.live_bytes = 0
        self.pending_store_bytes = 0
        self.peak_live_bytes = 0
        self.peak_total_bytes = 0
        self.live_by_kind: dict[str, int] = {}  # kind -> live bytes (module docstring)
        self.peak_by_kind: dict[str, int] = {}  # kind -> the most live bytes of that kind at a ``note_peak``

    # -- sizes
    def bytes(self, tokens: int) -> int:
        """KV bytes of ``tokens`` tokens."""
        return int(tokens) * self.bytes_per_token

    def store_block_tokens(self, context_tokens: int) -> int:
        """Tokens of a context's full store blocks (what a prefill may copy into the store); 0 without a
        store."""
        if self.store is None:
            return 0
        block = self.store.block_tokens
        return int(context_tokens) // block * block

    def request_bytes(self, tail_tokens: int, max_new_tokens: int) -> int:
        """The tail slots one request reserves: its own prompt tokens + its generated tokens."""
        return self.bytes(tail_tokens + max_new_tokens)

    def admission_bytes(
        self, context_tokens: int, tail_tokens: int, max_new_tokens: int, *, new_context: bool
    ) -> int:
        """Bytes admitting a request needs: its tail slots, and for a context not live yet its prefix and the
        store blocks its prefill may insert."""
        need = self.request_bytes(tail_tokens, max_new_tokens)
        if new_context:
            need += self.bytes(context_tokens) + self.bytes(self.store_block_tokens(context_tokens))
        return need

    def never_fits(
        self, context_tokens: int, tail_tokens: int, max_new_tokens: int, extra_bytes: int = 0
    ) -> int | None:
        """The bytes a request needs alone (``extra_bytes``: what its decoder keeps beside the context) when
        that exceeds the budget (it can never be admitted); else None. The same sum as admitting it on a new
        context (``admission_bytes``: with a store, the blocks its prefill inserts too), so a request that
        passes here is admitted once the others have ended instead of waiting for ever."""
        need = self.admission_bytes(context_tokens, tail_tokens, max_new_tokens, new_context=True)
        need += int(extra_bytes)
        return need if self.budget_bytes is not None and need > self.budget_bytes else None

    @property
    def store_bytes(self) -> int:
        return 0 if self.store is None else int(self.store.bytes_in_use)

    # -- accounting
    def make_room(self, need: int) -> bool:
        """Whether ``need`` more bytes fit; evicts unreferenced store blocks (LRU) first when they would
        not."""
        if self.budget_bytes is None:
            return True
        used = self.live_bytes + self.pending_store_bytes
        over = used + self.store_bytes + need - self.budget_bytes
        if over > 0 and self.store is not None:
            self.store.evict(over)
        return used + self.store_bytes + need <= self.budget_bytes

    def reserve(self, nbytes: int, kind: str = "context") -> int:
        """Count ``nbytes`` as live, of ``kind`` (module docstring); returns them (to release later)."""
        self.live_bytes += int(nbytes)
        self.live_by_kind[kind] = self.live_by_kind.get(kind, 0) + int(nbytes)
        return int(nbytes)

    def release(self, nbytes: int, kind: str = "context") -> None:
        """Count ``nbytes`` of ``kind`` (as they were reserved) as free."""
        self.live_bytes -= int(nbytes)
        self.live_by_kind[kind] = self.live_by_kind.get(kind, 0) - int(nbytes)

    def reserve_store(self, nbytes: int) -> int:
        """Count ``nbytes`` a running prefill will insert into the store; returns them."""
        self.pending_store_bytes += int(nbytes)
        return int(nbytes)

    def release_store(self, nbytes: int) -> None:
        self.pending_store_bytes -= int(nbytes)

    def note_peak(self) -> None:
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        self.peak_total_bytes = max(self.peak_total_bytes, self.live_bytes + self.store_bytes)
        for kind, n in self.live_by_kind.items():
            self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0), n)
