"""
Atomic file writes, shared by checkpoints, the tokenizer and the data shards: write a temp file next to the target,
fsync it, rename it over the target, fsync the directory. Readers see the old file or the new one, never half of one,
and a crash mid-write leaves the previous file in place. No torch import here: the data tools use it too.
"""

import os
import tempfile


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
