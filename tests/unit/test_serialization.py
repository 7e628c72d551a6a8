import pickle

import pytest
import torch

from posttrain.distributed.serialization import _tensor_payload, use_numpy_tensor_transport


@pytest.fixture(scope="module")
def echo(ray_session):
    class Echo:  # local: Ray pickles it by value (the test module is not importable in its workers)
        def __init__(self):
            use_numpy_tensor_transport()

        def echo(self, value):
            return value

        def add_one(self, t):
            t += 1  # received tensors are writable
            return t

    use_numpy_tensor_transport()
    actor = ray_session.remote(num_cpus=0)(Echo).remote()
    yield actor
    ray_session.kill(actor)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    out = {"f32": x, "bf16": x.bfloat16(), "f16": x.half(), "i64": torch.randint(-9, 9, (7,), generator=g),
           "bool": x > 0, "scalar": torch.tensor(3.5), "transposed": x.t(), "empty": torch.zeros(0, 4),
           "row_of_big": torch.arange(100_000.0).view(1000, 100)[7]}
    if hasattr(torch, "float8_e4m3fn"):
        out["f8"] = x.to(torch.float8_e4m3fn)
    return out


def test_cpu_tensors_go_as_numpy_and_come_back_equal(ray_session, echo):
    sent = _tensors()
    assert all(_tensor_payload(t)[0] == "numpy" for t in sent.values())
    got = ray_session.get(echo.echo.remote(sent))

    def bits(t: torch.Tensor) -> torch.Tensor:  # float8 has no torch.equal: compare its bytes
        return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t

    for k, t in sent.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(bits(got[k]), bits(t)), k
    # Only a view's own elements travel (torch's reduction sends its whole storage: 400 KB here).
    assert len(pickle.dumps(_tensor_payload(sent["row_of_big"]))) < 1_000


def test_one_tensor_twice_arrives_as_one_and_writable(ray_session, echo):
    t = torch.arange(5)
    got = ray_session.get(echo.echo.remote({"a": t, "b": t}))
    assert got["a"] is got["b"]
    for n in (10, 1_000_000):  # inline in the message, and through the shared-memory object store
        back = ray_session.get(echo.add_one.remote(torch.zeros(n)))
        assert float(back.sum()) == n
        back += 1  # writable on this side too
        assert float(back.sum()) == 2 * n


def test_other_tensors_keep_torchs_own_reduction(ray_session, echo):
    leaf = torch.ones(3, requires_grad=True)
    param = torch.nn.Parameter(torch.ones(2))
    assert _tensor_payload(leaf)[0] == "torch"
    got_leaf, got_param = ray_session.get(echo.echo.remote([leaf, param]))
    assert got_leaf.requires_grad and torch.equal(got_leaf.detach(), leaf.detach())
    assert isinstance(got_param, torch.nn.Parameter) and torch.equal(got_param.detach(), param.detach())
