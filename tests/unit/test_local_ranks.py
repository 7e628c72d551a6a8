import os

import pytest

from posttrain.distributed.local_ranks import run_local_ranks


def _all_reduce(rank: int, value: int) -> tuple:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([value * (rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return rank, os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], int(t), torch.get_num_threads()


def _second_rank_fails(rank: int, how: str) -> int:
    if rank == 1 and how == "raise":
        raise ValueError("rank one is broken")
    if rank == 1:
        os._exit(3)
    return rank


def test_ranks_form_one_job_and_return_in_rank_order():
    assert run_local_ranks(_all_reduce, 2, 5, timeout_s=120) == [(0, "0", "2", 15, 1), (1, "1", "2", 15, 1)]


@pytest.mark.parametrize("how, message", [("raise", r"(?s)rank 1 of 2 raised:\n.*ValueError: rank one is broken"),
                                          ("exit", r"rank 1 of 2 exited with code 3 before returning")])
def test_a_failing_rank_is_named(how, message):
    with pytest.raises(RuntimeError, match=message):
        run_local_ranks(_second_rank_fails, 2, how, timeout_s=120)


def test_ranks_follow_the_nodes_so_a_tensor_parallel_group_stays_on_one():
    # SPREAD placement alternates nodes between bundles: rank r on bundle r put ranks 0 and 1 (one
    # tensor-parallel group) on nodes a and b.
    from posttrain.distributed.worker_group import ranks_by_node

    assert ranks_by_node({0: "a", 1: "b", 2: "a", 3: "b"}, 4) == [0, 2, 1, 3]
    assert ranks_by_node({0: "b", 1: "a", 2: "a", 3: "b"}, 4) == [0, 3, 1, 2]  # bundle 0 stays rank 0
    assert ranks_by_node({0: "a", 1: "a"}, 2) == [0, 1]  # one node: rank r on bundle r, as before
