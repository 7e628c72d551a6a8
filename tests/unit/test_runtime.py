"""`posttrain.runtime`: process settings of the long-lived processes."""

import gc
import platform
import re
import signal
import subprocess
import sys
import textwrap
import timeit
import weakref
from pathlib import Path

from posttrain.runtime import cpu_has_native_bf16, freeze_setup_objects


class _Node:
    pass


def test_freeze_hides_setup_objects_but_later_cycles_are_collected():
    before = gc.get_threshold()
    setup_cycle = _Node()
    setup_cycle.self = setup_cycle
    try:
        freeze_setup_objects()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules, classes and functions imported so far
        assert not any(o is setup_cycle for o in gc.get_objects())  # out of the collector's sight
        later = _Node()
        later.self = later
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None  # a cycle made after setup is still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_later_cycles_are_collected_without_a_call_but_less_often():
    before = gc.get_threshold()
    try:
        freeze_setup_objects()
        cycle = _Node()
        cycle.self = cycle
        ref = weakref.ref(cycle)
        del cycle
        held = [[] for _ in range(5_000)]  # a driver step's worth of short-lived containers and more
        assert ref() is not None  # Python's default (700 allocations) would have collected it by now
        held += [[] for _ in range(20_000)]
        assert ref() is None  # the collector still runs by itself
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_supervisor_names_the_signal_that_killed_its_job():
    """A job SIGKILLed (the OOM killer) prints nothing itself: the supervisor must say what
    happened, and exit as the shell reports a killed command."""
    script = textwrap.dedent("""
        import os, signal
        from posttrain.runtime import supervise_in_own_session
        supervise_in_own_session()
        os.kill(os.getpid(), signal.SIGKILL)  # in the job, as the OOM killer would
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    assert re.fullmatch(r"posttrain: the job \(pid \d+\) was killed by SIGKILL \(the kernel's OOM killer sends it "
                        r"when memory runs out: see `dmesg`\); checkpoints saved before stay, and the same command "
                        r"resumes from the latest\n", proc.stderr), proc.stderr


def test_the_job_acts_on_a_sigint_even_when_started_with_sigint_ignored():
    """A script's `posttrain ... &` (no job control) starts with SIGINT ignored: the supervisor
    forwarded a `kill -INT` to a job that ignored it, and a run in its set-up went on to the end."""
    script = textwrap.dedent("""
        import signal, sys, time
        from posttrain.runtime import supervise_in_own_session
        supervise_in_own_session()
        print("job", flush=True)
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline() == "job\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()


_FAULTS = textwrap.dedent("""
    import os, resource, sys, torch
    from posttrain.runtime import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "keep" else None
    def step():  # a training step's activations: all alive together, then freed
        live = [torch.empty(10 << 20).fill_(1.0) for _ in range(4)]  # 4 x 40 MiB
    for _ in range(3):  # the heap reaches its steady layout
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str, **env: str) -> tuple[str, int]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
                         env=env, check=True).stdout.split()
    return out[0], int(out[1])


def test_keep_freed_memory_stops_tensor_memory_from_page_faulting_at_every_step():
    # 10 steps of 4 blocks of 40 MiB (10,240 pages each) after 3 warm-up steps: by default glibc
    # maps such blocks one by one and unmaps them on free, so every step faults them in again
    # (~400k faults); with the setting the warm-up's memory is reused.
    _, default = _faults("default")
    applied, kept = _faults("keep")
    assert applied == "True"
    assert default > 300_000, default
    assert kept < 100_000, kept  # 0-40k: a block now and then lands on fresh heap
    # An explicit choice of the environment's is left alone.
    applied, faults = _faults("keep", MALLOC_ARENA_MAX="2")
    assert applied == "False" and faults > 300_000


def test_single_threaded_driver_restores_the_threads_even_after_an_error():
    import pytest
    import torch

    from posttrain.runtime import single_threaded_driver

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with single_threaded_driver():
                assert torch.get_num_threads() == 1
                raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _bf16_speedup(n: int = 256) -> float:
    """How many times faster a bf16 n x n matmul is than a float32 one here, on one thread (best of
    10 timings of 3 each). On the default two threads beside the other test process, best of 3 of
    one matmul measured the contention: 1.3 in one fresh-clone run on a VM where it is 3.3-4.5."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            torch.matmul(a, b)
            best[dtype] = min(timeit.repeat(lambda: torch.matmul(a, b), number=3, repeat=10))
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


def test_native_bf16_is_read_from_the_cpu_flags_and_is_what_runs_fast(tmp_path):
    # What policy.precision=auto decides by, against a measurement on this machine: with AMX
    # (or AVX512-BF16) bf16 matmuls run several times as fast as float32; without, torch emulates
    # them (~75x slower on an AVX2-only CPU).
    native = cpu_has_native_bf16()
    speedup = _bf16_speedup()
    if native:
        assert speedup > 1.5, speedup
    elif platform.machine() == "x86_64":
        assert speedup < 1, speedup
    flags = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {}\nbugs\t\t: spectre_v1\n"
    for extra, expected in (("", False), ("avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True),
                            ("avx512f", False)):
        path = tmp_path / f"cpuinfo-{len(extra)}"
        path.write_text(flags.format(extra))
        assert cpu_has_native_bf16(str(path)) is expected, extra
    assert cpu_has_native_bf16(str(tmp_path / "none")) is False  # not Linux: float32, the safe choice


def test_the_command_forks_its_job_from_a_single_threaded_process():
    # The config is validated before the fork (policy.precision=auto included): a torch matmul
    # there started OpenMP threads, and killing the command then sent the job its parent-death
    # SIGTERM once per thread, the second stopping it at once without its checkpoint.
    code = textwrap.dedent("""
        import sys
        from posttrain.config import load_config
        load_config("grpo", "examples/configs/grpo_quickstart.yaml", [])
        import psutil
        print(psutil.Process().num_threads(), "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["1", "False"], out.stdout + out.stderr
