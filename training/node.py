"""Where this process runs: the Ray node's identity, for the status and placement reports of workers,
actors and the driver.

It lives in ``training``, the lowest layer that already depends on Ray, so that the workers
(``training``), the actors (``actors``) and the driver (``orchestrator``) all import it downward.
"""

from __future__ import annotations

import ray


def this_node() -> dict[str, str | None]:
    """``node_id`` (hex) and ``node_ip`` of the Ray node this process runs on (driver, worker or
    actor); both None in a process not connected to Ray (e.g. a plain class under test)."""
    if not ray.is_initialized():
        return {"node_id": None, "node_ip": None}
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
