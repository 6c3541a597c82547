"""
The optimizers, all in one map (nanochat trains with AdamW for the embeddings and lm_head, Muon for the block
matrices; GPT.setup_optimizers picks the classes and the learning rates, nanochat/parallel.py the path):

    path                  AdamW                      Muon                          module
    one process           torch.optim.AdamW          Muon                          nanochat/muon.py
    DDP (no wrapper)      DistAdamW (ZeRO-2)         DistMuon                      nanochat/adamw.py, nanochat/muon.py
    FSDP2 (--use_fsdp=1)  FSDPAdamW                  FSDPMuon                      nanochat/optim/sharded.py
    FSDP2 x TP (--tp_size) FSDPAdamW                 ShardedMuon                   nanochat/optim/sharded.py

Why this layout: nanochat's own optimizer modules keep their paths, class names and content (nanochat.muon holds
Muon's math, `zeropower_via_newtonschulz5` and `muon_update`, and Muon/DistMuon; nanochat.adamw holds DistAdamW), so
code written against nanochat imports the same names. What this project adds lives in this package: the optimizers
for DTensor parameters (sharded.py: they need DTensor layouts and the FSDP group rebuild, which plain-tensor users
never import), and the step preamble that all six optimizer classes share (base.py: the torchrun check, the
per-rank state dict with its rank/world check, the closure and the missing-gradient check).

This file imports nothing, so nanochat.muon and nanochat.adamw can import optim.base without an import circle
(optim.sharded imports nanochat.muon for the math).
"""
