"""Where the learner's arrays live: `Sharding`, the device mesh with the axis mappings of parameters and batches.

The policy, the critic and the supervised step all place their parameters, optimizer states and batches through
one `Sharding` (on a single device without a mesh every placement is the identity).

Expert parallelism (`learner.mesh.expert` > 1) is placement alone: the parameter mapping splits the `experts` axis
of a mixture-of-experts model's weights over the mesh's `expert` axis, and the batch rows split over it as over
`data`. Levanter's sparse blocks run unchanged under the compute mapping, which leaves `experts` and the flattened
token axes unmapped: their routing, permuting and unpermuting shard_maps see every token and every expert on each
device (as they do without expert parallelism), and XLA's partitioner decides how the experts' grouped matrix
products (`haliax.nn.MoELinear`, `ragged_dot`) meet the split weights. On CPU it multiplies each device's own
experts and sums the outputs over the expert axis (no weight all-gather; seen in the compiled step; the small
router weight is all-gathered); a backend that all-gathers the experts instead is equally exact but briefly holds a
layer's full experts (more if XLA hoists the gathers out of the scan over layers). Either way stored weights and
optimizer state shrink by the expert axis, while the sparse block still handles every token of the batch on each
device: a token-dispatching (all-to-all) expert-parallel block is future work."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from marin_rl.learner.batch import RlExample, chunked, to_example
from marin_rl.learner.config import MeshConfig
from marin_rl.types import PackedBatch


class Sharding:
    """The learner's mesh (None: one device, no sharding) and its `MeshConfig`'s axis mappings: parameters and
    optimizer states by the parameter mapping, batch rows over the axes that `batch` maps to."""

    def __init__(self, mesh: Mesh | None, config: MeshConfig):
        self.mesh = mesh
        """The device mesh, or None on a single device."""
        self.config = config
        """The mesh configuration (its `compute_axis_mapping` and `param_axis_mapping`)."""

    @property
    def platform(self) -> str:
        """The platform of the learner's devices ('cpu', 'gpu', 'tpu', ...): the mesh's, else JAX's first device's."""
        return (self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]).platform

    def context(self) -> contextlib.AbstractContextManager:
        """Context in which arrays are placed and steps traced and run: the mesh and the compute axis mapping."""
        if self.mesh is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(hax.partitioning.set_mesh(self.mesh))
        stack.enter_context(hax.axis_mapping(self.config.compute_axis_mapping))
        return stack

    @property
    def batch_shards(self) -> int:
        """Number of pieces the batch rows split into (the product of the mesh axes that `batch` maps to)."""
        if self.mesh is None:
            return 1
        target = self.config.compute_axis_mapping.get("batch", ())
        return math.prod(self.mesh.shape[a] for a in ((target,) if isinstance(target, str) else target))

    def params(self, tree: Any) -> Any:
        """Parameters or optimizer state laid out by the parameter mapping (inside jit: a sharding constraint)."""
        return tree if self.mesh is None else hax.shard(tree, self.config.param_axis_mapping, self.mesh)

    def batch(self, tree: Any) -> Any:
        """Batch rows (an example, or named arrays over its axes) split over the axes that `batch` maps to (outside
        jit: placed on the devices)."""
        return tree if self.mesh is None else hax.shard(tree, self.config.compute_axis_mapping, self.mesh)

    def place(self, batch: PackedBatch) -> RlExample:
        """The host batch as an example on the devices, rows split over the mesh: the one host → device copy."""
        return self.batch(to_example(batch))

    def padded(self, batch: PackedBatch) -> PackedBatch:
        """`batch` with its first row repeated until the rows split evenly over the batch shards (unchanged when they
        do); a caller drops the padding's results."""
        pad = -batch.num_rows % self.batch_shards
        if not pad:
            return batch
        return PackedBatch(
            **{k: None if v is None else np.concatenate([v, v[:1].repeat(pad, 0)]) for k, v in vars(batch).items()}
        )

    def chunked(self, ex: RlExample, n: int) -> dict[str, jax.Array]:
        """`marin_rl.learner.batch.chunked`, with each chunk's rows (not the chunks) split over the devices."""
        raw = chunked(ex, n)
        if self.mesh is None or n == 1:
            return raw
        target = self.config.compute_axis_mapping.get("batch")
        sharding = NamedSharding(self.mesh, PartitionSpec(None, target, None))
        return {k: jax.lax.with_sharding_constraint(v, sharding) for k, v in raw.items()}

    def check_rows(self, rows: int, what: str, parts: int = 1) -> None:
        """Raise ValueError naming `what` when `rows` do not split into `parts` × the batch shards."""
        if rows % (parts * self.batch_shards) != 0:
            raise ValueError(
                f"{what}: {rows} rows do not split over the learner mesh's batch shards ({self.batch_shards} = "
                f"{self.config.compute_axis_mapping.get('batch')} of mesh {dict(self.mesh.shape)})"
                + (f" × {parts} minibatch/microbatch parts" if parts > 1 else "")
                + f"; choose a row count divisible by {parts * self.batch_shards}"
            )

    def replicated(self, value: int) -> jax.Array:
        """An int32 scalar; on a mesh, replicated over all of it (a multi-host checkpoint writes only arrays that
        span the processes)."""
        if self.mesh is None:
            return jnp.asarray(value, dtype=jnp.int32)
        host = np.asarray(value, dtype=np.int32)
        return jax.make_array_from_callback((), NamedSharding(self.mesh, PartitionSpec()), lambda _: host)
