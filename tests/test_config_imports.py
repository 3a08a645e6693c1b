"""Reading the configuration loads no JAX: `import marin_rl.config` (every config class of a run, `parse_config`,
`make_environment`) imports none of JAX, haliax, Levanter, equinox or optax, so a process that only reads, checks
or writes configs does not pay seconds for them. Each layer keeps its config classes in a module of its own that
imports no JAX (`model/config.py`, `learner/config.py`, `inference/config.py`, `broadcast/base.py`, ...).

Parsing a config does load them, and must: `model.architecture` is one of Levanter's model configs (the YAML's
`type: llama` is `levanter.models.llama.LlamaConfig`, whose module imports JAX), resolved when draccus decodes the
field, and `RunConfig.validate` checks the embedded engine against the architecture by building the model's shapes
with equinox (`engine_refusal`). What parsing must not load is marin_rl's training code: the learner, its losses and
critic, the model builder.
"""

import json
import subprocess
import sys
import textwrap

from subprocess_env import ROOT, subprocess_env

JAX_FAMILY = ("jax", "jaxlib", "haliax", "levanter", "equinox", "optax")
"""Top-level packages that importing the configuration must not load."""
TRAINING_CODE = (
    "marin_rl.learner.learner",
    "marin_rl.learner.losses",
    "marin_rl.learner.critic",
    "marin_rl.model.build",
)
"""marin_rl's modules that parsing a config must not load."""


def _import_chain(importtime: str, module: str) -> str:
    """'marin_rl.config -> marin_rl.learner.learner -> equinox' : the modules whose import first imported `module`,
    read from `python -X importtime`'s report (a module's line follows those of the modules it imported, indented
    one level deeper)."""
    rows = []
    for line in importtime.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1]
            stripped = name.lstrip(" ")
            if stripped != "imported package":
                rows.append(((len(name) - len(stripped) - 1) // 2, stripped))
    start = next((i for i, (_, name) in enumerate(rows) if name == module), None)
    if start is None:
        return module
    chain, depth = [module], rows[start][0]
    for d, name in rows[start + 1 :]:
        if d == depth - 1:
            chain.append(name)
            depth = d
    return " -> ".join(reversed(chain))


def _loaded(code: str, watched: tuple[str, ...]) -> list[str]:
    """Run `code` in a fresh interpreter; each of `watched` it left in `sys.modules`, with the chain of imports that
    loaded it."""
    report = f"import json, sys\nprint(json.dumps([m for m in {list(watched)!r} if m in sys.modules]))"
    probe = f"{textwrap.dedent(code)}\n{report}"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [_import_chain(done.stderr, m) for m in json.loads(done.stdout.splitlines()[-1])]


def test_importing_the_config_loads_no_jax():
    loaded = _loaded("import marin_rl.config", JAX_FAMILY)
    assert not loaded, "import marin_rl.config loads:\n  " + "\n  ".join(loaded)


def test_parsing_a_config_loads_no_training_code():
    code = "from marin_rl.config import parse_config\nparse_config(['--config', 'experiments/quickstart.yaml'])"
    loaded = _loaded(code, TRAINING_CODE)
    assert not loaded, "parse_config loads:\n  " + "\n  ".join(loaded)


def test_the_import_chain_is_read_from_the_importtime_report():
    report = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       100 |        100 |       jax._src",
            "import time:       100 |        200 |     jax",
            "import time:       100 |        300 |   equinox",
            "import time:       100 |        100 |   marin_rl.bounds",
            "import time:       100 |        500 | marin_rl.learner.learner",
        ]
    )
    assert _import_chain(report, "jax") == "marin_rl.learner.learner -> equinox -> jax"
    assert _import_chain(report, "optax") == "optax"
