"""In-process refit (`load_state_dict_inplace`): all of a state dict or none of it."""

import pytest
import torch

from posttrain.distributed.weight_sync import load_state_dict_inplace


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


@pytest.mark.parametrize("change,error,message", [
    (lambda sd: sd.pop("1.weight"), KeyError, r"1 weight\(s\) missing from the state dict, e.g. \['1.weight'\]"),
    (lambda sd: sd.__setitem__("1.bias", torch.zeros(4)), ValueError, r"1 weight\(s\) of another shape, e.g. 1.bias \[4\] for \[3\]"),
    (lambda sd: sd.__setitem__("2.weight", torch.zeros(3)), KeyError, r"key\(s\) not in the generation model"),
    # The same number of elements in another shape (a transposed weight) is another shape too.
    (lambda sd: sd.__setitem__("0.weight", sd["0.weight"].t()), ValueError, r"0.weight \[4, 3\] for \[3, 4\]"),
], ids=["missing", "shape", "unknown", "transposed"])
def test_a_state_dict_that_does_not_fit_changes_no_weight(change, error, message):
    # A missing or misshapen weight was found after the others had been copied: the engine
    # then generated with a mix of two versions' weights under the old version.
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: v + 1.0 for k, v in before.items()}
    change(new)
    with pytest.raises(error, match=message):
        load_state_dict_inplace(model, new)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    load_state_dict_inplace(model, {k: v + 1.0 for k, v in before.items()})  # a whole one loads
    assert all(torch.equal(model.state_dict()[k], v + 1.0) for k, v in before.items())
