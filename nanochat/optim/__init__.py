"""
The optimizers, all in one map (nanochat trains with AdamW for the embeddings and lm_head, Muon for the block
matrices; GPT.setup_optimizers picks the classes and the learning rates, nanochat/distributed/parallel.py the path):

    path                    AdamW               Muon          where
    one process             torch.optim.AdamW   Muon          torch, nanochat/muon.py
    DDP (no wrapper)        DistAdamW (ZeRO-2)  DistMuon      nanochat/adamw.py, nanochat/muon.py
    FSDP2 (--use_fsdp=1)    FSDPAdamW           FSDPMuon      nanochat/optim/sharded.py
    FSDP2 x TP (--tp_size)  FSDPAdamW           ShardedMuon   nanochat/optim/sharded.py

The record model's AdamW groups carry math="record" (nanochat 92d63d4's float32 arithmetic, nanochat/adamw.py): in one
process they get nanochat.adamw.AdamW, under FSDP FSDPRecordAdamW; DistAdamW reads the key per group.

The param groups are the interface (GPT.setup_optimizers fills them; every class on every path reads each group's own
values at every step, so a schedule writes them into the groups):
    AdamW: dict(params, lr, betas, eps, weight_decay)   per group in every AdamW class (92d63d4's record recipe
                                                        gives lm_head, wte, value embeddings, the residual and x0
                                                        scalars and smear each their own, with math="record")
    Muon:  dict(params, lr, momentum, nesterov, ns_steps, ns, row_equilibrate, renormalize, normuon, beta2,
                weight_decay, cautious_wd)              nanochat/muon.py's docstring; muon.RECORD_MUON holds the record
                                                        recipe's options. Groups are split by shape inside.
Every group also carries "initial_lr" (the schedule's base). The N-ranks-equal-one-process tests run the December
and the record options on every path (tests/distributed/test_dist_optim.py, test_fsdp.py, test_tp.py, test_record_optim.py).

Why this layout: nanochat's own optimizer modules keep their paths and class names (nanochat.muon holds Muon's math,
`zeropower_via_newtonschulz5` and `muon_update`, and Muon/DistMuon; nanochat.adamw holds DistAdamW), so code and
habits from nanochat carry over, and those two files still read side by side with nanochat's. What this project adds
lives in this package rather than in them: the optimizers for DTensor parameters (sharded.py) need DTensor layouts,
a private torch helper and GPT's group rebuild, which nobody on the one-process or DDP path should have to read past
or import. What the classes repeated is written once: the step preamble of all six (base.py: the torchrun check, the
per-rank state dict tagged and checked on load, the closure, the missing-gradient error) and, for the four Muons,
their common parent Muon (hyperparameter checks, shape groups, momentum buffers).

This file imports nothing, so nanochat.muon and nanochat.adamw can import optim.base without an import circle
(optim.sharded imports nanochat.muon for the math).
"""
