"""Fail fast on placements Ray would wait on forever.

Ray queues an actor whose resources no node offers (an unknown custom
resource, more GPUs than any node has) and keeps it pending without an error.
So before anything is created the run checks its demands against the nodes'
totals (``check_placement``, pure), and every actor or placement group it then
creates must be up within ``ray.placement_timeout_s`` (``wait_placed``), else
the run stops with a ``PlacementError`` naming what did not fit.

The check: every resource named by a demand exists on some node; every single
actor fits on one node; the summed demand of each resource fits the cluster's
total. A packing that passes these but still cannot be found (fragmented
nodes) is caught by the readiness timeout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from labrl.errors import PlacementError

_EPS = 1e-9


@dataclass(frozen=True)
class Demand:
    """``count`` actors named ``role``, each needing ``resources`` (``{"CPU": 1, "GPU": 1, "lab": 1}``)."""

    role: str
    count: int
    resources: Mapping[str, float] = field(default_factory=dict)


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def check_placement(demands: Sequence[Demand], nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise ``PlacementError`` when ``demands`` cannot be placed on ``nodes`` (each a resource total)."""
    known = {name for node in nodes for name in node}
    for d in demands:
        unknown = sorted(name for name, v in d.resources.items() if v > 0 and name not in known)
        if unknown:
            raise PlacementError(
                f"{d.role}: resource {', '.join(unknown)} is on no node of the cluster "
                f"(nodes offer {sorted(known)}); start a node with it (ray start --resources=...) "
                f"or change the ray.* setting"
            )
        if not any(all(node.get(k, 0.0) + _EPS >= v for k, v in d.resources.items()) for node in nodes):
            largest = max(nodes, key=lambda n: sum(n.get(k, 0.0) for k in d.resources), default={})
            raise PlacementError(
                f"{d.role}: one actor needs {_fmt(d.resources)} but no node has that much "
                f"(largest: {_fmt({k: largest.get(k, 0.0) for k in d.resources})})"
            )
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            totals[k] = totals.get(k, 0.0) + v
    for name in sorted({k for d in demands for k in d.resources}):
        need = sum(d.count * d.resources.get(name, 0.0) for d in demands)
        if need > totals.get(name, 0.0) + _EPS:
            parts = ", ".join(
                f"{d.role} {d.count} x {d.resources[name]:g}" for d in demands if d.resources.get(name)
            )
            raise PlacementError(
                f"the run needs {need:g} {name} ({parts}) but the cluster has {totals.get(name, 0.0):g}"
            )


def cluster_nodes() -> list[dict[str, float]]:
    """Resource totals of the alive nodes of the connected Ray cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def wait_placed(refs: Sequence[object], timeout_s: float, what: str) -> list[object]:
    """``ray.get(refs)`` within ``timeout_s``; a ``PlacementError`` naming ``what`` when it times out."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(list(refs), timeout=timeout_s)
    except GetTimeoutError:
        raise PlacementError(
            f"{what} not up within ray.placement_timeout_s={timeout_s:g} s: the cluster has the resources "
            f"in total but Ray could not place it (busy or fragmented nodes); see `ray status`"
        ) from None
