"""calculate_kl: every estimator and both clamps on hand-computed values."""

import math

import pytest
import torch

from posttrain.losses import calculate_kl

LN2 = math.log(2.0)


def _kl(logp, ref, **kw):
    return calculate_kl(torch.tensor([logp]), torch.tensor([ref]), **kw).item()


@pytest.mark.parametrize(
    "kl_type,expected",
    # pi = 0.5, pi_ref = 0.25: log r = log(pi_ref / pi) = -ln 2
    [("k1", LN2), ("k2", 0.5 * LN2**2), ("k3", 0.5 - 1.0 + LN2)],
)
def test_estimators(kl_type, expected):
    assert _kl(math.log(0.5), math.log(0.25), kl_type=kl_type) == pytest.approx(expected, rel=1e-6)


def test_equal_policies_give_zero():
    lp = torch.tensor([-0.1, -2.0, -7.0])
    for kl_type in ("k1", "k2", "k3"):
        assert torch.equal(calculate_kl(lp, lp.clone(), kl_type=kl_type), torch.zeros(3))


def test_k1_is_signed_k2_k3_nonnegative():
    # pi_ref > pi: log r = +1
    assert _kl(-2.0, -1.0, kl_type="k1") == pytest.approx(-1.0)
    assert _kl(-2.0, -1.0, kl_type="k2") == pytest.approx(0.5)
    assert _kl(-2.0, -1.0, kl_type="k3") == pytest.approx(math.e - 2.0, rel=1e-6)


def test_input_and_output_clamps():
    # log r = -30: input clamp to -20, k1 = 20, then output clamp to 10
    assert _kl(0.0, -30.0, kl_type="k1") == pytest.approx(10.0)
    assert _kl(0.0, -30.0, kl_type="k1", output_clamp_value=None) == pytest.approx(20.0)
    assert _kl(0.0, -30.0, kl_type="k1", input_clamp_value=None, output_clamp_value=None) == pytest.approx(30.0)
    # k3 at log r = -20 is e^-20 + 19
    assert _kl(0.0, -30.0, kl_type="k3", output_clamp_value=None) == pytest.approx(19.0, rel=1e-6)
    # log r = +5: k3 = e^5 - 6 = 142.41..., clamped to 10; k1 = -5 is clamped below at -3
    assert _kl(-5.0, 0.0, kl_type="k3", output_clamp_value=None) == pytest.approx(math.exp(5) - 6, rel=1e-6)
    assert _kl(-5.0, 0.0, kl_type="k3") == pytest.approx(10.0)
    assert _kl(-5.0, 0.0, kl_type="k1", output_clamp_value=3.0) == pytest.approx(-3.0)
    # a huge log r without the input clamp overflows k3 to inf; the clamp keeps it finite
    assert math.isinf(_kl(-200.0, 0.0, kl_type="k3", input_clamp_value=None, output_clamp_value=None))
    assert math.isfinite(_kl(-200.0, 0.0, kl_type="k3", output_clamp_value=None))


def test_elementwise_shape_and_errors():
    out = calculate_kl(torch.zeros(2, 3), torch.full((2, 3), -LN2), kl_type="k1")
    assert out.shape == (2, 3) and torch.allclose(out, torch.full((2, 3), LN2))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        calculate_kl(torch.zeros(2), torch.zeros(2), kl_type="k4")
    with pytest.raises(ValueError, match="same shape"):
        calculate_kl(torch.zeros(2), torch.zeros(3))
