"""fsspec transport: each publish is a directory of raw tensors under `broadcast.path` (local or gs://).

Layout of `path`:

    p<publish time, µs>-v<version>-<id>/leaf-00000.bin ...   raw bytes of each tensor (C order)
    p<...>/manifest.json                                    dtypes, shapes, sizes; written after the tensors
    latest.json                                             names the newest complete directory; written last

A publish is visible only once `latest.json` names it, and that file is replaced atomically (a rename on local
disks; a single-object write on object stores), so `latest()` never returns a half-written version. Directories
are named by publish time, not version, so a learner restarted at a lower version is still the newest; the last
`broadcast.keep` directories are kept and older ones deleted. Tensors are written and read in parallel threads,
large ones in `broadcast.chunk_mb` ranges.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from marin_rl.atomic_files import write_atomically
from marin_rl.broadcast.arrays import aligned_empty, byte_view, dtype_from_name, dtype_name, host_leaves
from marin_rl.broadcast.base import BroadcastConfig, WeightTransport, WeightUpdate, register_transport

POINTER = "latest.json"
MANIFEST = "manifest.json"


@register_transport
class FsspecTransport(WeightTransport):
    """Publishes to, and loads from, a checkpoint directory on any fsspec filesystem."""

    name = "fsspec"

    def __init__(self, config: BroadcastConfig | None = None):
        super().__init__(config)
        if not self.config.path:
            raise ValueError("broadcast.path is required for the 'fsspec' transport")
        self.fs, self.root = fsspec.core.url_to_fs(self.config.path)
        self.root = self.root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._pool = ThreadPoolExecutor(self.config.fetch_threads, thread_name_prefix="fsspec-weights")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # ---- learner side ----------------------------------------------------------------------------------------
    def publish(self, version: int, params: Any) -> WeightUpdate:
        leaves = host_leaves(params, self.config.dtype)
        update = WeightUpdate(version, self.name, None, sum(x.nbytes for x in leaves))
        name = f"p{time.time_ns() // 1000:017d}-v{int(version)}-{update.publish_id[:8]}"
        self.fs.makedirs(self._path(name), exist_ok=True)
        list(self._pool.map(lambda i: self._write_leaf(name, i, leaves[i]), range(len(leaves))))
        manifest = {
            "version": int(version),
            "publish_id": update.publish_id,
            "leaves": [{"dtype": dtype_name(x.dtype), "shape": list(x.shape), "nbytes": int(x.nbytes)} for x in leaves],
        }
        self.fs.pipe_file(self._path(name, MANIFEST), json.dumps(manifest).encode())
        pointer = {"version": int(version), "publish_id": update.publish_id, "dir": name, "num_bytes": update.num_bytes}
        self._write_pointer(json.dumps(pointer).encode())
        update.payload = {"dir": name, "manifest": manifest}
        self._latest = update
        self._prune(keep_dir=name)
        return update

    def _write_leaf(self, name: str, index: int, leaf: np.ndarray) -> None:
        with self.fs.open(self._path(name, f"leaf-{index:05d}.bin"), "wb") as f:
            f.write(memoryview(byte_view(leaf)))

    def _write_pointer(self, data: bytes) -> None:
        write_atomically(self.fs, self._path(POINTER), data)

    def _prune(self, keep_dir: str) -> None:
        dirs = sorted(
            os.path.basename(p.rstrip("/"))
            for p in self.fs.ls(self.root, detail=False)
            if os.path.basename(p.rstrip("/")).startswith("p")
        )
        for old in dirs[: max(0, len(dirs) - self.config.keep)]:
            if old != keep_dir:
                self.fs.rm(self._path(old), recursive=True)

    # ---- server side -----------------------------------------------------------------------------------------
    def latest(self) -> WeightUpdate | None:
        """The update `latest.json` names (None when nothing was published yet)."""
        try:
            pointer = json.loads(self.fs.cat_file(self._path(POINTER)))
        except FileNotFoundError:
            return None
        return WeightUpdate(
            pointer["version"],
            self.name,
            {"dir": pointer["dir"]},
            pointer["num_bytes"],
            publish_id=pointer["publish_id"],
        )

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        name = update.payload["dir"]
        try:
            manifest = update.payload.get("manifest") or json.loads(self.fs.cat_file(self._path(name, MANIFEST)))
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"weights {name} are gone from {self.config.path} (only the last broadcast.keep="
                f"{self.config.keep} are kept); fetch the latest update"
            ) from e
        out = [aligned_empty(leaf["shape"], dtype_from_name(leaf["dtype"])) for leaf in manifest["leaves"]]
        chunk = self.config.chunk_mb << 20
        work = [
            (i, start, min(start + chunk, leaf["nbytes"]))
            for i, leaf in enumerate(manifest["leaves"])
            for start in range(0, leaf["nbytes"], chunk)
        ]
        views = [byte_view(x) for x in out]
        list(self._pool.map(lambda w: self._read_piece(name, views, *w), work))
        return out

    def _read_piece(self, name: str, views: list[np.ndarray], leaf: int, start: int, end: int) -> None:
        path = self._path(name, f"leaf-{leaf:05d}.bin")
        target = memoryview(views[leaf][start:end])
        if self._local:
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < end - start:
                    n = os.preadv(fd, [target[done:]], start + done)
                    if n == 0:
                        raise RuntimeError(f"{path} is shorter than its manifest says ({start + done} bytes)")
                    done += n
            finally:
                os.close(fd)
        else:
            data = self.fs.cat_file(path, start=start, end=end)
            if len(data) != end - start:
                raise RuntimeError(f"{path}: read {len(data)} bytes at {start}, expected {end - start}")
            target[:] = data

    def close(self) -> None:
        self._pool.shutdown(wait=False)
