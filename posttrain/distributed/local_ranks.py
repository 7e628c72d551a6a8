"""`run_local_ranks`: a function as the ranks of one torch.distributed job, in processes of this
machine, without Ray: the workers' own classes (whose modules Ray's actors hide from a test)
under real collectives (gloo on a CPU), for tests and benchmarks of the distributed code."""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from typing import Any, Callable

from posttrain.distributed.ports import free_port


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)  # the ranks share this machine's cores
    try:
        results.put((rank, None, fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it naming the rank
        results.put((rank, traceback.format_exc(), None))


def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """`fn(rank, *args)` in `world_size` spawned processes at once, with the environment of
    rank `rank` of a torch.distributed job (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and a free
    MASTER_PORT) and one torch thread each; their return values, in rank order. `fn` must be
    importable (a module-level function) and return something picklable: plain values, as a
    tensor would travel as a shared-memory handle that dies with its process.

    A rank that raises, dies or is still running after `timeout_s` fails the call with a
    RuntimeError naming it (with its traceback when it raised); every process is gone when the
    call returns or raises."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            try:
                rank, error, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} of {world_size} exited with code {procs[dead[0]].exitcode} "
                                       "before returning") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise RuntimeError(f"rank(s) {missing} of {world_size} still running after "
                                       f"{timeout_s:g} s") from None
                continue
            if error is not None:
                raise RuntimeError(f"rank {rank} of {world_size} raised:\n{error}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(got) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world_size)]
