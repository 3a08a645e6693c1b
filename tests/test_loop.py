"""The step-and-cadence skeleton (`marin_rl.learner.loop.run_steps`) that every training loop runs."""

import threading

import pytest

from marin_rl.learner.loop import Every, Progress, run_steps


def _add(state, batch):
    return state + batch, {"loss": float(batch)}


def test_steps_thread_the_state_and_stop_at_total_without_drawing_another_batch():
    drawn = []

    def batches():
        for i in range(1, 100):
            drawn.append(i)
            yield i

    state, steps = run_steps(0, batches(), _add, total=4)
    assert (state, steps) == (1 + 2 + 3 + 4, 4)
    assert drawn == [1, 2, 3, 4], "no batch is built past the last step"


def test_cadences_run_every_n_steps_and_at_the_end_in_order_and_may_add_metrics():
    calls = []

    def evaluate(step, state, metrics):
        metrics["eval"] = state
        calls.append(("eval", step))

    def track(step, _state, metrics):
        calls.append(("track", step, "eval" in metrics))

    run_steps(0, range(1, 10), _add, total=5, every=[Every(2, evaluate), Every(1, track)])
    assert calls == [
        ("track", 1, False),
        ("eval", 2),
        ("track", 2, True),
        ("track", 3, False),
        ("eval", 4),
        ("track", 4, True),
        ("eval", 5),  # the end
        ("track", 5, True),
    ]
    assert not Every(0, track).due(3, 5) and Every(0, track).due(5, 5) and not Every(2, track, at_end=False).due(5, 5)


def test_batches_ending_early_end_the_loop_and_no_total_runs_them_all():
    assert run_steps(0, [1, 2], _add, total=10) == (3, 2)
    assert run_steps(0, [1, 2, 3], _add) == (6, 3)
    assert run_steps(7, [1], _add, total=0) == (7, 0)


def test_a_stop_event_interrupts_before_the_next_step_naming_the_steps_done():
    stop = threading.Event()

    def step(state, batch):
        if batch == 2:
            stop.set()
        return _add(state, batch)

    with pytest.raises(KeyboardInterrupt, match=r"^warm start interrupted after 2 of 5 steps$"):
        run_steps(0, range(1, 10), step, total=5, stop=stop, what="warm start")


def test_progress_is_described_after_each_step():
    seen = []
    progress = Progress("demo", lambda metrics: seen.append(metrics["loss"]) or "")
    run_steps(0, [1, 2, 3], _add, total=3, progress=progress)
    assert seen == [1.0, 2.0, 3.0]
