"""A volunteer's price over the day (`echo-node join --price-schedule "07:00=0.45,23:00=0.30"`).

What a volunteer's GPU hour costs moves with the clock, not with the hub: an electricity tariff with peak and
off-peak hours, evenings the owner games on it. A schedule set once at start follows that without anyone at the
keyboard; the node re-declares its price to the hub when the schedule moves it (node/hub_link.py).
"""

from __future__ import annotations

import re

from shared.messages import MAX_PRICE_PER_HOUR

MINUTES_PER_DAY = 24 * 60
MAX_ENTRIES = 48
_ENTRY = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])=([0-9]+(\.[0-9]+)?)$")

# (minute of the day, $/h), by minute: each price holds from its minute until the next entry's, across midnight.
PriceSchedule = tuple[tuple[int, float], ...]


def parse_price_schedule(text: str) -> PriceSchedule:
    """`HH:MM=PRICE,...` in local time; ValueError naming the bad entry."""
    entries: dict[int, float] = {}
    parts = [p.strip() for p in text.split(",")]
    if not 1 <= len(parts) <= MAX_ENTRIES:
        raise ValueError(f"a price schedule has 1 to {MAX_ENTRIES} entries, got {len(parts)}")
    for part in parts:
        match = _ENTRY.match(part)
        if match is None:
            raise ValueError(f"price schedule entry {part!r} is not HH:MM=PRICE (e.g. 07:00=0.45)")
        minute, price = int(match[1]) * 60 + int(match[2]), float(match[3])
        if price > MAX_PRICE_PER_HOUR:
            raise ValueError(f"price schedule entry {part!r}: at most ${MAX_PRICE_PER_HOUR:g}/h")
        if minute in entries:
            raise ValueError(f"price schedule names {match[1]}:{match[2]} twice")
        entries[minute] = price
    return tuple(sorted(entries.items()))


def scheduled_price(schedule: PriceSchedule, minute_of_day: int) -> float:
    """The price in force at `minute_of_day`: the latest entry at or before it, else the day's last one."""
    if not 0 <= minute_of_day < MINUTES_PER_DAY:
        raise ValueError(f"minute of the day must be in [0, {MINUTES_PER_DAY}), got {minute_of_day}")
    price = schedule[-1][1]
    for minute, at in schedule:
        if minute > minute_of_day:
            break
        price = at
    return price
