"""
Runs inside nanochat 92d63d4 (its extracted copy goes first on sys.path; tests/integration/test_record_model.py launches it with
NANOCHAT_BASE_DIR set): loads a base checkpoint with 92d63d4's own checkpoint_manager and saves, per prompt, its
logits (one forward of the prompt) and its Engine's greedy continuation.

    python generate_92d63d4.py ANCHOR_DIR MODEL_TAG MAX_TOKENS OUT.pt PROMPT...
"""

import sys

anchor, model_tag, max_tokens, out_path, *prompts = sys.argv[1:]
sys.path.insert(0, anchor)

import torch  # noqa: E402

from nanochat.checkpoint_manager import load_model  # noqa: E402  (92d63d4's)
from nanochat.engine import Engine  # noqa: E402

model, tokenizer, meta = load_model("base", torch.device("cpu"), "eval", model_tag=model_tag)
engine = Engine(model, tokenizer)
result = {"logits": [], "tokens": []}
for prompt in prompts:
    ids = tokenizer(prompt, prepend="<|bos|>")
    with torch.no_grad():
        result["logits"].append(model(torch.tensor([ids])))
    out, _ = engine.generate_batch(ids, num_samples=1, max_tokens=int(max_tokens), temperature=0)
    result["tokens"].append(out[0][len(ids):])
torch.save(result, out_path)
