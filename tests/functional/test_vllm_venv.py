"""vLLM generation workers in their own venv, driven from the main venv
(`policy.generation.vllm_cfg.python`, Ray runtime_env `py_executable`): the actors run under
the vllm venv's Python, generate like the torch engine here, and are refit from this venv.

Run from the MAIN venv:  .venv/bin/python -m pytest tests/functional/test_vllm_venv.py
The vllm venv (scripts/setup_vllm_cpu.sh) is POSTTRAIN_VLLM_PYTHON, default
/work/vllm-venv/bin/python; the tests that need it skip (with the reason) where it is absent.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from test_generation_helpers import (
    forward_logprobs,
    generated_mask,
    make_batch,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    perturb_,
    token_mult_prob_error,
    vllm_ready_model,
)

from posttrain.distributed.weight_sync import put_state_dict
from posttrain.generation import build_generation
from posttrain.schemas import ClusterConfig, GenerationConfig

VLLM_PYTHON = os.environ.get("POSTTRAIN_VLLM_PYTHON", "/work/vllm-venv/bin/python")
if not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK)):
    _SKIP = f"no vllm venv Python at {VLLM_PYTHON} (run scripts/setup_vllm_cpu.sh or set POSTTRAIN_VLLM_PYTHON)"
elif os.path.abspath(sys.executable) == os.path.abspath(VLLM_PYTHON):
    _SKIP = "runs from the main venv (this is the vllm venv itself)"
else:
    _SKIP = None
needs_vllm_venv = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

CTX = 128


@pytest.fixture(scope="module")
def setup(ray_session, tmp_path_factory):
    from posttrain.distributed.cluster import RayVirtualCluster
    from posttrain.generation.workers import GenerationWorkerGroup

    model, tok, path = vllm_ready_model(tmp_path_factory.mktemp("vllm_venv_model"))
    cfg = GenerationConfig(backend="vllm", max_new_tokens=16, colocated={"enabled": False},
                           vllm_cfg={"python": VLLM_PYTHON, "gpu_memory_utilization": 0.2,
                                     "kv_cache_memory_gib": 0.25, "enforce_eager": True})
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=1, cpus_per_worker=1), name="vllm-venv-test")
    try:
        group = GenerationWorkerGroup(cluster, backend="vllm", model_path=str(path), cfg=cfg,
                                      max_total_sequence_length=CTX)
    except BaseException:
        cluster.shutdown()
        raise
    torch_engine = build_generation("torch", model=model, tokenizer=tok, cfg=cfg, max_total_sequence_length=CTX)
    yield model, tok, group, torch_engine
    group.shutdown()
    cluster.shutdown()


@needs_vllm_venv
def test_workers_run_under_the_vllm_venv_and_match_torch_engine(setup):
    model, tok, group, torch_engine = setup
    assert [i["python"] for i in group.workers.worker_info] == [os.path.abspath(VLLM_PYTHON)]
    batch = make_batch(tok)
    out = group.generate(batch, greedy=True)
    ref = torch_engine.generate(batch, greedy=True)
    assert int(out["generation_lengths"].sum()) > 20
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=2e-3, rtol=0)
    rows = make_batch(tok, repeat=2)
    sampled = group.generate(rows)
    assert int(generated_mask(rows, sampled).sum()) > 20
    assert token_mult_prob_error(rows, sampled, forward_logprobs(model, sampled)) < 1.01


@needs_vllm_venv
def test_refit_from_the_main_venv(setup):
    model, tok, group, _ = setup
    batch = make_batch(tok)
    before = group.generate(batch, greedy=True)
    trained = copy.deepcopy(model)
    perturb_(trained, std=0.2, seed=5)
    stats = group.update_weights(put_state_dict(trained), version=1)
    assert group.version == 1 and stats["refit_s"] > 0
    after = group.generate(batch, greedy=True)
    m = generated_mask(batch, before)
    # The new weights really differ, and generation now follows them.
    assert float((forward_logprobs(trained, before) - before["logprobs"]).abs()[m].mean()) > 0.1
    assert after["output_ids"].tolist() != before["output_ids"].tolist()
    assert token_mult_prob_error(batch, after, forward_logprobs(trained, after)) < 1.01
    group.update_weights(model.state_dict(), version=2)  # back (a plain state dict works too)
    assert group.generate(batch, greedy=True)["output_ids"].tolist() == before["output_ids"].tolist()


def test_python_executable_is_checked_before_any_actor(tmp_path):
    import ray

    from posttrain.distributed.worker_group import check_python_executable

    check_python_executable(sys.executable)  # this venv: fine
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '" + json.dumps({"python": "3.1", "ray": None}) + "'\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError) as e:
        check_python_executable(str(fake), what="policy.generation.vllm_cfg.python")
    msg = str(e.value)
    assert f"policy.generation.vllm_cfg.python='{fake}' cannot host Ray workers" in msg
    assert f"ray (not installed), the driver has {ray.__version__}" in msg and "python 3.1," in msg
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho boom >&2; exit 3\n")
    broken.chmod(0o755)
    with pytest.raises(ValueError, match="does not run: boom"):
        check_python_executable(str(broken))
    # Probed once per process (GRPO's setup checks the generation workers' interpreter, then the
    # workers do): a second check runs nothing.
    runs = tmp_path / "runs"
    counted = tmp_path / "counted"
    counted.write_text(f"#!/bin/sh\necho run >> {runs}\necho '" + json.dumps(
        {"python": "%d.%d" % sys.version_info[:2], "ray": ray.__version__, "missing": []}) + "'\n")
    counted.chmod(0o755)
    check_python_executable(str(counted), needs=("vllm",))
    check_python_executable(str(counted), what="policy.generation.vllm_cfg.python", needs=("vllm",))
    assert runs.read_text().splitlines() == ["run"]


@needs_vllm_venv
def test_the_vllm_venv_passes_the_setup_check():
    from posttrain.config import load_config
    from posttrain.generation import check_backend_installed

    cfg = load_config("grpo", None, ["policy.generation.backend=vllm", "policy.generation.colocated.enabled=false",
                                     f"policy.generation.vllm_cfg.python={VLLM_PYTHON}"])
    check_backend_installed(cfg.policy.generation)  # it runs, holds vllm and this driver's ray
