"""`RayWorkerGroup`: N Ray actors (one per placement-group bundle) forming a torch.distributed group.

Each actor is its own process hosting one instance of a plain Python `worker_cls` (the
worker class needs no Ray knowledge). Before the worker is built the host sets RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free port found
on the rank-0 node), torch's thread count from `cluster.cpus_per_worker`, and tees its
stdout/stderr to a log file so that the driver can show the last lines of a worker that died.

`runtime_env` (Ray's, applied to every actor of the group) lets a group run apart from the
driver's environment, e.g. `{"py_executable": "/work/vllm-venv/bin/python"}` for workers
under another venv's interpreter; `check_python_executable` first checks that Ray can start
a worker there (same Python and ray versions as the driver).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.config import RunStopped
from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.cluster import RayVirtualCluster, local_ray_node_lost
from posttrain.distributed.ports import node_ip_and_free_port
from posttrain.distributed.serialization import use_numpy_tensor_transport
from posttrain.runtime import keep_freed_memory


def _tee_output(log_path: str):
    """Send fd 1 and 2 through a pipe to both the original stdout and `log_path`; returns the log file."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    logfile = open(log_path, "ab", buffering=0)
    original = os.dup(1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)

    def pump() -> None:
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                return
            os.write(original, chunk)
            logfile.write(chunk)

    threading.Thread(target=pump, daemon=True, name="log-tee").start()
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    return logfile


_PROBE = """
import importlib.metadata as m, importlib.util, json, sys
try:
    ray = m.version("ray")
except m.PackageNotFoundError:
    ray = None
missing = [name for name in sys.argv[1:] if importlib.util.find_spec(name) is None]
print(json.dumps({"python": "%d.%d" % sys.version_info[:2], "ray": ray, "missing": missing}))
"""


class _ProbeFailed(Exception):
    """The probe's interpreter exited with an error (the message: the end of its stderr)."""


@functools.lru_cache(maxsize=None)
def _probe(python: str, needs: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    """What `_PROBE` finds in `python`, run once per process for each (python, needs): GRPO's setup
    checks its generation workers' interpreter before Ray starts, and the workers again when they
    start (a failure is not cached: it raises)."""
    proc = subprocess.run([python, "-c", _PROBE, *needs], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise _ProbeFailed(proc.stderr.strip()[-500:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_python_executable(python: str, what: str = "py_executable", timeout_s: float = 60.0,
                            needs: tuple[str, ...] = (), hint: str = "") -> None:
    """Raise ValueError naming `what` unless `python` runs, has this driver's Python (major.minor)
    and ray versions (Ray cannot start a worker elsewhere, and its actor would wait forever) and
    can import the modules `needs` (else they failed in the first actor, after the policy had
    loaded; `hint` says where to get them)."""
    try:
        found = _probe(python, tuple(needs), timeout_s)
    except _ProbeFailed as e:
        raise ValueError(f"{what}={python!r} does not run: {e}") from None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        raise ValueError(f"{what}={python!r} does not run ({type(e).__name__}: {e})") from None
    want = {"python": "%d.%d" % sys.version_info[:2], "ray": ray.__version__}
    wrong = [f"{k} {found[k] or '(not installed)'}, the driver has {want[k]}" for k in want if found[k] != want[k]]
    if wrong:
        raise ValueError(
            f"{what}={python!r} cannot host Ray workers of this driver: {'; '.join(wrong)} "
            f"(install ray=={ray.__version__} there, under the driver's Python version)"
        )
    if found["missing"]:
        raise ValueError(f"{what}={python!r} cannot import {', '.join(found['missing'])}{hint}")


class _WorkerHost:
    """The Ray actor: sets up the process, then builds and serves one `worker_cls` instance."""

    def __init__(self, env: dict[str, str], log_path: str, threads: int, worker_cls, args, kwargs):
        self._log = _tee_output(log_path)
        os.environ.update(env)
        if not ray.get_gpu_ids():
            keep_freed_memory()  # a CPU worker: every step reuses the memory of the steps before
        import torch

        torch.set_num_threads(threads)
        use_numpy_tensor_transport()  # the results this worker sends
        self.worker = worker_cls(*args, **kwargs)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "python": sys.executable}

    def call(self, method: str, *args, **kwargs):
        # One line per call in the log file only (not the console), so the tail of a dead
        # worker's log says what it was doing.
        self._log.write(f"{time.strftime('%H:%M:%S')} rank {os.environ['RANK']}: {method}\n".encode())
        return getattr(self.worker, method)(*args, **kwargs)


def ranks_by_node(node_of: dict[int, Any], world_size: int) -> list[int]:
    """The placement group bundle of each rank: a node's bundles take consecutive ranks, the
    nodes in the order of their first bundle (bundle 0, where the rendezvous listens, is rank 0).
    SPREAD placement alternates nodes between bundles, and rank r on bundle r put the two ranks of
    a tensor-parallel group (consecutive ranks) on two nodes, its every collective across them."""
    first = {}
    for b in range(world_size):
        first.setdefault(node_of[b], b)
    return sorted(range(world_size), key=lambda b: (first[node_of[b]], b))


class WorkerError(RunStopped):
    """A worker process died; the message names it and shows its last log lines. `group`: the
    name of its worker group (RayWorkerGroup.name)."""

    after = "The checkpoints saved before stay: the same command resumes from the latest."

    def __init__(self, message: str, group: str | None = None):
        super().__init__(message)
        self.group = group


class WorkerGroupBroken(RunStopped):
    """A call failed on some ranks while others still ran it, blocked in a collective that the
    failed ranks will never join: the group can run no other call."""

    after = WorkerError.after


class RayWorkerGroup:
    """One actor per bundle of `cluster`, ranks in bundle order."""

    # Seconds a failed call waits for its other ranks, to tell a dead peer (named) from ranks
    # blocked in a collective (the group breaks: WorkerGroupBroken).
    failure_grace_s = 10.0

    def __init__(self, cluster: RayVirtualCluster, worker_cls: type, *args, name_prefix: str = "worker",
                 log_dir: str | None = None, env_vars: dict[str, str] | None = None,
                 runtime_env: dict[str, Any] | None = None, **kwargs):
        use_numpy_tensor_transport()  # the batches the driver sends
        self.cluster = cluster
        self.name = name_prefix
        self.world_size = cluster.world_size
        self.log_dir = log_dir or os.path.join(
            os.environ.get("RAY_TMPDIR", tempfile.gettempdir()), "posttrain-workers",
            f"{name_prefix}-{uuid.uuid4().hex[:8]}",
        )
        # A temp folder of ours goes at shutdown, unless a worker died: its error names its log.
        self._remove_logs_at_shutdown = log_dir is None
        pg = cluster.placement_group
        # Port probe on the rank-0 bundle's node: that is where the rendezvous store listens.
        addr, port = ray.get(
            ray.remote(num_cpus=0)(node_ip_and_free_port)
            .options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
            .remote()
        )
        threads = max(1, int(cluster.cfg.cpus_per_worker))
        host_cls = ray.remote(_WorkerHost)
        self.log_paths = [os.path.join(self.log_dir, f"rank{r}.log") for r in range(self.world_size)]
        # Ranks and local ranks from where Ray actually put each bundle (SPREAD gives no fixed order).
        node_of = placement_group_table(pg)["bundles_to_node_id"]
        bundle_of = ranks_by_node(node_of, self.world_size)
        self.actors = []
        for rank, bundle in enumerate(bundle_of):
            same_node = [r for r, b in enumerate(bundle_of) if node_of[b] == node_of[bundle]]
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(same_node.index(rank)),
                "LOCAL_WORLD_SIZE": str(len(same_node)),
                "MASTER_ADDR": addr,
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(threads),
                **(env_vars or {}),
            }
            actor = host_cls.options(
                num_cpus=cluster.cfg.cpus_per_worker,
                num_gpus=1 if cluster.use_gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
                name=f"{name_prefix}-{uuid.uuid4().hex[:6]}-rank{rank}",
                runtime_env=runtime_env,
            ).remote(env, self.log_paths[rank], threads, worker_cls, args, kwargs)
            self.actors.append(actor)
        self._ref_rank: dict[bytes, int] = {}
        self._broken: str | None = None  # why the group can run no more calls (WorkerGroupBroken)
        self.worker_info: list[dict[str, Any]] = [{"pid": None, "node": None, "python": None}] * self.world_size
        try:
            self.worker_info = self.get([a.info.remote() for a in self.actors])
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ dispatch

    def run_all(self, method: str, *args, **kwargs) -> list[ray.ObjectRef]:
        """`worker.method(*args, **kwargs)` on every worker; futures in rank order."""
        self._check_usable(method)
        return [self._track(r, a.call.remote(method, *args, **kwargs)) for r, a in enumerate(self.actors)]

    def _check_usable(self, method: str) -> None:
        if self._broken is not None:
            raise WorkerGroupBroken(f"cannot run {method}: {self._broken}")

    def run_sharded(self, method: str, batch: BatchedDataDict, *args, batch_size: int | None = None,
                    replicas: int = 1, **kwargs) -> list[ray.ObjectRef]:
        """Shard `batch` over the workers (`shard_by_batch_size(world_size / replicas, batch_size)`);
        worker i gets shard i // replicas as its first argument (`replicas` consecutive ranks, a
        tensor-parallel group, compute on the same rows). Futures in rank order."""
        self._check_usable(method)
        shards = batch.shard_by_batch_size(self.world_size // replicas, batch_size=batch_size)
        return [self._track(r, a.call.remote(method, shards[r // replicas], *args, **kwargs))
                for r, a in enumerate(self.actors)]

    def _track(self, rank: int, ref: ray.ObjectRef) -> ray.ObjectRef:
        self._ref_rank[ref.binary()] = rank
        return ref

    def get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Results of `refs` in order. Waits on all at once, so one dead worker fails the call at
        once (its peers may be blocked in a collective waiting for it) with a `WorkerError`
        naming the worker and its last log lines; an exception raised inside a worker is
        re-raised as its own type."""
        pending = list(refs)
        values: dict[ray.ObjectRef, Any] = {}  # each result fetched and deserialized once
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                values[ready[0]] = ray.get(ready[0])
            except RayActorError as e:
                rank = self._ref_rank.get(ready[0].binary(), refs.index(ready[0]))
                self._forget(refs)
                raise self._dead_worker_error(rank, e) from None
            except RayTaskError as e:
                # A peer's death often surfaces first as a collective error on a live rank
                # ("connection reset"): name the dead worker if there is one.
                dead, stuck = self._first_dead(refs, pending)
                rank = self._ref_rank.get(ready[0].binary(), refs.index(ready[0]))
                self._forget(refs)
                if dead is not None:
                    raise dead from None
                if stuck:
                    # They wait in a collective for the failed rank: a next call's collectives would
                    # pair with theirs, or hang. Later calls fail at once instead.
                    cause = str(e.cause).splitlines()[0] if e.cause is not None else type(e).__name__
                    self._broken = (f"rank {rank} failed ({type(e.cause).__name__}: {cause}) while rank(s) {stuck} "
                                    "still ran the same call, blocked in a collective it will not join; start "
                                    "the workers anew (a run resumes from its last checkpoint)")
                raise e.as_instanceof_cause() from None
        self._forget(refs)
        return [values[r] for r in refs]

    def _first_dead(self, refs: list[ray.ObjectRef],
                    pending: list[ray.ObjectRef]) -> tuple[WorkerError | None, list[int]]:
        """The error of a worker among `pending` that died within `failure_grace_s`, if any, and the
        ranks of those still running after it."""
        ready, running = (ray.wait(pending, num_returns=len(pending), timeout=self.failure_grace_s) if pending
                          else ([], []))
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                return self._dead_worker_error(self._ref_rank.get(ref.binary(), refs.index(ref)), e), []
            except RayTaskError:
                continue
        return None, sorted(self._ref_rank.get(r.binary(), refs.index(r)) for r in running)

    def _forget(self, refs: list[ray.ObjectRef]) -> None:
        for r in refs:
            self._ref_rank.pop(r.binary(), None)

    def _dead_worker_error(self, rank: int, err: Exception) -> WorkerError:
        info = self.worker_info[rank]
        # A failed constructor carries its traceback in the message; a killed process one line.
        reason = "\n".join(str(err).splitlines()[-15:]) or type(err).__name__
        self._remove_logs_at_shutdown = False
        return WorkerError(
            f"{self.name} worker rank {rank} (pid {info['pid']}, node {info['node']}) died: {reason}\n"
            f"last lines of its log {self.log_paths[rank]}:\n{self.tail_log(rank)}", group=self.name,
        )

    def tail_log(self, rank: int, lines: int = 20) -> str:
        try:
            with open(self.log_paths[rank], errors="replace") as f:
                return "".join(deque(f, maxlen=lines)) or "(empty)"
        except OSError as e:
            return f"(log unavailable: {e})"

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Kill the actors and wait until their processes are gone."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        # Only processes on this node can be checked from here; Ray reaps the others.
        here = ray.util.get_node_ip_address()
        _wait_pids_gone([i["pid"] for i in self.worker_info if i["pid"] and i["node"] == here])
        self.actors = []
        if self._remove_logs_at_shutdown:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _wait_pids_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    """Wait until `pids` have exited; not when the local Ray node is gone (the kills cannot be
    delivered then, and the workers exit on their own once they notice)."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline and not local_ray_node_lost():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
