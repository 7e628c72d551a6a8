"""`RayVirtualCluster`: the Ray resources a worker group runs on, as one placement group.

CPU machines (`cluster.gpus_per_node == 0`) get `workers_per_node` bundles of
`cpus_per_worker` CPUs per node; GPU machines get one bundle per GPU (each with
`cpus_per_worker` CPUs too). The same code joins an existing Ray cluster (`cluster.address`
or `RAY_ADDRESS`) or starts a local one. A request the cluster cannot hold (its resources, or
more nodes than it has) fails at setup within `cluster.placement_timeout_s` (at once on a Ray
node this process started, which never grows), naming what was asked and what Ray offers.
`Bundles` says what one worker group asks; `reserve` checks all of a run's groups together and
places them before any worker starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from posttrain.checkpoint import StopAtOnce, stop_at_once_on_sigterm
from posttrain.config import InputError
from posttrain.schemas import ClusterConfig

log = logging.getLogger(__name__)


# Ray settings posttrain runs with unless the environment sets them (Ray reads `RAY_<setting>`
# in every process it starts, so a local node's workers inherit them from the driver; a joined
# cluster's workers keep what its `ray start` had).
RAY_ENV_DEFAULTS = {
    "RAY_AUTH_MODE": "disabled",
    # Ray starts workers at nice 15; ours are the job itself, not background helpers, and at that
    # priority any other load on the machine starves them (measured: minutes per step).
    "RAY_worker_niceness": "0",
    # Arguments and results up to this size travel inside the call instead of through the shared
    # object store (Ray's default: 100 KiB). A GRPO step's training batch and generation output
    # are 100-500 KB for small models: a round trip with 190 KB took 2.2 ms through the store and
    # 1.1 ms inline, 400 KB 2.4 against 1.35 ms; at 1 MB the two ways cost the same and above it
    # the store is faster (4 MB: 4.1 against 10.5 ms).
    "RAY_max_direct_call_object_size": str(512 * 1024),
}


def apply_ray_env_defaults() -> None:
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


# Seconds a cluster address's port may take to accept a connection.
_CONNECT_TIMEOUT_S = 5.0


def _check_reachable(address: str, where: str) -> None:
    """A '<host>:<port>' or 'ray://<host>:<port>' address must accept a TCP connection: Ray retried
    an unreachable one for minutes ("Failed to get cluster ID from GCS server") before failing."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or "://" in host:
        return  # "auto", or a form Ray parses (and refuses) itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise InputError(f"{where}={address!r}: nothing answers there ({e.strerror or type(e).__name__}, within "
                         f"{_CONNECT_TIMEOUT_S:g} s); give the head node's address (`ray status` there shows "
                         "it), or unset it to run on a local Ray of this job's own") from None


def init_ray(cfg: ClusterConfig) -> None:
    """Join the configured Ray cluster, or start a local one; an already-initialized Ray is kept."""
    if ray.is_initialized():
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    apply_ray_env_defaults()
    where = "cluster.address" if cfg.address else "the RAY_ADDRESS environment variable"
    if address:
        _check_reachable(address, where)
    with _stop_signals_held() as held:
        try:
            # No address: a Ray of this job's own ("local"); ray.init() without one joined the latest
            # cluster `ray start` had left on this machine, someone else's, whose placement waits then
            # waited out placement_timeout_s instead of failing at once.
            ray.init(address=address or "local", include_dashboard=False)
        except ValueError as e:  # an address Ray cannot parse ("Invalid address format"): RAY_ADDRESS's
            raise InputError(f"{where}={address!r}: Ray refuses it ({e}); give 'auto', '<host>:<port>' or "
                             "'ray://<host>:<port>'") from None
        except ConnectionError as e:  # "auto" with no cluster running here (a traceback of Ray's)
            raise InputError(f"{where}={address!r}: no Ray cluster to join ({str(e).splitlines()[0]}); start one "
                             "(`ray start --head`) or unset it to run on a local Ray of this job's own") from None
        except (SystemExit, KeyboardInterrupt) as e:
            # A second stop signal while Ray starts (or the first, where it could not be held): stop
            # the node's processes started so far, and stop as a SIGTERM anywhere else in the setup does.
            try:
                ray.shutdown()
            finally:
                if isinstance(e, SystemExit) and e.code == signal.SIGTERM:
                    raise StopAtOnce("SIGTERM") from None
            raise
    if held:
        ray.shutdown()
        raise StopAtOnce(held[0])
    stop_at_once_on_sigterm()


@contextlib.contextmanager
def _stop_signals_held():
    """Within this block (`ray.init`), a first SIGTERM or SIGINT is held: its name is appended to
    the list yielded, to be acted on once Ray has started; a second one raises `StopAtOnce`.
    Why: acting on it inside `ray.init` (Ray sets a SIGTERM handler there that raises SystemExit)
    tore down a half-built core worker. The driver then aborted with "terminate called without
    an active exception" (exit 134, no message; 1 run in 4 with the signal ~0.35 s after the
    raylet started) or hung forever: the failure signal handler of Ray's C++ core, which had
    chained that SIGTERM to Python's from another thread, then parks every later thread that
    meets a failure signal, here the abort. Ray's handlers come through
    `ray._private.utils.set_sigterm_handler` (not public API), which is idle within the block;
    where it is missing, the first signal stops Ray's start as before."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    held: list[str] = []

    def hold(signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if held:
            raise StopAtOnce(name)
        held.append(name)
        log.warning("%s received while Ray starts: stopping once it has started (another stops at once)", name)

    wanted = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in wanted}
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    ray_sets = getattr(utils, "set_sigterm_handler", None)
    for s in wanted:
        signal.signal(s, hold)
    if ray_sets is not None:
        utils.set_sigterm_handler = lambda _handler: None
    try:
        yield held
    finally:
        if ray_sets is not None:
            utils.set_sigterm_handler = ray_sets
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)  # None: a handler not set from Python


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


@dataclass(frozen=True)
class Bundles:
    """What one worker group asks of Ray: `world_size` bundles of `bundle`, one per worker, and
    `asked`, the config keys and values they came from, for the errors (default: the `cluster`
    section's; separate generation workers name their own keys: their `cfg` is derived, and its
    values under the `cluster.*` names would not be the user's)."""

    cfg: ClusterConfig
    name: str = "posttrain"
    asked: str = ""

    def __post_init__(self) -> None:
        if not self.asked:
            c = self.cfg
            object.__setattr__(self, "asked", f"cluster.num_nodes={c.num_nodes}, gpus_per_node={c.gpus_per_node}, "
                                              f"workers_per_node={c.workers_per_node}, "
                                              f"cpus_per_worker={c.cpus_per_worker:g}")

    @property
    def use_gpus(self) -> bool:
        return self.cfg.gpus_per_node > 0

    @property
    def world_size(self) -> int:
        return self.cfg.num_workers

    @property
    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cfg.cpus_per_worker} | ({"GPU": 1} if self.use_gpus else {})

    def described(self) -> str:
        return f"{self.world_size} bundles of {self.bundle} ({self.asked})"


def check_fits(groups: Sequence[Bundles]) -> None:
    """Start or join Ray and fail, naming every group's keys and numbers, when `groups` cannot all
    be placed, before any of them is: a Ray node this process started (it never grows) fails at
    once when their sum exceeds its resources; a joined cluster may still be growing, so only its
    nodes are awaited here (`_wait_for_nodes`), and each placement group then waits up to
    `cluster.placement_timeout_s` for the rest."""
    init_ray(groups[0].cfg)
    started_here = bool(_local_raylets())
    widest = max(groups, key=lambda g: g.cfg.num_nodes)
    _wait_for_nodes(widest.cfg.num_nodes, 0.0 if started_here else widest.cfg.placement_timeout_s, widest.asked)
    if not started_here:
        return
    total = ray.cluster_resources()
    need = _summed(groups)
    if any(n > total.get(key, 0) for key, n in need.items()):
        raise _shortfall(groups, "(the Ray node this run started: its resources are fixed)",
                         together=need if len(groups) > 1 else None)


def reserve(groups: Sequence[Bundles]) -> list["RayVirtualCluster"]:
    """One placement group per group, in order, all placed before any worker starts: a run's
    groups are checked together (`check_fits`), so the last one's shortfall is not found only
    after the first one's workers have loaded the model."""
    check_fits(groups)
    clusters: list[RayVirtualCluster] = []
    try:
        for g in groups:  # each checked again alone: instant once they fit together
            clusters.append(RayVirtualCluster(g.cfg, g.name, g.asked))
    except BaseException as e:
        for cluster in reversed(clusters):
            cluster.shutdown()
        if isinstance(e, PlacementError) and clusters:
            # A joined cluster (check_fits cannot sum a cluster that may grow): the groups placed
            # first held part of what Ray no longer offered while this one waited; name them, or the
            # numbers in the message do not add up to the run's request.
            placed = groups[: len(clusters)]
            raise PlacementError(
                f"{e}; this run's {' and '.join(g.described() for g in placed)} had been placed first and "
                f"held their share of that, {_fmt(_summed(groups))} for the whole run") from None
        raise
    return clusters


class RayVirtualCluster:
    """A placement group of one bundle per worker; `world_size` bundles in rank order."""

    def __init__(self, cfg: ClusterConfig, name: str = "posttrain", asked: str = ""):
        """`asked`: as `Bundles.asked`. Several groups of one run: `reserve`."""
        request = Bundles(cfg, name, asked)
        check_fits([request])
        self.cfg = cfg
        self.use_gpus = request.use_gpus
        self.workers_per_node = cfg.gpus_per_node if self.use_gpus else cfg.workers_per_node
        self.world_size = request.world_size
        self.bundles = [request.bundle for _ in range(self.world_size)]
        # One node per `workers_per_node` bundles when several nodes are asked for; PACK otherwise
        # keeps a single-node job on one node (cheaper collectives).
        strategy = "PACK" if cfg.num_nodes == 1 else "SPREAD"
        self.placement_group = placement_group(self.bundles, strategy=strategy, name=f"{name}-pg")
        if not self.placement_group.wait(timeout_seconds=cfg.placement_timeout_s):
            remove_placement_group(self.placement_group)
            self.placement_group = None
            raise _shortfall([request], f"(waited {cfg.placement_timeout_s:g} s = cluster.placement_timeout_s)")
        log.info("placement group ready: %d bundles of %s", self.world_size, request.bundle)

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


def _summed(groups: Sequence[Bundles]) -> dict[str, float]:
    """The resources `groups` ask for together."""
    need: dict[str, float] = {}
    for g in groups:
        for key, n in g.bundle.items():
            need[key] = need.get(key, 0) + n * g.world_size
    return need


def _shortfall(groups: Sequence[Bundles], why: str, together: dict[str, float] | None = None) -> PlacementError:
    """The error for `groups` that Ray cannot hold: what each asked, and what Ray offers."""
    offered, total = ray.available_resources(), ray.cluster_resources()
    return PlacementError(
        "the Ray cluster cannot hold the requested workers: asked for "
        + " and ".join(g.described() for g in groups)
        + (f", {_fmt(together)} together" if together else "")
        + f"; Ray offers {_fmt(offered)} available of {_fmt(total)} total {why}"
        # A GPU exemplar (grpo_math_1B.yaml) run as it is on a laptop: say the way out.
        + ("; Ray sees no GPU: to run on CPUs set the gpus_per_node named above to 0"
           if any(g.use_gpus for g in groups) and not total.get("GPU") else "")
    )


def _fmt(resources: dict[str, float]) -> str:
    parts = [f"{k}: {resources[k]:g}" for k in ("CPU", "GPU") if k in resources]
    if "memory" in resources:
        parts.append(f"memory: {resources['memory'] / 2**30:.1f} GiB")
    return "{" + ", ".join(parts) + "}"
