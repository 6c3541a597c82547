"""
How a run spreads over processes and accelerators (what nanochat does with DDP alone, plus FSDP2 and TP):

- `dist`: torch.distributed setup and teardown, the few collectives on python values, DataRanks.
- `parallel`: the run's parallel plan, one object chosen from the flags: the device mesh, the data rank/world, and
  `prepare(model)`, which applies AC -> FP8 -> TP -> FSDP -> compile in one ordered place.
- `fsdp`: FSDP2's mechanics (fully_shard per block, gathered state dicts, full weights for sampling).
- `tensor_parallel`: the blocks' matrices split over the tp ranks, FSDP2 over the data ranks.

Nothing is re-exported here: import the module you need (nanochat.common keeps nanochat's names).
"""
