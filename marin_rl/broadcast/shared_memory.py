"""Shared-memory transport: the learner copies each version into a slot file on a memory filesystem (/dev/shm), and
servers on the same machine serve the arrays straight from it.

Layout of the directory (`broadcast.path`, or a private `/dev/shm/marin_rl-weights-<pid>-<id>`):

    slot-0, slot-1, ...   one model's bytes each: a 4 KiB header (the publish id of the version inside), then every
                          tensor at a 64-byte-aligned offset
    latest.json           the newest publish (version, slot, tensor layout); replaced atomically after the data

Fast: a slot's pages are allocated and mapped once (`posix_fallocate` + `MAP_POPULATE`), so a publish is a
parallel memcpy into memory that is already touched, with the optional bf16 cast folded into the copy. A server
maps the slot read-only and gets NumPy views without a copy; on a CPU device 64-byte-aligned host arrays become
device arrays without a copy too, so the served model lives in the slot.

Safe: file locks. The publisher writes a slot only under an exclusive `flock` and never the slot of its latest
publish. A server takes a shared lock on the slot it fetches and keeps it until it serves a newer update
(`applied`), so no slot is rewritten while a server's arrays live in it; a lock dies with its process, so a
crashed server frees its slot. When every slot is held (a server is behind), `publish` waits for one, logging
after 10 s and failing after `PUBLISH_WAIT_S`. A server handed an update whose slot has since been rewritten with
a newer version finds another publish id in the header and raises `SupersededUpdate` instead of serving it.

Only servers on the learner's machine can use it (the update names the host; others get an error that says to use
'ray' or 'arrow_flight').
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import socket
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from marin_rl.broadcast.arrays import dtype_from_name, dtype_name, host_leaves, leaf_dtype
from marin_rl.broadcast.base import (
    BroadcastConfig,
    UpdateUnavailable,
    WeightTransport,
    WeightUpdate,
    register_transport,
)
from marin_rl.processes import remove_directories_of_dead_processes

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
PRIVATE_PREFIX = "marin_rl-weights-"
POINTER = "latest.json"
HEADER_BYTES = 4096
MAGIC = b"marin_rl-weights-v1\n"
ALIGN = 64
PUBLISH_WAIT_S = 600.0
"""Longest a publish waits for a server to release a slot before it fails."""
LOCK_WAIT_S = 120.0
"""Longest a fetch waits for the publisher to finish writing the slot it names."""


class SupersededUpdate(UpdateUnavailable):
    """The slot an update names holds a newer version by now; fetch the latest update instead."""


class MissingSlot(UpdateUnavailable, FileNotFoundError):
    """The slot file an update names is gone: its learner was closed, or died and a later learner on this machine
    removed its slots (or the update was published on another machine)."""


@dataclass
class _Mapping:
    """One open slot file: the descriptor the locks are taken on, and its memory map."""

    fd: int
    mm: mmap.mmap
    inode: int
    size: int

    def close(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)  # the map's own duplicate descriptor would keep a lock alive
        try:
            self.mm.close()
        except BufferError:  # arrays still view it: the map is freed with the last of them
            pass
        os.close(self.fd)


def slot_count(config: BroadcastConfig) -> int:
    """How many slots a publisher may create: `broadcast.keep`, at least 2 (one served, one being written)."""
    return max(2, config.keep)


def _layout(dtypes: list[np.dtype], shapes: list[tuple[int, ...]]) -> tuple[list[list], int]:
    """[offset, shape, dtype name] of every tensor in a slot, and the slot's size (whole pages)."""
    entries, offset = [], HEADER_BYTES
    for dtype, shape in zip(dtypes, shapes, strict=True):
        offset = -(-offset // ALIGN) * ALIGN
        entries.append([offset, list(shape), dtype_name(dtype)])
        offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return entries, -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _host_id() -> str:
    """This machine: host name and boot id (containers on one host with separate /dev/shm differ by host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def remove_stale_directories(root: str = DEFAULT_ROOT) -> list[str]:
    """Delete the private slot directories under `root` whose learner process is gone (killed before `close`);
    returns their paths."""
    return remove_directories_of_dead_processes(root, PRIVATE_PREFIX)


def _remove_published(directory: str, created: list[str], owned: bool) -> None:
    for path in created:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if owned:
        shutil.rmtree(directory, ignore_errors=True)


@register_transport
class SharedMemoryTransport(WeightTransport):
    """Publishes into model-sized slots on a memory filesystem; servers on the same machine read them in place."""

    name = "shared_memory"

    def __init__(self, config: BroadcastConfig | None = None):
        super().__init__(config)
        self.directory: str | None = self.config.path
        self.max_slots = slot_count(self.config)
        self._pool = ThreadPoolExecutor(
            max(1, min(self.config.fetch_threads, os.cpu_count() or 1)), thread_name_prefix="shm-weights"
        )
        # Learner side: writable maps of the slots this object created, and the slot of its latest publish.
        self._slots: dict[int, _Mapping] = {}
        self._latest_slot: int | None = None
        self._created: list[str] = []
        self._finalizer = None
        # Server side: read-only maps by path, and the paths this object holds a shared lock on.
        self._readers: dict[str, _Mapping] = {}
        self._pinned: set[str] = set()

    # ---- learner side ----------------------------------------------------------------------------------------
    def _ensure_directory(self) -> str:
        if self.directory is None:
            remove_stale_directories()
            self.directory = os.path.join(DEFAULT_ROOT, f"{PRIVATE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.makedirs(self.directory)
            owned = True
        else:
            os.makedirs(self.directory, exist_ok=True)
            owned = False
        if self._finalizer is None:  # remove the slots at exit even when `close` is never called
            self._finalizer = weakref.finalize(self, _remove_published, self.directory, self._created, owned)
        return self.directory

    def _create_slot(self, index: int, size: int) -> _Mapping:
        path = os.path.join(self.directory, f"slot-{index}")
        if index in self._slots:  # too small: a new file; readers of the old one keep their maps
            self._slots.pop(index).close()
            os.unlink(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                raise RuntimeError(f"{path}: a new slot file is locked by another process")
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                free = shutil.disk_usage(self.directory).free
                raise OSError(
                    e.errno,
                    f"cannot allocate a {size / 1e6:.0f} MB weight slot in {self.directory} ({free / 1e6:.0f} MB "
                    f"free): enlarge that filesystem, set broadcast.path to a larger memory filesystem, or use "
                    f"broadcast.transport 'ray'",
                ) from e
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # pages mapped now, not per write
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        mapping = _Mapping(fd, mm, os.fstat(fd).st_ino, size)
        self._slots[index] = mapping
        if path not in self._created:
            self._created.append(path)
        return mapping

    def _acquire_slot(self, size: int) -> tuple[int, _Mapping]:
        """A slot of at least `size` bytes under this object's exclusive lock: a free one (not the latest publish,
        held by no server), else a new one while fewer than `max_slots` exist, else wait for one."""
        start, warned = time.monotonic(), False
        while True:
            for index, mapping in sorted(self._slots.items()):
                if index != self._latest_slot and _try_lock(mapping.fd, fcntl.LOCK_EX):
                    if mapping.size < size:
                        fcntl.flock(mapping.fd, fcntl.LOCK_UN)
                        return index, self._create_slot(index, size)
                    return index, mapping
            if len(self._slots) < self.max_slots:
                index = min(set(range(self.max_slots)) - set(self._slots))
                return index, self._create_slot(index, size)
            waited = time.monotonic() - start
            if waited > PUBLISH_WAIT_S:
                raise TimeoutError(
                    f"no free weight slot in {self.directory} after {waited:.0f} s: every one of the "
                    f"{self.max_slots} slots is held by a server that has not applied a newer version"
                )
            if waited > 10 and not warned:
                logger.warning(
                    "publish waits for a server to release one of %d weight slots in %s (%.0f s)",
                    self.max_slots,
                    self.directory,
                    waited,
                )
                warned = True
            time.sleep(0.002)

    def _copy(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy (and cast) each source into its destination view, large arrays split into `chunk_mb` pieces so
        that the threads share the work."""
        chunk = self.config.chunk_mb << 20
        work = []
        for dst, src in pieces:
            dst, src = dst.reshape(-1), np.ascontiguousarray(src).reshape(-1)
            step = max(1, chunk // max(1, dst.itemsize))
            work.extend((dst[i : i + step], src[i : i + step]) for i in range(0, dst.size, step))
        list(self._pool.map(lambda w: np.copyto(w[0], w[1], casting="unsafe"), work))

    def publish(self, version: int, params: Any) -> WeightUpdate:
        sources = host_leaves(params, self.config.dtype, cast_host_arrays=False)  # cast while copying instead
        dtypes = [leaf_dtype(x, self.config.dtype) for x in sources]
        entries, size = _layout(dtypes, [x.shape for x in sources])
        self._ensure_directory()
        index, slot = self._acquire_slot(size)
        publish_id = uuid.uuid4().hex
        try:
            slot.mm[: len(MAGIC) + 32] = b"\0" * (len(MAGIC) + 32)  # no valid publish id while the data changes
            views = [
                np.frombuffer(slot.mm, dt, int(np.prod(shape, dtype=np.int64)), off).reshape(shape)
                for (off, shape, _), dt in zip(entries, dtypes, strict=True)
            ]
            self._copy(list(zip(views, sources, strict=True)))
            del views
            slot.mm[: len(MAGIC) + 32] = MAGIC + publish_id.encode()
        finally:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)
        num_bytes = sum(
            int(np.prod(shape, dtype=np.int64)) * dt.itemsize for (_, shape, _), dt in zip(entries, dtypes, strict=True)
        )
        payload = {"host": _host_id(), "directory": self.directory, "slot": index, "leaves": entries}
        update = WeightUpdate(int(version), self.name, payload, num_bytes, publish_id=publish_id)
        self._latest_slot = index
        self._write_pointer(update)
        self._latest = update
        return update

    def _write_pointer(self, update: WeightUpdate) -> None:
        pointer = {
            "version": update.version,
            "publish_id": update.publish_id,
            "num_bytes": update.num_bytes,
            "published_at": update.published_at,
            "payload": update.payload,
        }
        target = os.path.join(self.directory, POINTER)
        tmp = f"{target}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump(pointer, f)
        os.replace(tmp, target)  # atomic: a reader sees the previous pointer or this one
        if target not in self._created:
            self._created.append(target)

    # ---- server side -----------------------------------------------------------------------------------------
    def latest(self) -> WeightUpdate | None:
        """This object's last publish; otherwise the update `latest.json` in `broadcast.path` names (None when
        nothing was published there yet)."""
        if self._latest is not None or self.directory is None:
            return self._latest
        try:
            with open(os.path.join(self.directory, POINTER)) as f:
                pointer = json.load(f)
        except FileNotFoundError:
            return None
        return WeightUpdate(
            pointer["version"],
            self.name,
            pointer["payload"],
            pointer["num_bytes"],
            publish_id=pointer["publish_id"],
            published_at=pointer["published_at"],
        )

    def _reader(self, path: str) -> _Mapping:
        """A read-only map of the slot file at `path` (a new one when the file was replaced)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise MissingSlot(
                f"weight slot {path} does not exist here; was the learner closed, or is this another machine's "
                f"/dev/shm?"
            ) from None
        info = os.fstat(fd)
        cached = self._readers.get(path)
        if cached is not None and (cached.inode, cached.size) == (info.st_ino, info.st_size):
            os.close(fd)
            return cached
        if cached is not None:  # replaced by the publisher, so no longer held by this server
            cached.close()
            self._pinned.discard(path)
        # Read-only (a server cannot corrupt the slot), pages mapped now: once per slot file, not per version.
        mm = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        mapping = _Mapping(fd, mm, info.st_ino, info.st_size)
        self._readers[path] = mapping
        return mapping

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        """Read-only views of the update's arrays inside its slot; the slot stays locked against rewrites until
        a newer update is `applied` (or this transport is closed)."""
        payload = update.payload
        if payload["host"] != _host_id():
            raise RuntimeError(
                f"'shared_memory' weights were published on {payload['host'].split('/')[0]!r}, this server runs on "
                f"{socket.gethostname()!r}: servers on other machines need broadcast.transport 'ray' or "
                f"'arrow_flight'"
            )
        path = os.path.join(payload["directory"], f"slot-{payload['slot']}")
        mapping = self._reader(path)
        held = path in self._pinned
        start = time.monotonic()
        while not _try_lock(mapping.fd, fcntl.LOCK_SH):  # the publisher holds it only while it writes
            if time.monotonic() - start > LOCK_WAIT_S:
                raise TimeoutError(f"weight slot {path} stayed locked by its writer for {LOCK_WAIT_S:.0f} s")
            time.sleep(0.001)
        if bytes(mapping.mm[: len(MAGIC) + 32]) != MAGIC + update.publish_id.encode():
            if not held:
                fcntl.flock(mapping.fd, fcntl.LOCK_UN)
            raise SupersededUpdate(
                f"version {update.version} (publish {update.publish_id[:8]}) was overwritten in {path} by a newer "
                f"publish; fetch the latest update"
            )
        self._pinned.add(path)
        return [
            np.frombuffer(mapping.mm, dtype_from_name(dt), int(np.prod(shape, dtype=np.int64)), off).reshape(shape)
            for off, shape, dt in payload["leaves"]
        ]

    def applied(self, update: WeightUpdate) -> None:
        """`update` is served now: release the slots of the updates fetched before it."""
        keep = os.path.join(update.payload["directory"], f"slot-{update.payload['slot']}")
        for path in list(self._pinned):
            if path != keep:
                fcntl.flock(self._readers[path].fd, fcntl.LOCK_UN)
                self._pinned.discard(path)

    def close(self) -> None:
        for mapping in self._readers.values():
            mapping.close()  # closing the descriptor drops its locks
        self._readers.clear()
        self._pinned.clear()
        for mapping in self._slots.values():
            mapping.close()
        self._slots.clear()
        if self._finalizer is not None:
            self._finalizer()  # remove the slot files and pointer this object wrote
        self._pool.shutdown(wait=False)
