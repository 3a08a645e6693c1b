"""`ServerControl`: weight updates, pause and resume on an `InferenceEngine`'s servers.

In-process servers (`InferenceEngine.local`) are called directly and fetch weights from the broadcast transport;
remote servers (`InferenceEngine.remote`) are reached through their control routes (`POST /v1/control/{action}`),
which need the servers' `inference.control_secret`.
"""

from __future__ import annotations

import time

import httpx

from marin_rl.broadcast.base import WeightSubscriber, WeightUpdate


class ServerControl:
    """Changes what the servers at `addresses` serve: `servers` are the in-process ones (empty for remote servers),
    `transport` the broadcast transport they fetch weights from, `control_secret` the remote servers' secret,
    `timeout_s` the limit of one control request."""

    def __init__(
        self,
        addresses: list[str],
        servers: list,
        transport=None,
        control_secret: str | None = None,
        timeout_s: float = 600.0,
    ):
        self.addresses = addresses
        self.servers = servers
        self.transport = transport
        self.control_secret = control_secret
        self.timeout_s = timeout_s
        self._subscribers = [WeightSubscriber(transport, s.apply_weights) for s in servers] if transport else []

    def apply_update(self, update: WeightUpdate) -> dict[str, float]:
        """Serve a published weight update on every server; blocks until every server serves it. Local servers
        fetch it from the transport; remote ones poll their own transport's latest publish through
        `POST /v1/control/weights` (the transport must reach across processes: arrow_flight, fsspec, ray). Returns
        timings; raises RuntimeError when a remote server refuses or serves another version."""
        start = time.time()
        if self.servers:
            results = [s.apply_update(update) for s in self._subscribers]
            apply_s = max(r["apply_s"] for r in results)
        else:
            for address in self.addresses:
                body = self._control(address, "weights")
                if int(body.get("version", -2)) != update.version:
                    raise RuntimeError(
                        f"server {address} serves version {body.get('version')} after the weight "
                        f"update, not {update.version}"
                    )
            apply_s = time.time() - start
        return {
            "broadcast/seconds": time.time() - start,
            "broadcast/apply_s": apply_s,
            "broadcast/bytes": update.num_bytes,
        }

    def pause(self) -> None:
        """Pause sampling on every server (requests in progress wait). Blocking."""
        self._on_every_server("pause")

    def resume(self) -> None:
        """Undo `pause`: the servers sample again. Blocking."""
        self._on_every_server("resume")

    def _on_every_server(self, action: str) -> None:
        """Call `action` ('pause' or 'resume') on each in-process server, or on each remote one's control route."""
        for s in self.servers:
            getattr(s, action)()
        if not self.servers:
            for address in self.addresses:
                self._control(address, action)

    def close(self) -> None:
        """Close the broadcast transport (the servers are stopped by their owner)."""
        if self.transport is not None:
            self.transport.close()

    def _control(self, address: str, action: str) -> dict:
        if self.control_secret is None:
            raise RuntimeError(f"{action} on remote servers needs the servers' control_secret")
        r = httpx.post(
            f"http://{address}/v1/control/{action}",
            headers={"Authorization": f"Bearer {self.control_secret}"},
            timeout=self.timeout_s,
        )
        if r.status_code != 200:
            raise RuntimeError(f"server {address} refused {action}: HTTP {r.status_code} {r.text}")
        return r.json()
