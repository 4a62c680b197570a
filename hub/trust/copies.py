"""Copy detection: completions submitted again, whole groups or some of their completions, for other leases or prompts.

A node that replays work it (or another identity) already submitted is paid for sampling it never did. The
detector keeps a bounded LRU of recent accepted groups and, per completion, an index of where each was last seen
(for its prompt text, and anywhere); `check` flags a group whose repeats an honest sampler would almost never have
drawn.

Digests are blake3 over the sampled token ids alone (a tool-using completion's environment tokens, the hub's own
answers, are left out of its digest and its log-prob sum): independent of completion order (a copier gains nothing by
shuffling), of the claimed version, and of the log-probs, so nudging a log-prob (which audits cannot tell from bf16 noise) changes
nothing. A group's fingerprint is over its sorted completion digests; a completion's key under its prompt adds the
prompt text's digest.

What is legitimately repeated: prompts are drawn with replacement, so the same prompt text reaches several nodes,
and a peaked or converged policy repeats itself (a confident model answers "olleh<eos>" eight times out of eight,
with log-probs near 0). So a repeat is evidence only when it was improbable under the policy that was sampled:
- same prompt text, against one earlier group: the completions the group shares with it (each occurrence), and its
  own duplicates beyond the first, are what an honest sampler would have had to redraw. The evidence is
  R = -(log ways + sum of those occurrences' log-prob sums) (repeat_surprise); flagged when R reaches the run's
  threshold (copy_threshold_nats, below). A whole group repeated is the case where every completion counts
  (R is then -log P of an honest redraw of the multiset); a genuine group replayed with a completion replaced by a
  duplicate of another is caught by the rest; a group that duplicates its own completions (one sampled, eight
  sold) needs no earlier group. Its combinatorial term counts the ways to place the repeats in the group (for a whole
  group, the multinomial).
- another prompt text: log-probs are conditioned on the prompt, so an honest sampler of the other prompt reports
  other log-probs for the same tokens. A group, or some of its completions, is flagged when their log-prob sums are
  within `logprob_tolerance_nats` per token of the earlier group's and R reaches the same threshold: a model that
  ignores its prompt repeats itself across prompts honestly, with those log-probs, at odds e^-R. A copier that
  shifts its log-probs by more than the tolerance (the audit tolerance) lies by more than audits let pass.

Whose log-probs: R is computed on the submitter's own claims (audited like all its claims: a lie found bans it and
voids its pay) and on the earlier sighting's claims for the shared completions. When the two agree on which side of
the bar R falls, that is the verdict; when they disagree, neither party is believed: `check` answers Disputed and
the hub recomputes the group's log-probs under the claimed version (hub/trust/audit.py Auditor.logprob_sums), then
`settle`s on those, and keeps them as the sighting's sums. So a throwaway identity that submits the group a
confident policy produces, claiming low log-probs for it, gets honest repeats recomputed, not refused; and a copier
that claims near-certain tokens for a copy gets its copy recomputed, not believed. Sightings of a node that is
banned are forgotten (`forget`).

The threshold is the multiple-testing one. Over a run, the detector compares every group with up to `capacity` kept
groups, and any subset of a group's completions may be the shared ones; an honest repeat of R nats has odds e^-R. So
the n-th group checked is flagged at R >= log(capacity x 2^group_size / alpha_n), with alpha_n = 6 alpha / (pi^2 n^2):
the alpha_n sum to `false_alarm` (the run-wide chance that any honest group is called a copy) however long the run.
At alpha = 1e-6, 100,000 kept groups of 8: 31 nats for the first group, 50 at the 10,000th, 59 at the millionth.
A policy that collapsed repeats itself with log-probs near 0, far below that: it is never a copier. Edited copies (a
token changed in each completion) are not repeats; they are caught by how improbably they were sampled
(hub/trust/sampling.py).
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
# One completion of a kept group: its digest, token count (uint32), log-prob sum (float64).
ENTRY = struct.Struct(f"<{DIGEST_BYTES}sId")


def copy_threshold_nats(checked: int, capacity: int, group_size: int, false_alarm: float) -> float:
    """The surprise R at which the `checked`-th group (from 1) is a copy (module doc)."""
    if checked < 1 or not 0.0 < false_alarm < 1.0:
        raise ValueError(f"checked must be >= 1 and false_alarm in (0, 1), got {checked} and {false_alarm}")
    return math.log(capacity) + group_size * math.log(2.0) + math.log(math.pi**2 * checked**2 / (6.0 * false_alarm))


def completion_digest(token_ids: tuple[int, ...]) -> bytes:
    packed = struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)
    return blake3.blake3(packed).digest(length=DIGEST_BYTES)


def _in_digest_order(group: Group) -> list[Completion]:
    return sorted(group.completions, key=lambda c: completion_digest(c.model_token_ids()))


def group_fingerprint(group: Group) -> bytes:
    """Order-independent digest of a group's completions' sampled token ids."""
    digests = (completion_digest(c.model_token_ids()) for c in _in_digest_order(group))
    return blake3.blake3(b"".join(digests)).digest(length=DIGEST_BYTES)


def log_multinomial(counts: Sequence[int]) -> float:
    """log of the number of orderings of a multiset with these multiplicities."""
    return math.lgamma(sum(counts) + 1) - sum(math.lgamma(m + 1) for m in counts)


def coincidence_log_prob(group: Group) -> float:
    """log P that an independent honest sampler draws this same multiset of completions (see module doc)."""
    counts = Counter(c.model_token_ids() for c in group.completions)
    return log_multinomial(list(counts.values())) + sum(sum(c.model_logprobs()) for c in group.completions)


def repeat_surprise(counts: Sequence[int], sums: Sequence[float], shared: Sequence[bool]) -> float:
    """R of the module doc, for distinct completions with multiplicities `counts` and log-prob sums `sums`: every
    occurrence of a `shared` one counts, and every occurrence but the first of the others. The honest odds are
    those of a group of n draws holding the counted completions somewhere: ways to place them (every occurrence of
    a shared or duplicated completion: n! / ((n - K)! prod k!)) times their probabilities."""
    n = sum(counts)
    placed = [m for m, s in zip(counts, shared) if s or m > 1]
    ways = math.lgamma(n + 1) - math.lgamma(n - sum(placed) + 1) - sum(math.lgamma(k + 1) for k in placed)
    counted = math.fsum((m if s else m - 1) * lp for m, lp, s in zip(counts, sums, shared) if m > 1 or s)
    return -(ways + counted)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a group was seen: who sent it, for which lease and prompt, and its completions' log-prob sums."""

    node_id: str
    lease_id: str
    prompt_id: str
    prompt_digest: bytes  # of the prompt text: only its equality is asked
    # Per completion, in digest order, one ENTRY each.
    packed: bytes = b""

    @property
    def logprob_sums(self) -> list[tuple[int, float]]:
        return [(n, s) for _, n, s in ENTRY.iter_unpack(self.packed)]


def prompt_digest(text: str) -> bytes:
    return blake3.blake3(text.encode("utf-8", "surrogatepass")).digest(length=DIGEST_BYTES)


@dataclass(frozen=True)
class CopyFlag:
    """A group that repeats earlier work: who submitted it first, who again, how many of its completions are repeats
    (of the earlier group's, or of its own), and how unlikely an honest repeat was.

    `first` comes from the detector's records, its texts cut to their fields' widths (enough to name them); it is
    `again` itself for a group that only duplicates its own completions."""

    fingerprint: str
    first: Origin
    again: Origin
    surprise_nats: float
    same_node: bool
    repeated: int  # completions of the group counted as repeats
    of: int  # completions in the group
    exact: bool  # the same multiset of completions as `first`'s
    threshold_nats: float  # the run's bar when it was judged (copy_threshold_nats)

    def describe(self) -> str:
        odds = f"honest odds e^-{min(self.surprise_nats, 1e6):.0f}, past the run's bar of e^-{self.threshold_nats:.0f}"
        if self.first is self.again:
            return (
                f"group for {self.again.prompt_id} (lease {self.again.lease_id[:8]}) duplicates its own "
                f"completions ({self.repeated} of {self.of}); {odds}"
            )
        who = "its own" if self.same_node else f"{self.first.node_id}'s"
        what = "repeats" if self.exact else f"repeats {self.repeated} of {self.of} completions of"
        return (
            f"group for {self.again.prompt_id} (lease {self.again.lease_id[:8]}) {what} {who} group for "
            f"{self.first.prompt_id} (lease {self.first.lease_id[:8]}); {odds}"
        )


@dataclass(frozen=True)
class Disputed:
    """The submitter's log-probs and an earlier sighting's disagree on whether the repeat is improbable: `settle`
    the group on log-probs the hub recomputed."""

    first: Origin


def same_logprobs(a: Origin, b: Origin, tolerance_nats: float) -> bool:
    """Every completion's log-prob sum within `tolerance_nats` per token of the other's."""
    return len(a.packed) == len(b.packed) and all(
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
# (a peer id is 52 characters, a lease id 24); its completion count. Its completions follow in a slot of
# group_size ENTRYs.
RECORD = struct.Struct(f"<{DIGEST_BYTES}s{DIGEST_BYTES}s{DIGEST_BYTES}s{DIGEST_BYTES}s64s24s48sH")
NODE_KEY_AT = 2 * DIGEST_BYTES  # where a record's node digest starts
NONE = -1  # no slot: the ends of the recency list and of the free list


@dataclass(frozen=True, slots=True)
class _Seen:
    """One group being checked, digested once: its completions in digest order, grouped by digest."""

    fingerprint: bytes
    origin_key: bytes
    node_key: bytes
    here: Origin
    keys: tuple[bytes, ...]  # digest of each distinct completion
    counts: tuple[int, ...]  # its multiplicity in the group
    claimed: tuple[float, ...]  # its log-prob sum as the submitter claims it
    tokens: tuple[int, ...]


class _Table:
    """An open-addressing hash table (linear probing, no tombstones) of int32 values in an anonymous mapping; keys
    are not stored: `key_of(value)` reads a value's key from the records it points into."""

    def __init__(self, entries: int, key_of, salt: bytes) -> None:
        self.size = 1 << max(1, (2 * entries - 1).bit_length())  # load factor <= 1/2
        self._values = _ints(self.size)  # value + 1 at each position, 0 where empty: a fresh mapping reads as zeros
        self._key_of = key_of
        self._salt = salt

    @property
    def reserved_bytes(self) -> int:
        return 4 * self.size

    def _home(self, key: bytes) -> int:
        # Keyed by a secret of this detector's: a node grinding token ids cannot aim its keys at one probe run (each
        # accepted group would then cost the hub a scan of all the others).
        digest = hashlib.blake2b(key, key=self._salt, digest_size=8).digest()
        return int.from_bytes(digest, "little") & (self.size - 1)

    def find(self, key: bytes) -> int | None:
        """The position holding `key`, None if it is not kept."""
        position = self._home(key)
        while (entry := self._values[position]) != 0:
            if self._key_of(entry - 1) == key:
                return position
            position = (position + 1) & (self.size - 1)
        return None

    def value(self, position: int) -> int:
        return self._values[position] - 1

    def put(self, position: int, value: int) -> None:
        self._values[position] = value + 1

    def insert(self, key: bytes, value: int) -> None:
        position = self._home(key)
        while self._values[position] != 0:
            position = (position + 1) & (self.size - 1)
        self._values[position] = value + 1

    def delete(self, position: int) -> None:
        """Empty `position`, shifting later entries of its probe run back (lookups stay short)."""
        mask = self.size - 1
        scan = position
        while True:
            scan = (scan + 1) & mask
            entry = self._values[scan]
            if entry == 0:
                break
            home = self._home(self._key_of(entry - 1))
            # The entry may fill the hole only if its home is not cyclically within (hole, scan].
            if (position < scan and position < home <= scan) or (position > scan and (home > position or home <= scan)):
                continue
            self._values[position] = entry
            position = scan
        self._values[position] = 0


class CopyDetector:
    """Bounded LRU of recent groups and an index of their completions; `check` every accepted group once (and
    `settle` it on recomputed log-probs when `check` answers Disputed); `forget` a banned node's sightings.

    It keeps up to `capacity` groups for days of a run, so it holds no Python object per group: a group's record,
    its completions, their places in the hash tables (open addressing, linear probing), the recency and free lists
    live in anonymous mappings allocated once, whose pages the system backs as they are first written. A dict of
    small objects per group (as it was) took ~0.6 KB each and pinned more: they were allocated amid each
    submission's short-lived decoding, and Python's allocator hands an arena back only once all of it is free.
    """

    def __init__(self, capacity: int, group_size: int, false_alarm: float, logprob_tolerance_nats: float) -> None:
        if capacity < 1 or group_size < 1:
            raise ValueError(f"capacity and group_size must be >= 1, got {capacity} and {group_size}")
        self.capacity = capacity
        self.group_size = group_size
        self.false_alarm = false_alarm
        self.checked = 0  # groups judged: what the threshold accounts for
        self.threshold_nats = copy_threshold_nats(1, capacity, group_size, false_alarm)
        self.logprob_tolerance_nats = logprob_tolerance_nats
        self._entries_bytes = group_size * ENTRY.size
        self._records = _mapping(capacity * RECORD.size)
        self._entries = _mapping(capacity * self._entries_bytes)
        salt = secrets.token_bytes(16)
        self._groups = _Table(capacity, self._fingerprint, salt)
        # A completion's value: slot * group_size + its index in the slot. Indexed under its prompt text (the key
        # adds the prompt's digest), and anywhere (its digest alone: replayed under another prompt).
        self._completions = _Table(capacity * group_size, self._entry_key, salt)
        self._anywhere = _Table(capacity * group_size, self._entry_digest, salt)
        self._older, self._newer = _ints(capacity), _ints(capacity)
        self._oldest = self._newest = NONE
        self._free = NONE  # slots forgotten, chained through _newer
        self._used = 0  # slots ever taken
        self._kept = 0

    def __len__(self) -> int:
        return self._kept

    @property
    def reserved_bytes(self) -> int:
        """What it may come to hold when full, in bytes: the most its mappings are backed with."""
        return (
            len(self._records)
            + len(self._entries)
            + self._groups.reserved_bytes
            + self._completions.reserved_bytes
            + self._anywhere.reserved_bytes
            + 8 * self.capacity
        )

    def check(self, group: Group, node_id: str, lease_id: str) -> CopyFlag | Disputed | None:
        """A CopyFlag if this group repeats work too improbably to be honest; Disputed when that depends on whose
        log-probs are believed (then `settle` it); None otherwise, and the group is remembered."""
        # Counted here only: `settle` judges the same group again, one test with one share of the false-alarm rate.
        self.checked += 1
        self.threshold_nats = copy_threshold_nats(self.checked, self.capacity, self.group_size, self.false_alarm)
        return self._judge(self._seen(group, node_id, lease_id), None, keep=False)

    def settle(self, group: Group, node_id: str, lease_id: str, trusted: Sequence[float] | None) -> CopyFlag | None:
        """`check`, deciding on `trusted`: each completion's log-prob sum (in the group's order) as the hub recomputed
        it under the claimed version; None when it could not (the version left the shelf): the submitter's own."""
        seen = self._seen(group, node_id, lease_id)
        if trusted is None:  # decided on its own claims (audited like the rest), which replace no one's
            flag = self._judge(seen, seen.claimed, keep=False)
        else:
            if len(trusted) != len(group.completions):
                raise ValueError(f"{len(trusted)} recomputed sums for {len(group.completions)} completions")
            by_key = {completion_digest(c.model_token_ids()): s for c, s in zip(group.completions, trusted)}
            flag = self._judge(seen, tuple(by_key[k] for k in seen.keys), keep=True)
        assert not isinstance(flag, Disputed)
        return flag

    def forget(self, node_id: str) -> int:
        """Forget every group `node_id` was the kept sighting of (a banned node: its claims are no evidence against
        anyone). Returns how many."""
        node_key = _key(node_id)
        forgotten, at = 0, self._records.find(node_key)
        while at != -1:
            slot, offset = divmod(at, RECORD.size)
            if offset == NODE_KEY_AT and slot < self._used:
                self._drop(slot)
                self._unlink(slot)
                self._records[slot * RECORD.size : (slot + 1) * RECORD.size] = bytes(RECORD.size)
                self._newer[slot], self._free = self._free, slot
                self._kept -= 1
                forgotten += 1
            at = self._records.find(node_key, at + 1)
        return forgotten

    # -- the verdict ---------------------------------------------------------------------------

    def _seen(self, group: Group, node_id: str, lease_id: str) -> _Seen:
        if len(group.completions) > self.group_size:
            raise ValueError(f"a group of {len(group.completions)} completions, the detector keeps {self.group_size}")
        ordered = _in_digest_order(group)
        digest = prompt_digest(group.prompt_text)
        keys: list[bytes] = []
        counts: list[int] = []
        claimed: list[float] = []
        tokens: list[int] = []
        packed = bytearray()
        for c in ordered:
            sampled = c.model_token_ids()
            key = completion_digest(sampled)
            total = math.fsum(c.model_logprobs())
            packed += ENTRY.pack(key, len(sampled), total)
            if keys and keys[-1] == key:  # digest order puts a completion's duplicates together
                counts[-1] += 1
                continue
            keys.append(key)
            counts.append(1)
            claimed.append(total)
            tokens.append(len(sampled))
        here = Origin(node_id, lease_id, group.prompt_id, digest, bytes(packed))
        fingerprint = blake3.blake3(b"".join(ENTRY.unpack_from(packed, i * ENTRY.size)[0] for i in range(len(ordered)))).digest(
            length=DIGEST_BYTES
        )
        return _Seen(
            fingerprint,
            _key(lease_id, group.prompt_id),
            _key(node_id),
            here,
            tuple(keys),
            tuple(counts),
            tuple(claimed),
            tuple(tokens),
        )

    def _judge(self, seen: _Seen, trusted: Sequence[float] | None, keep: bool) -> CopyFlag | Disputed | None:
        """The verdict on `seen`, on `trusted` sums (per distinct completion) if given, else on the claims; `keep`:
        `trusted` are the hub's own, to replace the sightings' claims for the completions they share."""
        position = self._groups.find(seen.fingerprint)
        whole = None if position is None else self._groups.value(position)
        if whole is not None:
            self._touch(whole)
        # Earlier groups this one shares completions with (same prompt text), each with the shared ones' indexes.
        earlier: dict[int, list[int]] = {}
        if whole is not None and self._origin_key(whole) != seen.origin_key:
            if self._prompt_digest(whole) == seen.here.prompt_digest:
                earlier[whole] = list(range(len(seen.keys)))
            else:
                flag = self._cross_prompt(seen, whole, trusted)
                if flag is not None:
                    return flag
        elsewhere: dict[int, list[int]] = {}
        for i, key in enumerate(seen.keys):
            slot = self._same_prompt_sighting(seen, key, whole)
            if slot is not None:
                earlier.setdefault(slot, []).append(i)
            slot = self._replayed_sighting(seen, i, key, whole)
            if slot is not None:
                elsewhere.setdefault(slot, []).append(i)
        verdict = self._verdict(seen, whole, earlier, elsewhere, trusted)
        if verdict is None:
            self._settled(seen, whole, earlier, trusted if keep else None)
        return verdict

    def _same_prompt_sighting(self, seen: _Seen, key: bytes, whole: int | None) -> int | None:
        """The earlier group of another origin, under the same prompt text, that holds completion `key`."""
        found = self._completions.find(_prompt_key(seen.here.prompt_digest, key))
        if found is None:
            return None
        slot = self._completions.value(found) // self.group_size
        return slot if slot != whole and self._origin_key(slot) != seen.origin_key else None

    def _replayed_sighting(self, seen: _Seen, i: int, key: bytes, whole: int | None) -> int | None:
        """The earlier group of another origin that holds completion `key` under another prompt text with the same
        log-probs: not sampled there."""
        found = self._anywhere.find(key)
        if found is None:
            return None
        slot, index = divmod(self._anywhere.value(found), self.group_size)
        if slot == whole or self._prompt_digest(slot) == seen.here.prompt_digest or self._origin_key(slot) == seen.origin_key:
            return None
        _, n, first_sum = ENTRY.unpack_from(self._entries, slot * self._entries_bytes + index * ENTRY.size)
        return slot if abs(first_sum - seen.claimed[i]) <= self.logprob_tolerance_nats * max(1, n) else None

    def _verdict(
        self,
        seen: _Seen,
        whole: int | None,
        earlier: dict[int, list[int]],
        elsewhere: dict[int, list[int]],
        trusted: Sequence[float] | None,
    ) -> CopyFlag | Disputed | None:
        """A copy flag for the first repeat that makes the group a copy; else Disputed if one depends on whose
        log-probs are believed; else None."""
        verdicts: list[tuple[int | None, bool | None, float, int]] = [
            (slot, *self._repeat(seen, slot, shared, trusted)) for slot, shared in earlier.items()
        ]
        # Its own duplicates alone (one completion sampled, several sold) need no earlier group.
        verdicts.append((None, *self._repeat(seen, None, [], trusted)))
        for slot, shared in elsewhere.items():  # the same figures as the earlier sighting's: no dispute to settle
            verdicts.append((slot, *self._repeat(seen, None, shared, trusted)))
        disputed: Disputed | None = None
        for earlier_slot, copied, surprise, repeated in verdicts:
            if copied is None:
                disputed = disputed or Disputed(self._origin(earlier_slot) if earlier_slot is not None else seen.here)
            elif copied:
                first = self._origin(earlier_slot) if earlier_slot is not None else seen.here
                same = earlier_slot is None or self._node_key(earlier_slot) == seen.node_key
                return CopyFlag(
                    seen.fingerprint.hex(),
                    first,
                    seen.here,
                    surprise,
                    same,
                    repeated,
                    sum(seen.counts),
                    earlier_slot is not None and earlier_slot == whole,
                    self.threshold_nats,
                )
        return disputed

    def _settled(self, seen: _Seen, whole: int | None, earlier: dict[int, list[int]], trusted: Sequence[float] | None) -> None:
        """A group that is no copy: the hub's own figures (`trusted`) replace the disputed claims, so a later repeat
        is judged against them; a new group is remembered."""
        if trusted is not None:
            for slot, shared in earlier.items():
                self._write_sums(slot, [seen.keys[i] for i in shared], [trusted[i] for i in shared])
            if whole is not None:
                self._write_sums(whole, seen.keys, trusted)
        if whole is None:
            self._remember(seen, trusted)

    def _repeat(
        self, seen: _Seen, slot: int | None, shared: list[int], trusted: Sequence[float] | None
    ) -> tuple[bool | None, float, int]:
        """Whether repeating `slot`'s `shared` completions (and its own duplicates) makes the group a copy (None:
        disputed), R, and how many completions count as repeats."""
        is_shared = [False] * len(seen.keys)
        for i in shared:
            is_shared[i] = True
        repeated = sum(m if s else m - 1 for m, s in zip(seen.counts, is_shared))
        if repeated == 0:
            return False, 0.0, 0
        if trusted is not None:
            surprise = repeat_surprise(seen.counts, trusted, is_shared)
            return surprise >= self.threshold_nats, surprise, repeated
        surprise = repeat_surprise(seen.counts, seen.claimed, is_shared)
        if slot is None:
            return surprise >= self.threshold_nats, surprise, repeated
        first_sums = dict(self._sums(slot))
        theirs = [first_sums.get(k, own) if s else own for k, own, s in zip(seen.keys, seen.claimed, is_shared)]
        first_surprise = repeat_surprise(seen.counts, theirs, is_shared)
        if (surprise >= self.threshold_nats) != (first_surprise >= self.threshold_nats):
            return None, surprise, repeated
        return surprise >= self.threshold_nats, surprise, repeated

    def _cross_prompt(self, seen: _Seen, slot: int, trusted: Sequence[float] | None) -> CopyFlag | None:
        """The same completions under another prompt text: a copy when reported with the same log-probs (not sampled
        there) and not near-certain anyway."""
        first = self._origin(slot)
        if not same_logprobs(first, seen.here, self.logprob_tolerance_nats):
            return None
        sums = seen.claimed if trusted is None else trusted
        surprise = repeat_surprise(seen.counts, sums, [True] * len(seen.keys))
        if surprise < self.threshold_nats:
            return None
        return CopyFlag(
            seen.fingerprint.hex(),
            first,
            seen.here,
            surprise,
            self._node_key(slot) == seen.node_key,
            sum(seen.counts),
            sum(seen.counts),
            True,
            self.threshold_nats,
        )

    # -- records ---------------------------------------------------------------------------------

    def _remember(self, seen: _Seen, trusted: Sequence[float] | None) -> None:
        here = seen.here
        record = RECORD.pack(
            seen.fingerprint,
            seen.origin_key,
            seen.node_key,
            here.prompt_digest,
            _fit(here.node_id, 64),
            _fit(here.lease_id, 24),
            _fit(here.prompt_id, 48),
            sum(seen.counts),
        )
        packed = here.packed
        if trusted is not None:
            by_key = dict(zip(seen.keys, trusted))
            packed = b"".join(ENTRY.pack(k, n, by_key[k]) for k, n, _ in ENTRY.iter_unpack(here.packed))
        # Packed first: nothing below raises once the tables have changed.
        slot = self._take_slot()
        self._records[slot * RECORD.size : (slot + 1) * RECORD.size] = record
        start = slot * self._entries_bytes
        self._entries[start : start + len(packed)] = packed
        self._groups.insert(seen.fingerprint, slot)
        self._link_newest(slot)
        self._kept += 1
        previous = None
        for index, (key, _, _) in enumerate(ENTRY.iter_unpack(packed)):
            if key == previous:
                continue
            previous = key
            value = slot * self.group_size + index
            for table, table_key in ((self._completions, _prompt_key(here.prompt_digest, key)), (self._anywhere, key)):
                found = table.find(table_key)
                if found is None:
                    table.insert(table_key, value)
                else:  # the newest sighting: an older group's eviction then leaves it indexed
                    table.put(found, value)

    def _take_slot(self) -> int:
        """A free slot: a forgotten one, the next unused one, or the least recently used one's, forgotten first."""
        if self._free != NONE:
            slot, self._free = self._free, self._newer[self._free]
            return slot
        if self._used < self.capacity:
            self._used += 1
            return self._used - 1
        slot = self._oldest
        self._drop(slot)
        self._unlink(slot)
        self._kept -= 1
        return slot

    def _drop(self, slot: int) -> None:
        """Take `slot`'s group and the completions indexed at it out of the tables."""
        position = self._groups.find(self._fingerprint(slot))
        assert position is not None
        self._groups.delete(position)
        for index in range(self._count(slot)):
            value = slot * self.group_size + index
            for table, key in ((self._completions, self._entry_key(value)), (self._anywhere, self._entry_digest(value))):
                found = table.find(key)
                if found is not None and table.value(found) == value:
                    table.delete(found)

    def _write_sums(self, slot: int, keys: Sequence[bytes], sums: Sequence[float]) -> None:
        by_key = dict(zip(keys, sums))
        start = slot * self._entries_bytes
        for index in range(self._count(slot)):
            at = start + index * ENTRY.size
            key, n, _ = ENTRY.unpack_from(self._entries, at)
            if key in by_key:
                ENTRY.pack_into(self._entries, at, key, n, by_key[key])

    def _origin(self, slot: int) -> Origin:
        _, _, _, digest, node, lease, prompt, n = RECORD.unpack_from(self._records, slot * RECORD.size)
        start = slot * self._entries_bytes
        return Origin(_text(node), _text(lease), _text(prompt), digest, self._entries[start : start + n * ENTRY.size])

    def _sums(self, slot: int) -> list[tuple[bytes, float]]:
        start = slot * self._entries_bytes
        return [(key, s) for key, _, s in ENTRY.iter_unpack(self._entries[start : start + self._count(slot) * ENTRY.size])]

    def _field(self, slot: int, index: int) -> bytes:
        start = slot * RECORD.size + index * DIGEST_BYTES
        return self._records[start : start + DIGEST_BYTES]

    def _fingerprint(self, slot: int) -> bytes:
        return self._field(slot, 0)

    def _origin_key(self, slot: int) -> bytes:
        return self._field(slot, 1)

    def _node_key(self, slot: int) -> bytes:
        return self._field(slot, 2)

    def _prompt_digest(self, slot: int) -> bytes:
        return self._field(slot, 3)

    def _count(self, slot: int) -> int:
        return struct.unpack_from("<H", self._records, (slot + 1) * RECORD.size - 2)[0]

    def _entry_digest(self, value: int) -> bytes:
        slot, index = divmod(value, self.group_size)
        start = slot * self._entries_bytes + index * ENTRY.size
        return self._entries[start : start + DIGEST_BYTES]

    def _entry_key(self, value: int) -> bytes:
        return _prompt_key(self._prompt_digest(value // self.group_size), self._entry_digest(value))

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


def _prompt_key(prompt: bytes, completion: bytes) -> bytes:
    """A completion's key under its prompt text: the digests of both (the same tokens under another prompt are
    another completion there)."""
    return blake3.blake3(prompt + completion).digest(length=DIGEST_BYTES)


def _mapping(size: int) -> mmap.mmap:
    """`size` bytes of zeros, private to this process (a fork would copy them, not share them)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)


def _ints(count: int) -> memoryview:
    """`count` int32s in an anonymous mapping, all 0."""
    return memoryview(_mapping(4 * max(1, count))).cast("i")


def _text(field: bytes) -> str:
    return field.rstrip(b"\0").decode("utf-8", "surrogatepass")
