"""Replacing a small file atomically on any fsspec filesystem, so that a reader sees the old content or the new."""

from __future__ import annotations

import os
import uuid

from fsspec.implementations.local import LocalFileSystem


def write_atomically(fs, path: str, data: bytes) -> None:
    """Write `data` to `path` on `fs` so that a reader sees the previous file or the whole new one: on a local disk
    a hidden temporary file beside it, synced, then renamed over it (atomic on POSIX); on an object store one
    object write (which replaces a whole object atomically)."""
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
