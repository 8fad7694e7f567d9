"""Which experts PuzzleMoE merges together (§3.2 "Pair-wise experts grouping").

* ``random_grouping`` / ``random_pairing``: the paper's default, a seeded random (partial) matching.
* ``evolve_grouping``: a small deterministic genetic search over groupings scored by a user loss
  (e.g. calibration loss of the merged layer); the paper reports it helps only slightly (Table 4).

A grouping is a sorted list of sorted tuples of expert indices; experts in no group are kept as they
are. ``num_groups`` pairs of a layer with E experts remove num_groups·(G − 1) experts, so 25 % and 50 %
of 8 experts are 2 and 4 pairs (``groups_for_ratio``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import MoECompressError

Grouping = list[tuple[int, ...]]


def canonical(groups: Sequence[Sequence[int]]) -> Grouping:
    """Sorted members within each group, groups sorted: the one representation of a grouping."""
    return sorted(tuple(sorted(int(e) for e in g)) for g in groups)


def _default_num_groups(num_experts: int, group_size: int, num_groups: int | None) -> int:
    if group_size < 2:
        raise MoECompressError(f"Merge groups need at least 2 experts, got group_size={group_size}.")
    n = num_experts // group_size if num_groups is None else int(num_groups)
    if n < 0 or n * group_size > num_experts:
        raise MoECompressError(
            f"Cannot form {n} groups of {group_size} from {num_experts} experts; "
            f"use at most {num_experts // group_size} groups."
        )
    return n


def groups_for_ratio(num_experts: int, ratio: float, group_size: int = 2) -> int:
    """Number of groups that removes round(ratio · E) experts (each group of G removes G − 1)."""
    if not 0.0 <= ratio < 1.0:
        raise MoECompressError(f"The compression ratio {ratio} is outside [0, 1); use e.g. 0.25 or 0.5.")
    n = round(ratio * num_experts / (group_size - 1))
    return _default_num_groups(num_experts, group_size, n)


def validate_grouping(
    groups: Sequence[Sequence[int]], num_experts: int, group_size: int = 2, num_groups: int | None = None
) -> Grouping:
    """Check that groups are disjoint, in range and of the right size (and count); return canonical form."""
    out = canonical(groups)
    seen: set[int] = set()
    for g in out:
        if len(g) != group_size:
            raise MoECompressError(f"Group {g} has {len(g)} experts; every group must have {group_size}.")
        for e in g:
            if not 0 <= e < num_experts:
                raise MoECompressError(f"Expert index {e} is outside 0..{num_experts - 1}.")
            if e in seen:
                raise MoECompressError(f"Expert {e} appears in two groups; a grouping must be disjoint.")
            seen.add(e)
    if num_groups is not None and len(out) != num_groups:
        raise MoECompressError(f"Expected {num_groups} groups, got {len(out)}.")
    return out


def _decode(perm: Sequence[int], group_size: int, num_groups: int) -> Grouping:
    return canonical(perm[k * group_size : (k + 1) * group_size] for k in range(num_groups))


def random_grouping(
    num_experts: int, group_size: int = 2, num_groups: int | None = None, seed: int = 0
) -> Grouping:
    """Seeded random disjoint groups (Python's Mersenne Twister: identical on every platform)."""
    n = _default_num_groups(num_experts, group_size, num_groups)
    perm = list(range(num_experts))
    random.Random(seed).shuffle(perm)
    return _decode(perm, group_size, n)


def random_pairing(num_experts: int, num_pairs: int | None = None, seed: int = 0) -> list[tuple[int, int]]:
    """Seeded random pairs; a perfect matching when num_pairs is None and num_experts is even."""
    return random_grouping(num_experts, 2, num_pairs, seed)  # type: ignore[return-value]


@dataclass
class SearchResult:
    groups: Grouping
    loss: float
    history: list[float] = field(default_factory=list)  # best loss seen before each generation, then final
    evaluations: int = 0  # distinct groupings scored


def evolve_grouping(
    num_experts: int,
    loss_fn: Callable[[Grouping], float],
    group_size: int = 2,
    num_groups: int | None = None,
    population: int = 16,
    generations: int = 20,
    elite: int = 2,
    mutation_swaps: int = 1,
    tournament: int = 2,
    seed: int = 0,
    progress: bool = False,
) -> SearchResult:
    """Genetic search over groupings minimising ``loss_fn(groups)`` (lower is better).

    Genome: a permutation of the experts; its first num_groups·G entries, cut into consecutive runs of
    G, are the groups. Each generation keeps the ``elite`` best genomes unchanged and fills the rest with
    children of tournament-selected parents mutated by ``mutation_swaps`` swaps of two experts from
    different groups (exchanging partners, or a grouped expert with a kept one). The seeded random
    grouping is in the first population and the best grouping ever scored is returned, so the result is
    never worse than the default. Losses are
    cached per grouping; with the same seed and a deterministic loss the search is deterministic.
    """
    n = _default_num_groups(num_experts, group_size, num_groups)
    if population < 1 or generations < 0 or not 0 <= elite <= population or tournament < 1:
        raise MoECompressError(
            "evolve_grouping needs population ≥ 1, generations ≥ 0, 0 ≤ elite ≤ population "
            "and tournament ≥ 1."
        )
    search = _GroupSearch(num_experts, loss_fn, group_size, n, mutation_swaps, seed)
    pop = search.first_population(population)
    history: list[float] = []
    gens = range(generations)
    if progress:
        from rich.progress import track

        gens = track(gens, description="PuzzleMoE grouping search")
    pop = search.ranked(pop)
    for _ in gens:
        history.append(search.best_so_far()[0])
        pop = search.ranked(search.children(pop, elite, population, tournament))
    loss, key = search.best_so_far()
    history.append(loss)
    return SearchResult(
        groups=[tuple(g) for g in key], loss=loss, history=history, evaluations=len(search.cache)
    )


class _GroupSearch:
    """`evolve_grouping`'s state: its random generator (seeded once; every draw in the search's order), the loss
    cache per grouping, and the genome operations."""

    def __init__(self, num_experts: int, loss_fn, group_size: int, n: int, mutation_swaps: int, seed: int):
        self.num_experts, self.loss_fn, self.group_size, self.n = num_experts, loss_fn, group_size, n
        self.mutation_swaps, self.seed = mutation_swaps, seed
        self.rng = random.Random(seed)
        self.span = n * group_size
        self.cache: dict[tuple, float] = {}

    def score(self, perm: list[int]) -> float:
        """The loss of the grouping `perm` decodes to (cached; NaN counts as infinite)."""
        key = tuple(_decode(perm, self.group_size, self.n))
        if key not in self.cache:
            value = float(self.loss_fn([tuple(g) for g in key]))
            self.cache[key] = math.inf if math.isnan(value) else value
        return self.cache[key]

    def group_of(self, pos: int) -> int:
        """The group of genome position `pos`; every kept expert is its own "group"."""
        return pos // self.group_size if pos < self.span else -1 - pos

    def mutate(self, perm: list[int]) -> list[int]:
        """`perm` with `mutation_swaps` swaps of two experts from different groups."""
        child = list(perm)
        for _ in range(self.mutation_swaps):
            a = self.rng.randrange(self.span)
            others = [b for b in range(self.num_experts) if self.group_of(b) != self.group_of(a)]
            if not others:
                break
            b = self.rng.choice(others)
            child[a], child[b] = child[b], child[a]
        return child

    def first_population(self, population: int) -> list[list[int]]:
        """The seeded random grouping (exactly `random_grouping(seed)`), then random genomes."""
        first = list(range(self.num_experts))
        random.Random(self.seed).shuffle(first)  # exactly random_grouping(seed)
        pop = [first]
        while len(pop) < population:
            perm = list(range(self.num_experts))
            self.rng.shuffle(perm)
            pop.append(perm)
        return pop

    def _key(self, g: list[int]) -> tuple:
        """The ranking key of genome `g`: its loss, then its grouping."""
        return (self.score(g), _decode(g, self.group_size, self.n))

    def ranked(self, p: list[list[int]]) -> list[list[int]]:
        """`p` best first (ties by grouping)."""
        return sorted(p, key=self._key)

    def best_so_far(self) -> tuple[float, tuple]:
        """The lowest loss scored and its grouping."""
        return min((loss, key) for key, loss in self.cache.items())

    def children(self, pop: list[list[int]], elite: int, population: int, tournament: int) -> list[list[int]]:
        """The next generation of the ranked `pop`: its `elite` best unchanged, then mutated children of
        tournament-selected parents."""
        children = [list(g) for g in pop[:elite]]
        while len(children) < population:
            parent = min((pop[self.rng.randrange(len(pop))] for _ in range(tournament)), key=self._key)
            children.append(self.mutate(parent))
        return children
