"""One option per group, the least summed sensitivity within a budget of bits: a multiple-choice
knapsack, solved the way its linear relaxation is (each group climbs its lower convex hull of
(bits, sensitivity), best sensitivity saved per bit first), then the bits left filled by the single
changes that save the most. Deterministic: ties go to the earlier group and the cheaper option."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from llmpress.errors import RecipeError

__all__ = ["Group", "choose_options"]


@dataclass
class Group:
    """Modules that take one scheme: their names, per menu option their bits and sensitivity,
    and how many weights they hold."""

    modules: list[str]
    bits: list[int]
    sensitivity: list[float]
    weights: int = 0


def _hull(group: Group) -> list[int]:
    """The options on the lower convex hull of (bits, sensitivity), cheapest first; each one
    after the first costs more and saves sensitivity at a lower rate per bit than the one before."""
    order = sorted(range(len(group.bits)), key=lambda o: (group.bits[o], group.sensitivity[o], o))
    front: list[int] = []
    for option in order:  # the Pareto front: each costlier option must lower the sensitivity
        if not front or group.sensitivity[option] < group.sensitivity[front[-1]]:
            front.append(option)
    hull: list[int] = []
    for option in front:
        while len(hull) >= 2 and _rate(group, hull[-2], hull[-1]) <= _rate(group, hull[-1], option):
            hull.pop()
        hull.append(option)
    return hull


def _rate(group: Group, cheap: int, dear: int) -> float:
    """Sensitivity saved per bit going from option ``cheap`` to option ``dear``."""
    return (group.sensitivity[cheap] - group.sensitivity[dear]) / max(group.bits[dear] - group.bits[cheap], 1)


def choose_options(groups: list[Group], budget: float) -> list[int]:
    """Each group's option: summed bits at most ``budget``, summed sensitivity as low as the
    hull climb and the fill find. A budget under the cheapest choice is a ``RecipeError``."""
    hulls = [_hull(g) for g in groups]
    choice = [hull[0] for hull in hulls]
    spent = sum(g.bits[c] for g, c in zip(groups, choice))
    if spent > budget:
        raise RecipeError(
            "mixed precision: the target is below the cheapest scheme of the menu",
            got=f"a budget of {budget:.0f} bits for the targeted weights", expected=f"at least {spent} bits (every module at its cheapest)",
            fix="raise the target, or add a cheaper scheme to the menu",
        )
    step = [0] * len(groups)
    queue = [(-_rate(g, hull[0], hull[1]), i) for i, (g, hull) in enumerate(zip(groups, hulls)) if len(hull) > 1]
    heapq.heapify(queue)
    while queue:
        _, i = heapq.heappop(queue)
        group, hull = groups[i], hulls[i]
        extra = group.bits[hull[step[i] + 1]] - group.bits[hull[step[i]]]
        if spent + extra > budget:
            continue  # this group stays; a cheaper step elsewhere may still fit
        spent += extra
        step[i] += 1
        choice[i] = hull[step[i]]
        if step[i] + 1 < len(hull):
            heapq.heappush(queue, (-_rate(group, hull[step[i]], hull[step[i] + 1]), i))
    return _fill(groups, choice, budget - spent)


def _fill(groups: list[Group], choice: list[int], left: float) -> list[int]:
    """The bits the hull left: the change (any group, any option) that saves the most
    sensitivity and fits, again, until none does."""
    for _ in range(sum(len(g.bits) for g in groups)):
        best = None
        for i, group in enumerate(groups):
            now = choice[i]
            for option in range(len(group.bits)):
                saved = group.sensitivity[now] - group.sensitivity[option]
                extra = group.bits[option] - group.bits[now]
                if saved > 0 and extra <= left and (best is None or saved > best[0]):
                    best = (saved, i, option, extra)
        if best is None:
            break
        _, i, option, extra = best
        choice[i] = option
        left -= extra
    return choice
