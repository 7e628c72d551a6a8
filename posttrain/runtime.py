"""Process-level settings for posttrain's long-lived processes (the driver, policy and
generation workers, environment actors), and the `posttrain` command's supervisor."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import re
import signal
import sys
import threading
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# mallopt(3) parameters, <malloc.h>.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_GC_GEN0_THRESHOLD = 20_000

# Set while a training loop is to stop after its current step (a first SIGTERM or Ctrl-C,
# `CheckpointManager.stop_on_signals`): what would wait long within the step, an environment's
# scoring, stops waiting (a hung one held the save for its whole time limit, 2,590 s by default
# for the quickstart's step, well past a scheduler's grace period).
STOP_REQUESTED = threading.Event()


def freeze_setup_objects() -> None:
    """Exclude every object alive now (imported modules, tokenizer, datasets, model) from the
    cyclic garbage collector's full collections, which otherwise walk them all again and again:
    370 ms per full collection in the GRPO driver, about every 12 steps of the quickstart.
    Call once setup is done.

    Objects created later are collected as usual, but less often: the youngest generation is
    collected after `_GC_GEN0_THRESHOLD` net container allocations instead of Python's 700.
    A GRPO step of the quickstart allocates ~8,000 (512 conversations, the environment's
    return) that die by reference counting anyway; at 700 the driver ran ~11 young and one
    middle collection a step, ~1.5 ms (the middle one walks everything the step still holds)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


@contextlib.contextmanager
def single_threaded_driver():
    """Run the block with one torch intra-op thread in this process, the driver's, then restore.

    The driver computes nothing heavy (masks, advantages, batch bookkeeping: the models run in
    the workers), but with torch's default of one thread per core each of its small ops wakes an
    OpenMP team, and the team's threads then spin on the cores the workers compute on, between
    and during their calls. The quickstart's GRPO step (workers on both cores of a 2-core CPU,
    3 runs each, the same results bit for bit): 166 ms with the default, 156 ms with one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel;
    True when applied. For processes that compute with torch on the CPU (policy and generation
    workers without a GPU), called before their first tensors.

    Why: CPU tensors come from malloc. glibc maps blocks above its mmap threshold (128 KiB at
    first, raised as such blocks are freed, at most 32 MiB) one by one and unmaps them on free,
    and trims the heap's free top, so every step's activations page-fault again and the kernel
    zeroes each page. A 30M model's GRPO train step (8.5k positions, bf16) took 148k minor faults
    per step by default, 58k with the threshold at its 32 MiB maximum, and 10k with no mmap and no
    trimming, which this sets (about 0.3 s of system time a step; benchmarks/results/grpo_vs_trl.md).
    The process then holds its peak heap between steps, as a GPU caching allocator holds device
    memory. The price is a higher peak: freed blocks stay in the heap, and a later step's blocks
    do not always fit the holes they leave, so the heap grows past the live peak. Peak RSS per
    worker with it vs glibc's defaults (benchmarks/results/memory_check.md): 2-worker FSDP2 SFT of
    a 58.5M fp32 model, 2 x 128 tokens, 1.94-2.12 vs 1.23 GiB; 1 worker, 8 x 512 tokens, 4.36-4.60
    vs 3.82 GiB; 4 GRPO steps of a 30M bf16 model 4.00 vs 3.29 GiB (the memory check counts 0.5 GiB
    for it, `hf_io.ALLOCATOR_SLACK_BYTES`). Kept for the speed: in that SFT run 0.6 vs 3.0 million
    page faults and 1.8 vs 5.5 s of system time per worker, 2.5 vs 3.7 s a step; in the GRPO run
    1.0 vs 17.1 million faults and 2.1 vs 25.8 s. A fixed 32 MiB mmap threshold without trimming
    did not lower the peak (1.68-1.83 GiB), nor did one malloc arena (1.89-1.98 GiB).
    Skipped (False) off glibc, and when the environment already chooses: MALLOC_* tunables or an
    LD_PRELOADed allocator (jemalloc, tcmalloc)."""
    if not sys.platform.startswith("linux") or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    if any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc; musl has none
    except AttributeError:
        return False
    # mallopt returns 1 on success; the trim threshold is an int: INT_MAX, 2 GiB.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def resolve_device(name: str):
    """The torch device of `policy.device` in this process (a policy or generation worker, or
    the eval driver): "auto" is CUDA when torch sees a GPU here (Ray exposes a worker's own),
    else the CPU."""
    import torch

    from posttrain.config import InputError

    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise InputError("policy.device=cuda but torch sees no CUDA device in this process; use "
                             "policy.device=auto or cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# The x86 CPU flags (Linux /proc/cpuinfo) of native bf16 matmuls, which `policy.precision: auto`
# takes bfloat16 for. Measured (2 threads, benchmarks/results/train_throughput.md): with them bf16
# matmuls ran 4-6x as fast as float32 (a GRPO step of the quickstart 0.22 vs 0.31 s on AMX);
# without (AVX2 only) torch emulates bf16 at ~1/75 of float32's speed (1.35 vs 100 GFLOP/s), and
# the quickstart's warm-up did not end in its 9 minutes.
_NATIVE_BF16_FLAGS = {"amx_bf16", "avx512_bf16"}


def auto_precision(device: str) -> str:
    """The compute dtype `policy.precision: auto` stands for when the policy runs on `device`
    ("auto", "cpu" or "cuda"; what the driver decides for the workers): bfloat16 on CUDA GPUs
    (Ampere and later have it) and on CPUs with native bf16 (`cpu_has_native_bf16`), float32 on
    other CPUs. "auto" counts as the CPU: deciding it would import torch (below)."""
    return "bfloat16" if device == "cuda" or cpu_has_native_bf16() else "float32"


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 matmul instructions (AMX-BF16 or AVX512-BF16); False where
    /proc/cpuinfo does not say (not Linux, not x86).

    Read from the flags rather than measured with torch: the config is validated in the
    `posttrain` command's process before it forks the job, and a torch matmul there started
    OpenMP threads. Killing the command then sent the job its parent-death SIGTERM once per
    thread that exited, so the job's second signal stopped it at once without its checkpoint;
    and OpenMP is not fork-safe."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    return found is not None and not _NATIVE_BF16_FLAGS.isdisjoint(found.group(1).split())


def supervise_in_own_session() -> None:
    """Fork: the child returns and runs the job in a session of its own; this process stays
    behind as a thin supervisor that forwards SIGINT and SIGTERM to it and exits with its status.
    Returns only in the child. Linux only (elsewhere it returns at once, without forking).

    Why: the Ray node a driver starts (GCS, raylet) inherits the driver's process group, so a
    signal to the whole group (a terminal's Ctrl-C, `kill -TERM -<pgid>`, a job runner ending
    the job) reached it too. Ray blocks SIGINT in those processes but not SIGTERM: the raylet
    went down at once, the policy workers with it, and the checkpoint the driver saves after
    the current step could no longer be written (1 run in 4 of tests/functional/test_stop.py
    with 50 ms steps; every run whose step outlasts the raylet's exit). In its own session the
    driver hears such a signal only from the supervisor, and saves and shuts the node down
    itself. The child asks for SIGTERM when the supervisor dies (prctl PR_SET_PDEATHSIG), so
    even a SIGKILLed supervisor leaves a checkpoint behind."""
    if not sys.platform.startswith("linux"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = os.getpid()
    child = os.fork()
    if child == 0:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != supervisor:  # it died before the prctl: nothing has started yet
            os._exit(128 + signal.SIGTERM)
        # A shell without job control starts a background command with SIGINT ignored, and the
        # job inherited that: `kill -INT` during the set-up did nothing (the run went on to its
        # end), though the loop's handler stops it later. A SIGINT reaches the job only through the
        # supervisor, which handles it: act on it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return

    forwarded: set[int] = set()

    def forward(signum: int, _frame) -> None:
        forwarded.add(signum)
        try:
            os.kill(child, signum)
        except ProcessLookupError:  # exited meanwhile: waitpid below returns its status
            pass

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, forward)
    _, status = os.waitpid(child, 0)
    # What the job left in its process group: the processes of the Ray node it was starting when
    # a signal stopped it inside `ray.init`, before it could shut them down (the raylet's agents
    # stayed behind, orphaned). A job that ended normally left nothing there.
    try:
        os.killpg(child, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    code = os.waitstatus_to_exitcode(status)  # -N when a signal N killed it
    if code < 0 and -code not in forwarded:
        # Killed by a signal it could not handle (the kernel's OOM killer sends SIGKILL): the job
        # printed nothing, and its Ray node went with it, so this is the one place to say so.
        name = signal.Signals(-code).name
        why = " (the kernel's OOM killer sends it when memory runs out: see `dmesg`)" if -code == signal.SIGKILL else ""
        print(f"posttrain: the job (pid {child}) was killed by {name}{why}; checkpoints saved before stay, "
              "and the same command resumes from the latest", file=sys.stderr, flush=True)
    os._exit(128 - code if code < 0 else code)  # no atexit handlers here: they are the job's, in the child
