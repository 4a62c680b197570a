"""Copy detection: the same group of completions submitted twice, for different leases or prompts.

A node that replays work it (or another identity) already submitted is paid for sampling it
never did. The detector keeps a bounded LRU of fingerprints of recent accepted groups and flags
a group whose fingerprint it has already seen under another (lease, prompt).

The fingerprint is blake3 over the sorted per-completion digests of the token ids alone:
independent of completion order (a copier gains nothing by shuffling), of the prompt (a group
copied onto another prompt is still a copy), of the claimed version, and of the log-probs, so
nudging a log-prob (which audits cannot tell from bf16 noise) changes nothing.

What is legitimately identical: prompts are drawn with replacement, so the same prompt text
reaches several nodes, and on a small, peaked policy identical completions are common (a
confident model answers "olleh<eos>" eight times out of eight, with log-probs near 0). Two
honest groups coincide with probability P = multinomial(n; counts) * prod_j p(c_j), where
p(c_j) = exp(sum of c_j's sampling log-probs): the chance that an independent sampler redraws
this multiset of completions. The rules:
- same prompt text: flagged when P < exp(-copy_min_surprise_nats) (default e^-20 ~ 2e-9 per pair),
  so whole low-entropy groups are not flagged while a group with real sampling randomness is;
- another prompt text: log-probs are conditioned on the prompt, so an honest sampler of the other
  prompt reports other log-probs for the same tokens. Flagged when every completion's log-prob sum
  is within `logprob_tolerance_nats` per token of the first sighting's and P < exp(-CROSS_PROMPT_MIN_SURPRISE_NATS).
  A copier that shifts its log-probs by more than the tolerance (set to the audit tolerance)
  lies by more than audits let pass; one that copies near-certain groups gains little (an honest
  node would have produced them), and the audit of their log-probs under the new prompt still applies.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import secrets
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from shared.rollout import Completion, Group

DIGEST_BYTES = 16
SUM_BYTES = 12  # a completion's token count (uint32) and log-prob sum (float64), packed in an Origin
# A cross-prompt repeat with matching log-probs is flagged only if an honest redraw had odds below e^-this.
CROSS_PROMPT_MIN_SURPRISE_NATS = 3.0


def completion_digest(token_ids: tuple[int, ...]) -> bytes:
    packed = struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)
    return blake3.blake3(packed).digest(length=DIGEST_BYTES)


def _in_digest_order(group: Group) -> list[Completion]:
    return sorted(group.completions, key=lambda c: completion_digest(c.token_ids))


def group_fingerprint(group: Group) -> bytes:
    """Order-independent digest of a group's completions' token ids."""
    return blake3.blake3(b"".join(completion_digest(c.token_ids) for c in _in_digest_order(group))).digest(length=DIGEST_BYTES)


def coincidence_log_prob(group: Group) -> float:
    """log P that an independent honest sampler draws this same multiset of completions (see module doc)."""
    counts = Counter(c.token_ids for c in group.completions)
    log_multinomial = math.lgamma(len(group.completions) + 1) - sum(math.lgamma(m + 1) for m in counts.values())
    return log_multinomial + sum(sum(c.logprobs) for c in group.completions)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a group was seen: who sent it, for which lease and prompt, and its completions' log-prob sums."""

    node_id: str
    lease_id: str
    prompt_id: str
    prompt_digest: bytes  # of the prompt text: only its equality is asked
    # Per completion, in digest order: its token count, then the sum of its reported log-probs (pack_sums).
    packed_sums: bytes = b""

    @property
    def logprob_sums(self) -> list[tuple[int, float]]:
        n = len(self.packed_sums) // SUM_BYTES
        values = struct.unpack(f"<{n}I{n}d", self.packed_sums)
        return list(zip(values[:n], values[n:]))


def pack_sums(sums: Sequence[tuple[int, float]]) -> bytes:
    return struct.pack(f"<{len(sums)}I{len(sums)}d", *(n for n, _ in sums), *(s for _, s in sums))


def prompt_digest(text: str) -> bytes:
    return blake3.blake3(text.encode("utf-8", "surrogatepass")).digest(length=DIGEST_BYTES)


@dataclass(frozen=True)
class CopyFlag:
    """A group seen before: who submitted it first, who again, and how unlikely an honest repeat was.

    `first` comes from the detector's records, its texts cut to their fields' widths (enough to name them)."""

    fingerprint: str
    first: Origin
    again: Origin
    surprise_nats: float
    same_node: bool

    def describe(self) -> str:
        who = "its own" if self.same_node else f"{self.first.node_id}'s"
        return (f"group for {self.again.prompt_id} (lease {self.again.lease_id[:8]}) repeats {who} group for "
                f"{self.first.prompt_id} (lease {self.first.lease_id[:8]}); honest odds e^-{self.surprise_nats:.0f}")


def same_logprobs(a: Origin, b: Origin, tolerance_nats: float) -> bool:
    """Every completion's log-prob sum within `tolerance_nats` per token of the other's."""
    return len(a.packed_sums) == len(b.packed_sums) and all(
        abs(sa - sb) <= tolerance_nats * max(1, n) for (n, sa), (_, sb) in zip(a.logprob_sums, b.logprob_sums)
    )


def _key(*texts: str) -> bytes:
    """A digest of `texts` that no other split of the same characters shares."""
    hasher = blake3.blake3()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        hasher.update(struct.pack("<I", len(data)) + data)
    return hasher.digest(length=DIGEST_BYTES)


def _fit(text: str, width: int) -> bytes:
    """`text` in at most `width` UTF-8 bytes, cut on a character boundary."""
    return text.encode("utf-8", "surrogatepass")[:width].decode("utf-8", "ignore").encode("utf-8", "surrogatepass")


# A kept group, in one fixed-size record: its fingerprint; digests of (lease, prompt id), of the node id and of the
# prompt text (what the rules compare); the node id, lease id and prompt id cut to widths that name them in an event
# (a peer id is 52 characters, a lease id 24); its completion count. Its packed sums follow in a slot of
# group_size x SUM_BYTES.
RECORD = struct.Struct(f"<{DIGEST_BYTES}s{DIGEST_BYTES}s{DIGEST_BYTES}s{DIGEST_BYTES}s64s24s48sH")
NONE = -1  # no slot: the ends of the recency list


class CopyDetector:
    """Bounded LRU of recent group fingerprints; `check` every accepted group once.

    It keeps up to `capacity` groups for days of a run, so it holds no Python object per group: a group's record,
    its sums, its place in the hash table (open addressing, linear probing) and in the recency list live in
    anonymous mappings allocated once, whose pages the system backs as they are first written. A dict of small
    objects per group (as it was) took ~0.6 KB each and pinned more: they were allocated amid each submission's
    short-lived decoding, and Python's allocator hands an arena back only once all of it is free.
    """

    def __init__(self, capacity: int, group_size: int, min_surprise_nats: float, logprob_tolerance_nats: float) -> None:
        if capacity < 1 or group_size < 1:
            raise ValueError(f"capacity and group_size must be >= 1, got {capacity} and {group_size}")
        self.capacity = capacity
        self.group_size = group_size
        self.min_surprise_nats = min_surprise_nats
        self.logprob_tolerance_nats = logprob_tolerance_nats
        self._sums_bytes = group_size * SUM_BYTES
        self._records = _mapping(capacity * RECORD.size)
        self._sums = _mapping(capacity * self._sums_bytes)
        self._salt = secrets.token_bytes(16)
        self._table_size = 1 << max(1, (2 * capacity - 1).bit_length())  # load factor <= 1/2
        # Slot + 1 at each position, 0 where empty: a fresh mapping reads as zeros.
        self._table = _ints(self._table_size)
        self._older, self._newer = _ints(capacity), _ints(capacity)
        self._oldest = self._newest = NONE
        self._used = 0

    def __len__(self) -> int:
        return self._used

    @property
    def reserved_bytes(self) -> int:
        """What it may come to hold when full, in bytes: the most its mappings are backed with."""
        return len(self._records) + len(self._sums) + 4 * (self._table_size + 2 * self.capacity)

    def check(self, group: Group, node_id: str, lease_id: str) -> CopyFlag | None:
        """A CopyFlag if this group repeats one seen under another (lease, prompt); remembers it otherwise."""
        if len(group.completions) > self.group_size:
            raise ValueError(f"a group of {len(group.completions)} completions, the detector keeps {self.group_size}")
        surprise = -coincidence_log_prob(group)
        key = group_fingerprint(group)
        sums = tuple((len(c.token_ids), math.fsum(c.logprobs)) for c in _in_digest_order(group))
        here = Origin(node_id, lease_id, group.prompt_id, prompt_digest(group.prompt_text), pack_sums(sums))
        origin_key = _key(lease_id, group.prompt_id)
        position = self._find(key)
        if position is not None:
            slot = self._table[position] - 1
            self._touch(slot)
            _, first_key, first_node, _, *_ = RECORD.unpack_from(self._records, slot * RECORD.size)
            if first_key != origin_key:
                first = self._origin(slot)
                # The odds of an honest repeat, by the log-probs of whichever sighting makes it less likely: a
                # copier cannot make its copy look likely by reporting log-probs near 0 for it.
                log_multinomial = -surprise - math.fsum(s for _, s in sums)
                surprise = max(surprise, -(log_multinomial + math.fsum(s for _, s in first.logprob_sums)))
                if first.prompt_digest == here.prompt_digest:
                    copied = surprise >= self.min_surprise_nats
                else:
                    # Log-probs are conditioned on the prompt: the same ones under another prompt text were
                    # not sampled there (unless the tokens were near-certain anyway).
                    copied = surprise >= CROSS_PROMPT_MIN_SURPRISE_NATS and same_logprobs(
                        first, here, self.logprob_tolerance_nats)
                if copied:
                    return CopyFlag(key.hex(), first, here, surprise, first_node == _key(node_id))
                return None
        else:
            slot = None
        record = RECORD.pack(key, origin_key, _key(node_id), here.prompt_digest, _fit(node_id, 64), _fit(lease_id, 24),
                             _fit(group.prompt_id, 48), len(sums))
        if slot is None:  # the record packed first: nothing below raises once the table has changed
            slot = self._take_slot()
            self._insert(key, slot)
        self._records[slot * RECORD.size:(slot + 1) * RECORD.size] = record
        start = slot * self._sums_bytes
        self._sums[start:start + len(here.packed_sums)] = here.packed_sums
        return None

    def _origin(self, slot: int) -> Origin:
        _, _, _, digest, node, lease, prompt, n = RECORD.unpack_from(self._records, slot * RECORD.size)
        start = slot * self._sums_bytes
        return Origin(_text(node), _text(lease), _text(prompt), digest, self._sums[start:start + n * SUM_BYTES])

    def _fingerprint(self, slot: int) -> bytes:
        start = slot * RECORD.size
        return self._records[start:start + DIGEST_BYTES]

    def _home(self, key: bytes) -> int:
        # Keyed by a secret of this detector's: a node grinding token ids cannot aim its groups' fingerprints at one
        # probe run (each accepted group would then cost the hub a scan of all the others).
        digest = hashlib.blake2b(key, key=self._salt, digest_size=8).digest()
        return int.from_bytes(digest, "little") & (self._table_size - 1)

    def _find(self, key: bytes) -> int | None:
        """The table position holding `key`'s slot, None if it is not kept."""
        position = self._home(key)
        while (entry := self._table[position]) != 0:
            if self._fingerprint(entry - 1) == key:
                return position
            position = (position + 1) & (self._table_size - 1)
        return None

    def _insert(self, key: bytes, slot: int) -> None:
        position = self._home(key)
        while self._table[position] != 0:
            position = (position + 1) & (self._table_size - 1)
        self._table[position] = slot + 1
        self._link_newest(slot)

    def _take_slot(self) -> int:
        """A free slot: the next unused one, or the least recently used one's, forgotten first."""
        if self._used < self.capacity:
            self._used += 1
            return self._used - 1
        slot = self._oldest
        position = self._find(self._fingerprint(slot))
        assert position is not None
        self._delete(position)
        self._unlink(slot)
        return slot

    def _delete(self, position: int) -> None:
        """Empty `position`, shifting later entries of its probe run back (no tombstones: lookups stay short)."""
        mask = self._table_size - 1
        scan = position
        while True:
            scan = (scan + 1) & mask
            entry = self._table[scan]
            if entry == 0:
                break
            home = self._home(self._fingerprint(entry - 1))
            # The entry may fill the hole only if its home is not cyclically within (hole, scan].
            if (position < scan and position < home <= scan) or (position > scan and (home > position or home <= scan)):
                continue
            self._table[position] = entry
            position = scan
        self._table[position] = 0

    def _touch(self, slot: int) -> None:
        if slot != self._newest:
            self._unlink(slot)
            self._link_newest(slot)

    def _unlink(self, slot: int) -> None:
        older, newer = self._older[slot], self._newer[slot]
        if older == NONE:
            self._oldest = newer
        else:
            self._newer[older] = newer
        if newer == NONE:
            self._newest = older
        else:
            self._older[newer] = older

    def _link_newest(self, slot: int) -> None:
        self._older[slot], self._newer[slot] = self._newest, NONE
        if self._newest == NONE:
            self._oldest = slot
        else:
            self._newer[self._newest] = slot
        self._newest = slot


def _mapping(size: int) -> mmap.mmap:
    """`size` bytes of zeros, private to this process (a fork would copy them, not share them)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)


def _ints(count: int) -> memoryview:
    """`count` int32s in an anonymous mapping, all 0."""
    return memoryview(_mapping(4 * max(1, count))).cast("i")


def _text(field: bytes) -> str:
    return field.rstrip(b"\0").decode("utf-8", "surrogatepass")
