"""Putting each role's actors where `placement` says: feasibility checks, placement groups, actor options.

`Launcher.check` fails at once when a request cannot be met by any live node (the message names the role, the
request and what the cluster has); `Launcher.reserve` creates the placement groups (the learner's hosts, a TPU
slice, colocated learner/server bundles, a role's own strategy) and waits for them a bounded time; the `*_options`
methods are what each actor is created with. See `marin_rl.placement` for the layouts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from marin_rl.config import RunConfig
from marin_rl.placement import PlacementError, RoleResources, check_feasible, cluster_nodes, tpu_slice_shape

logger = logging.getLogger("marin_rl")

_MIN_CPU = 0.001
"""A placement-group bundle may not be empty: a role that reserves nothing gets this much CPU in its bundle."""


def _bundle(res: RoleResources, tpu_chips: int | None = None) -> dict[str, float]:
    bundle = res.ray_resources()
    if tpu_chips:
        bundle["TPU"] = float(tpu_chips)
    return bundle or {"CPU": _MIN_CPU}


def _in_bundle(res: RoleResources, role: str, group, index: int, bundle: dict[str, float], share: float) -> dict:
    """Options of an actor that takes `share` of bundle `index` of placement group `group`."""
    custom = {k: v * share for k, v in bundle.items() if k not in ("CPU", "GPU")}
    options: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 0.0) * share,
        "num_gpus": bundle.get("GPU", 0.0) * share,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
    }
    if custom:
        options["resources"] = custom
    env = res.process_env(role)
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


class Launcher:
    """Options (Ray resources, placement-group bundles, environment) for every actor of a run."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.placement = config.placement
        self.hosts = config.learner.hosts
        self.num_servers = config.inference.num_servers
        self.num_env_actors = sum(e.replicas for e in config.envs)
        self.groups: dict[str, Any] = {}
        self._tpu_slice = None
        self._env_slots: dict[tuple[int, int], int] = {}

    # ---- before anything starts ---------------------------------------------------------------------------
    def _learner_request(self) -> RoleResources:
        lr = self.placement.learner
        if lr.tpu_version is None:
            return lr
        _, chips = tpu_slice_shape(lr.tpu_version, lr.tpu_topology)
        return dataclasses.replace(lr, tpu_chips=chips, tpu_version=None, tpu_topology=None)

    def check(self) -> None:
        """Raise `PlacementError` when a role's request cannot be met by the live nodes (at once, not by hanging)."""
        p = self.placement
        requests = {
            "learner": (self._learner_request(), self.hosts),
            "servers": (p.servers, 0 if p.colocate else self.num_servers),  # colocated: inside the learner's bundles
            "envs": (p.envs, self.num_env_actors),
        }
        check_feasible(requests, cluster_nodes())

    def reserve(self) -> None:
        """Create the placement groups the layout needs and wait for them (`placement.wait_timeout_s`)."""
        p = self.placement
        lr = p.learner
        if lr.tpu_version is not None:
            from ray.util.tpu import slice_placement_group

            self._tpu_slice = slice_placement_group(lr.tpu_topology, lr.tpu_version)
            self.groups["learner"] = self._tpu_slice.placement_group
        elif self.hosts > 1 or p.colocate or lr.strategy is not None:
            strategy = lr.strategy or ("STRICT_PACK" if p.colocate and self.hosts == 1 else "SPREAD")
            self.groups["learner"] = placement_group([_bundle(lr)] * self.hosts, strategy=strategy)
        if not p.colocate and p.servers.strategy is not None:
            self.groups["servers"] = placement_group(
                [_bundle(p.servers)] * self.num_servers, strategy=p.servers.strategy
            )
        if p.envs.strategy is not None:
            self.groups["envs"] = placement_group([_bundle(p.envs)] * self.num_env_actors, strategy=p.envs.strategy)
        deadline = time.time() + p.wait_timeout_s
        for role, group in self.groups.items():
            left = max(0.0, deadline - time.time())
            if not ray.wait([group.ready()], timeout=left)[0]:
                raise PlacementError(
                    f"placement.{role}: its placement group ({len(group.bundle_specs)} bundles of "
                    f"{group.bundle_specs[0]}) was not granted within placement.wait_timeout_s={p.wait_timeout_s:g}s; "
                    f"available: {ray.available_resources()}"
                )

    def release(self) -> None:
        """Remove the placement groups (their actors must be gone or going)."""
        for group in self.groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # already removed, or Ray is shutting down
                pass
        if self._tpu_slice is not None:
            try:
                self._tpu_slice.shutdown()
            except Exception:
                pass
        self.groups.clear()

    # ---- per actor ----------------------------------------------------------------------------------------
    def learner_options(self, host: int) -> dict[str, Any]:
        """Options of learner process `host`."""
        p = self.placement
        group = self.groups.get("learner")
        if group is None:
            return p.learner.actor_options("learner")
        bundle = group.bundle_specs[host]
        return _in_bundle(p.learner, "learner", group, host, bundle, 0.5 if p.colocate else 1.0)

    def server_options(self, index: int) -> dict[str, Any]:
        """Options of inference server `index` (colocated: half of learner host `index`'s bundle)."""
        p = self.placement
        if p.colocate:
            group = self.groups["learner"]
            return _in_bundle(p.servers, "servers", group, index, group.bundle_specs[index], 0.5)
        group = self.groups.get("servers")
        if group is None:
            return p.servers.actor_options("servers")
        return _in_bundle(p.servers, "servers", group, index, group.bundle_specs[index], 1.0)

    def env_options(self, env_index: int, replica: int) -> dict[str, Any]:
        """Options of replica `replica` of environment `env_index` (a replacement takes its predecessor's slot)."""
        p = self.placement
        group = self.groups.get("envs")
        if group is None:
            return p.envs.actor_options("envs")
        slot = self._env_slots.setdefault((env_index, replica), len(self._env_slots))
        return _in_bundle(p.envs, "envs", group, slot, group.bundle_specs[slot], 1.0)
