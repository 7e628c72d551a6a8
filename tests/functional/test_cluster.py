"""RayVirtualCluster and RayWorkerGroup with real processes."""

import os
import sys
import time

import pytest
import torch

from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.cluster import RAY_ENV_DEFAULTS, PlacementError, RayVirtualCluster, apply_ray_env_defaults
from posttrain.distributed.worker_group import RayWorkerGroup, WorkerError, WorkerGroupBroken
from posttrain.schemas import ClusterConfig


class EchoWorker:
    """Joins the torch.distributed group from the env the worker group sets."""

    def __init__(self, tag: str):
        import torch.distributed as dist

        self.tag = tag
        dist.init_process_group("gloo")
        print(f"{tag} ready on rank {os.environ['RANK']}", flush=True)

    def env(self):
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        return ({k: os.environ[k] for k in keys} | {"threads": torch.get_num_threads()}
                | {k: os.environ.get(k) for k in RAY_ENV_DEFAULTS})

    def all_reduce(self, x: float) -> float:
        t = torch.tensor([x])
        torch.distributed.all_reduce(t)
        return t.item()

    def rows(self, batch: BatchedDataDict, scale: int) -> list[int]:
        return [int(v) * scale for v in batch["x"]]

    def fail(self):
        raise ValueError(f"bad value on {self.tag}")

    def fail_on_rank0_then_reduce(self):
        if os.environ["RANK"] == "0":
            raise ValueError("rank 0 fails")
        return self.all_reduce(1.0)  # waits for rank 0, which never joins

    def minor_faults_of_steps(self) -> int:
        """Page faults of 10 steps that each allocate, write and free 4 x 40 MiB, after 3 warm-up steps."""
        import resource

        def step():
            live = [torch.empty(10 << 20).fill_(1.0) for _ in range(4)]  # noqa: F841 (alive together)

        for _ in range(3):
            step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            step()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.fixture(scope="module")
def group(ray_session):
    # Test-module classes are not importable in the worker processes: ship them by value.
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, cpus_per_worker=1), name="cluster-test")
    g = RayWorkerGroup(cluster, EchoWorker, "echo", name_prefix="echo")
    yield g
    g.shutdown()
    cluster.shutdown()


def test_ranks_env_and_collective(group):
    envs = group.get(group.run_all("env"))
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"] and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["threads"] == 1
    assert group.get(group.run_all("all_reduce", 1.5)) == [3.0, 3.0]
    assert len({i["pid"] for i in group.worker_info} | {os.getpid()}) == 3  # own processes
    # The workers run with the Ray settings the driver's process had (RAY_ENV_DEFAULTS unless set).
    assert all(e[k] == os.environ[k] for e in envs for k in RAY_ENV_DEFAULTS)


def test_ray_env_defaults_fill_only_what_is_unset(monkeypatch):
    monkeypatch.setenv("RAY_max_direct_call_object_size", "1000")
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    apply_ray_env_defaults()
    assert os.environ["RAY_max_direct_call_object_size"] == "1000"
    assert os.environ["RAY_worker_niceness"] == "0"


def test_a_ray_address_ray_cannot_parse_is_an_input_error_naming_where_it_came_from(monkeypatch):
    # cluster.address is checked with the config; RAY_ADDRESS only here, where it was a traceback.
    import ray

    from posttrain.config import ConfigError, InputError, load_config
    from posttrain.distributed.cluster import init_ray

    with pytest.raises(ConfigError, match=r"cluster.address: got 'head', expected 'auto', '<host>:<port>'"):
        load_config("grpo", None, ["cluster.address=head"])
    assert load_config("grpo", None, ["cluster.address=ray://head:10001"]).cluster.address == "ray://head:10001"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "nonsense")
    with pytest.raises(InputError, match=r"the RAY_ADDRESS environment variable='nonsense': Ray refuses it \("
                                         r".*Invalid address format.*\); give 'auto', '<host>:<port>' or"):
        init_ray(ClusterConfig())
    # An address where nothing listens: Ray retried it for minutes, with no word of posttrain's.
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(InputError, match=rf"cluster.address='127.0.0.1:{port}': nothing answers there \("):
        init_ray(ClusterConfig(address=f"127.0.0.1:{port}"))
    assert time.monotonic() - start < 10


_SIGNAL_WHILE_RAY_STARTS = """
import logging, os, signal, sys, threading, time
import ray
from posttrain.checkpoint import StopAtOnce
from posttrain.distributed.cluster import init_ray
from posttrain.schemas import ClusterConfig

logging.basicConfig(level=logging.WARNING, format="%(message)s")
sig = getattr(signal, sys.argv[1])

def send_once_the_node_runs():  # ray.init has started the node and connects to it next
    while ray._private.worker._global_node is None:
        time.sleep(0.005)
    os.kill(os.getpid(), sig)

threading.Thread(target=send_once_the_node_runs, daemon=True).start()
try:
    init_ray(ClusterConfig())
except StopAtOnce as e:
    print("stopped", e.signal_name, ray.is_initialized(), ray._private.worker._global_node, flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_ray_starts_is_held_until_it_has_started(sig):
    # Acted on inside ray.init (Ray's handler raised SystemExit there), it tore down a half-built
    # core worker: the driver aborted ("terminate called without an active exception", exit 134)
    # or hung for good, 1 run in 4 with the signal at this point.
    import shutil
    import subprocess
    import tempfile

    ray_tmpdir = tempfile.mkdtemp(prefix="pt-ray-", dir="/tmp")  # Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmpdir, "RAY_AUTH_MODE": "disabled"}
    try:
        out = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_RAY_STARTS, sig], env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"stopped {sig} False None", out.stdout + out.stderr
    assert f"{sig} received while Ray starts: stopping once it has started" in out.stderr
    assert "terminate called" not in out.stderr


def test_cpu_workers_keep_freed_memory_for_the_next_step(group):
    # runtime.keep_freed_memory in every worker without a GPU: 0-40k faults, ~400k otherwise (glibc maps
    # and unmaps blocks this large one by one), see tests/unit/test_runtime.py.
    faults = group.get(group.run_all("minor_faults_of_steps"))
    assert all(f < 100_000 for f in faults), faults


def test_run_sharded_and_worker_exception(group):
    batch = BatchedDataDict(x=torch.arange(6))
    assert group.get(group.run_sharded("rows", batch, 10)) == [[0, 10, 20], [30, 40, 50]]
    with pytest.raises(ValueError, match="bad value on echo"):
        group.get(group.run_all("fail"))
    assert "echo ready on rank 1" in group.tail_log(1)


def test_a_rank_failing_while_another_waits_in_a_collective_breaks_the_group(ray_session):
    # The waiting rank stayed blocked, and the next call paired its collectives with the old
    # call's or hung: now the next call fails at once, saying why.
    free = ray_session.available_resources().get("CPU", 0)
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, cpus_per_worker=1), name="wedge-test")
    g = RayWorkerGroup(cluster, EchoWorker, "wedge", name_prefix="wedge")
    g.failure_grace_s = 1.0
    try:
        with pytest.raises(ValueError, match="rank 0 fails"):
            g.get(g.run_all("fail_on_rank0_then_reduce"))
        with pytest.raises(WorkerGroupBroken, match=r"cannot run env: rank 0 failed \(ValueError: rank 0 fails\) "
                                                    r"while rank\(s\) \[1\] still ran the same call"):
            g.run_all("env")
    finally:
        g.shutdown()
        cluster.shutdown()
        deadline = time.monotonic() + 30  # the next tests count the free CPUs
        while ray_session.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
            time.sleep(0.2)


def test_unsatisfiable_request_fails_fast_with_numbers(ray_session):
    t0 = time.monotonic()
    # An input error (the CLI prints it without a traceback), and still a RuntimeError.
    with pytest.raises(PlacementError, match=r"asked for 64 bundles of \{'CPU': 1.0\}.*Ray offers \{CPU: ") as e:
        RayVirtualCluster(ClusterConfig(workers_per_node=64, placement_timeout_s=1.0))
    assert time.monotonic() - t0 < 10 and isinstance(e.value, RuntimeError)


def test_more_than_the_local_node_holds_fails_without_waiting_for_the_timeout(ray_session):
    # The Ray node this process started (the CLI's, this session's) has fixed resources: asking for
    # more than it has waited the whole placement_timeout_s (30 s by default) before failing.
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"asked for 64 bundles of \{'CPU': 1.0\}.*\(the Ray node this run "
                                             r"started: its resources are fixed\)"):
        RayVirtualCluster(ClusterConfig(workers_per_node=64))
    assert time.monotonic() - t0 < 10


def test_more_nodes_than_the_ray_cluster_has_fail_at_once(ray_session):
    # The 2 one-CPU workers fit on this session's single node: SPREAD placed them both there and
    # the run went on as a one-node job.
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"the Ray cluster has 1 node\(s\), fewer than the 2 asked for "
                                             r"\(cluster.num_nodes=2, gpus_per_node=0, workers_per_node=1"):
        RayVirtualCluster(ClusterConfig(num_nodes=2, workers_per_node=1, cpus_per_worker=1))
    assert time.monotonic() - t0 < 10


def test_separate_generation_workers_that_do_not_fit_are_named_by_their_own_keys(ray_session):
    # The error listed the derived cluster's values under the `cluster.*` names: a user who set
    # cluster.workers_per_node=2 read "workers_per_node=1".
    from posttrain.algorithms.grpo import worker_bundles
    from posttrain.config import load_config
    from posttrain.distributed.cluster import reserve

    cfg = load_config("grpo", None, ["cluster.workers_per_node=2", "cluster.cpus_per_worker=64",
                                     "cluster.placement_timeout_s=1", "policy.generation.colocated.enabled=false",
                                     "policy.train_global_batch_size=16"])
    with pytest.raises(PlacementError) as e:
        reserve(worker_bundles(cfg))
    msg = str(e.value)
    assert ("and 1 bundles of {'CPU': 64.0} (the separate generation workers of "
            "policy.generation.colocated.enabled=false, beside the policy workers' own: "
            "policy.generation.colocated.resources.num_nodes=null (null: 1), gpus_per_node=null (null: "
            "cluster.gpus_per_node=0), one worker per node with cluster.cpus_per_worker=64 CPUs), {CPU: 192} "
            "together; Ray offers") in msg
    assert "workers_per_node=1" not in msg


def test_grpo_placement_shortfall_fails_before_any_policy_worker_starts(ray_session, tmp_path, monkeypatch):
    # Policy workers that fit and separate generation workers that do not: the policy workers
    # started and loaded the model (30 s on this machine) before the generation workers' placement
    # failed. Now the run's placement groups are checked together right after Ray starts.
    import ray

    import posttrain.algorithms.grpo as grpo
    from posttrain.config import load_config

    def no_policy(*args, **kwargs):
        raise AssertionError("the policy workers started before every placement group was checked")

    monkeypatch.setattr(grpo, "Policy", no_policy)
    cfg = load_config("grpo", None, [
        "cluster.workers_per_node=2", "cluster.cpus_per_worker=2", "policy.generation.colocated.enabled=false",
        "policy.train_global_batch_size=16", f"logger.log_dir={tmp_path / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"])
    total = ray.cluster_resources()["CPU"]
    assert total == 4  # this session's Ray node: the policy workers' 4 CPUs fit, with generation's 2 they do not
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as e:
        grpo.setup(cfg)
    assert str(e.value).startswith(
        "the Ray cluster cannot hold the requested workers: asked for 2 bundles of {'CPU': 2.0} (cluster.num_nodes=1, "
        "gpus_per_node=0, workers_per_node=2, cpus_per_worker=2) and 1 bundles of {'CPU': 2.0} (the separate "
        "generation workers of policy.generation.colocated.enabled=false")
    assert "{CPU: 6} together; Ray offers {CPU: " in str(e.value)
    assert "(the Ray node this run started: its resources are fixed)" in str(e.value)
    assert time.monotonic() - t0 < 30
    # No placement group was made, or one was removed again.
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"
                and pg["name"] in ("posttrain-pg", "generation-pg")]


def test_shutdown_leaves_no_processes_and_dead_worker_is_named(ray_session):
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=1, cpus_per_worker=1), name="short")
    g = RayWorkerGroup(cluster, EchoWorker, "solo", name_prefix="solo")
    pid = g.worker_info[0]["pid"]
    os.kill(pid, 9)
    with pytest.raises(WorkerError, match=rf"(?s)solo worker rank 0 \(pid {pid}, node .*solo ready on rank 0"):
        g.get(g.run_all("env"))
    g.shutdown()
    g2 = RayWorkerGroup(cluster, EchoWorker, "again", name_prefix="again")
    pid2 = g2.worker_info[0]["pid"]
    g2.shutdown()
    cluster.shutdown()
    # The dead worker's log, named in its error, stays; a clean group's temp log folder goes.
    assert os.path.isfile(g.log_paths[0]) and not os.path.exists(g2.log_dir)
    for p in (pid, pid2):
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)


def test_joins_a_running_ray_cluster_by_address():
    """`RAY_ADDRESS` makes RayVirtualCluster join a running cluster instead of starting one. There, a
    group that does not fit after an earlier one was placed names that one too."""
    import shutil
    import subprocess
    import tempfile
    import textwrap

    # A short temp dir: Ray's unix socket paths must stay under ~107 characters.
    ray_tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, ray
            ray.init(num_cpus=3, include_dashboard=False)
            print(ray.get_runtime_context().gcs_address, flush=True)
            sys.stdin.read()  # hold the cluster until the test closes stdin
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        address = head.stdout.readline().strip()
        assert address, "the head process did not start Ray"
        joined = subprocess.run(
            [sys.executable, "-c", textwrap.dedent("""
                import ray
                from posttrain.distributed.cluster import Bundles, PlacementError, RayVirtualCluster, reserve
                from posttrain.schemas import ClusterConfig
                cluster = RayVirtualCluster(ClusterConfig(cpus_per_worker=2))
                print(ray.get_runtime_context().gcs_address, ray.cluster_resources()["CPU"])
                cluster.shutdown()
                try:  # 2 + 2 CPUs of 3: the second group waits, then fails
                    reserve([Bundles(ClusterConfig(cpus_per_worker=2), "policy"),
                             Bundles(ClusterConfig(cpus_per_worker=2, placement_timeout_s=1), "gen", "gen keys")])
                except PlacementError as e:
                    print(e)
                print(sum(p["state"] == "CREATED" for p in ray.util.placement_group_table().values()))
            """)],
            capture_output=True, text=True, timeout=120, env={**env, "RAY_ADDRESS": address},
        )
        assert joined.returncode == 0, joined.stderr[-2000:]
        first, error, placed = joined.stdout.strip().splitlines()[-3:]
        gcs, cpus = first.split()
        assert gcs == address and float(cpus) == 3.0  # the head's cluster, not a new local one
        # The waiting group's numbers (Ray offers 1 CPU: the policy group held 2), then that group.
        assert "asked for 1 bundles of {'CPU': 2.0} (gen keys); Ray offers {CPU: 1" in error
        assert ("; this run's 1 bundles of {'CPU': 2.0} (cluster.num_nodes=1, gpus_per_node=0, workers_per_node=1, "
                "cpus_per_worker=2) had been placed first and held their share of that, {CPU: 4} for the whole run"
                ) in error
        assert placed == "0"  # the policy group's placement group was removed again
    finally:
        head.stdin.close()
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_without_an_address_a_run_starts_its_own_ray_beside_a_running_cluster():
    """cluster.address null and no RAY_ADDRESS: a Ray of the run's own. ray.init() without an
    address joined the latest cluster `ray start` had left on the machine (someone else's)."""
    import shutil
    import subprocess
    import tempfile
    import textwrap

    import psutil

    from posttrain.distributed.ports import free_port

    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    head = f"127.0.0.1:{free_port()}"
    try:
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head",
                        f"--port={head.split(':')[1]}", "--num-cpus=3", f"--temp-dir={ray_tmp}/ray",
                        "--include-dashboard=false"], env=env, check=True, capture_output=True, timeout=120)
        run = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import ray
            from posttrain.distributed.cluster import RayVirtualCluster
            from posttrain.schemas import ClusterConfig
            cluster = RayVirtualCluster(ClusterConfig())
            print(ray.get_runtime_context().gcs_address.split(":")[1], ray.cluster_resources()["CPU"])
            cluster.shutdown()
        """)], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        port, cpus = run.stdout.split()
        assert port != head.split(":")[1] and float(cpus) != 3.0, (run.stdout, run.stderr[-1000:])
        assert "Connecting to existing Ray cluster" not in run.stderr
    finally:  # the head's processes only (a `ray stop` would stop every Ray on the machine)
        for p in psutil.process_iter(["cmdline"]):
            if any(ray_tmp in part for part in p.info["cmdline"] or ()):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_rendezvous_ports_lie_outside_the_ephemeral_range():
    # A port from the kernel's ephemeral range can become an outgoing connection's local port
    # between the probe and the rendezvous (EADDRINUSE); free_port draws from below it.
    import socket

    from posttrain.distributed.ports import RENDEZVOUS_PORTS, free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(RENDEZVOUS_PORTS[0] <= p < min(RENDEZVOUS_PORTS[1], ephemeral_low) for p in ports)
    assert len(ports) > 1  # drawn at random: two runs starting together do not pick the same port
    port = ports.pop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free, as promised


@pytest.mark.skipif(torch.cuda.is_available(), reason="tells a machine without GPUs what to set")
def test_gpus_asked_of_a_ray_node_without_gpus_say_to_set_them_to_zero(ray_session):
    # grpo_math_1B.yaml run as it is on a CPU machine: the error named the keys and what Ray
    # offers, but not the way out.
    with pytest.raises(PlacementError, match=r"asked for 4 bundles of \{'CPU': 1.0, 'GPU': 1\} \(cluster.num_nodes=1, "
                                             r"gpus_per_node=4, .*; Ray sees no GPU: to run on CPUs set the "
                                             r"gpus_per_node named above to 0$"):
        RayVirtualCluster(ClusterConfig(gpus_per_node=4))
