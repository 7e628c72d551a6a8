"""`RayVirtualCluster`: the Ray resources a worker group runs on, as one placement group.

CPU machines (`cluster.gpus_per_node == 0`) get `workers_per_node` bundles of
`cpus_per_worker` CPUs per node; GPU machines get one bundle per GPU (each with
`cpus_per_worker` CPUs too). The same code joins an existing Ray cluster (`cluster.address`
or `RAY_ADDRESS`) or starts a local one. A request the cluster cannot hold (its resources, or
more nodes than it has) fails at setup within `cluster.placement_timeout_s` (at once on a Ray
node this process started, which never grows), naming what was asked and what Ray offers.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from posttrain.checkpoint import stop_at_once_on_sigterm
from posttrain.config import InputError
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
    stop_at_once_on_sigterm()


def local_ray_node_lost() -> bool:
    """Whether the Ray node this process started (`init_ray` without an address) has lost its
    raylet: it crashed, or a signal reached every process of the job (a scheduler that signals
    all of a job's processes, or a driver run without the `posttrain` command's supervisor,
    `runtime.supervise_in_own_session`, whose process group the node shares). Actor and
    placement group teardown through a dead raylet waits for answers that never come, so it
    stops waiting once this is True (the raylet may take seconds to exit; the waits have
    timeouts until then).
    Reads Ray's node handle (`ray._private.worker._global_node`, not public API): False when it
    is absent (a joined cluster) or unreadable."""
    return any(info.process.poll() is not None for info in _local_raylets())


def _local_raylets() -> list:
    """The raylet processes of the Ray node this process started (none when it joined a cluster)."""
    try:
        node = ray._private.worker._global_node
        return list(node.all_processes.get("raylet", [])) if node is not None else []
    except Exception:  # noqa: BLE001 - a private handle: never let it break a shutdown
        return []


class PlacementError(InputError, RuntimeError):
    """Ray cannot place the workers a config asks for; the message names the keys and what Ray offers."""


class RayVirtualCluster:
    """A placement group of one bundle per worker; `world_size` bundles in rank order."""

    def __init__(self, cfg: ClusterConfig, name: str = "posttrain", asked: str | None = None):
        """`asked`: the config keys and values `cfg` was made of, for the error when Ray cannot place
        the workers (default: the `cluster` section's), e.g. separate generation workers' own keys:
        their `cfg` is derived, and its values under the `cluster.*` names would not be the user's."""
        init_ray(cfg)
        self.cfg = cfg
        self.use_gpus = cfg.gpus_per_node > 0
        per_node = cfg.gpus_per_node if self.use_gpus else cfg.workers_per_node
        self.workers_per_node = per_node
        self.world_size = cfg.num_workers
        bundle: dict[str, float] = {"CPU": cfg.cpus_per_worker}
        if self.use_gpus:
            bundle["GPU"] = 1
        self.bundles = [dict(bundle) for _ in range(self.world_size)]
        # One node per `per_node` bundles when several nodes are asked for; PACK otherwise
        # keeps a single-node job on one node (cheaper collectives).
        strategy = "PACK" if cfg.num_nodes == 1 else "SPREAD"
        total = ray.cluster_resources()
        # A Ray node this process started has no autoscaler: what exceeds its total never fits,
        # so that fails at once instead of after the placement timeout.
        started_here = bool(_local_raylets())
        never = started_here and any(n * self.world_size > total.get(k, 0) for k, n in bundle.items())
        asked = asked or (f"cluster.num_nodes={cfg.num_nodes}, gpus_per_node={cfg.gpus_per_node}, "
                          f"workers_per_node={cfg.workers_per_node}, cpus_per_worker={cfg.cpus_per_worker:g}")
        _wait_for_nodes(cfg.num_nodes, 0.0 if started_here else cfg.placement_timeout_s, asked)
        self.placement_group = placement_group(self.bundles, strategy=strategy, name=f"{name}-pg")
        ready = not never and self.placement_group.wait(timeout_seconds=cfg.placement_timeout_s)
        if not ready:
            offered, total = ray.available_resources(), ray.cluster_resources()
            remove_placement_group(self.placement_group)
            self.placement_group = None
            raise PlacementError(
                f"the Ray cluster cannot hold the requested workers: asked for {self.world_size} bundles "
                f"of {bundle} ({asked}); Ray offers {_fmt(offered)} available of {_fmt(total)} total "
                + ("(the Ray node this run started: its resources are fixed)" if never else
                   f"(waited {cfg.placement_timeout_s:g} s = cluster.placement_timeout_s)")
                # A GPU exemplar (grpo_math_1B.yaml) run as it is on a laptop: say the way out.
                + ("; Ray sees no GPU: to run on CPUs set the gpus_per_node named above to 0"
                   if self.use_gpus and not total.get("GPU") else "")
            )
        log.info("placement group ready: %d bundles of %s", self.world_size, bundle)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Remove the placement group (the worker groups on it must be shut down first).

        Skipped when the local Ray node is gone (`local_ray_node_lost`); otherwise given
        `timeout_s` (Ray's call has none) and then left to Ray's own shutdown at exit, so a
        node going down never hangs a run whose checkpoint is already saved."""
        if self.placement_group is None:
            return
        pg, self.placement_group = self.placement_group, None
        remover = threading.Thread(target=remove_placement_group, args=(pg,), daemon=True)
        remover.start()
        deadline = time.monotonic() + timeout_s
        while remover.is_alive() and time.monotonic() < deadline and not local_ray_node_lost():
            remover.join(0.05)
        if remover.is_alive():
            log.warning("the Ray placement group was not removed within %.0f s (is the Ray node "
                        "shutting down?); leaving it to Ray's shutdown", timeout_s)


def _wait_for_nodes(num_nodes: int, timeout_s: float, asked: str) -> None:
    """Wait up to `timeout_s` for the Ray cluster to have `num_nodes` alive nodes. SPREAD placement
    is best effort: without this, workers asked on several nodes all landed on one node's spare
    CPUs, and the job ran with a layout that was not the config's."""
    deadline = time.monotonic() + timeout_s
    while (alive := sum(bool(n.get("Alive")) for n in ray.nodes())) < num_nodes:
        if time.monotonic() >= deadline:
            raise PlacementError(
                f"the Ray cluster has {alive} node(s), fewer than the {num_nodes} asked for ({asked}); "
                + ("start the job on a Ray cluster of that many nodes (cluster.address or RAY_ADDRESS), or set "
                   "the number of nodes to the cluster's" if timeout_s == 0 else
                   f"waited {timeout_s:g} s = cluster.placement_timeout_s for nodes to join"))
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _fmt(resources: dict[str, float]) -> str:
    parts = [f"{k}: {resources[k]:g}" for k in ("CPU", "GPU") if k in resources]
    if "memory" in resources:
        parts.append(f"memory: {resources['memory'] / 2**30:.1f} GiB")
    return "{" + ", ".join(parts) + "}"
