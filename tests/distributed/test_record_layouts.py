"""
The record model (nanochat/gpt.py RecordGPT) under the sharded layouts, on 2 gloo ranks launched by torchrun
(tests/dist_scripts/record_layout_check.py), N ranks == one process:

- FSDP2 (each rank trains on half of the rows) and FSDP x TP (tp_size 2: value embeddings and their gates split by kv
  head with c_v): the loss of a forward/backward, every parameter's gradient, the logits without gradients and the
  gathered single-file state dict equal the unsharded model's; the layout's optimizers build from the record groups
  and step. (The optimizer update's equality across layouts is tested with the record optimizer itself:
  tests/distributed/test_dist_optim.py, test_fsdp.py, test_tp.py.)
"""

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("nanochat_test_launch", HERE / "dist_scripts" / "launch.py")
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("mode, optimizers", [("fsdp", ["FSDPRecordAdamW", "FSDPMuon"]), ("tp", ["FSDPRecordAdamW", "ShardedMuon"])])
def test_record_model_sharded_equals_one_process(mode, optimizers):
    [out] = launch.json_lines(launch.ranks("record_layout_check.py", [mode], timeout=400))
    assert out["loss"] < 1e-6 and out["logits"] < 1e-5 and out["state"] == 0.0
    # every parameter of the record model has its gradient, equal up to float summation order
    assert {"value_embeds.0.weight", "value_embeds.2.weight", "transformer.h.0.attn.ve_gate.weight", "smear_gate.weight",
            "smear_lambda", "backout_lambda", "resid_lambdas", "x0_lambdas"} <= out["grads"].keys()
    assert max(out["grads"].values()) < 1e-5, out["grads"]
    assert out["optimizers"] == optimizers and out["finite"]
