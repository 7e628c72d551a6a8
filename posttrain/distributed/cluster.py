"""`RayVirtualCluster`: the Ray resources a worker group runs on, as one placement group.

CPU machines (`cluster.gpus_per_node == 0`) get `workers_per_node` bundles of
`cpus_per_worker` CPUs per node; GPU machines get one bundle per GPU (each with
`cpus_per_worker` CPUs too). The same code joins an existing Ray cluster (`cluster.address`
or `RAY_ADDRESS`) or starts a local one. A request the cluster cannot hold fails at setup
within `cluster.placement_timeout_s`, naming what was asked and what Ray offers.
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from posttrain.schemas import ClusterConfig

log = logging.getLogger(__name__)


def init_ray(cfg: ClusterConfig) -> None:
    """Join the configured Ray cluster, or start a local one; an already-initialized Ray is kept."""
    if ray.is_initialized():
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts workers at nice 15; ours are the job itself, not background helpers, and at that
    # priority any other load on the machine starves them (measured: minutes per step).
    os.environ.setdefault("RAY_worker_niceness", "0")
    if address:
        ray.init(address=address, include_dashboard=False)
    else:
        ray.init(include_dashboard=False)


class RayVirtualCluster:
    """A placement group of one bundle per worker; `world_size` bundles in rank order."""

    def __init__(self, cfg: ClusterConfig, name: str = "posttrain"):
        init_ray(cfg)
        self.cfg = cfg
        self.use_gpus = cfg.gpus_per_node > 0
        per_node = cfg.gpus_per_node if self.use_gpus else cfg.workers_per_node
        self.workers_per_node = per_node
        self.world_size = cfg.num_nodes * per_node
        bundle: dict[str, float] = {"CPU": cfg.cpus_per_worker}
        if self.use_gpus:
            bundle["GPU"] = 1
        self.bundles = [dict(bundle) for _ in range(self.world_size)]
        # One node per `per_node` bundles when several nodes are asked for; PACK otherwise
        # keeps a single-node job on one node (cheaper collectives).
        strategy = "PACK" if cfg.num_nodes == 1 else "SPREAD"
        self.placement_group = placement_group(self.bundles, strategy=strategy, name=f"{name}-pg")
        ready = self.placement_group.wait(timeout_seconds=cfg.placement_timeout_s)
        if not ready:
            offered = ray.available_resources()
            total = ray.cluster_resources()
            remove_placement_group(self.placement_group)
            self.placement_group = None
            raise RuntimeError(
                f"the Ray cluster cannot hold the requested workers: asked for {self.world_size} bundles "
                f"of {bundle} (cluster.num_nodes={cfg.num_nodes}, gpus_per_node={cfg.gpus_per_node}, "
                f"workers_per_node={cfg.workers_per_node}, cpus_per_worker={cfg.cpus_per_worker}); "
                f"Ray offers {_fmt(offered)} available of {_fmt(total)} total "
                f"(waited {cfg.placement_timeout_s:g} s = cluster.placement_timeout_s)"
            )
        log.info("placement group ready: %d bundles of %s", self.world_size, bundle)

    def shutdown(self) -> None:
        """Remove the placement group (the worker groups on it must be shut down first)."""
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


def _fmt(resources: dict[str, float]) -> str:
    parts = [f"{k}: {resources[k]:g}" for k in ("CPU", "GPU") if k in resources]
    if "memory" in resources:
        parts.append(f"memory: {resources['memory'] / 2**30:.1f} GiB")
    return "{" + ", ".join(parts) + "}"
