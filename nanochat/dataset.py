"""
The pretraining data: parquet shards with a `text` column, one document per row.

Layout (nanochat's): `$NANOCHAT_BASE_DIR/base_data/shard_{i:05d}.parquet`. The shards are read in sorted order;
the LAST one is the validation split and all the others are the train split. Each web source has its own directory
(SOURCES): FineWeb-Edu 100B, what nanochat's December recipe trains on, in `base_data/`; ClimbMix 400B, what its record
recipe (nanochat 92d63d4) trains on, in `base_data_climbmix/`, the directory 92d63d4 reads.

Two ways to fill a directory:
    python -m nanochat.dataset -n 8 -w 4                    # download FineWeb-Edu 100B shards 0..7 (nanochat's command)
    python -m nanochat.dataset --data=climbmix -n 170       # ClimbMix train shards 0..169 + its validation shard
    python -m nanochat.dataset import PATH ... [--data=...] # import local .txt / .jsonl / .json / .parquet text (offline)

This module is the bottom of the data layers: the layout and the readers `list_parquet_files()` and
`parquets_iter_batched(split, start, step)` (documents one row group at a time). The layers above it live in
nanochat/data/: the downloader (download.py), the importer (corpus_import.py) and the command line shown above (cli.py,
which `python -m nanochat.dataset` runs). The tokenizing, rank-sharded, resumable loader built on the shards is
nanochat/dataloader.py.
"""

import os
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.atomic import short_error
from nanochat.usage import BadValue, Missing, run_main

# -----------------------------------------------------------------------------
# Where the shards live

BASE_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"  # the web shards' home
MAX_SHARD = 1822  # the last shard index of FineWeb-Edu 100B shuffled (1823 shards, ~100 MB each)
CLIMBMIX_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
CLIMBMIX_MAX_SHARD = 6542  # ClimbMix 400B shuffled: shards 0..6542; 92d63d4 always fetches the last as validation
IMPORT_INFO = "import_info.json"  # written by `import` so the downloader never mixes web shards into a local corpus


class DataSource(NamedTuple):
    """A web source of shards: its directory under $NANOCHAT_BASE_DIR, its name in messages, where it downloads from
    (and the environment variable naming a mirror), its last shard index, and the shard always fetched as the
    validation split (None: the last of the shards fetched is)."""

    dir_name: str
    title: str
    base_url: str
    url_env: str
    max_shard: int
    val_shard: int | None


SOURCES = {
    "fineweb_edu": DataSource("base_data", "FineWeb-Edu 100B", BASE_URL, "NANOCHAT_DATA_URL", MAX_SHARD, None),
    "climbmix": DataSource("base_data_climbmix", "ClimbMix 400B", CLIMBMIX_URL, "NANOCHAT_CLIMBMIX_URL",
                           CLIMBMIX_MAX_SHARD, CLIMBMIX_MAX_SHARD),
}
DEFAULT_SOURCE = "fineweb_edu"  # nanochat's December data, and `base_data/` where nanochat's tools look


def index_to_filename(index):
    return f"shard_{index:05d}.parquet"


def resolve_source(data, recipe_source=DEFAULT_SOURCE):
    """base_train's --data: None (auto) takes the recipe's source (the December recipe: fineweb_edu, the record
    recipe: climbmix), an explicit value wins."""
    chosen = recipe_source if data is None else data
    if chosen not in SOURCES:
        raise BadValue(f"--data must be one of {', '.join(SOURCES)} (or auto), got {chosen!r}")
    return chosen


def base_data_dir(data_dir=None, source=DEFAULT_SOURCE):
    """The shard dir: `data_dir` if given, else the source's directory under $NANOCHAT_BASE_DIR (created)."""
    if data_dir is not None:
        return os.fspath(data_dir)
    # imported here, not at module top: nanochat.common imports torch, which download workers and the
    # import command do not need (it costs seconds per spawned worker on macOS)
    from nanochat.common import get_base_dir

    path = os.path.join(get_base_dir(), SOURCES[resolve_source(source)].dir_name)
    os.makedirs(path, exist_ok=True)
    return path


def data_flag(data_dir):
    """` --data=NAME` for a source's directory other than the default one ('' otherwise): commands in messages."""
    name = os.path.basename(os.path.normpath(data_dir))
    return next((f" --data={n}" for n, s in SOURCES.items() if s.dir_name == name and n != DEFAULT_SOURCE), "")


def list_parquet_files(data_dir=None):
    """Full paths of the finished shards in the data dir, sorted by name (partial `.tmp` downloads excluded)."""
    data_dir = base_data_dir(data_dir)
    if not os.path.isdir(data_dir):
        return []
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))
    return [os.path.join(data_dir, f) for f in names]


def _fill_hint(where):
    flag = data_flag(where)
    title = SOURCES[flag.partition("=")[2] or DEFAULT_SOURCE].title
    return (
        f"fill it with `python -m nanochat.dataset{flag} -n 8` (downloads {title} shards) or, offline, "
        f"`python -m nanochat.dataset import PATH{flag}` (imports local .txt/.jsonl/.json/.parquet text)"
    )


def split_parquet_files(split, data_dir=None):
    """The shard paths of one split: 'train' = all but the last shard, 'val' = the last shard."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    paths = list_parquet_files(data_dir)
    where = base_data_dir(data_dir)
    if not paths:
        raise Missing(f"no parquet shards in {where}: {_fill_hint(where)}")
    if len(paths) == 1:
        raise Missing(
            f"only one shard in {where} ({os.path.basename(paths[0])}); the last shard is the validation split, "
            f"so at least 2 are needed: {_fill_hint(where)}"
        )
    return paths[:-1] if split == "train" else paths[-1:]


def parquets_iter_batched(split, start=0, step=1, data_dir=None):
    """
    Yield the documents of a split one row group at a time (a list[str] per row group).
    Within each file, row groups start, start+step, ... are read (nanochat's per-file striding).
    """
    if step < 1 or start < 0:
        raise ValueError(f"need start >= 0 and step >= 1, got start={start}, step={step}")
    for path in split_parquet_files(split, data_dir):
        pf = open_shard(path)
        for rg_idx in range(start, pf.num_row_groups, step):
            yield read_texts(pf, path, rg_idx)


def check_text_column(pf, path):
    names = pf.schema_arrow.names
    if "text" not in names:
        raise ValueError(f"{path} has no 'text' column (columns: {names}); shards need one")
    kind = pf.schema_arrow.field("text").type
    is_string_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_string_view(kind)):
        raise ValueError(f"{path}: the 'text' column holds {kind}, not strings; shards need text")


def shard_fix(path):
    """How to replace a bad shard: re-import an imported corpus, re-download a downloaded one."""
    data_dir = os.path.dirname(os.path.abspath(path))
    if os.path.exists(os.path.join(data_dir, IMPORT_INFO)):
        return (f"this corpus was imported ({IMPORT_INFO} there lists its sources): import it again with "
                f"`python -m nanochat.dataset import ...{data_flag(data_dir)} --overwrite`")
    return (f"move {os.path.basename(path)} out of {data_dir} and run `python -m nanochat.dataset{data_flag(data_dir)} "
            f"-n N` again (it downloads only the shards that are missing, so the file comes back whole)")


def open_shard(path):
    """pq.ParquetFile of a shard with a text column; an empty, truncated or foreign file is named with the fix."""
    try:
        pf = pq.ParquetFile(path)
    except (PermissionError, FileNotFoundError, IsADirectoryError):
        raise
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid for a bad footer, OSError for I/O-level damage
        size = os.path.getsize(path)
        why = "is empty (0 bytes)" if size == 0 else f"is truncated or not a parquet file ({size:,} bytes)"
        raise ValueError(f"shard {path} {why} ({short_error(e)}): {shard_fix(path)}") from e
    try:
        check_text_column(pf, path)
    except ValueError as e:
        raise ValueError(f"{e}: {shard_fix(path)}") from None
    return pf


def read_texts(pf, path, rg):
    """The documents of row group `rg` of an open shard; a damaged row group is named with the fix."""
    try:
        return pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
    except (pa.ArrowException, OSError) as e:  # e.g. "ZSTD decompression failed: Data corruption detected"
        raise ValueError(f"shard {path}: row group {rg} cannot be read, the file is damaged ({short_error(e)}): "
                         f"{shard_fix(path)}") from e


# -----------------------------------------------------------------------------
# The layers above this one, reached only lazily: this module imports none of them, so reading shards never loads
# the downloader, and they can import the layout above without a circle.


def download_single_file(index, *args, **kwargs):
    """Download shard `index` into the shard dir (nanochat's name; nanochat/data/download.py does the work)."""
    from nanochat.data.download import download_single_file as download

    return download(index, *args, **kwargs)


def main(argv=None):
    """nanochat's `python -m nanochat.dataset -n 8`: the command line (download, or `import`) is nanochat/data/cli.py."""
    from nanochat.data.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    run_main(main)
