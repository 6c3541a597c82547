"""
Compatibility names: the data-source helpers moved down into the library (nanochat/data_sources.py, and
nanochat/download.py for download_file) so that nanochat/ never imports tasks/. Import them from there.
"""

from nanochat.data_sources import (  # noqa: F401
    TaskDataNotFound,
    get_data_dir,
    hub_endpoint,
    hub_offline_mode,
    hub_reachable,
    load_hf_dataset,
)
from nanochat.download import download_file  # noqa: F401
