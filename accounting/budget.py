"""Budget certificates: verified upper bounds on ε for the next steps of a ledger's last phase.

:meth:`userdp.accounting.ledger.Ledger.check_budget` runs before every step. Recomputing ε of the
whole ledger each time costs a PLD self-composition per step (tens of ms at 10⁴ steps). For
uls/els the PLD accountant returns an UPPER bound on ε and the true ε grows with the step count,
so ε̂(prefix, (m, c')) ≤ budget proves every count c ≤ c' of the last phase within budget.
:class:`BudgetCertificates` looks ahead (twice the current count), and when the look-ahead is over
budget but the step itself is not, bisects for the largest verified count; either way later steps
up to that count cost nothing. O(log T) accountant calls per phase instead of T.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from userdp.accounting.api import PLD_KINDS
from userdp.accounting.mechanisms import Mechanism

__all__ = ["BudgetCertificates"]


class BudgetCertificates:
    """The certificates proven so far for one ledger, keyed by (earlier phases, mechanism,
    accountant options): the largest verified count of the mechanism's phase and its ε bound."""

    def __init__(self) -> None:
        self._proven: dict[Any, tuple[int, float]] = {}

    def epsilon_bound(
        self,
        phases: Sequence[tuple[Mechanism, int]],
        mechanism: Mechanism,
        budget: tuple[float, float],
        accountant_options: dict[str, Any],
        compose: Callable[..., float],
    ) -> float | None:
        """An ε bound, within ``budget`` = (ε, δ), after one more step of ``mechanism`` on top of
        the released ``phases``; or None when no certificate applies (a mechanism kind other than
        uls/els, or the step itself over budget): then the caller computes the exact ε.

        ``compose`` is the accountant the ledger charges with
        (:func:`userdp.accounting.api.compose_epsilon`); ``accountant_options`` are passed to it.
        """
        kinds = {m.kind for m, _ in phases} | {mechanism.kind}
        if not kinds <= set(PLD_KINDS):
            return None
        if phases and phases[-1][0] == mechanism:
            prefix, count = list(phases[:-1]), phases[-1][1] + 1
        else:
            prefix, count = list(phases), 1
        key = (
            tuple(prefix),
            mechanism,
            tuple((k, repr(v)) for k, v in sorted(accountant_options.items())),
        )
        budget_epsilon, budget_delta = budget
        proven = self._proven.get(key)
        if proven is not None and count <= proven[0]:
            return proven[1]

        def eps(c: int) -> float:
            return compose(prefix + [(mechanism, c)], budget_delta, **accountant_options)

        ahead = 2 * count
        eps_ahead = eps(ahead)
        if eps_ahead <= budget_epsilon:
            self._proven[key] = (ahead, eps_ahead)
            return eps_ahead
        eps_now = eps(count)
        if eps_now > budget_epsilon:
            return None  # the exact path refuses (and names the spent ε)
        good, good_eps, bad = count, eps_now, ahead  # bisect: the largest verified count
        while bad - good > 1:
            middle = (good + bad) // 2
            value = eps(middle)
            if value <= budget_epsilon:
                good, good_eps = middle, value
            else:
                bad = middle
        self._proven[key] = (good, good_eps)
        return good_eps
