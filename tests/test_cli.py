"""The command line for a newcomer: `--help` lists the run's own keys (the chosen model type's only), an unknown key
is one line with the nearest valid key, and missing prerequisites (an optional package, a placeholder path, a
cluster that cannot hold the run) are one line each, without a traceback."""

import dataclasses
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from levanter.models.llama import LlamaConfig
from subprocess_env import subprocess_env
from test_resume import _reap_session

from marin_rl.cli_help import placeholder_fields, preflight, split_command_line
from marin_rl.config import RunConfig, parse_config
from marin_rl.frozen import thaw

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def _run(args: list[str], env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m marin_rl.run ARGS` in its own session (reaped after: a Ray cluster's agents outlive a driver)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "marin_rl.run", *args],
        cwd=ROOT,
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _reap_session(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _env(**extra: str) -> dict[str, str]:
    return subprocess_env(COLUMNS="120", **extra)


def _help(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        preflight(RunConfig, args, prog="python -m marin_rl.run")
    assert e.value.code == 0
    return capsys.readouterr().out


def _refusal(args: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(args)
    return str(e.value.code)


# ---- --help ---------------------------------------------------------------------------------------------------------


def test_help_lists_the_runs_keys_with_the_files_values_and_only_the_chosen_model_type():
    out = _run(["--config", QUICKSTART, "--help"], timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) < 340  # the run's own fields, one line each (--help-all: every model type's, ~2,500 lines)
    assert "--config FILE" in out.stdout and "--help-all" in out.stdout
    by_key = {line.split()[0]: line for line in lines if line.startswith("  --")}
    # dotted key, type, the file's value (not the dataclass default) and the field's docstring
    assert "int = 300" in by_key["--orchestrator.num_steps"]  # default 100
    assert "Learner steps (= policy versions) to train for." in by_key["--orchestrator.num_steps"]
    assert "int = 2048" in by_key["--batcher.total_token_budget"]
    assert "Token slots per batch" in by_key["--batcher.total_token_budget"]
    assert "float = 0.28" in by_key["--learner.loss.clip_high"]
    assert "str = llama" in by_key["--model.architecture.type"]
    # the model section is the chosen type's fields, nothing of the other types
    arch = {k.removeprefix("--model.architecture.").split(".")[0] for k in by_key if "architecture" in k}
    assert arch == {f.name for f in dataclasses.fields(LlamaConfig)} | {"type"}
    assert "hyena" not in out.stdout and "final_logit_softcapping" not in out.stdout  # gpt2_hyena's, gemma2's
    assert not any("whisper" in key for key in by_key)


def test_help_follows_a_type_chosen_on_the_command_line_and_dash_h_is_help(capsys):
    out = _help(capsys, ["--config", QUICKSTART, "--model.architecture.type", "qwen", "-h"])
    assert "--model.architecture.use_sliding_window" in out  # a Qwen field
    assert "str = qwen" in out and "int = 128" in out  # the type given, the file's sizes
    default = _help(capsys, ["--help"])  # no file: the dataclass defaults
    assert "values: the defaults" in default and "--orchestrator.num_steps" in default
    assert [line for line in default.splitlines() if line.startswith("  --orchestrator.num_steps ")][0].split()[3] == (
        "100"
    )


def test_help_on_a_section_prints_its_descriptions_whole(capsys):
    out = _help(capsys, ["--config", QUICKSTART, "--help", "orchestrator"])
    text = " ".join(out.split())
    assert "--orchestrator.deterministic bool = false" in text
    assert "multiple of `broadcast.sync_every` (a resumed run serves the checkpoint's weights)." in text  # its end
    assert "--learner" not in out
    with pytest.raises(SystemExit, match="unknown key orchestrator.num_stepz; did you mean orchestrator.num_steps"):
        preflight(RunConfig, ["--help", "orchestrator.num_stepz"])


def test_reward_model_help_lists_its_own_keys_and_an_unknown_key_is_one_line(capsys):
    from marin_rl.programs.reward_model import parse_config as parse_reward_model_config

    with pytest.raises(SystemExit) as e:
        parse_reward_model_config(["--config", str(ROOT / "experiments" / "addition_reward_model.yaml"), "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 300 and "usage: python -m marin_rl.reward_model --config FILE" in out
    assert "--config experiments/addition_reward_model.yaml --steps 100" in out  # its own example, not run's
    steps = [line for line in out.splitlines() if line.startswith("  --steps ")]
    assert steps and "Optimizer steps." in steps[0]
    assert "--orchestrator" not in out and "hyena" not in out
    with pytest.raises(SystemExit, match="^marin_rl: invalid configuration: unknown key --stepz; did you mean --steps"):
        parse_reward_model_config(["--stepz", "3"])


def test_a_misspelled_model_type_is_one_line_with_the_nearest_type():
    with pytest.raises(SystemExit) as e:
        parse_config(["--config", QUICKSTART, "--model.architecture.type", "lama"])
    message = str(e.value.code)
    assert message.startswith("marin_rl: invalid configuration: model.architecture.type: unknown type 'lama'; ")
    assert "did you mean llama?" in message and "qwen3" in message and "\n" not in message


def test_help_all_is_draccus_listing_of_every_type(capsys):
    out = _help(capsys, ["--help-all"])
    assert "--model.architecture.hyena" in out and "whisper" in out and "--orchestrator.num_steps" in out


def test_command_line_is_split_as_draccus_reads_it():
    line = split_command_line(["--config=x.yaml", "--a.b", "1", "--c=-2", "--flag", "--help", "learner", "-h"])
    assert line.config_path == "x.yaml" and line.help and line.help_topic == "learner"
    assert line.overrides == [("a.b", "1"), ("c", "-2"), ("flag", None)]


# ---- unknown keys ---------------------------------------------------------------------------------------------------


def test_unknown_key_on_the_command_line_is_one_line_with_the_nearest_key():
    out = _run(["--config", QUICKSTART, "--orchestrator.num_stepz", "10"], timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "marin_rl: invalid configuration: unknown key --orchestrator.num_stepz; did you mean --orchestrator.num_steps?"
    ]
    assert "usage" not in out.stderr and out.stdout == ""


def test_unknown_key_in_the_config_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("orchestrator:\n  num_stepz: 3\n")
    assert _refusal(["--config", str(bad)]) == (
        f"marin_rl: invalid configuration: unknown key orchestrator.num_stepz in {bad}; did you mean "
        "orchestrator.num_steps?"
    )
    bad.write_text("envs:\n  - name: a\n  - name: b\n    group_siz: 4\n")
    assert _refusal(["--config", str(bad)]) == (
        f"marin_rl: invalid configuration: unknown key envs[1].group_siz in {bad}; did you mean envs[1].group_size?"
    )
    bad.write_text("model:\n  architecture:\n    type: llama\n    hiden_dim: 64\n")
    assert _refusal(["--config", str(bad)]).endswith("did you mean model.architecture.hidden_dim?")


@pytest.mark.parametrize(
    "key, message",
    [
        ("--num_steps", "unknown key --num_steps; did you mean --orchestrator.num_steps?"),  # the right name elsewhere
        ("--learner.optimizer.lr", "unknown key --learner.optimizer.lr (--help learner.optimizer lists the keys)"),
        ("--zzz", "unknown key --zzz (--help lists the keys)"),
        ("--envs.0.group_size", "unknown key --envs.0.group_size: envs is a list, whose items are set in the config"),
        (
            "--model.architecture.final_logit_softcapping",
            "unknown key --model.architecture.final_logit_softcapping: not a field of model.architecture.type llama "
            "(a field of gemma2, gemma3)",
        ),
    ],
)
def test_unknown_key_messages(key, message):
    assert _refusal(["--config", QUICKSTART, key, "1"]).startswith(f"marin_rl: invalid configuration: {message}")


def test_keys_of_a_type_chosen_on_the_command_line_are_known():
    config = parse_config(
        [
            "--config",
            QUICKSTART,
            "--model.architecture.type",
            "gemma2",
            "--model.architecture.final_logit_softcapping",
            "30",
            "--inference.backend",
            "vllm",  # the embedded engines do not decode Gemma (refused before anything starts)
        ]
    )
    assert type(config.model.architecture).__name__ == "Gemma2Config"
    assert config.model.architecture.final_logit_softcapping == 30


# ---- prerequisites --------------------------------------------------------------------------------------------------


def test_placeholder_path_is_refused_at_start_naming_the_field():
    out = _run(["--config", str(ROOT / "experiments" / "tpu_v4_32.yaml")], timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "marin_rl: invalid configuration: output_dir: 'gs://YOUR_BUCKET/marin_rl/quickstart-v4-32' holds the "
        "placeholder YOUR_BUCKET; replace it in the config file or with --output_dir VALUE"
    ]
    config = thaw(parse_config(["--config", QUICKSTART]))
    assert placeholder_fields(config) == []
    config.envs[0].args["data"] = "gs://YOUR_BUCKET/x.jsonl"
    config.checkpoint.path = "/mnt/YOUR_DISK/ckpt"
    assert placeholder_fields(config) == [
        ("envs[0].args.data", "gs://YOUR_BUCKET/x.jsonl", False),
        ("checkpoint.path", "/mnt/YOUR_DISK/ckpt", True),
    ]


def test_infeasible_placement_is_one_line_without_a_traceback(tmp_path):
    out = _run(
        [
            "--config",
            QUICKSTART,
            "--output_dir",
            str(tmp_path / "run"),
            "--orchestrator.num_cpus",
            "2",
            "--placement.envs.resources",
            "{no_such_node: 1}",
        ]
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text
    ours = [line for line in text.splitlines() if line.startswith("marin_rl:")]
    assert len(ours) == 1 and ours[0].startswith("marin_rl: placement.envs: no node can run one of its processes")
    assert "{no_such_node: 1}" in ours[0]


def test_an_experiment_sized_for_a_gpu_is_refused_in_one_line_where_jax_finds_none(tmp_path):
    import jax

    if jax.devices()[0].platform != "cpu":
        pytest.skip("this machine has an accelerator")
    start = time.time()
    out = _run(["--config", str(ROOT / "experiments" / "gpu_local.yaml"), "--output_dir", str(tmp_path / "run")])
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text and time.time() - start < 60
    ours = [line for line in text.splitlines() if line.startswith("marin_rl:")]
    assert ours == [
        "marin_rl: invalid configuration: learner.platform: this experiment is sized for gpu, but JAX finds only cpu "
        "devices (1 cpu); run it where JAX sees a gpu (check the jax install's gpu support), or set learner.platform: "
        "null to run it here anyway"
    ], text[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before anything started"
    with pytest.raises(SystemExit, match="learner.platform must be one of"):
        parse_config(["--config", QUICKSTART, "--learner.platform", "cuda"])


def test_pipeline_without_marin_names_the_extra_to_install(tmp_path):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("marin-core") for dep in extras["marin"])  # the extra the message names
    shim = tmp_path / "no_marin" / "marin"  # an empty `marin` package shadows an installed one: no marin.execution
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(shim.parent), env["PYTHONPATH"]])
    out = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "marin_pipeline.py"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "marin_rl: experiments/marin_pipeline.py needs marin-core (Marin's executor), the `marin` extra: "
        "pip install -e '.[marin]' in the marin_rl checkout"
    ]
