"""Weight broadcast: every transport round-trips the learner's arrays, fetches in parallel, publishes atomically,
and the embedded server applies whatever was published last (lower versions too) without recompiling."""

import threading
import time

import equinox as eqx
import haliax as hax
import httpx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from marin_rl.broadcast import BroadcastConfig, WeightSubscriber, make_transport
from marin_rl.broadcast.arrays import _cast_on_device
from marin_rl.broadcast.arrow_flight import ArrowFlightTransport, _WeightFlightServer, plan_tickets
from marin_rl.broadcast.base import UpdateUnavailable
from marin_rl.broadcast.fsspec_checkpoint import FsspecTransport
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.model.logprobs import token_logprobs
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer

LOCAL = ["in_process", "shared_memory", "arrow_flight", "fsspec"]


def _leaves(seed=0):
    """Arrays like a model's: a large matrix spanning several 1 MiB chunks, odd shapes, ints, a scalar, an empty."""
    rng = np.random.default_rng(seed)
    return [
        rng.normal(size=(700, 1000)).astype(np.float32),  # 2.8 MB
        rng.normal(size=(3, 5, 7)).astype(np.float32),
        np.arange(-5, 6, dtype=np.int32),
        np.array(3.5, dtype=np.float32),
        np.zeros((0, 4), np.float32),
        rng.normal(size=(129,)).astype(np.float32),
    ]


def _transport(name, tmp_path, **kwargs):
    return make_transport(BroadcastConfig(transport=name, path=str(tmp_path / "weights"), chunk_mb=1, **kwargs))


@pytest.mark.parametrize("name", LOCAL)
def test_round_trip_is_exact(name, tmp_path):
    transport = _transport(name, tmp_path)
    try:
        leaves = _leaves()
        update = transport.publish(7, leaves)
        assert update.num_bytes == sum(x.nbytes for x in leaves)
        latest = transport.latest()
        assert latest.version == 7 and latest.publish_id == update.publish_id
        out = transport.fetch(latest)
        assert len(out) == len(leaves)
        for got, want in zip(out, leaves, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    finally:
        transport.close()


@pytest.mark.parametrize("name", LOCAL)
def test_bfloat16_broadcast_within_bf16_precision(name, tmp_path):
    transport = _transport(name, tmp_path, dtype="bfloat16")
    try:
        leaves = _leaves(1)
        # Device arrays are cast on the device; the result must equal NumPy's round-to-nearest-even cast.
        update = transport.publish(1, [jnp.asarray(x) for x in leaves])
        floats = sum(x.nbytes for x in leaves if x.dtype.kind == "f")
        assert update.num_bytes == floats // 2 + sum(x.nbytes for x in leaves if x.dtype.kind != "f")
        for got, want in zip(transport.fetch(transport.latest()), leaves, strict=True):
            if want.dtype.kind == "f":
                assert got.dtype == ml_dtypes.bfloat16
                np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16))
                np.testing.assert_allclose(got.astype(np.float32), want, rtol=2**-8, atol=0)
            else:
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)
        # Accelerators cast with XLA on the device instead (CPU devices use NumPy): same rounding.
        on_device = jax.device_get(_cast_on_device([jnp.asarray(x) for x in leaves], jnp.dtype(jnp.bfloat16)))
        for got, want in zip(on_device, leaves, strict=True):
            np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16) if want.dtype.kind == "f" else want)
    finally:
        transport.close()


@pytest.mark.parametrize("name", ["shared_memory", "arrow_flight"])
def test_the_update_of_a_closed_publisher_is_unavailable_not_an_arbitrary_error(name):
    """A server told to apply the update of a learner that is gone raises `UpdateUnavailable`, which the driver
    answers by having the (replaced) learner publish again."""
    config = BroadcastConfig(transport=name, secret="run-secret")
    publisher, reader = make_transport(config), make_transport(config)
    try:
        update = publisher.publish(4, _leaves(3))
        np.testing.assert_array_equal(reader.fetch(update)[0], _leaves(3)[0])
        publisher.close()
        fresh = make_transport(config)
        with pytest.raises(UpdateUnavailable, match="version 4|does not exist"):
            fresh.fetch(update)
        fresh.close()
    finally:
        publisher.close()
        reader.close()


def test_ray_object_store_round_trip_in_another_process(tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        def fetch_elsewhere(update):
            out = make_transport("ray").fetch(update)
            return [(x.dtype.name, x.shape, x.tobytes()) for x in out]

        for dtype in (None, "bfloat16"):
            transport = make_transport(BroadcastConfig(transport="ray", dtype=dtype))
            leaves = _leaves(2)
            update = transport.publish(3, leaves)
            assert transport.latest() is update
            for (dt, shape, data), want in zip(ray.get(fetch_elsewhere.remote(update)), leaves, strict=True):
                expect = want.astype(ml_dtypes.bfloat16) if dtype and want.dtype.kind == "f" else want
                assert (dt, shape) == (expect.dtype.name, expect.shape)
                assert data == expect.tobytes()

        @ray.remote(num_cpus=0)
        class Publisher:
            def publish(self):
                return make_transport("ray").publish(5, [np.ones((300_000,), np.float32)])

        publisher = Publisher.remote()
        update = ray.get(publisher.publish.remote())
        ray.kill(publisher)  # the learner that owned the object died
        deadline = time.time() + 30
        while True:  # ray.kill is asynchronous: a call sent just after it may still be answered (seen in a suite run)
            try:
                ray.get(publisher.__ray_ready__.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
            assert time.time() < deadline, "the killed publisher still answers 30 s after ray.kill"
            time.sleep(0.1)
        deadline = time.time() + 30  # the owner's death reaches the object's other holders asynchronously
        with pytest.raises(UpdateUnavailable, match="version 5"):
            while time.time() < deadline:
                try:
                    ray.get(fetch_elsewhere.remote(update))
                except ray.exceptions.RayTaskError as e:
                    raise e.cause from None
                time.sleep(0.2)
    finally:
        ray.shutdown()


@pytest.mark.exclusive  # its wall-clock bound shows the fetches overlap
def test_flight_fetches_tickets_in_parallel_and_polls_across_processes(tmp_path, monkeypatch):
    active, peak = [0], [0]
    lock = threading.Lock()
    do_get = _WeightFlightServer.do_get

    def slow_do_get(self, context, ticket):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.2)
            return do_get(self, context, ticket)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(_WeightFlightServer, "do_get", slow_do_get)
    secret = "run-secret"  # what the run's driver hands to the learner and every server
    learner = ArrowFlightTransport(
        BroadcastConfig(transport="arrow_flight", chunk_mb=1, fetch_threads=8, secret=secret)
    )
    try:
        leaves = [np.random.default_rng(3).normal(size=(8, 1 << 18)).astype(np.float32)]  # 8 MiB: 8 tickets
        update = learner.publish(2, leaves)
        assert len(plan_tickets(update.payload["manifest"])) == 8
        port = int(learner.location.rsplit(":", 1)[1])
        # A server knows only the learner's address: it polls the latest manifest, then fetches.
        server = ArrowFlightTransport(
            BroadcastConfig(transport="arrow_flight", flight_port=port, fetch_threads=8, secret=secret)
        )
        latest = server.latest()
        assert latest.publish_id == update.publish_id and latest.version == 2
        start = time.perf_counter()
        out = server.fetch(latest)
        elapsed = time.perf_counter() - start
        np.testing.assert_array_equal(out[0], leaves[0])
        assert peak[0] >= 4, f"at most {peak[0]} tickets were fetched at once"
        assert elapsed < 8 * 0.2 * 0.6, f"fetch took {elapsed:.2f}s: not parallel"
        server.close()
    finally:
        learner.close()


def test_fsspec_reads_chunks_in_parallel(tmp_path, monkeypatch):
    transport = FsspecTransport(BroadcastConfig(transport="fsspec", path=str(tmp_path), chunk_mb=1, fetch_threads=4))
    threads = set()
    read_piece = FsspecTransport._read_piece

    def recording(self, *args):
        threads.add(threading.get_ident())
        time.sleep(0.05)
        return read_piece(self, *args)

    monkeypatch.setattr(FsspecTransport, "_read_piece", recording)
    leaves = [np.random.default_rng(4).normal(size=(6, 1 << 18)).astype(np.float32)]  # 6 chunks
    out = transport.fetch(transport.publish(1, leaves))
    np.testing.assert_array_equal(out[0], leaves[0])
    assert len(threads) >= 2


def test_fsspec_latest_never_returns_a_half_written_version(tmp_path, monkeypatch):
    transport = FsspecTransport(BroadcastConfig(transport="fsspec", path=str(tmp_path), chunk_mb=1))
    good = _leaves(5)
    first = transport.publish(1, good)
    write_leaf = FsspecTransport._write_leaf

    def crash_on_leaf_3(self, name, index, leaf):
        if index == 3:
            raise OSError("disk full")
        return write_leaf(self, name, index, leaf)

    monkeypatch.setattr(FsspecTransport, "_write_leaf", crash_on_leaf_3)
    with pytest.raises(OSError, match="disk full"):
        transport.publish(2, _leaves(6))
    monkeypatch.setattr(FsspecTransport, "_write_leaf", write_leaf)
    # A fresh reader (another process would do the same) still sees version 1, whole.
    reader = FsspecTransport(BroadcastConfig(transport="fsspec", path=str(tmp_path)))
    latest = reader.latest()
    assert (latest.version, latest.publish_id) == (1, first.publish_id)
    for got, want in zip(reader.fetch(latest), good, strict=True):
        np.testing.assert_array_equal(got, want)


def test_fsspec_concurrent_publish_and_poll_see_only_complete_versions(tmp_path):
    cfg = BroadcastConfig(transport="fsspec", path=str(tmp_path), chunk_mb=1, keep=3)
    writer, reader = FsspecTransport(cfg), FsspecTransport(cfg)
    versions = list(range(1, 16))
    seen, errors = [], []

    def publish_all():
        for v in versions:
            writer.publish(v, [np.full((300, 1000), v, np.float32), np.full((17,), v, np.int32)])

    def poll():
        deadline = time.time() + 60
        while time.time() < deadline:
            update = reader.latest()
            if update is None:
                continue
            try:
                arrays = reader.fetch(update)
            except FileNotFoundError:
                continue  # pruned while we read (keep=3): a server fetches the latest again
            if any(not (a == update.version).all() for a in arrays):
                errors.append(update.version)
            seen.append(update.version)
            if update.version == versions[-1]:
                return

    t = threading.Thread(target=poll)
    t.start()
    publish_all()
    t.join(60)
    assert not errors, f"torn reads of versions {errors}"
    assert seen and seen[-1] == versions[-1]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("p")]) == 3  # older versions pruned


# ---- the embedded server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(), len(tok))
    srv = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(
            max_seqs=8,
            max_seq_len=64,
            levanter=LevanterServerConfig(page_size=16, prefill_tokens=512, segment_tokens=8),
        ),
    )
    address = srv.start()
    yield srv, address, model, tok
    srv.stop()


def _weights(model, seed, scale=0.3):
    rng = np.random.default_rng(seed)
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    return [np.asarray(x) + rng.normal(0, scale, x.shape).astype(np.float32) for x in leaves]


def _model_with(model, leaves):
    params, static = eqx.partition(model, eqx.is_array)
    treedef = jax.tree_util.tree_structure(params)
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves]), static)


@eqx.filter_jit
def _logprobs_of(model, *arrays):
    return token_logprobs(model, *arrays)[0]


def _served_matches(address, model, prompt, seed):
    """Sample from the server and check its logprobs against `model`'s; returns the max difference."""
    body = {
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    choice = httpx.post(f"http://{address}/v1/completions", json=body, timeout=120).json()["choices"][0]
    ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    batch, _ = pack([Sequence.supervised(prompt, ids)], 1, 64)
    named = [hax.named(getattr(batch, k), ("batch", "position")) for k in ("input_ids", "position_ids", "segment_ids")]
    ref = np.asarray(_logprobs_of(model, *named).array)[0, len(prompt) : len(prompt) + len(ids)]
    return float(np.abs(ref - np.asarray(choice["logprobs"]["token_logprobs"])).max()), choice


@pytest.mark.parametrize("name", ["fsspec", "arrow_flight", "shared_memory"])
def test_server_follows_the_learner_back_to_a_lower_version(server, name, tmp_path):
    srv, address, model, tok = server
    prompt = tok("12+30=", add_special_tokens=False)["input_ids"]
    cfg = BroadcastConfig(transport=name, path=str(tmp_path / "w"), secret="run-secret")
    learner = make_transport(cfg)
    if name == "arrow_flight":  # the server side knows only the learner's address (and the run's secret)
        cfg = BroadcastConfig(transport=name, flight_port=int(learner.location.rsplit(":", 1)[1]), secret="run-secret")
    subscriber = WeightSubscriber(make_transport(cfg), srv.apply_weights)
    try:
        a, b = _weights(model, 10), _weights(model, 11)
        learner.publish(5, a)
        assert subscriber.poll()["version"] == 5 and srv.version == 5
        assert subscriber.poll() is None  # nothing new
        diff, choice = _served_matches(address, _model_with(model, a), prompt, seed=1)
        assert diff <= 1e-4 and choice["policy_version_start"] == 5
        # The learner restarts from an earlier checkpoint and publishes a LOWER version: it is applied.
        learner.close()
        learner = make_transport(cfg)
        learner.publish(3, b)
        assert subscriber.poll()["version"] == 3 and srv.version == 3
        diff, choice = _served_matches(address, _model_with(model, b), prompt, seed=1)
        assert diff <= 1e-4 and choice["policy_version_start"] == choice["policy_version_end"] == 3
        assert _served_matches(address, _model_with(model, a), prompt, seed=1)[0] > 1e-2  # b is served, not a
    finally:
        learner.close()
        subscriber.transport.close()


def test_bf16_broadcast_is_applied_at_model_precision_without_recompiling(server, tmp_path):
    srv, address, model, tok = server
    prompt = tok("7+8=", add_special_tokens=False)["input_ids"]
    transport = make_transport(BroadcastConfig(transport="in_process", dtype="bfloat16"))
    subscriber = WeightSubscriber(transport, srv.apply_weights)
    subscriber.apply_update(transport.publish(1, [jnp.asarray(x) for x in _weights(model, 20)]))
    _served_matches(address, model, prompt, seed=2)  # warm: the bf16 -> f32 casts and decode are compiled
    compiles = []

    def listener(event, *args, **kwargs):
        if "compil" in event:
            compiles.append(event)

    weights = _weights(model, 21)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        info = subscriber.apply_update(transport.publish(2, [jnp.asarray(x) for x in weights]))
        diff, choice = _served_matches(
            address, _model_with(model, [w.astype(ml_dtypes.bfloat16).astype(np.float32) for w in weights]), prompt, 2
        )
    finally:
        jax.monitoring.clear_event_listeners()
    assert info["version"] == 2 and srv.version == 2
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(eqx.filter(srv.context.model, eqx.is_array)))
    assert diff <= 1e-4, "the server must serve the bf16-rounded weights, cast back to float32"
    assert not compiles, f"applying weights recompiled: {compiles[:3]}"
