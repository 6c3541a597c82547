"""
What every optimizer step in nanochat starts with (nanochat/optim/__init__.py maps the optimizers):

- `run_closure(closure)`: torch.optim's closure protocol, for the optimizers that write their own step().
- `PerRankState`: the distributed optimizers' common part. Each rank holds only its share of the state (DistMuon
  the matrices it owns, DistAdamW its rows, the FSDP/TP ones their DTensor shards), so: torch.distributed must be up
  when one is built (it sets `rank` and `world_size`), `state_dict()` is one file per rank tagged with the rank, the
  world size and the class, `load_state_dict()` accepts only a file saved by the same class on the same rank of the
  same world size, and `grad_of(p)` refuses a missing gradient (it would leave the ranks' collectives mismatched).
"""

import torch
import torch.distributed as dist


def run_closure(closure):
    """The loss from `closure` re-evaluated with autograd on (step() itself runs under no_grad), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class PerRankState:
    """Mixin for an optimizer whose state is sharded over ranks; list it before the torch optimizer class:
    `class DistMuon(PerRankState, Muon)`. The class name is the `kind` its state dicts carry."""

    def __init__(self, *args, **kwargs):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{self.kind} needs torch.distributed initialised: launch with torchrun (even --nproc_per_node=1); "
                               f"in one process GPT.setup_optimizers gives Muon and torch.optim.AdamW")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        super().__init__(*args, **kwargs)

    @property
    def kind(self):
        return type(self).__name__

    def grad_of(self, p):
        """p's gradient; every rank must have one (each step's collectives expect every parameter on every rank)."""
        if p.grad is None:
            raise RuntimeError(f"{self.kind}: a parameter of shape {tuple(p.shape)} has no gradient on rank {self.rank}; "
                               f"every rank must backprop through every parameter")
        return p.grad

    def state_dict(self):
        sd = super().state_dict()
        sd["dist"] = {"world_size": self.world_size, "rank": self.rank, "kind": self.kind}
        return sd

    def load_state_dict(self, state_dict):
        """Check and strip the 'dist' entry (the state only fits the same class, rank and world size), then load."""
        kind, state_dict = self.kind, dict(state_dict)
        info = state_dict.pop("dist", None)
        if info is None:
            raise ValueError(f"{kind}.load_state_dict: this state dict has no 'dist' entry; it was not saved by {kind} (a single-process optimizer state cannot be split across ranks)")
        if info.get("kind") != kind:
            raise ValueError(f"{kind}.load_state_dict: the state dict was saved by {info.get('kind')}, not {kind}")
        if info["world_size"] != self.world_size or info["rank"] != self.rank:
            raise ValueError(
                f"{kind}.load_state_dict: state saved by rank {info['rank']} of {info['world_size']} cannot load on rank {self.rank} of "
                f"{self.world_size}: optimizer state is sharded per rank, resume with the same number of ranks and each rank's own file"
            )
        super().load_state_dict(state_dict)
