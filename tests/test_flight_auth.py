"""The learner's Arrow Flight weight server serves only callers that carry the run's secret: a client without it,
or with a wrong one, gets an Unauthenticated error and no bytes of the weights from any call; the run's own
receiver fetches as before; the driver makes a secret per run and keeps it out of the logged config."""

import subprocess
import sys

import numpy as np
import pyarrow.flight as flight
import pytest

from marin_rl.broadcast import BroadcastConfig
from marin_rl.broadcast.arrow_flight import ArrowFlightTransport
from marin_rl.config import RunConfig
from marin_rl.orchestrator.run_metrics import redacted as _redacted

SECRET = "the-run-secret"


@pytest.fixture
def learner():
    transport = ArrowFlightTransport(BroadcastConfig(transport="arrow_flight", chunk_mb=1, secret=SECRET))
    leaves = [np.random.default_rng(0).normal(size=(600, 1000)).astype(np.float32), np.arange(7, dtype=np.int32)]
    update = transport.publish(4, leaves)
    try:
        yield transport, update, leaves
    finally:
        transport.close()


def _calls(client: flight.FlightClient, update, options: flight.FlightCallOptions) -> dict:
    """Every read a client could try: each returns what it received."""
    ticket = flight.Ticket(f"{update.publish_id}/0".encode())

    def get():
        received = []
        for chunk in client.do_get(ticket, options):
            received.append(chunk.data.column(0))
        return received

    return {
        "do_get": get,
        "list_flights": lambda: list(client.list_flights(options=options)),
        "get_flight_info": lambda: client.get_flight_info(flight.FlightDescriptor.for_path("weights"), options),
        "get_schema": lambda: client.get_schema(flight.FlightDescriptor.for_path("weights"), options),
        "do_action latest": lambda: list(client.do_action(flight.Action("latest", b""), options)),
        "list_actions": lambda: client.list_actions(options),
    }


@pytest.mark.parametrize(
    "headers",
    [None, [(b"authorization", b"Bearer not-the-secret")], [(b"authorization", SECRET.encode())]],
    ids=["no-secret", "wrong-secret", "secret-without-bearer"],
)
def test_a_client_without_the_secret_gets_nothing(learner, headers):
    transport, update, _ = learner
    client = flight.FlightClient(transport.location)
    try:
        for name, call in _calls(client, update, flight.FlightCallOptions(headers=headers)).items():
            received = []
            # pyarrow reports GetSchema's Unauthenticated status as an OSError; the others as the Flight error
            expected = OSError if name == "get_schema" else flight.FlightUnauthenticatedError
            with pytest.raises(expected, match="run's secret.*Unauthenticated"):
                received.append(call())
            assert received == [], f"{name} returned {received}"
    finally:
        client.close()


def test_a_receiver_with_a_wrong_secret_is_refused(learner):
    transport, update, _ = learner
    port = int(transport.location.rsplit(":", 1)[1])
    wrong = ArrowFlightTransport(BroadcastConfig(transport="arrow_flight", flight_port=port, secret="guess"))
    try:
        with pytest.raises(flight.FlightUnauthenticatedError):
            wrong.latest()
        with pytest.raises(flight.FlightUnauthenticatedError):
            wrong.fetch(update)  # the pushed update names the address and the tickets: still refused
    finally:
        wrong.close()


def test_a_receiver_without_a_configured_secret_says_so(learner):
    transport, update, _ = learner
    port = int(transport.location.rsplit(":", 1)[1])
    none = ArrowFlightTransport(BroadcastConfig(transport="arrow_flight", flight_port=port))
    try:
        with pytest.raises(ValueError, match="broadcast.secret is not set"):
            none.latest()
    finally:
        none.close()


def test_the_runs_receiver_fetches_in_another_process(learner):
    transport, update, leaves = learner
    port = int(transport.location.rsplit(":", 1)[1])
    code = f"""
import numpy as np
from marin_rl.broadcast import BroadcastConfig
from marin_rl.broadcast.arrow_flight import ArrowFlightTransport
t = ArrowFlightTransport(BroadcastConfig(transport="arrow_flight", flight_port={port}, secret={SECRET!r}))
u = t.latest()
out = t.fetch(u)
print(u.version, u.publish_id, float(out[0].astype(np.float64).sum()), out[1].tolist())
t.close()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    version, publish_id, total, ints = result.stdout.split(maxsplit=3)
    assert (int(version), publish_id) == (4, update.publish_id)
    assert float(total) == float(leaves[0].astype(np.float64).sum())
    assert ints.strip() == str(leaves[1].tolist())


def test_a_learner_without_a_configured_secret_serves_only_its_own_process():
    transport = ArrowFlightTransport(BroadcastConfig(transport="arrow_flight"))
    try:
        leaves = [np.arange(12, dtype=np.float32)]
        update = transport.publish(1, leaves)
        np.testing.assert_array_equal(transport.fetch(transport.latest())[0], leaves[0])
        client = flight.FlightClient(transport.location)
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.do_get(flight.Ticket(f"{update.publish_id}/0".encode())).read_all()
        client.close()
    finally:
        transport.close()


def test_the_driver_makes_a_secret_per_run_and_redacts_it():
    from marin_rl.orchestrator.ray_backend.backend import RayBackend

    def components(config):
        return RayBackend(config, section=None, count=None)

    a, b = components(RunConfig()), components(RunConfig())
    assert a.config.broadcast.secret and b.config.broadcast.secret
    assert a.config.broadcast.secret != b.config.broadcast.secret
    given = RunConfig()
    given.broadcast.secret = "configured"
    assert components(given).config.broadcast.secret == "configured"
    from dataclasses import asdict

    logged = _redacted(asdict(a.config))
    assert logged["broadcast"]["secret"] == "<redacted>"
    assert a.config.broadcast.secret not in repr(logged)


def test_an_empty_secret_is_a_config_error():
    with pytest.raises(ValueError, match="broadcast.secret"):
        BroadcastConfig(transport="arrow_flight", secret="  ")
