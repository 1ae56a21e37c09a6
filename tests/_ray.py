"""Helpers of the tests that share the session's Ray cluster."""


def forget_pools(timeout_s: float = 60.0) -> None:
    """Kill every pool registry on the cluster (the workers were stopped by their module),
    and wait until their names are free."""
    import time

    import ray

    from async_grpo.pools import POOLS
    from async_grpo.ray_utils import NAMESPACE, registry_name

    names = [registry_name(p) for p in POOLS]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # this module had no such pool
            continue
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            assert time.monotonic() < deadline, f"registry {name} still named after {timeout_s}s"
            time.sleep(0.1)


def my_processes(marker: str) -> set[int]:
    """Live processes under this test process (its Ray clusters' workers and their children
    included) whose command line contains `marker`; other test processes running beside
    this one (pytest -n) do not count."""
    import psutil

    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if any(marker in part for part in p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def seconds_until_dead(actor, timeout_s: float, what: str = "the actor") -> float:
    """Seconds until Ray reports `actor` dead (asked every 0.2 s); fails naming `what` if
    it still answers `timeout_s` later."""
    import time

    import ray
    from ray.exceptions import RayActorError

    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except RayActorError:
            return time.monotonic() - t
        time.sleep(0.2)
    raise AssertionError(f"{what} still answers {timeout_s:.0f} s later")
