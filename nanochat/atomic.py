"""
Atomic file writes, shared by checkpoints, the tokenizer and the data shards: write a temp file next to the target,
fsync it, rename it over the target, fsync the directory. Readers see the old file or the new one, never half of one,
and a crash mid-write leaves the previous file in place. No torch import here: the data tools use it too.

And the other side, for readers that name a damaged file (a copy cut short, an empty file): `short_error` and
`torch_file_problem`.
"""

import os
import tempfile
import zipfile


def fsync_dir(path):
    """Flush a directory entry: a rename is durable only once its directory is synced (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, write):
    """Call write(binary_file) on a temp file in path's directory, fsync, rename over path, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); give it the usual permissions (0666 less the umask)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def short_error(e):
    """An exception's type and first sentence: torch's and pyarrow's load errors go on for paragraphs."""
    first = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def torch_file_problem(path):
    """What is wrong with a file torch.load could not read, when it shows in the file itself (else None)."""
    size = os.path.getsize(path)
    if size == 0:
        return "is empty (0 bytes)"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive whose directory is at the end
        return f"is truncated or not a torch file ({size:,} bytes, no zip directory at its end)"
    return None
