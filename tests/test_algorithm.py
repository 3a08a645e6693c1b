"""Algorithms as declared graphs: the start-time checks name what is wrong, the shipped graphs run in order, and an
algorithm registered from user code trains through `learner.algorithm` without touching the package."""

import subprocess
import sys

import numpy as np
import pytest

from marin_rl.config import parse_config
from marin_rl.learner.algorithm import (
    Algorithm,
    Call,
    get_algorithm,
    known_algorithms,
    register_algorithm,
)
from marin_rl.learner.config import LearnerConfig
from marin_rl.learner.learner import Learner
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer

GEN = Call("actor_generate", "actor", "generate", ("prompts",), ("rollouts", "token_rewards"), side="rollout")


def test_shipped_algorithms_are_valid_graphs_in_dependency_order():
    assert {"rloo", "grpo", "dr_grpo", "reinforce", "remax", "ppo"} <= set(known_algorithms())
    ppo = get_algorithm("ppo")
    assert [c.name for c in ppo.ordered()] == ["actor_generate", "critic_inf", "gae", "actor_train", "critic_train"]
    assert ppo.roles == ("actor", "critic") and ppo.advantage_estimator == "gae"
    assert [c.name for c in ppo.learner_calls()] == ["critic_inf", "gae", "actor_train", "critic_train"]
    assert get_algorithm("remax").greedy_baseline and get_algorithm("grpo").roles == ("actor",)


@pytest.mark.parametrize(
    "calls, message",
    [
        (
            (GEN, Call("train", "actor", "train", ("rollouts", "advantages"), ("actor",))),
            "call 'train' reads 'advantages', which no call writes",
        ),
        ((GEN, Call("judge", "judge", "inference", ("rollouts",), ("scores",))), "unknown role 'judge'"),
        (
            (
                GEN,
                Call("a", "actor", "compute", ("rollouts", "y"), ("x",)),
                Call("b", "actor", "compute", ("x",), ("y",)),
            ),
            "has a cycle: a -> b -> a",
        ),
        ((GEN, Call("again", "actor", "compute", ("rollouts",), ("token_rewards",))), "written by 'actor_generate'"),
        (
            (
                Call("g", "actor", "generate", ("prompts",), ("rollouts", "rewards"), side="rollout"),
                Call("t", "actor", "train", ("rollouts", "rewards"), ("actor",)),
            ),
            "stay on the rollout",
        ),
        (
            (
                GEN,
                Call("x", "actor", "compute", ("token_rewards",), ("advantages",)),
                Call("t", "actor", "train", ("rollouts", "advantages"), ("actor",)),
            ),
            r"declares learner calls \['x', 't'\] but no step function",
        ),
    ],
)
def test_start_time_checks_name_the_missing_key_role_or_cycle(calls, message):
    with pytest.raises(ValueError, match=message):
        Algorithm("bad", calls, "gae").learner_calls()


# ---- an algorithm written by a user: REINFORCE with per-token rewards to go, no critic ---------------------------
def rewards_to_go(batch):
    """Advantage of each sampled token: the sum of the rewards from it to the end of its episode (host arrays)."""
    rewards = batch.rewards
    adv = np.zeros_like(rewards)
    for r in range(rewards.shape[0]):
        for t in range(rewards.shape[1] - 1, -1, -1):
            same = t + 1 < rewards.shape[1] and batch.segment_ids[r, t + 1] == batch.segment_ids[r, t]
            adv[r, t] = rewards[r, t] + (adv[r, t + 1] if same else 0.0)
    return np.where(batch.loss_mask, adv, 0.0)


def reinforce_to_go_step(learner, batch, placed, *, loss, loss_weight_fn):
    """The user algorithm's learner side, top to bottom: rewards to go, then the actor's steps on them."""
    advantages = rewards_to_go(batch)
    metrics = learner.actor_train(batch, placed, loss=loss, loss_weight_fn=loss_weight_fn, advantages=advantages)
    return {**metrics, "to_go/advantage_sum": float(advantages.sum())}


REINFORCE_TO_GO = register_algorithm(
    Algorithm(
        "reinforce_to_go",
        (
            GEN,
            Call("to_go", "actor", "compute", ("token_rewards",), ("advantages",)),
            Call("actor_train", "actor", "train", ("rollouts", "advantages"), ("actor",)),
        ),
        "gae",
        "REINFORCE with per-token rewards to go",
        step=reinforce_to_go_step,
    )
)


def test_a_user_algorithm_trains_through_the_learner_and_is_chosen_by_one_config_field():
    tok = build_char_tokenizer()
    cfg = LearnerConfig(algorithm="reinforce_to_go", optimizer=OptimizerConfig(learning_rate=1e-3))
    learner = Learner(ModelConfig(architecture=tiny_llama()), cfg, len(tok))
    assert learner.critic is None and [c.name for c in learner.learner_calls] == ["to_go", "actor_train"]
    seqs = []
    for prompt, reward in (("a:", 1.0), ("b:", -1.0)):
        for _ in range(3):
            s = Sequence.supervised(tok(prompt)["input_ids"], tok("xyz")["input_ids"])
            s.rewards = np.zeros(len(s), np.float32)
            s.rewards[-1] = reward
            s.token_versions = np.where(s.loss_mask, 0, -1).astype(np.int32)
            seqs.append(s)
    batch, _ = pack(seqs, 2, 32)
    batch.sampler_logprobs = np.where(batch.loss_mask, learner.logprobs(batch), 0.0).astype(np.float32)
    before = learner.logprobs(batch)
    metrics = learner.train_step(batch)
    # every sampled token's reward to go is its episode's reward: 3 episodes × ±1 × their sampled tokens
    per_episode = int(seqs[0].loss_mask.sum())
    assert metrics["to_go/advantage_sum"] == pytest.approx(3 * per_episode - 3 * per_episode)
    assert learner.version == 1 and "learner/loss" in metrics
    for _ in range(3):
        learner.train_step(batch)
    gain = (learner.logprobs(batch) - before) * batch.loss_mask
    up = np.zeros_like(batch.loss_mask)
    for r, c in zip(*np.nonzero(batch.loss_mask), strict=True):
        start = np.flatnonzero(batch.segment_ids[r] == batch.segment_ids[r, c])[0]
        up[r, c] = "a" in tok.decode(batch.input_ids[r, start:c].tolist())
    assert gain[up].sum() > 0 > gain[batch.loss_mask & ~up].sum()
    # in a run config the one field also sets what the replay buffers compute
    run = parse_config(
        ["--config", "experiments/quickstart.yaml", "--learner.algorithm", "test_algorithm:REINFORCE_TO_GO"]
    )
    assert run.replay.advantage_estimator == "gae" and not run.learner.critic.enabled
    ppo = parse_config(["--config", "experiments/quickstart.yaml", "--learner.algorithm", "ppo"])
    assert ppo.replay.advantage_estimator == "gae" and ppo.learner.critic.enabled
    assert (
        parse_config(["--config", "experiments/quickstart.yaml", "--learner.algorithm", "remax"]).algorithm().name
        == "remax"
    )


def test_a_bad_algorithm_in_a_config_stops_before_anything_starts(tmp_path):
    (tmp_path / "bad_algorithm.py").write_text(
        "from marin_rl.learner.algorithm import Algorithm, Call\n"
        "BAD = Algorithm('bad', (Call('g', 'actor', 'generate', ('prompts',), ('rollouts',), side='rollout'),\n"
        "    Call('t', 'actor', 'train', ('rollouts', 'advantages'), ('actor',))), 'gae')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SystemExit, match="reads 'advantages', which no call writes"):
            parse_config(["--config", "experiments/quickstart.yaml", "--learner.algorithm", "bad_algorithm:BAD"])
    finally:
        sys.path.remove(str(tmp_path))


def test_graph_program_writes_dot_and_png_and_lists_the_calls_in_order(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "marin_rl.graph",
            "--config",
            "experiments/quickstart_ppo.yaml",
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line.split()[1] for line in out.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    assert lines == ["actor_generate", "critic_inf", "gae", "actor_train", "critic_train"]
    dot = (tmp_path / "ppo.dot").read_text()
    assert '"key:values" -> "gae";' in dot and '"critic_train" -> "key:critic";' in dot
    assert (tmp_path / "ppo.png").stat().st_size > 10_000
    from PIL import Image

    assert Image.open(tmp_path / "ppo.png").size[0] <= 1200  # fits the README's column


@pytest.mark.parametrize("name", ["ppo", "rloo", "remax", "turn_rloo"])
def test_every_edge_of_a_drawn_graph_is_an_arrow_whose_head_shows(name):
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch

    from marin_rl.learner.algorithm import with_reward_models
    from marin_rl.programs.graph import DPI, MAX_WIDTH_PX, figure

    algorithm = get_algorithm(name)
    if name == "rloo":
        algorithm = with_reward_models(algorithm, ["rm"])
    fig = figure(algorithm)
    try:
        assert fig.get_size_inches()[0] * DPI <= MAX_WIDTH_PX
        fig.canvas.draw()
        ax = fig.axes[0]
        boxes = {t.get_text(): t.get_bbox_patch() for t in ax.texts if t.get_bbox_patch() is not None}
        arrows = [c.arrow_patch for c in ax.texts if getattr(c, "arrow_patch", None) is not None]
        order = algorithm.ordered()
        assert len(arrows) == sum(len(c.reads) + len(c.writes) for c in order)
        for arrow in arrows:
            assert isinstance(arrow, FancyArrowPatch) and arrow.get_arrowstyle().__class__.__name__ == "CurveFilledB"
            shaft, head = arrow._get_path_in_displaycoord()[0]
            tip = shaft.vertices[-1]
            target = arrow.patchB.get_window_extent()
            head_box = head.get_extents()
            assert head_box.width > 3 and head_box.height > 3, "a visible head"
            # the tip touches the target's border from outside: the head is not hidden under the box
            assert target.x0 - 4 <= tip[0] <= target.x1 + 4 and target.y0 - 4 <= tip[1] <= target.y1 + 4
            assert not (target.x0 + 3 < tip[0] < target.x1 - 3 and target.y0 + 3 < tip[1] < target.y1 - 3)
            assert np.hypot(*(shaft.vertices[0] - tip)) > 10, "the edge is longer than its head"
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert {f"role {r}" for r in algorithm.roles} <= set(legend) and "data key (italic)" in legend
        assert all(isinstance(h, Patch) for h in ax.get_legend().legend_handles[:-1])
        assert len(boxes) == len(order) + len({k for c in order for k in (*c.reads, *c.writes)})
    finally:
        plt.close(fig)
