"""Bad configuration values are refused before anything starts, in one line naming the field; validation does not
change the config.

The walk over every numeric field finds the fields by reflection on the quickstart config (plus a reward model, so
that `reward_models[*]` is covered), so a field added later is tried too: 0, a negative value and NaN must each be
either refused as `marin_rl: invalid configuration: <field>: ...`, or accepted with the field's docstring saying
what that value means.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import pickle
import re
import resource
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import draccus
import pytest
import yaml
from draccus.wrappers.docstring import get_attribute_docstring

from marin_rl.bounds import Bounds, bounded, check_fields, deferred_checks, field_errors, numeric_kind
from marin_rl.config import RunConfig, parse_config
from marin_rl.frozen import FrozenConfigError, thaw

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
PREFIX = "marin_rl: invalid configuration: "


def base_document() -> dict:
    """The quickstart, with one reward model used by its environment (validation only: nothing is loaded)."""
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["reward_models"] = [{"name": "rm", "path": "/nowhere/rm"}]
    doc["envs"][0]["reward_models"] = ["rm"]
    doc["envs"][0]["args"]["reward_weights"] = {"correct": 1.0, "rm": 0.5}
    return doc


def parse_document(doc: dict, directory: Path) -> RunConfig:
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return parse_config(["--config", str(path)])


def numeric_fields(obj, path=()):
    """(key path, owning class, field) of every int or float field under the dataclass `obj` (nested dataclasses,
    list items by index), found by reflection."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if numeric_kind(hints.get(f.name, f.type)) is not None:
            yield (*path, f.name), type(obj), f
        elif dataclasses.is_dataclass(value):
            yield from numeric_fields(value, (*path, f.name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    yield from numeric_fields(item, (*path, f.name, i))


def dotted(path) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def with_value(doc: dict, path, value) -> dict:
    """`doc` with the field at `path` set to `value` (a section the document leaves out is added, with the `type`
    of a choice class such as the architecture's `rope`)."""
    doc = yaml.safe_load(yaml.safe_dump(doc))
    node, obj = doc, BASE
    for key in path[:-1]:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
        if not isinstance(key, int) and key not in node:
            node[key] = {"type": obj.get_choice_name(type(obj))} if isinstance(obj, draccus.ChoiceRegistry) else {}
        node = node[key]
    node[path[-1]] = value
    return doc


def documents(docstring: str, value: float) -> bool:
    """Whether a field's docstring says what `value` (0 or a negative value) means: it names 0 ('0: none',
    '>= 0', 'in [0, 1]'), or, for a negative value, a negative one ('-1: all', 'negative')."""
    if value == 0:
        return re.search(r"(?<![\w.])0(?!\.?\d|\w)", docstring) is not None
    return re.search(r"-1\b|negative", docstring) is not None


with tempfile.TemporaryDirectory() as _dir:
    BASE = parse_document(base_document(), Path(_dir))
FIELDS = list(numeric_fields(BASE))
TRIES = [(path, owner, f, value) for path, owner, f in FIELDS for value in (0, -3, math.nan)]


def test_the_walk_covers_every_section():
    names = {dotted(p) for p, _, _ in FIELDS}
    for expected in (
        "orchestrator.num_steps",
        "tracking.console_every",
        "learner.optimizer.learning_rate",
        "learner.critic.optimizer.eps",
        "envs[0].sampling.temperature",
        "reward_models[0].placement.num_gpus",
        "model.architecture.hidden_dim",
        "inference.levanter.batch_timeout_s",
        "placement.learner.memory_fraction",
    ):
        assert expected in names
    assert len(names) > 120


@pytest.mark.parametrize("path,owner,f,value", TRIES, ids=[f"{dotted(p)}={v}" for p, _, _, v in TRIES])
def test_every_numeric_field_refuses_or_documents_zero_negative_and_nan(path, owner, f, value, tmp_path):
    name = dotted(path)
    try:
        config = parse_document(with_value(base_document(), path, value), tmp_path)
    except SystemExit as e:
        message = str(e)
        assert "\n" not in message and "Traceback" not in message, message
        if owner.__module__.startswith("marin_rl"):
            assert message.startswith(f"{PREFIX}{name}:"), message
        else:  # the model architecture (Levanter's class) may refuse it first, in its own words
            assert message.startswith((f"{PREFIX}{name}:", f"{PREFIX}model.architecture: ")), message
        return
    assert not math.isnan(value), f"{name}: NaN was accepted"
    got = config
    for key in path:
        got = got[key] if isinstance(key, int) else getattr(got, key)
    assert got == value
    docstring = get_attribute_docstring(owner, f.name).docstring_below or ""
    assert documents(docstring, value), f"{name} accepts {value} but its docstring does not say what it means"


CASES = [
    (["--orchestrator.num_steps", "-5"], "orchestrator.num_steps: must be >= 1, got -5"),
    (["--tracking.console_every", "0"], "tracking.console_every: must be >= 1, got 0"),
    (["--orchestrator.max_staleness", "-1"], "orchestrator.max_staleness: must be >= 0, got -1"),
    (["--learner.optimizer.learning_rate", "-0.001"], "learner.optimizer.learning_rate: must be > 0, got -0.001"),
    (["--learner.optimizer.learning_rate", "nan"], "learner.optimizer.learning_rate: must be a finite number, got nan"),
    (["--learner.warm_start.learning_rate", "inf"], "learner.warm_start.learning_rate: must be a finite number"),
    (
        ["--envs", "[{name: addition, sampling: {temperature: -1.0}}]"],
        "envs[0].sampling.temperature: must be > 0, got -1.0",
    ),
    (
        ["--envs", "[{name: a, env_class: 'marin_rl.config:RunConfig'}]"],
        "envs[0].env_class: 'marin_rl.config:RunConfig' is not an Environment subclass",
    ),
    (
        ["--envs", "[{name: a, env_class: 'no_such_module_here:Env'}]"],
        "envs[0].env_class: environment class 'no_such_module_here:Env' cannot be imported",
    ),
    (
        ["--envs", "[{name: addition, args: {max_operandd: 9}}]"],
        "envs[addition].args do not fit marin_rl.envs.arithmetic:AdditionEnvironment: got an unexpected keyword "
        "argument 'max_operandd'",
    ),
    (
        ["--envs", "[{name: gsm8k, env_class: 'marin_rl.envs.math:MathEnvironment'}]"],
        "envs[gsm8k].args do not fit marin_rl.envs.math:MathEnvironment: missing a required argument: 'train_path'",
    ),
    (["--envs", "[{name: addition, args: {seed: 3}}]"], "envs[addition].args.seed: set by the run"),
    (  # a constructor that passes **options on to its base class's: the base's keywords bind, others do not
        ["--envs", "[{name: calc, env_class: 'marin_rl.envs.calculator:CalculatorEnvironment', args: {maxturns: 2}}]"],
        "envs[calc].args do not fit marin_rl.envs.calculator:CalculatorEnvironment: got an unexpected keyword "
        "argument 'maxturns'",
    ),
    (  # a class that declares its arguments as a dataclass: their values are checked before anything starts
        ["--envs", "[{name: addition, args: {max_operand: 0}}]"],
        "envs[addition].args.max_operand: must be >= 1, got 0",
    ),
    (
        [
            "--envs",
            "[{name: calc, env_class: 'marin_rl.envs.calculator:CalculatorEnvironment', args: {operations: /}}]",
        ],
        "envs[calc].args.operations: must be a string of",
    ),
    (["--orchestrator.num_steps", "[1, 2]"], "orchestrator.num_steps: expected int, got list [1, 2]"),
    (["--envs", "[{name: a, group_size: [1, 2]}]"], "envs[0].group_size: expected int, got list [1, 2]"),
    (["--learner.optimizer.learning_rate", "fast"], "learner.optimizer.learning_rate: expected float, got str 'fast'"),
    (["--checkpoint.keep", "[3]"], "checkpoint.keep: expected int or null, got list [3]"),
    (["--learner.algorithm", "no_such_module_here:ALGO"], "learner.algorithm: algorithm 'no_such_module_here:ALGO'"),
    (["--learner.loss.objective", "no_such_module_here:f"], "learner.loss.objective: loss 'no_such_module_here:f'"),
    (["--model.matmul_precision", "tf32"], "model.matmul_precision must be null or one of ('default', 'high', "),
    (
        ["--model.architecture", "{type: olmo2, hidden_dim: 32, intermediate_dim: 64, num_heads: 2, num_kv_heads: 2}"],
        "inference.levanter.engine: the dense engine decodes Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral "
        "models (their decoder layer stacks), not Olmo2LMHeadModel",
    ),
    (
        [
            "--model.architecture",
            "{type: qwen, hidden_dim: 32, intermediate_dim: 64}",
            "--inference.levanter.engine",
            "paged",
        ],
        "inference.levanter.engine: the paged engine decodes models with a paged KV cache (Llama, Qwen3), not "
        "QwenLMHeadModel",
    ),
]


@pytest.mark.parametrize("args,expected", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_each_bad_value_is_refused_in_one_line_naming_the_field(args, expected):
    start = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        parse_config(["--config", str(QUICKSTART), *args])
    message = str(exc.value)
    assert message.startswith(PREFIX + expected), message
    assert "\n" not in message and "Traceback" not in message and 'File "' not in message, message
    assert time.monotonic() - start < 5


def test_configure_jax_sets_the_matmul_precision_of_the_process():
    """`model.matmul_precision` reaches JAX in the process that calls `configure_jax` (every process of a run does),
    and null leaves JAX's default; run in a subprocess so that this process keeps its own."""
    code = (
        "import jax, sys; from marin_rl.config import parse_config; "
        "cfg = parse_config(['--config', sys.argv[1], '--orchestrator.compilation_cache_dir', 'null', *sys.argv[2:]]); "
        "cfg.configure_jax(); print(jax.config.jax_default_matmul_precision)"
    )
    for args, want in ((["--model.matmul_precision", "highest"], "highest"), ([], "None")):
        proc = subprocess.run(
            [sys.executable, "-c", code, str(QUICKSTART), *args], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == want


def test_the_command_line_refuses_before_anything_starts():
    """The whole program, as a user runs it: one line on stderr, exit status 1, no traceback, nothing started (its
    CPU time is that of the imports; wall time depends on the machine's load)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "marin_rl.run", "--config", str(QUICKSTART), "--orchestrator.num_steps", "-5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"{PREFIX}orchestrator.num_steps: must be >= 1, got -5", proc.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 15


def test_validation_does_not_change_the_config_and_resolved_derives_the_rest(tmp_path):
    doc = base_document()
    doc["learner"]["algorithm"] = "ppo"
    doc["orchestrator"].update(deterministic=True, max_staleness=0)
    doc["replay"]["max_age"] = 0
    doc["replay"]["advantage_estimator"] = "rloo"
    config = parse_document(doc, tmp_path)  # what the program runs: resolved
    assert config.replay.advantage_estimator == "gae" and config.inference.levanter.batch_invariant

    raw = RunConfig(
        envs=BASE.envs,
        learner=dataclasses.replace(BASE.learner, algorithm="ppo"),
        replay=dataclasses.replace(BASE.replay, advantage_estimator="rloo", max_age=0),
        orchestrator=dataclasses.replace(BASE.orchestrator, deterministic=True, max_staleness=0),
        reward_models=BASE.reward_models,
    )
    before = repr(raw)
    raw.validate()
    assert repr(raw) == before  # validate is pure
    resolved = raw.resolve()
    assert repr(raw) == before  # and so is resolve: it returns a new config
    assert resolved.replay.advantage_estimator == "gae" and resolved.inference.levanter.batch_invariant
    assert raw.replay.advantage_estimator == "rloo" and not raw.inference.levanter.batch_invariant
    assert resolved.resolve() is resolved  # resolved once: a resolved config is returned as it is
    with pytest.raises(FrozenConfigError, match=r"ReplayConfig.max_age: this config is resolved and frozen"):
        resolved.replay.max_age = 3
    changed = dataclasses.replace(resolved, replay=dataclasses.replace(resolved.replay, max_age=3))
    assert changed.resolve().replay.max_age == 3 and resolved.replay.max_age == 0
    assert resolved.sampling_temperature == raw.envs[0].sampling.temperature


def test_the_run_entry_points_use_the_resolved_config():
    import inspect

    from marin_rl.orchestrator import orchestrator
    from marin_rl.programs import marin

    for fn in (orchestrator.run, orchestrator.Orchestrator.__init__, marin.resolve):
        assert ".resolve()" in inspect.getsource(fn), fn


@dataclasses.dataclass
class _Planted:
    """A config class with declared ranges, checked in `__post_init__` like the run's sections."""

    count: int = bounded(1, ge=1)
    """Something counted."""
    share: float | None = bounded(None, gt=0, le=1)
    """A share."""
    mode: int = bounded(-1, ge=1, also=(-1,))
    """-1: automatic."""
    free: float = 0.5
    """Declares no range: any finite value."""

    def __post_init__(self):
        check_fields(self, "planted")


def test_bounds_name_the_field_and_the_range():
    assert field_errors(_Planted()) == []
    with deferred_checks():  # a parser builds the tree first and checks it once, by full names
        bad, fractional, boolean = _Planted(count=0, share=1.5, mode=0, free=math.inf), _Planted(2.5), _Planted(True)
    assert field_errors(bad, "x") == [
        "x.count: must be >= 1, got 0",
        "x.share: must be in (0, 1], got 1.5",
        "x.mode: must be >= 1 or -1, got 0",
        "x.free: must be a finite number, got inf",
    ]
    assert field_errors(fractional) == ["count: expected int, got float 2.5"]
    assert field_errors(boolean) == ["count: expected int, got bool True"]
    assert field_errors(bad, "a.b")[0] == "a.b.count: must be >= 1, got 0"
    with pytest.raises(ValueError, match=r"^planted.count: must be >= 1, got 0$"):  # built in code: refused at once
        _Planted(count=0)
    assert Bounds(ge=0, lt=1).describe() == "in [0, 1)" and Bounds(gt=0).describe() == "> 0"


# ---- one field chooses the algorithm; sources checked before anything starts -----------------------------------
def _refusal(*args: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(["--config", str(QUICKSTART), *args])
    message = str(e.value)
    assert message.startswith(PREFIX) and "\n" not in message, message
    return message.removeprefix(PREFIX)


def test_learner_algorithm_is_the_one_field_that_chooses_the_algorithm():
    for name, estimator, critic in (("rloo", "rloo", False), ("grpo", "grpo", False), ("ppo", "gae", True)):
        config = parse_config(["--config", str(QUICKSTART), "--learner.algorithm", name])
        assert (config.algorithm().name, config.replay.advantage_estimator) == (name, estimator)
        assert config.learner.critic.enabled is critic
    # the estimator or the critic set on their own no longer choose: one line names the field to set instead
    assert _refusal("--replay.advantage_estimator", "grpo") == (
        "replay.advantage_estimator: 'grpo', but learner.algorithm chooses it (here 'rloo', whose estimator is "
        "'rloo'): set learner.algorithm: grpo instead"
    )
    assert "set learner.algorithm: ppo instead" in _refusal("--replay.advantage_estimator", "gae")
    assert "learner.critic.enabled: true, but learner.algorithm chooses whether a critic trains" in _refusal(
        "--learner.critic.enabled", "true"
    )
    # agreeing with the algorithm is not an error (configs written before keep working)
    assert (
        parse_config(["--config", str(QUICKSTART), "--replay.advantage_estimator", "rloo"]).algorithm().name == "rloo"
    )


def test_a_parsed_config_is_resolved_once_and_frozen():
    config = parse_config(["--config", str(QUICKSTART)])
    assert config.resolve() is config
    for change in (
        lambda: setattr(config, "output_dir", "elsewhere"),
        lambda: setattr(config.learner.optimizer, "learning_rate", 1.0),
        lambda: setattr(config.envs[0].sampling, "temperature", 0.5),
        lambda: config.envs.append(config.envs[0]),
        lambda: config.envs.__setitem__(0, config.envs[0]),
        lambda: config.envs[0].args.update(max_operand=5),
        lambda: config.envs[0].args.__setitem__("max_operand", 5),
    ):
        with pytest.raises(FrozenConfigError, match="resolved and frozen"):
            change()
    variant = thaw(config)
    variant.learner.optimizer.learning_rate = 1.0
    assert variant.resolve().learner.optimizer.learning_rate == 1.0 and config.learner.optimizer.learning_rate != 1.0
    assert pickle.loads(pickle.dumps(config)) == config  # what Ray actors receive: equal, and frozen
    with pytest.raises(FrozenConfigError):
        pickle.loads(pickle.dumps(config)).output_dir = "elsewhere"
    with pytest.raises(FrozenConfigError):
        copy.deepcopy(config).envs[0].args.clear()
    # frozen lists and dicts still read, compare and encode as lists and dicts
    assert isinstance(config.envs, list) and config.envs == list(config.envs)
    assert draccus.encode(config)["envs"][0]["args"] == dict(config.envs[0].args)
    thawed = thaw(config)
    thawed.envs[0].args["max_operand"] = 5
    assert type(thawed.envs) is list and type(thawed.envs[0].args) is dict


@pytest.mark.parametrize(
    "field,value",
    [("tokenizer.path", "/nonexistent/tokenizer"), ("model.init_from_hf", "./no/such/checkpoint")],
)
def test_a_missing_local_source_is_one_line_before_anything_starts(field, value):
    """A tokenizer or checkpoint path that does not exist used to end in a loader's traceback after ~10 s (Ray or the
    engine already started); a Hugging Face repo id or a URL is still looked up where it is loaded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "marin_rl.run", "--config", str(QUICKSTART), f"--{field}", value],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"{PREFIX}{field}: {value!r} does not exist (a local path), and is not a Hugging Face repo id either"
    ), proc.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 15
    hub = parse_config(["--config", str(QUICKSTART), f"--{field}", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert "SmolLM2" in (hub.tokenizer.path if field == "tokenizer.path" else hub.model.init_from_hf)


def test_env_signature_names_inherited_keywords():
    """A constructor ending in **options shows its base classes' keywords (what `_check_env_args` binds), and no
    **options: the chain accepts nothing else."""
    from marin_rl.envs.calculator import CalculatorEnvironment
    from marin_rl.envs.math import MathEnvironment

    calc = inspect.signature(CalculatorEnvironment).parameters
    assert {"min_digits", "tool_timeout_s", "max_turns", "name", "seed", "reward_weights"} <= set(calc)
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in calc.values())
    problem_set = inspect.signature(MathEnvironment).parameters
    assert {"train_path", "skip_bad_rows", "max_seq_len", "name", "seed", "reward_weights"} <= set(problem_set)
