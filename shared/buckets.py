"""Token buckets per key: request and byte rates per address, for the hub's guards and both web views."""

from __future__ import annotations


class TokenBuckets:
    """One token bucket per key (an address key, say): `take` spends a token or says how long until one is due.
    Past `max_keys` full buckets are forgotten, then the oldest keys, so throwaway keys can neither grow the table
    nor make every `take` walk it."""

    def __init__(self, per_s: float, burst: float, max_keys: int = 10_000) -> None:
        self.per_s, self.burst, self.max_keys = per_s, float(burst), max_keys
        self._buckets: dict[str, tuple[float, float]] = {}

    def level(self, key: str, now: float) -> float:
        """Tokens in `key`'s bucket now (a full bucket for a key never seen)."""
        tokens, at = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.per_s)

    def take(self, key: str, now: float, tokens: float = 1.0) -> float:
        """0.0 when `tokens` were spent, else the seconds until they are due (nothing spent)."""
        level = self.level(key, now)
        if level < tokens:
            return (tokens - level) / self.per_s
        self._buckets[key] = (level - tokens, now)
        if len(self._buckets) > self.max_keys:
            kept = [(k, v) for k, v in self._buckets.items() if self.level(k, now) < self.burst]
            self._buckets = dict(kept[-max(1, self.max_keys // 2) :])  # room for max_keys / 2 new keys till the next walk
        return 0.0
