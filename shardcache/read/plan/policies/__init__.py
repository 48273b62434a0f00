"""The packing policies by name: the one list ``PlanOptions``, the planner and the CLI read.

A policy turns the (shuffled) sequences of an epoch into batches (``base.Planner``). Mode
``"pad"`` (rows padded to their longest) is planned by the policy named ``"pad"``; mode
``"pack"`` (rows of exactly ``seq_len`` slots) by the policy ``PlanOptions.packing`` names.
Adding a packing is one module in this package and one ``register`` line below; ``modes()``,
``packings()`` and so ``PlanOptions`` and ``shardcache show --packing`` then offer it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardcache.config import check_choice
from shardcache.errors import ConfigError
from shardcache.read.plan.policies import best_fit, concat, pad
from shardcache.read.plan.policies.base import Planner

#: The row layouts a policy may plan; the collate stage knows how to lay out each.
ROW_MODES = ("pad", "pack")


@dataclass(frozen=True)
class Policy:
    """A registered packing policy.

    Attributes:
        name: the ``packing`` value (pack mode) or the mode's name (pad mode).
        mode: the row layout it plans, one of ``ROW_MODES``.
        plan: the planner.
    """

    name: str
    mode: str
    plan: Planner


#: Policies by name, in registration order (``modes()`` and ``packings()`` keep it).
POLICIES: dict[str, Policy] = {}


def register(name: str, plan: Planner, mode: str = "pack") -> Policy:
    """Make ``plan`` the policy ``name`` of ``mode``; ConfigError on a taken name or bad mode."""
    check_choice("mode", mode, ROW_MODES)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"packing policy: got the name {name!r}, expected a non-empty string")
    if name in POLICIES:
        raise ConfigError(
            f"packing policy: {name!r} is already registered; unregister it first or pick "
            "another name"
        )
    if mode != "pack" and name != mode:
        raise ConfigError(
            f"packing policy: {name!r} plans mode {mode!r}, which has one policy named after "
            f"it; register it as {mode!r} or make it a 'pack' policy"
        )
    POLICIES[name] = Policy(name, mode, plan)
    return POLICIES[name]


def unregister(name: str) -> None:
    """Remove the policy ``name`` (ConfigError listing the registered ones if there is none)."""
    check_choice("packing policy", name, tuple(POLICIES))
    del POLICIES[name]


def modes() -> tuple[str, ...]:
    """The modes some registered policy plans, in ``ROW_MODES`` order."""
    planned = {policy.mode for policy in POLICIES.values()}
    return tuple(mode for mode in ROW_MODES if mode in planned)


def packings() -> tuple[str, ...]:
    """The names ``PlanOptions.packing`` may take: the pack-mode policies, as registered."""
    return tuple(name for name, policy in POLICIES.items() if policy.mode == "pack")


def policy_for(mode: str, packing: str) -> Policy:
    """The policy that plans ``mode`` (``packing``'s in pack mode; ConfigError if unknown)."""
    if mode == "pack":
        check_choice("packing", packing, packings())
        return POLICIES[packing]
    check_choice("mode", mode, modes())
    return POLICIES[mode]


register("pad", pad.plan_pad, mode="pad")
register("best_fit", best_fit.plan_best_fit)
register("concat", concat.plan_concat)
