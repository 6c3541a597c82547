"""
What decides the SDPA kernels on this machine, for the suite's env.log: Python, torch, CUDA, cuDNN, the device and its
compute capability, TORCH_CUDNN_SDPA_DEPRIORITIZED, and torch's own SDPA kernel order after a call
(nanochat.attention.torch_sdpa_order: torch 2.15 settles it at its first CUDA call, cuDNN first on 9.x/10.x with a
runtime cuDNN newer than 9.15.0 unless that variable is 1).

    python -m bench.sdpa_env cuda      # or cpu
"""

import os
import sys

import torch

from nanochat.attention import torch_sdpa_order
from nanochat.configurator import Flag, Flags

FLAGS = Flags(Flag("device", "cuda", "the device whose SDPA order to report", choices=["cuda", "cpu"], positional=True),
              prog="python -m bench.sdpa_env", description=__doc__)


def main(argv=None):
    device = torch.device(FLAGS.parse(sys.argv[1:] if argv is None else argv)["device"])
    where = (f"{torch.cuda.get_device_name(device)}, compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
             if device.type == "cuda" else device.type)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}, {where}, "
          f"TORCH_CUDNN_SDPA_DEPRIORITIZED={os.environ.get('TORCH_CUDNN_SDPA_DEPRIORITIZED', '')!r}")
    print(f"torch's own SDPA kernel order after a call: {' > '.join(torch_sdpa_order(device))}")


if __name__ == "__main__":
    main()
