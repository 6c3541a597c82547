"""
Runs inside nanochat 92d63d4 (its extracted copy goes first on sys.path; tests/integration/test_record_model.py launches it) and
saves what 92d63d4's own code computes, for the test to compare with the record recipe here:

- its GPT at init (seed 0) and, with every weight perturbed so that no zero-initialised projection hides a module,
  its logits and loss on rows long enough for the sliding windows to matter; its windows, FLOPs, scaling parameters
  and optimizer groups (every hyperparameter of every parameter's group, by parameter name)
- its base_train's batch-size / learning-rate / weight-decay scaling and its lr, momentum and weight-decay schedules,
  executed from the source of its scripts/base_train.py (the blocks between the comments named below) on the cases
  the test gives

    python probe_92d63d4.py ANCHOR_DIR CASES.json OUT.pt
"""

import json
import math
import sys
import types

anchor, cases_path, out_path = sys.argv[1:4]
sys.path.insert(0, anchor)

import torch  # noqa: E402

from nanochat.gpt import GPT, GPTConfig  # noqa: E402  (92d63d4's)

with open(cases_path) as f:
    cases = json.load(f)
result = {}

# ---------------------------------------------------------------- the model
torch.manual_seed(0)
with torch.device("meta"):
    model = GPT(GPTConfig(**cases["model_config"]))
model.to_empty(device="cpu")
model.init_weights()
result["init"] = {k: v.clone() for k, v in model.state_dict().items()}
g = torch.Generator().manual_seed(1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))
result["perturbed"] = {k: v.clone() for k, v in model.state_dict().items()}
idx = torch.randint(0, model.config.vocab_size, (2, model.config.sequence_len), generator=g)
result["idx"] = idx
with torch.no_grad():
    result["logits"] = model(idx)
    result["loss"] = model(idx, idx)
result["windows"] = [left for left, _ in model.window_sizes]
result["flops"] = model.estimate_flops()
counts = model.num_scaling_params()
result["scaling_params"] = counts["transformer_matrices"] + counts["lm_head"]
names = {id(p): n for n, p in model.named_parameters()}
optimizer = model.setup_optimizer(**cases["optimizer_kwargs"])
result["groups"] = {names[id(p)]: {k: v for k, v in group.items() if k != "params"}
                    for group in optimizer.param_groups for p in group["params"]}

# ---------------------------------------------------------------- base_train's scaling and schedules, from its source
with open(f"{anchor}/scripts/base_train.py") as f:
    source = f.read()


def block(start, end):
    return source[source.index(start) : source.index(end)]


build_src = block("def build_model_meta", "# Build the model, move to device")
scale_src = block("def get_scaling_params", "# Initialize the Optimizer")
schedule_src = block("# Learning rate schedule", "# Training loop")
result["scaling"] = []
for case in cases["scaling"]:
    args = types.SimpleNamespace(depth=case["depth"], **case["args"])
    ns = dict(args=args, GPT=GPT, GPTConfig=GPTConfig, torch=torch, math=math, vocab_size=case["vocab_size"],
              print0=lambda *a, **k: None)
    exec(build_src, ns)
    ns["model"] = ns["build_model_meta"](case["depth"])
    exec(scale_src, ns)
    result["scaling"].append({k: ns[k] for k in ("total_batch_size", "batch_lr_scale", "weight_decay_scaled",
                                                  "target_tokens")})
result["schedules"] = []
for case in cases["schedules"]:
    ns = dict(args=types.SimpleNamespace(**case["args"]), math=math, num_iterations=case["num_iterations"],
              weight_decay_scaled=case["weight_decay_scaled"])
    exec(schedule_src, ns)
    steps = range(case["num_iterations"])
    result["schedules"].append([(ns["get_lr_multiplier"](s), ns["get_muon_momentum"](s), ns["get_weight_decay"](s))
                                for s in steps])
torch.save(result, out_path)
