"""
scripts.chat_rl with a reward a tiny model can earn (tests/integration/test_posttrain.py): GSM8K's reward is replaced by
`parity_reward`, 1.0 for a completion of even length, so the advantages and the policy-gradient update are not zero
and N ranks can be checked against one process on the update itself, not only on the samples.

    torchrun --nproc_per_node=2 tests/dist_scripts/rl_parity.py <chat_rl flags>
"""

import sys

from tasks.gsm8k import GSM8K


def parity_reward(self, conversation, assistant_response):
    return float(len(assistant_response) % 2 == 0)


if __name__ == "__main__":
    GSM8K.reward = parity_reward
    from scripts import chat_rl

    chat_rl.main(sys.argv[1:])
