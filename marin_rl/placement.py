"""Where each role's processes run: Ray resources, placement groups and the JAX settings of each process.

Three roles: the learner (`learner.hosts` processes, one per host of a multi-host mesh), the inference servers
(`inference.num_servers`) and the env actors. Each role's `RoleResources` says what one of its processes asks Ray
for (CPUs, GPUs, TPU chips, an accelerator type, custom resources) and how its JAX runtime is set up (the device
memory fraction, preallocation, extra environment variables, the cores it runs on). Env actors get
`JAX_PLATFORMS=cpu` unless told otherwise: they never need an accelerator, and a JAX process that opens one can take
its memory (on a TPU VM only one process may open the TPU).

Layouts:

* disaggregated (default): every process asks for its own resources; with `num_gpus: 1` each learner host and
  each embedded server gets a GPU of its own (Ray sets `CUDA_VISIBLE_DEVICES`).
* colocated (`placement.colocate: true`): learner host i and server i share one placement-group bundle of the
  learner's resources (one device), each taking half of its CPUs and GPUs and the device memory fraction given
  explicitly in `learner.memory_fraction` and `servers.memory_fraction` (required on accelerators; together at
  most 1).
* a TPU slice (`learner.tpu_version` + `learner.tpu_topology`): the learner's hosts are the hosts of one slice,
  reserved with Ray's `slice_placement_group` (one bundle of `TPU` chips per host), as Levanter's Ray TPU helpers
  schedule them.

Before anything starts, `check_feasible` compares every request with the live nodes and fails at once with a
message naming the role, the request and what the cluster has. After that, `wait_for_actors` bounds every start and
every replacement in two steps: a process has `placement.wait_timeout_s` to be placed (scheduled on a node, its
process started), then its role's start-up limit to answer (a server: `inference.startup_timeout_s`, for vLLM's long
start). When a node dies, the roles pinned to it wait for a node that offers their resources to join; once
`placement.wait_timeout_s` passes without one, the run fails with a `PlacementError` naming the role, the resource
that no live node offers and the dead node that had it (`lost_placement`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from marin_rl.bounds import bounded, check_fields

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ROLES = ("learner", "servers", "envs")


CPU_AFFINITY_ENV = "MARIN_RL_CPU_AFFINITY"
"""Environment variable naming the cores ('0,2') a marin_rl process pins itself to when it imports the package."""


def apply_cpu_affinity(spec: str | None = None) -> list[int] | None:
    """Pin every thread of this process to the cores in `spec` ('0,1'; default: `$MARIN_RL_CPU_AFFINITY`); threads
    started later inherit it. Returns the cores, or None when there is nothing to do. Raises ValueError for a
    malformed spec or cores this machine lacks."""
    import os

    spec = os.environ.get(CPU_AFFINITY_ENV) if spec is None else spec
    if not spec:
        return None
    try:
        cores = sorted({int(c) for c in spec.split(",") if c.strip()})
    except ValueError as e:
        raise ValueError(f"{CPU_AFFINITY_ENV}={spec!r}: expected core numbers such as '0,1'") from e
    available = os.cpu_count() or 1
    if not cores or cores[-1] >= available:
        raise ValueError(f"{CPU_AFFINITY_ENV}={spec!r}: this machine has cores 0-{available - 1}")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return cores


class PlacementError(RuntimeError):
    """A role's resources cannot be had (or its process did not start in time): the message names the role, its
    request and what the cluster has."""


@dataclass
class RoleResources:
    """What one process of a role asks Ray for, and how its JAX runtime is set up."""

    num_cpus: float = bounded(0.0, ge=0)
    """CPUs reserved per process (0: none reserved; the process still runs)."""
    num_gpus: float = bounded(0.0, ge=0)
    """GPUs per process (fractions share a GPU; 0: none); Ray sets `CUDA_VISIBLE_DEVICES` accordingly."""
    tpu_chips: int = bounded(0, ge=0)
    """TPU chips per process (Ray resource `TPU`; 0: none)."""
    tpu_version: str | None = None
    """Learner only: the TPU generation of a slice to run on ('v4', 'v5p', 'v5litepod', 'v6e', ...), with
    `tpu_topology`: the learner's hosts become the slice's hosts (Ray's `slice_placement_group`)."""
    tpu_topology: str | None = None
    """Learner only: the slice's topology, e.g. '2x2x4' (a v4-32: 4 hosts of 4 chips)."""
    accelerator_type: str | None = None
    """Ray accelerator type the process must run on, e.g. 'H100', 'A100', 'TPU-V4' (None: any)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per process, e.g. {'rollout_node': 1} to pin a role to nodes that declare it."""
    strategy: str | None = None
    """Placement-group strategy for the role's processes together ('PACK', 'SPREAD', 'STRICT_PACK',
    'STRICT_SPREAD'): they are then scheduled all or none. None: no group (each process placed on its own); a
    multi-host learner always uses a group ('SPREAD' when None)."""
    memory_fraction: float | None = bounded(None, gt=0, le=1)
    """Fraction of the accelerator's memory JAX may take in this process (`XLA_PYTHON_CLIENT_MEM_FRACTION`)."""
    preallocate: bool | None = None
    """Whether JAX preallocates that memory at start (`XLA_PYTHON_CLIENT_PREALLOCATE`; None: JAX's default)."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment variables of the process (e.g. `XLA_FLAGS`, `JAX_PLATFORMS`)."""
    cpu_affinity: list[int] | None = None
    """CPU cores the process runs on (Linux; by core number on its node), set as soon as it imports marin_rl, before
    JAX starts its thread pools, which are then sized to these cores (`CPU_AFFINITY_ENV`). For small machines where
    the learner and the servers would otherwise contend for the same cores. None: all cores."""

    def __post_init__(self):
        check_fields(self, "placement")
        if self.strategy is not None and self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement: strategy must be one of {PLACEMENT_STRATEGIES} or null, got {self.strategy!r}"
            )
        if (self.tpu_version is None) != (self.tpu_topology is None):
            raise ValueError("placement: give both tpu_version and tpu_topology (a TPU slice), or neither")
        if any(v < 0 for v in self.resources.values()):
            raise ValueError(f"placement: resources must be >= 0, got {self.resources}")
        if self.cpu_affinity is not None and (not self.cpu_affinity or min(self.cpu_affinity) < 0):
            raise ValueError(
                f"placement: cpu_affinity must list core numbers >= 0 (or be null), got {self.cpu_affinity}"
            )

    def ray_resources(self) -> dict[str, float]:
        """Everything one process asks Ray for, as Ray names it (CPU, GPU, TPU, accelerator_type:X, custom)."""
        out: dict[str, float] = {}
        if self.num_cpus:
            out["CPU"] = float(self.num_cpus)
        if self.num_gpus:
            out["GPU"] = float(self.num_gpus)
        if self.tpu_chips:
            out["TPU"] = float(self.tpu_chips)
        if self.accelerator_type:
            out[f"accelerator_type:{self.accelerator_type}"] = 0.001
        out.update({k: float(v) for k, v in self.resources.items()})
        return out

    def process_env(self, role: str) -> dict[str, str]:
        """Environment variables of one of the role's processes (JAX memory settings, `env`)."""
        env: dict[str, str] = {}
        if role == "envs":
            env["JAX_PLATFORMS"] = "cpu"
        if self.memory_fraction is not None:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{self.memory_fraction:g}"
        if self.preallocate is not None:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if self.preallocate else "false"
        if self.cpu_affinity is not None:
            env[CPU_AFFINITY_ENV] = ",".join(str(c) for c in self.cpu_affinity)
        env.update(self.env)
        return env

    def actor_options(self, role: str) -> dict[str, Any]:
        """`ActorClass.options(...)` for one process of the role (outside any placement group)."""
        custom = {k: float(v) for k, v in self.resources.items()}
        if self.tpu_chips:
            custom["TPU"] = float(self.tpu_chips)
        options: dict[str, Any] = {"num_cpus": float(self.num_cpus), "num_gpus": float(self.num_gpus)}
        if custom:
            options["resources"] = custom
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        env = self.process_env(role)
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options

    def describe(self) -> str:
        """The request in words, for messages."""
        request = self.ray_resources() or {"CPU": 0}
        return ", ".join(f"{k}: {v:g}" for k, v in request.items())


def tpu_slice_shape(version: str, topology: str) -> tuple[int, int]:
    """(hosts, chips per host) of a TPU slice of `version` and `topology`, as Ray's TPU support counts them."""
    import ray.util.tpu as tpu

    if version not in tpu.VALID_TPU_TYPES:
        raise ValueError(f"placement.learner.tpu_version must be one of {tpu.VALID_TPU_TYPES}, got {version!r}")
    chips = tpu.get_num_chips_from_topology(topology)
    per_host = tpu.get_chips_per_host(topology, version)
    return max(1, chips // per_host), per_host


@dataclass
class PlacementConfig:
    """Where the learner, the inference servers and the env actors run (see `marin_rl.placement`)."""

    learner: RoleResources = field(default_factory=RoleResources)
    """Resources of each learner process (one per host of the learner's mesh, `learner.hosts`)."""
    servers: RoleResources = field(default_factory=RoleResources)
    """Resources of each inference server (with the vLLM backend, `num_gpus` >= its tensor-parallel size)."""
    envs: RoleResources = field(default_factory=RoleResources)
    """Resources of each env actor."""
    colocate: bool = False
    """Run server i on learner host i's device (one placement-group bundle of the learner's resources, split in
    half); needs `inference.num_servers == learner.hosts` and, on accelerators, explicit `memory_fraction`s."""
    wait_timeout_s: float = bounded(300.0, gt=0)
    """How long a process of any role (at the start, or replacing one that died) may wait to be placed on a node
    before the run fails, naming what it waits for. A role whose node died waits this long for a node that offers
    its resources to join, then fails naming the resource and the lost node. Once placed, a process has its role's
    start-up limit (a server: `inference.startup_timeout_s`; the learner and env actors: this same limit again)."""

    def __post_init__(self):
        check_fields(self, "placement")
        for role in ("servers", "envs"):
            r = getattr(self, role)
            if r.tpu_version is not None:
                raise ValueError(f"placement.{role}: a TPU slice (tpu_version/tpu_topology) is for the learner only")
        if self.colocate:
            lr, sv = self.learner, self.servers
            if lr.tpu_chips or lr.tpu_version or sv.tpu_chips:
                raise ValueError(
                    "placement.colocate: on a TPU only one process can open the chips, so the learner and a server "
                    "cannot share them; give the servers hosts of their own"
                )
            if lr.num_gpus and (lr.memory_fraction is None or sv.memory_fraction is None):
                raise ValueError(
                    "placement.colocate on GPUs needs explicit placement.learner.memory_fraction and "
                    "placement.servers.memory_fraction (two JAX processes share the device's memory)"
                )
            if (lr.memory_fraction or 0) + (sv.memory_fraction or 0) > 1 + 1e-9:
                raise ValueError(
                    f"placement.colocate: learner.memory_fraction + servers.memory_fraction = "
                    f"{(lr.memory_fraction or 0) + (sv.memory_fraction or 0):g} > 1"
                )

    def role(self, name: str) -> RoleResources:
        if name not in ROLES:
            raise KeyError(name)
        return getattr(self, name)


def _shown_resources(resources: dict[str, float]) -> str:
    """Resources as 'name: amount, ...' without Ray's bookkeeping ones (node ids, memory, object store)."""
    shown = sorted((k, v) for k, v in resources.items() if not k.startswith(("node:", "memory", "object_store")))
    return ", ".join(f"{k}: {v:g}" for k, v in shown)


def _node_summary(nodes: list[dict]) -> str:
    parts = [f"{n.get('NodeManagerAddress', '?')} {{{_shown_resources(n.get('Resources', {}))}}}" for n in nodes]
    return "; ".join(parts) or "no live node"


def _fits(node: dict, want: dict[str, float]) -> bool:
    return all(node.get("Resources", {}).get(k, 0.0) >= v for k, v in want.items())


def check_feasible(requests: dict[str, tuple[RoleResources, int]], nodes: list[dict]) -> None:
    """Raise `PlacementError` if a role's process fits no live node, or all roles together exceed the cluster.

    `requests`: role -> (its resources, how many processes); `nodes`: `ray.nodes()`.
    """
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    totals: dict[str, float] = {}
    for n in alive:
        for k, v in n.get("Resources", {}).items():
            totals[k] = totals.get(k, 0.0) + v
    needed: dict[str, float] = {}
    for role, (res, count) in requests.items():
        want = res.ray_resources()
        if count and want and not any(_fits(n, want) for n in alive):
            raise PlacementError(
                f"placement.{role}: no node can run one of its processes, which asks for {{{res.describe()}}}; the "
                f"cluster has: {_node_summary(alive)}"
            )
        for k, v in want.items():
            needed[k] = needed.get(k, 0.0) + v * count
    short = {k: (v, totals.get(k, 0.0)) for k, v in needed.items() if v > totals.get(k, 0.0) + 1e-9}
    if short:
        detail = ", ".join(f"{k}: {need:g} needed, {have:g} in the cluster" for k, (need, have) in short.items())
        roles = ", ".join(f"{r} ({c} × {{{res.describe()}}})" for r, (res, c) in requests.items() if c)
        raise PlacementError(
            f"placement: the roles together need more than the cluster has ({detail}); requests: {roles}"
        )


def _is_alive(node: dict) -> bool:
    return bool(node.get("Alive", node.get("alive", False)))


_seen_resources: dict[str, dict[str, float]] = {}
"""Node id -> the total resources of each live node that `cluster_nodes` saw in this process."""


def cluster_nodes() -> list[dict]:
    """`ray.nodes()`, with each dead node's resources as this process last saw them alive (Ray reports none for a
    dead node), so that a message can say which node a lost resource was on."""
    import ray

    nodes = ray.nodes()
    for n in nodes:
        if _is_alive(n) and n.get("NodeID"):
            _seen_resources[n["NodeID"]] = dict(n.get("Resources", {}))
    return [
        n if _is_alive(n) or n.get("Resources") else {**n, "Resources": _seen_resources.get(n.get("NodeID"), {})}
        for n in nodes
    ]


def lost_placement(role: str, res: RoleResources, nodes: list[dict]) -> str | None:
    """Why no live node can run one of the role's processes any more, or None when one could (by the nodes' total
    resources, whatever others hold now): the resources no live node offers and the dead nodes that offered them.

    `nodes`: `cluster_nodes()` (dead nodes with the resources they had).
    """
    want = res.ray_resources()
    alive = [n for n in nodes if _is_alive(n)]
    if not want or any(_fits(n, want) for n in alive):
        return None
    missing = {k: v for k, v in want.items() if not any(n.get("Resources", {}).get(k, 0.0) >= v for n in alive)}
    missing = missing or want  # each resource exists somewhere, but no live node has them all
    dead = [n for n in nodes if not _is_alive(n) and _fits(n, missing)]
    lost = ", ".join(f"{n.get('NodeManagerAddress', '?')} (node id {n.get('NodeID', '?')})" for n in dead)
    shown = ", ".join(f"{k}: {v:g}" for k, v in missing.items())
    asks = "" if missing == want else f" (each of its processes asks for {{{res.describe()}}})"
    where = f"the dead node {lost} offered it" if lost else "no node in the cluster's records offered it"
    return f"placement.{role}: no live node offers {{{shown}}}{asks} any more; {where}"


def _pending_error(pending: list[str], requests: dict[str, RoleResources], timeout_s: float) -> PlacementError:
    """The error for processes of the roles `pending` (one entry per process) not placed within `timeout_s`."""
    import ray

    roles = sorted(set(pending))
    nodes = cluster_nodes()
    lost = [why for r in roles if (why := lost_placement(r, requests[r], nodes)) is not None]
    if lost:
        return PlacementError(
            f"{'; '.join(lost)}; no node with it joined within placement.wait_timeout_s={timeout_s:g}s "
            f"({len(pending)} process(es) of {', '.join(roles)} pending)"
        )
    waiting = "; ".join(f"{r} asks for {{{requests[r].describe()}}} per process" for r in roles)
    available = _shown_resources(ray.available_resources())
    return PlacementError(
        f"placement: {len(pending)} process(es) of {', '.join(roles)} still pending after {timeout_s:.0f}s "
        f"(placement.wait_timeout_s): {waiting}; available now: {available or 'nothing'}"
    )


def wait_for_actors(
    pending: dict[str, list[tuple[Any, Any]]],
    requests: dict[str, RoleResources],
    timeout_s: float,
    startup: dict[str, tuple[float, str]] | None = None,
    since: float | None = None,
) -> dict[str, list[Any]]:
    """Wait until every actor answers its ready call; returns role -> the calls' results, in order.

    `pending`: role -> [(actor, ready ObjectRef)]. Two limits: every actor must be placed (on a node, its process
    started and its constructor done: Ray's `__ray_ready__`, or its ready call, answers) within `timeout_s`
    (`placement.wait_timeout_s`) of `since` (default: now; a replacement started again after one died keeps its
    first start); then each role's ready calls have `startup[role]` = (seconds, the setting's name) more (default:
    `timeout_s`, 'placement.wait_timeout_s'). Raises `PlacementError` naming what is still pending (the resource no
    live node offers and the lost node, when that is why), or still starting; a dead actor's `RayActorError` and a
    failed ready call's error as soon as they are seen.
    """
    import ray

    # an actor is placed once either call answers (one that runs a call at a time answers `__ray_ready__` only
    # after its ready call)
    actors = [(role, (a.__ray_ready__.remote(), ref)) for role, items in pending.items() for a, ref in items]
    owner = {ref: k for k, (_, refs) in enumerate(actors) for ref in refs}
    deadline = (time.time() if since is None else since) + timeout_s
    unplaced = set(range(len(actors)))
    told = False  # whether a wait for a lost resource was logged
    while unplaced:
        left = max(0.0, deadline - time.time())
        refs = [ref for k in unplaced for ref in actors[k][1]]
        done, _ = ray.wait(refs, num_returns=1, timeout=left if told else min(left, 5.0))
        ray.get(done)  # raises a dead actor's error
        unplaced -= {owner[ref] for ref in done}
        if unplaced and not done:
            roles = sorted({actors[k][0] for k in unplaced})
            if time.time() >= deadline:
                raise _pending_error([actors[k][0] for k in unplaced], requests, timeout_s)
            if not told:  # pending for a while: say so once when it is for a resource no live node offers
                told, nodes = True, cluster_nodes()
                for role in roles:
                    if (why := lost_placement(role, requests[role], nodes)) is not None:
                        logger.warning(
                            "%s; waiting up to %.0fs more for a node that offers it", why, deadline - time.time()
                        )
    cluster_nodes()  # remembers the nodes they were placed on, to name them if they die
    started = time.time()
    limits = {role: (startup or {}).get(role, (timeout_s, "placement.wait_timeout_s")) for role in pending}
    calls = {ref: role for role, items in pending.items() for _, ref in items}
    remaining = list(calls)
    while remaining:
        deadline = started + min(limits[calls[r]][0] for r in remaining)
        done, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.time()))
        ray.get(done)
        late = sorted({calls[r] for r in remaining if time.time() >= started + limits[calls[r]][0]})
        if late:
            detail = ", ".join(f"{r} ({limits[r][1]}={limits[r][0]:g}s)" for r in late)
            raise PlacementError(f"placement: process(es) of {detail} placed but not started within their limit")
    return {role: ray.get([ref for _, ref in items]) for role, items in pending.items()}
