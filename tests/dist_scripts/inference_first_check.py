"""
Inference before the first training forward under FSDP, on 2 gloo ranks (tests/distributed/test_fsdp.py). FSDP2 creates its
unsharded parameters at a group's first all-gather; apply_fsdp creates them up front so that a first all-gather inside
torch.inference_mode cannot leave them as inference tensors. For each way of sampling first -- GPT.generate
and GPT.generate_greedy (base_train's samples, e.g. a run resumed on a --sample_every step), the KV-cache Engine (chat_sft's generative
evals, lockstep), and full_weights entered inside inference_mode with a different number of forwards per rank -- a
fresh sharded model samples, then takes a forward and backward on a batch that every rank shares. Rank 0 prints one
JSON line {case: {"error": message or None, "loss": |FSDP loss - one process's|, "grad": max |gradient difference|}}.

    torchrun --nproc_per_node=2 inference_first_check.py
"""

import json

import torch
import torch.distributed as dist

from nanochat.distributed.dist import compute_cleanup
from nanochat.engine import Engine
from nanochat.distributed.fsdp import apply_fsdp, full_weights
from nanochat.gpt import GPT, GPTConfig
from nanochat.tokenizer import RustBPETokenizer

VOCAB = 300


def model():
    torch.manual_seed(0)
    m = GPT(GPTConfig(sequence_len=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_kv_head=1, n_embd=64), attn="sdpa")
    m.init_weights("nanochat")
    return m


def sample_first(case, m, tokenizer, prompt, rank):
    m.eval()
    if case == "generate":
        list(m.generate(prompt, max_tokens=4, temperature=0))
    elif case == "generate_greedy":
        m.generate_greedy([prompt, prompt[:2]], max_tokens=4)
    elif case == "engine":  # the same greedy rows on every rank: the same forwards, as chat_sft's lockstep evals
        Engine(m, tokenizer).generate_batch(prompt, num_samples=2, max_tokens=4, temperature=0)
    elif case == "full_weights_in_inference_mode":
        with torch.inference_mode(), full_weights(m):
            for _ in range(rank + 1):  # forwards of its own on each rank: no collective inside
                m(torch.tensor([prompt]))
    m.train()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    text = "The quick brown fox jumps over the lazy dog. " * 50
    tokenizer = RustBPETokenizer.train_from_iterator(iter([text]), VOCAB)
    prompt = tokenizer("The quick brown fox", prepend="<|bos|>")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)
    ref = model()
    ref_loss = ref(x, y)
    ref_loss.backward()
    out = {}
    for case in ("generate", "generate_greedy", "engine", "full_weights_in_inference_mode"):
        m = apply_fsdp(model())
        try:
            sample_first(case, m, tokenizer, prompt, rank)
            loss = m(x, y)
            loss.backward()
        except RuntimeError as e:  # the same on every rank (same forwards), so no rank is left in a collective
            out[case] = {"error": str(e).splitlines()[0], "loss": None, "grad": None}
            continue
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        out[case] = {"error": None, "loss": abs(loss.item() - ref_loss.item()),
                     "grad": max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())}
    if rank == 0:
        print(json.dumps(out))
    compute_cleanup()


if __name__ == "__main__":
    main()
