"""
Checkpoints, one owner per concern (nanochat/checkpoint_manager.py is nanochat's front door over them):

- `files`: the names of a checkpoint's files, atomic writes, stale temp files of killed saves, the free-space check.
- `steps`: which steps a directory holds, complete or not, and in which format (`step_format`, the one place that
  decides whether a step is sharded); reading a step's meta and torch files back, a damaged one named.
- `sharded`: the sharded format (torch.distributed.checkpoint): every rank its shard, resharding loads, consolidation
  into nanochat's single files.
- `train_state`: a training run's state (model, optimizers, data position, loop state) saved and restored, in the
  format the run's parallel plan writes.
- `resume`: --resume_from_step (which step, the run restored to it).

Layers point down: resume -> train_state -> checkpoint_manager -> sharded -> steps -> files. Nothing is re-exported
here: import the module you need.
"""
