"""Which window a sample reads: pure integer functions, O(1) memory, no state.

- `permute(i, n, key)`: a keyed pseudo-random permutation of range(n) (a balanced
  Feistel network on the smallest even number of bits that covers n, with cycle
  walking back into range). Each epoch of a file uses its own key, so each window
  appears exactly once per epoch, in a new order every epoch, without ever holding
  an array of n entries.
- `Mixture`: several sources with weights, interleaved deterministically. The
  weights become integer quotas q_i (exact for weights like 3,1 or 0.7,0.3); each
  period of P = sum(q_i) consecutive samples gives source i exactly q_i of them, in
  the order of a smooth weighted round robin over one period. Sample g belongs to
  source pattern[g % P] and is that source's (g // P) * q_i + rank[g % P]-th sample:
  a pure function of g, so resuming at any step costs nothing.
"""

from __future__ import annotations

import math
from fractions import Fraction

from common.errors import UserError

MASK64 = (1 << 64) - 1
ROUNDS = 6
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijective scramble of 64-bit integers."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    key = 0
    for part in parts:
        key = mix64(key ^ mix64((part & MASK64) + _GOLDEN))
    return key


def permute(i: int, n: int, key: int) -> int:
    """The image of i in [0, n) under the permutation of range(n) keyed by `key`."""
    if not 0 <= i < n:
        raise IndexError(f"{i} is outside range({n})")
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2 * half bits hold every value < n
    mask = (1 << half) - 1
    x = i
    while True:  # cycle walking: at most a few passes, since 4^half < 4n
        left, right = x >> half, x & mask
        for r in range(ROUNDS):
            left, right = right, left ^ (mix64(key ^ (r * _GOLDEN) ^ right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def parse_weights(text: str, count: int, what: str = "data.weights") -> list[Fraction]:
    """`text` as `count` positive weights (empty: equal weights)."""
    if not text.strip():
        return [Fraction(1)] * count
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != count:
        raise UserError(f"{what}={text!r} gives {len(parts)} weight(s) but data.path names {count} "
                        f"folder(s). Give one weight per folder, in the same order, or leave "
                        f"{what} empty for equal weights.")
    weights = []
    for part in parts:
        try:
            weight = Fraction(part)
        except (ValueError, ZeroDivisionError):
            weight = None
        if weight is None or weight <= 0:
            raise UserError(f"{what}={text!r}: {part!r} is not a positive number. Give positive "
                            f"weights such as 0.7,0.3 or 3,1.")
        weights.append(weight)
    return weights


def quotas(weights: list[Fraction], resolution: int = 10_000, limit: int = 100_000) -> list[int]:
    """Integer quotas in the ratio of `weights`: exact when the smallest such integers sum
    to at most `limit`, else rounded (largest remainder) to a period of `resolution`,
    each source keeping at least one slot."""
    fractions = [Fraction(w).limit_denominator(resolution) for w in weights]
    common = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * common) for f in fractions]
    divisor = math.gcd(*ints)
    ints = [i // divisor for i in ints]
    if sum(ints) <= limit:
        return ints
    total = sum(fractions)
    shares = [f * resolution / total for f in fractions]
    ints = [max(1, math.floor(s)) for s in shares]
    by_remainder = sorted(range(len(ints)), key=lambda k: shares[k] - math.floor(shares[k]), reverse=True)
    for k in by_remainder[:max(0, resolution - sum(ints))]:
        ints[k] += 1
    return ints


class Mixture:
    """Sample g -> (source, how many samples that source had before g)."""

    def __init__(self, weights: list[Fraction]):
        self.quotas = quotas(weights)
        self.period = sum(self.quotas)
        current = [0] * len(self.quotas)
        seen = [0] * len(self.quotas)
        self.pattern: list[int] = []
        self.rank: list[int] = []
        for _ in range(self.period):  # smooth weighted round robin over one period
            for k, q in enumerate(self.quotas):
                current[k] += q
            best = max(range(len(current)), key=lambda k: current[k])
            current[best] -= self.period
            self.pattern.append(best)
            self.rank.append(seen[best])
            seen[best] += 1

    def locate(self, g: int) -> tuple[int, int]:
        period, slot = divmod(g, self.period)
        source = self.pattern[slot]
        return source, period * self.quotas[source] + self.rank[slot]
