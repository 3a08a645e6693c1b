"""The end-of-run report: the headline (the verifier's held-out score when a run trains on a reward model), the
summary's evaluation entries, the last console line and the reward plot."""

import json

import pytest

from marin_rl.report import headline_line, headline_summary, plot_rewards, reward_figure
from marin_rl.tracking import console_line


def _eval(reward, verifier=None, greedy=0.1, verifier_greedy=None, env="addition"):
    m = {f"eval/{env}/reward": reward, f"eval/{env}/greedy_reward": greedy, f"eval/{env}/pass@1": 1.0}
    if verifier is not None:
        m |= {f"eval/{env}/verifier_reward": verifier, f"eval/{env}/verifier_greedy_reward": verifier_greedy}
        m |= {f"eval/{env}/rewards/correct": verifier, f"eval/{env}/rewards/rm": reward}
    return m


def test_a_run_trained_on_a_reward_model_headlines_the_verifiers_score():
    start, end = _eval(0.61, verifier=0.495, verifier_greedy=0.5), _eval(0.92, verifier=0.733, verifier_greedy=0.8)
    s = headline_summary(start, end, ["addition"])
    assert s["headline"] == {"addition": "eval/addition/verifier_reward"}
    assert (s["eval_reward_start"], s["eval_reward_end"]) == (0.495, 0.733)
    assert (s["eval_reward_start/addition"], s["eval_greedy_reward_end/addition"]) == (0.495, 0.8)
    assert (s["eval_trained_reward_start"], s["eval_trained_reward_end/addition"]) == (0.61, 0.92)
    line = headline_line({**s, "wall_time_s": 229.4, "output_dir": "runs/x"})
    assert line.startswith("done: held-out verifier reward 0.495 -> 0.733 (+0.238)")
    assert "reward trained on (reward model) 0.610 -> 0.920" in line and line.endswith("in 229s; see runs/x")
    console = console_line(50, {"learner/version": 50, **end}, ["addition"])
    assert "eval verifier 0.733, trained reward 0.920 (correct 0.733, rm 0.920)" in console


def test_a_run_on_the_verifiers_reward_headlines_its_reward_as_before():
    s = headline_summary(_eval(0.2, greedy=0.3), _eval(0.8, greedy=0.9), ["addition"])
    assert s["headline"] == {"addition": "eval/addition/reward"}
    assert (s["eval_reward_start"], s["eval_reward_end"], s["eval_greedy_reward_end/addition"]) == (0.2, 0.8, 0.9)
    assert not any(k.startswith("eval_trained_reward") for k in s)
    line = headline_line({**s, "wall_time_s": 10, "output_dir": "runs/q"})
    assert line == "done: eval reward 0.200 -> 0.800 (+0.600) in 10s; see runs/q"


def test_the_headline_over_several_environments_is_the_mean_of_each_ones_headline():
    end = _eval(0.9, verifier=0.5, verifier_greedy=0.5) | _eval(0.3, env="count")
    s = headline_summary(end, end, ["addition", "count"])
    assert s["eval_reward_end"] == pytest.approx((0.5 + 0.3) / 2)
    assert s["eval_trained_reward_end"] == 0.9 and "eval_trained_reward_end/count" not in s


def test_the_plot_draws_the_verifier_bold_and_the_reward_models_score_dashed(tmp_path):
    history = [
        {"step": 0, **_eval(0.6, verifier=0.5, verifier_greedy=0.5)},
        {"step": 1, "batches/addition/reward/mean": 0.7},
        {"step": 2, "batches/addition/reward/mean": 0.8, **_eval(0.9, verifier=0.7, verifier_greedy=0.7)},
    ]
    fig = reward_figure(history, ["addition"])
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    verifier = lines["addition eval, verifier's score (held-out)"]
    model = lines["addition eval, reward model's score (held-out)"]
    assert list(verifier.get_ydata()) == [0.5, 0.7] and verifier.get_linestyle() == "-"
    assert list(model.get_ydata()) == [0.6, 0.9] and model.get_linestyle() == "--"
    assert "addition train, reward model's score (batch mean)" in lines
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == list(lines)
    path = plot_rewards(str(tmp_path), history, ["addition"])
    assert path.endswith("reward.png") and (tmp_path / "reward.png").stat().st_size > 1000
    json.dumps(headline_summary(history[0], history[2], ["addition"]))  # the summary is plain JSON
