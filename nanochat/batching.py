"""
Batch arithmetic: how one optimizer step's batch splits over ranks and gradient-accumulation micro-steps.
Pretraining and mid-training count tokens, SFT counts whole conversations.

The training scripts and the launchers use these same functions (pretrain.sh and speedrun.sh ask nanochat.presets,
which asks these, before anything is installed), so this module imports nothing beyond the standard library.
"""

from nanochat.usage import BadValue


def ceil_div(a, b):
    return -(-a // b)


def batch_arithmetic(total_batch_size, device_batch_size, max_seq_len, world_size):
    """grad_accum_steps for a target total batch (in tokens), or a clear error suggesting valid values."""
    tokens_per_fwdbwd = device_batch_size * max_seq_len * world_size
    if total_batch_size <= 0:
        return 1, tokens_per_fwdbwd
    if total_batch_size % tokens_per_fwdbwd != 0:
        lower = max(tokens_per_fwdbwd, (total_batch_size // tokens_per_fwdbwd) * tokens_per_fwdbwd)
        upper = ceil_div(total_batch_size, tokens_per_fwdbwd) * tokens_per_fwdbwd
        divisors = [b for b in range(1, device_batch_size * 2 + 1) if total_batch_size % (b * max_seq_len * world_size) == 0]
        hint = f" or --device_batch_size in {divisors[:8]}" if divisors else ""
        use = f"{lower}" if lower == upper else f"{lower} or {upper}"  # below one forward/backward both are that one
        raise BadValue(
            f"--total_batch_size={total_batch_size} is not divisible by device_batch_size*max_seq_len*world_size = "
            f"{device_batch_size}*{max_seq_len}*{world_size} = {tokens_per_fwdbwd}. Use --total_batch_size={use}{hint}."
        )
    return total_batch_size // tokens_per_fwdbwd, tokens_per_fwdbwd


def sft_batch_arithmetic(target_examples_per_step, device_batch_size, world_size):
    """SFT's grad_accum_steps: whole conversations per step = device_batch_size * world_size * grad_accum."""
    examples_per_fwdbwd = device_batch_size * world_size
    if target_examples_per_step % examples_per_fwdbwd != 0:
        raise BadValue(
            f"--target_examples_per_step={target_examples_per_step} is not divisible by device_batch_size * "
            f"world_size = {device_batch_size} * {world_size} = {examples_per_fwdbwd}: change one of them"
        )
    return target_examples_per_step // examples_per_fwdbwd
