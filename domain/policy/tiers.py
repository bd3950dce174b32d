"""Priority tiers: a free worker takes the highest tier with work first, with aging against starvation.

The rule (pure, `choose_tier` / `after_claim`): among the tiers with a waiting work item, take the
highest (`TIERS`: archive, standard, index) unless a tier has been passed over `limit` times
(`tier_starvation_limit`, default 4) in a row while it had waiting work; then the most passed-over
tier goes first (a tie goes to the higher tier). A claimed tier's count restarts at 0, and so does
the count of a tier with no waiting work. So under a flood of every tier, the lowest tier still
gets at least one claim in every `limit + len(TIERS) - 1` (6 by default), and a tier alone is
never delayed.

The I/O side (which heads are waiting) is `processors/tier_heads.py` `HeadBuffer`.
"""

from __future__ import annotations

from typing import Collection, Mapping

TIERS: tuple[str, ...] = ("archive", "standard", "index")
"""Priority tiers, highest first: archive preservation before replaceable indexing (docs/design.md)."""


def choose_tier(waiting: Collection[str], passed_over: Mapping[str, int], limit: int) -> str | None:
    """The tier to claim from, or None when no tier waits. Pure.

    `waiting`: tiers with at least one work item waiting; `passed_over`: per tier, how many claims in
    a row went to another tier while it waited; `limit`: `tier_starvation_limit` (>= 1).
    """
    tiers = [t for t in TIERS if t in waiting]
    if not tiers:
        return None
    starved = [t for t in tiers if passed_over.get(t, 0) >= limit]
    if starved:
        return max(starved, key=lambda t: (passed_over.get(t, 0), -TIERS.index(t)))
    return tiers[0]


def after_claim(waiting: Collection[str], passed_over: Mapping[str, int], claimed: str) -> dict[str, int]:
    """The passed-over counts after a claim from `claimed` while `waiting` tiers had work. Pure:
    +1 for every other waiting tier, 0 for the claimed tier and for tiers with nothing waiting."""
    return {t: passed_over.get(t, 0) + 1 if t in waiting and t != claimed else 0 for t in TIERS}


def tier_of(topic: str) -> str:
    """The tier of a work topic `<prefix>.work.<stage>.<tier>` (its last dotted part)."""
    return topic.rsplit(".", 1)[-1]
