"""What a run refuses in its core lists before it starts: a list that does not parse, fewer
cores than threads, cores this machine does not have (a run on this machine alone), and
two pools on one node sharing a core. Binding happens as each process starts
(async_grpo/placement.py)."""

from __future__ import annotations

from async_grpo.config import RunConfig
from async_grpo.placement import PlacementError, compact, parse_cpus, usable_cpus


def check_cpus(text: str, where: str, threads: int, here: bool = True) -> tuple[int, ...]:
    """`parse_cpus`, refusing fewer cores than the process's threads (they would take
    turns on a core) and, with `here`, cores this machine does not give us."""
    cores = parse_cpus(text, where)
    missing = sorted(set(cores) - usable_cpus()) if here else []
    if missing:
        raise PlacementError(
            f"{where}: cores {missing} do not exist here (usable: {compact(usable_cpus())})"
        )
    if threads > len(cores):
        raise PlacementError(
            f"{where}: {len(cores)} core(s) {compact(cores)} for {threads} threads; give at"
            f" least as many cores as threads"
        )
    return cores


def check_disjoint(named: dict[str, tuple[int, ...]]) -> None:
    """Refuse two settings that share a core (processes on one node)."""
    items = list(named.items())
    for i, (a, ca) in enumerate(items):
        for b, cb in items[i + 1 :]:
            shared = sorted(set(ca) & set(cb))
            if shared:
                raise PlacementError(
                    f"{b}: cores {shared} are also in {a}; the two must not share a core"
                )


def validate_placement(cfg: RunConfig) -> dict[str, tuple[int, ...]]:
    """Core lists that parse and hold each process's threads, and, for a run on this
    machine alone (no `ray_address`), exist here; the ones set, by key. On a cluster the
    cores are those of the node each process starts on: it checks them as it binds."""
    named = {}
    for key, section in (
        ("generation", cfg.generation),
        ("logprob", cfg.logprob),
        ("trainer", cfg.trainer),
        ("verifier.judge", cfg.verifier.judge),
        ("verifier.reward_model", cfg.verifier.reward_model),
    ):
        if section.cpus is not None:
            where = f"{key}.cpus"
            named[where] = check_cpus(
                section.cpus, where, section.threads, here=cfg.ray_address is None
            )
    return named
