"""The deterministic, shortened quickstart that the resume and fault tests run, and the learner state it ends with:
one-digit addition, so that a short warm start earns rewards."""

import json
from collections import Counter
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def deterministic_config(
    out: Path,
    num_steps: int,
    every: int,
    warm_start_steps: int = 30,
    eval_problems: int = 8,
    eval_samples: int = 2,
    learning_rate: float | None = None,
    num_servers: int = 1,
    ppo: bool = False,
    backend: str = "ray",
) -> Path:
    """Write the config of a run into `out` (checkpoint every `every` steps) next to it, as `<out>.yaml`; its path.
    `ppo`: with a critic and GAE (experiments/quickstart_ppo.yaml's settings). `backend`: `orchestrator.backend`."""
    import yaml

    cfg = yaml.safe_load((ROOT / "experiments" / ("quickstart_ppo.yaml" if ppo else "quickstart.yaml")).read_text())
    cfg["output_dir"] = str(out)
    env = cfg["envs"][0]
    env["args"] = {"max_operand": 9, "num_eval": 20, "demo_error_rate": 0.4}
    env.update(num_eval_problems=eval_problems, eval_samples_per_problem=eval_samples)
    cfg["learner"]["warm_start"]["steps"] = warm_start_steps
    if learning_rate is not None:
        cfg["learner"]["optimizer"]["learning_rate"] = learning_rate
    cfg["batcher"]["total_token_budget"] = 1024
    cfg["inference"]["num_servers"] = num_servers
    cfg["orchestrator"].update(
        num_steps=num_steps, max_staleness=0, deterministic=True, eval_every=1000, num_cpus=2, seed=3, backend=backend
    )
    cfg["checkpoint"] = {"every": every, "keep": 2}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def final_learner_arrays(config: Path, output: Path, step: int) -> list[np.ndarray]:
    """The learner's arrays (policy and optimizer state, and the critic's when there is one) in the final checkpoint
    of the run of `config` in `output`, which must be at `step`."""
    from marin_rl.checkpoint_dirs import latest_checkpoint, step_path
    from marin_rl.learner.checkpoint import load_learner_state
    from marin_rl.learner.learner import Learner
    from marin_rl.run import parse_config
    from marin_rl.tokenizer import load_tokenizer

    cfg = parse_config(["--config", str(config)])
    learner = Learner(cfg.model, cfg.learner, len(load_tokenizer(cfg.tokenizer)))
    path = latest_checkpoint(str(output / "checkpoints"))
    assert path == step_path(str(output / "checkpoints"), step)
    load_learner_state(learner, path)
    assert learner.version == step
    state = (learner.model, learner.opt_state)
    if learner.critic is not None:
        state += (learner.critic.model, learner.critic.opt_state)
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def stored_timeline(output: Path, env: str = "addition") -> tuple[int, int, Counter]:
    """Check that the surviving timeline of a finished run's rollout store holds exactly the groups the run accepted
    (`accepted_groups` in its summary), numbered 1..accepted once each, with nothing unreadable. Returns the number
    of stored groups in all timelines, the number on the surviving one, and its problems (problem id -> groups)."""
    from marin_rl.replay.store import read_rollouts

    summary = json.loads((output / "summary.json").read_text())
    surviving = read_rollouts(str(output / "rollouts" / env))
    everything = read_rollouts(str(output / "rollouts" / env), timeline="all")
    assert surviving.errors == [] and everything.errors == []
    groups = {s.group_id: (s.group_index, s.rollout.problem_id) for s in surviving.rollouts}
    assert sorted(index for index, _ in groups.values()) == list(range(1, summary["accepted_groups"] + 1))
    assert surviving.num_groups == summary["accepted_groups"]
    return everything.num_groups, surviving.num_groups, Counter(problem for _, problem in groups.values())


def warm_starts(log_text: str) -> int:
    """How many warm starts a run's log reports: trained, or reused from the warm-start cache."""
    return log_text.count("warm start done in") + log_text.count("warm start: reused an identical earlier one")
