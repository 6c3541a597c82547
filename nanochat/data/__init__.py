"""
The data this project adds around nanochat's two data modules. nanochat's own stay where nanochat has them:
nanochat/dataset.py (the pretraining shard layout and readers, the bottom layer) and nanochat/dataloader.py (the
tokenizing, rank-sharded, resumable loader on top of it). Here:

    download.py       HTTP downloads: one file atomically, and the FineWeb-Edu / ClimbMix shards (resumed, checked,
                      retried)
    corpus_import.py  local .txt/.jsonl/.json/.parquet text -> shards in nanochat.dataset's layout
    cli.py            `python -m nanochat.dataset` (download, the default, or `import`); nanochat.dataset runs it
    bestfit.py        BOS-aligned best-fit packing, the record recipe's batches (nanochat/dataloader.py's packing="bestfit")
    task_data.py      where the tasks' data comes from: $NANOCHAT_DATA_DIR, the Hugging Face hub, TaskDataNotFound
    conversations.py  the chat stages' batches: packed conversations (mid), padded and masked ones (SFT); the
                      previous stage's checkpoint they start from

The imports point down: cli -> download, corpus_import -> nanochat.dataset; nanochat.dataloader -> bestfit ->
nanochat.dataset; nanochat.dataset imports none of them at import time. This file imports nothing, so importing one module of the package loads only that module.
"""
