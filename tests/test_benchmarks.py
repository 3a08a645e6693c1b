"""Every benchmark runs: its `--smoke` mode (seconds, tiny sizes) must finish and print its figure line."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from subprocess_env import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))

FIGURE = {  # the last line each benchmark prints: name=value
    "broadcast": "broadcast_over_memcpy",
    "broadcast_nodes": "cross_node_over_memcpy",
    "chat": "chat_over_completions",
    "colocated": "default_over_local",
    "credit_assignment": "turn_over_group_reward",
    "device_local": "mfu",
    "distillation": "distill_over_rl",
    "generation": "embedded_over_paged",
    "inference": "http_over_engine",
    "learner_mfu": "mfu",
    "loop": "loop_over_limit",
    "lora": "lora_bytes_over_full",
    "model_size": "mfu",
    "packing": "packing_efficiency",
    "routing_replay": "replayed_over_free",
    "sampler_agreement": "max_abs_dlogprob",
    "scale": "trained_tok_s_over_target",
    "server_load": "recovery_over_initial",
    "staleness": "async_over_sync",
}


def test_every_benchmark_is_smoke_tested():
    assert set(BENCHMARKS) == set(FIGURE), f"add the new benchmark's figure line to FIGURE: {BENCHMARKS}"


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_smoke_mode_runs_and_prints_its_figure(name):
    env = subprocess_env(PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"benchmarks/{name}.py --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"{FIGURE[name]}=[0-9.]+", last), f"unexpected last line {last!r}"


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_colocated_benchmark_times_from_launch_in_unix_time():
    """Start-up and time-to-reward are measured from the launch (a Unix time), so against the rows' `time/unix`;
    `time/elapsed_s` counts from the run's own start (against it, start-up came out as minus the Unix time)."""
    colocated = _benchmark("colocated")
    rows = [
        {"step": 0, "time/elapsed_s": 3.0, "time/unix": 1005.0, "eval/mean_reward": 0.4},
        {"step": 1, "time/elapsed_s": 4.0, "time/unix": 1006.0, "learner/step_time_s": 0.5},
        {"step": 2, "time/elapsed_s": 6.0, "time/unix": 1008.0, "learner/step_time_s": 0.5, "eval/mean_reward": 0.9},
    ]
    figures = colocated.describe("run", 1000.0, 1010.0, rows, 0.8)
    assert figures["startup_s"] == 5.0
    assert figures["to_target_s"] == 8.0
    assert figures["loop_s"] == 3.0
    assert figures["whole_s"] == 10.0


def test_the_loop_benchmark_counts_cpu_over_the_loops_own_window():
    """The CPU samples are stamped in Unix time, so the loop's window is too (it was in seconds since the run began:
    every role's CPU came out 0). Samples: (time, {pid: (role, cpu seconds)})."""
    loop = _benchmark("loop")
    rows = [
        {"step": 0, "time/elapsed_s": 10.0, "time/unix": 1000.0},
        {"step": 1, "time/elapsed_s": 12.0, "time/unix": 1002.0},
        {"step": 2, "time/elapsed_s": 14.0, "time/unix": 1004.0},
    ]
    start, end = loop.loop_window(rows)
    assert (start, end) == (1000.0, 1004.0)
    samples = [(999.9, {7: ("learner", 5.0)}), (1002.0, {7: ("learner", 6.0)}), (1004.1, {7: ("learner", 8.5)})]
    assert loop.cpu_by_role(samples, start, end) == {"learner": 3.5}


def test_the_loop_benchmark_refuses_an_output_dir_that_holds_a_run(tmp_path):
    """A finished run there would be resumed at its last step and the loop would time nothing."""
    (tmp_path / "checkpoints").mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loop.py"), "--output-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and f"--output-dir {tmp_path} already holds a run" in proc.stderr, proc.stderr


PUBLISHED_PARAMETERS = {  # the model cards' counts (safetensors metadata)
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "llama3-8b": 8_030_261_248,
}


def test_the_size_model_counts_what_levanter_builds_and_what_the_model_cards_say():
    """The paper model's parameter count equals the published one for the real shapes, and what Levanter builds
    (shapes only, nothing allocated) for every preset; its table covers every preset on both devices."""
    import equinox as eqx
    import haliax as hax
    import jax
    import numpy as np

    model_size = _benchmark("model_size")
    for name, shape in model_size.PRESETS.items():
        if name in PUBLISHED_PARAMETERS:
            assert shape.params() == PUBLISHED_PARAMETERS[name], name
        built = eqx.filter_eval_shape(
            shape.levanter_config(256).build, hax.Axis("vocab", shape.vocab), key=jax.random.PRNGKey(0)
        )
        leaves = jax.tree_util.tree_leaves(built)
        floats = [x for x in leaves if np.issubdtype(getattr(x, "dtype", np.int32), np.floating)]
        assert sum(int(np.prod(x.shape)) for x in floats) == shape.params(), name
    table = model_size.paper_table(0.3, model_size.Workload(checkpointing=True, microbatches=4))
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table[2:]]
    rows = {(c[0], c[1], c[6], c[8]) for c in cells}  # model, training, device, fits
    for name in set(model_size.PRESETS) - {"smoke"}:
        assert {(name, "full", dev.name) for dev in model_size.DEVICES} <= {r[:3] for r in rows}, name
    # float32 weights, gradients and Adam of a 7-8B model fit neither one H100 nor a v5e-8's 16 GiB chips; LoRA does
    for name in ("qwen2.5-7b", "llama3-8b"):
        assert {(name, "full", dev.name, "no") for dev in model_size.DEVICES} <= rows
        assert {(name, "LoRA r16", dev.name, "yes") for dev in model_size.DEVICES} <= rows


def test_the_distillation_benchmark_pairs_seeds_and_averages_curves():
    """Per seed, distillation minus reward-only RL is averaged over the evaluations after step 0 (step 0 is the shared
    start); the seeds' mean and its standard error are reported, and mean curves keep the steps every run has."""
    bench = _benchmark("distillation")
    label = "distillation (opd_reverse_kl)"
    per_seed = [
        {label: [(0, 0.4), (10, 0.6), (20, 0.8)], bench.REWARD_ONLY: [(0, 0.5), (10, 0.5), (20, 0.7)]},  # +0.1
        {label: [(0, 0.4), (10, 0.5), (20, 0.7)], bench.REWARD_ONLY: [(0, 0.3), (10, 0.5), (20, 0.6)]},  # +0.05
        {label: [(0, 0.4), (10, 0.6), (20, 0.6)], bench.REWARD_ONLY: [(0, 0.4), (10, 0.6), (20, 0.6)]},  # 0
    ]
    mean, se = bench.paired_difference(per_seed, label)
    diffs = np.array([0.1, 0.05, 0.0])
    assert mean == pytest.approx(diffs.mean())
    assert se == pytest.approx(diffs.std(ddof=1) / np.sqrt(3))
    assert bench.paired_difference(per_seed[:1], label) == (pytest.approx(0.1), 0.0)
    curve = bench.mean_curve([[(0, 0.2), (10, 0.4)], [(0, 0.4), (10, 0.6), (20, 0.9)]])
    assert curve == [(0, pytest.approx(0.3)), (10, pytest.approx(0.5))]


def test_the_scale_benchmark_plans_memory_draws_lengths_and_times_steady_steps(monkeypatch):
    """The plan keeps every activation while microbatching alone fits, then checkpoints, and refuses what cannot fit;
    the synthetic environment's lengths stay in [128, 512] around a 250-token median; the end-to-end rate counts
    steps 2 -> N over the time between step 1's row and step N's."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    scale = _benchmark("scale")
    model_size = _benchmark("model_size")
    shape = model_size.PRESETS["qwen2.5-0.5b"]
    work = scale.Workload()
    assert scale.plan(shape, work, 80e9)[:2] == (False, 4)  # 8 rows of 4096: 8k tokens a microbatch fit
    checkpointing, microbatches, p = scale.plan(shape, work, 32e9)  # no checkpointing would need 33 GB at 4k tokens
    assert (checkpointing, microbatches) == (True, 8) and p["total"] <= 0.9 * 32e9
    with pytest.raises(SystemExit, match="nothing fits"):
        scale.plan(shape, work, 8e9)
    import random

    rng = random.Random(0)
    lengths = [scale.completion_length(rng, 250.0, 0.4, 128, 512) for _ in range(20_000)]
    assert min(lengths) >= 128 and max(lengths) <= 512
    assert 230 <= float(np.median(lengths)) <= 270
    rows = [
        {"step": 0, "time/unix": 0.0},
        {"step": 1, "time/unix": 10.0, "batches/tokens": 1000, "throughput/generated_tokens_per_s": 50.0},
        {"step": 2, "time/unix": 12.0, "batches/tokens": 400, "throughput/generated_tokens_per_s": 100.0},
        {"step": 3, "time/unix": 14.0, "batches/tokens": 600, "throughput/generated_tokens_per_s": 300.0},
    ]
    assert scale.end_to_end_rate(rows, "batches/tokens") == pytest.approx(250.0)
    assert scale.end_to_end_rate(rows, "throughput/generated_tokens_per_s", per_window=True) == pytest.approx(200.0)
