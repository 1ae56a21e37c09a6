"""Joining a Ray cluster the same way from every process (CLI, workers, torchrun ranks).

Token auth is turned off for every process we start (a local `ray.init()` otherwise writes
~/.ray/auth_token, after which drivers given an explicit address fail with InvalidAuthToken).
"""

from __future__ import annotations

import os
import time
from typing import Any

NAMESPACE = "async_grpo"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def connect(
    address: str | None,
    num_cpus: int | None = None,
    object_store_bytes: int = 1 << 30,
    log_to_driver: bool = True,
    tries: int = 1,
) -> dict[str, Any]:
    """Join the cluster at `address`, or start a private local instance when it is None.
    `log_to_driver=False`: actors' output is not streamed to this process's console.
    `tries`: joins to attempt (a head this process just started, whose GCS may be slow to
    answer on a loaded machine: Ray waits for it only so long)."""
    import logging

    import ray

    if ray.is_initialized():
        return {}
    level = logging.INFO if log_to_driver else logging.WARNING  # quiet: no connect lines
    if address is None:
        return ray.init(
            address="local",
            namespace=NAMESPACE,
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=object_store_bytes,
            log_to_driver=log_to_driver,
            logging_level=level,
        )
    for tries_left in reversed(range(tries)):
        try:
            return ray.init(
                address=address,
                namespace=NAMESPACE,
                log_to_driver=log_to_driver,
                logging_level=level,
            )
        except ConnectionError as e:  # the GCS did not answer in Ray's own wait
            ray.shutdown()
            if not tries_left:
                raise ConnectionError(
                    f"could not join the Ray cluster at {address} ({tries} tries): {e}"
                ) from e
            time.sleep(2.0)
    return {}


def gone_errors() -> tuple[type[BaseException], ...]:
    """What a call to an actor raises when the actor died or cannot be reached: Ray raises
    ActorUnavailableError (not a RayActorError) for an actor on a node that was lost until
    it declares the node dead, then ActorDiedError. A request to the actor is then lost:
    it goes to another worker."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError)


def on_head_node() -> dict[str, Any]:
    """Actor options that place it on the head node (every cluster has its
    `node:__internal_head__` resource): a registry there outlives any other node."""
    return {"resources": {"node:__internal_head__": 0.001}}


def on_this_node() -> dict[str, Any]:
    """Actor options that place it on the calling process's node (hard affinity): a run's
    batcher and evaluator live and die with trainer rank 0, not with a worker node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def registry_name(pool: str) -> str:
    return f"registry:{pool}"


def node_label() -> str:
    """The Ray node this process runs on, as `async-grpo status` groups workers: its IP,
    the start of its node id and the host name (two nodes of one host differ by the first
    two). Called inside a Ray worker or driver."""
    import socket

    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return f"{ray.util.get_node_ip_address()} node {node_id[:8]} ({socket.gethostname()})"


def actor_node(actor: Any) -> str:
    """`node_label` of the actor instance it runs in (`actor.__ray_call__`)."""
    return node_label()
