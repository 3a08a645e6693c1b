"""The GSM8K recipes: gsm8k_qwen.yaml is accepted once its paths point at a Qwen-shaped checkpoint and its tokenizer,
the shipped word problems are what their script writes and verify, and gsm8k_qwen_tiny.yaml runs to completion."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest

from marin_rl.bpe import build_bpe_tokenizer
from marin_rl.envs.math import MathEnvironment, verify
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.model.hf import export_hf_checkpoint
from marin_rl.model.hf_config import architecture_from_hf
from marin_rl.replay.store import read_rollouts
from marin_rl.run import parse_config
from marin_rl.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "experiments" / "data" / "word_problems"


def test_the_real_recipe_is_accepted_with_a_qwen_shaped_checkpoint_and_its_tokenizer(tmp_path):
    tiny = parse_config(["--config", str(ROOT / "experiments" / "gsm8k_qwen_tiny.yaml")])
    tok = build_bpe_tokenizer(tiny.tokenizer.vocab_size, cache_dir=tmp_path / "cache")
    model = build_model(ModelConfig(architecture=tiny.model.architecture), len(tok))
    checkpoint = export_hf_checkpoint(model, tok, str(tmp_path / "qwen-tiny"))
    config = parse_config(
        [
            "--config",
            str(ROOT / "experiments" / "gsm8k_qwen.yaml"),
            "--model.init_from_hf",
            checkpoint,
            "--tokenizer.path",
            checkpoint,
        ]
    )
    assert config.model.init_from_hf == config.tokenizer.path == checkpoint
    assert config.learner.loss.objective == "decoupled" and config.envs[0].chat_template
    env = config.envs[0]
    assert env.env_class == "marin_rl.envs.math:MathEnvironment" and env.sampling.max_tokens >= 256
    # the recipe's architecture is the checkpoint's in everything but the sizes (Qwen2.5: GQA, qkv bias, tying, rope)
    derived = architecture_from_hf(checkpoint, config.model.architecture.max_seq_len)
    sizes = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "layer_norm_epsilon")
    recipe = config.model.architecture
    assert type(derived) is type(recipe)
    for f in dataclasses.fields(recipe):
        if f.name not in sizes and f.name not in ("gradient_checkpointing", "scan_layers", "reference_checkpoint"):
            assert getattr(derived, f.name) == getattr(recipe, f.name), f.name
    assert recipe.num_kv_heads < recipe.num_heads and recipe.tie_word_embeddings
    # the tokenizer loads from the checkpoint's directory with its chat template and stops at <|im_end|>
    loaded = load_tokenizer(config.tokenizer)
    assert len(loaded) == len(tok) and loaded.eos_token == "<|im_end|>" and loaded.chat_template == tok.chat_template


def assert_the_script_writes_the_shipped_data(script: str, shipped: Path, out: Path) -> None:
    """`experiments/<script>` run now into `out` writes train.jsonl and test.jsonl byte for byte as `shipped` holds
    them: a data set in the repository has not drifted from the script that makes it."""
    command = [sys.executable, str(ROOT / "experiments" / script), str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for name in ("train.jsonl", "test.jsonl"):
        assert filecmp.cmp(out / name, shipped / name, shallow=False), f"{name} differs from the script's output"


def test_the_shipped_word_problems_are_what_the_script_writes_and_verify(tmp_path):
    assert_the_script_writes_the_shipped_data("word_problems.py", DATA, tmp_path)
    tok = build_bpe_tokenizer(1024, cache_dir=tmp_path / "cache")
    env = MathEnvironment(
        tok,
        train_path=str(DATA / "train.jsonl"),
        eval_path=str(DATA / "test.jsonl"),
        demonstration="solution",
        max_seq_len=192,
    )
    assert len(env.train_problems()) == 320 and len(env.eval_problems()) == 80
    questions = lambda problems: {p.fields["question"] for p in problems}
    assert not questions(env.train_problems()) & questions(env.eval_problems())
    for p in env.train_problems() + env.eval_problems():
        demo = env.reference_completion(p)
        assert "<<" not in demo and verify(demo, p.answer) == 1.0 and demo.endswith(f"#### {p.answer}")
    with pytest.raises(ValueError, match="demonstration: must be"):
        MathEnvironment(tok, train_path=str(DATA / "train.jsonl"), format="jsonl", demonstration="solution")


@pytest.mark.slow
def test_the_tiny_gsm8k_recipe_trains_evaluates_and_finishes(tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    with open(log, "wb") as f:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "marin_rl.run",
                "--config",
                str(ROOT / "experiments" / "gsm8k_qwen_tiny.yaml"),
                "--output_dir",
                str(out),
            ],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    assert done.returncode == 0, log.read_text()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    print("GSM8K tiny:", {k: summary[k] for k in ("eval_reward_start", "eval_reward_end", "steps", "wall_time_s")})
    assert summary["steps"] == 6
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/gsm8k/reward" in r] == [0, 3, 6]
    assert len([r for r in rows if "learner/loss" in r]) == 6
    # the policy's turns: chat-rendered prompts, and a sampled <|im_end|> (the tokenizer's EOS) ends a turn
    tok = build_bpe_tokenizer(1024, cache_dir=tmp_path / "cache")
    stored = read_rollouts(str(out / "rollouts" / "gsm8k")).rollouts
    assert stored
    for s in stored:
        prompt, turn = s.rollout.turns
        assert tok.decode(prompt.token_ids).startswith("<|im_start|>system\nSolve the problem step by step.")
        assert tok.decode(prompt.token_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
        stopped = turn.inference_metadata.finish_reason == "stop"
        assert (turn.token_ids[-1] == tok.eos_token_id) == stopped
        assert tok.eos_token_id not in turn.token_ids[:-1] and "<|im_end|>" not in turn.message
    assert any(s.rollout.turns[1].inference_metadata.finish_reason == "stop" for s in stored)


@pytest.mark.slow
def test_the_gsm8k_recipe_runs_with_a_released_models_tokenizer_and_template(tmp_path):
    """gsm8k_qwen.yaml's data format, verifier, system prompt and chat rendering, end to end with a real BPE tokenizer
    and chat template: SmolLM2-135M-Instruct's, from its GGUF file (models/, linked by install.sh), on the shipped
    GSM8K-format word problems; the model and its answers shortened to what two CPU cores run in a few minutes."""
    import yaml
    from test_gguf import smollm2_file

    recipe = yaml.safe_load((ROOT / "experiments" / "gsm8k_qwen.yaml").read_text())
    smollm2 = yaml.safe_load((ROOT / "experiments" / "smollm2_math.yaml").read_text())
    gguf = str(smollm2_file())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["model"] = smollm2["model"] | {"init_from_hf": gguf}
    recipe["model"]["architecture"] = smollm2["model"]["architecture"] | {"max_seq_len": 256}
    recipe["tokenizer"] = {"path": gguf}
    env = recipe["envs"][0]
    env["args"] |= {"train_path": str(DATA / "train.jsonl"), "eval_path": str(DATA / "test.jsonl")}
    env |= {"concurrency": 8, "group_size": 4, "num_eval_problems": 4, "eval_samples_per_problem": 1}
    env["sampling"]["max_tokens"] = 96
    recipe["inference"] |= {"max_seqs": 16, "max_seq_len": 256}
    recipe["batcher"] = {"total_token_budget": 1024, "max_seq_len": 256}
    recipe["orchestrator"] |= {"num_steps": 2, "eval_every": 2, "compilation_cache_dir": None}
    recipe["learner"]["optimizer"] |= {"learning_rate": 1.0e-5}
    recipe["checkpoint"] = {"every": 100, "keep": 1}
    config = tmp_path / "gsm8k_smollm2.yaml"
    config.write_text(yaml.safe_dump(recipe))
    out, log = tmp_path / "run", tmp_path / "run.log"
    with open(log, "wb") as f:
        done = subprocess.run(
            [sys.executable, "-m", "marin_rl.run", "--config", str(config)],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=1200,
        )
    assert done.returncode == 0, log.read_text()[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "learner/loss" in r]) == 2
    assert [r["step"] for r in rows if "eval/gsm8k/reward" in r] == [0, 2]
    tok = load_tokenizer(parse_config(["--config", str(config)]).tokenizer)
    problems = MathEnvironment(tok, train_path=str(DATA / "train.jsonl"), eval_path=str(DATA / "test.jsonl"))
    answers = {p.id: p.answer for p in problems.train_problems()}
    stored = read_rollouts(str(out / "rollouts" / "gsm8k")).rollouts
    assert stored
    for s in stored:
        prompt, turn = s.rollout.turns
        text = tok.decode(prompt.token_ids)
        assert text.startswith("<|im_start|>system\nSolve the problem step by step. End with '#### '")
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n") and "<|im_start|>user\n" in text
        stopped = turn.inference_metadata.finish_reason == "stop"
        assert (turn.token_ids[-1] == tok.eos_token_id) == stopped and tok.eos_token == "<|im_end|>"
        assert s.rollout.reward == verify(turn.message, answers[s.rollout.problem_id])  # the verifier scored it
