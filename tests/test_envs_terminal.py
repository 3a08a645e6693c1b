"""Terminal tasks (`marin_rl.envs.terminal`): every task's solution, run in a sandbox, gives what the reference shows
and what the verifier accepts; episodes run their shell calls in their own sandbox; a run that needs a sandbox
stops before it starts when this machine cannot make one; and a shortened run goes end to end through sandboxes."""

import asyncio
import json
import os
from pathlib import Path

import pytest
import yaml

from marin_rl.envs import sandbox as sandbox_module
from marin_rl.envs.base import SamplingParams
from marin_rl.envs.code_tools import format_result
from marin_rl.envs.sandbox import Sandbox, SandboxUnavailable, use_sandbox
from marin_rl.envs.terminal import KINDS, TerminalEnvironment, verify
from marin_rl.envs.tools import format_tool_call
from marin_rl.inference.client import Sample
from marin_rl.orchestrator.preflight import RunRefused, check_sandboxes
from marin_rl.run import parse_config, run
from marin_rl.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env():
    return TerminalEnvironment(build_char_tokenizer(), num_train=40, num_eval=10, seed=3)


def _sample(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Sample(ids, [-0.1] * len(ids), text, "stop", 0, 0, "local", 0.0)


def test_problems_cover_every_kind_and_split_held_out(env):
    kinds = [p.fields["kind"] for p in env.eval_problems()]
    assert kinds == [KINDS[i % len(KINDS)] for i in range(10)]
    train_ids = {p.id for p in env.train_problems()}
    assert len(train_ids) == 40 and not train_ids & {p.id for p in env.eval_problems()}
    again = TerminalEnvironment(build_char_tokenizer(), num_train=40, num_eval=10, seed=3)
    assert [p.fields for p in again.eval_problems()] == [p.fields for p in env.eval_problems()]
    with pytest.raises(ValueError, match="kinds: must be a non-empty list of"):
        TerminalEnvironment(build_char_tokenizer(), kinds=["count", "nope"])


def test_solutions_match_the_reference_and_the_verifier(env):
    """For every problem: the solution command's output in a sandbox is the reference's tool message; the verifier
    accepts the right answer and refuses a wrong one (and a wrong out.txt for `write`)."""

    async def check(problem):
        async with Sandbox(env.limits) as sb:
            for path, text in problem.fields["files"].items():
                await sb.write_file(path, text)
            result = await sb.exec(problem.fields["solution"])
            output = await sb.read_file("out.txt") if problem.fields["kind"] == "write" else None
        shown = format_result(result, timeout_s=5, memory_mb=256, max_output_chars=400)
        if problem.fields["kind"] == "write":
            assert output == problem.answer.encode() and output
            right = await verify(problem, "done", output, env.limits)
            wrong = await verify(problem, "done", output + b"extra\n", env.limits)
            missing = await verify(problem, "done", None, env.limits)
            return shown, right, wrong or missing
        right = await verify(problem, f"The answer is {problem.answer}.", None, env.limits)
        wrong = await verify(problem, str(int(problem.answer) + 1), None, env.limits)
        return shown, right, wrong

    for problem in env.eval_problems():
        shown, right, wrong = asyncio.run(check(problem))
        assert shown == env.solution_output(problem), problem
        assert right and not wrong, problem
    assert all(int(p.answer) > 0 for p in env.eval_problems() if p.fields["kind"] != "write")


def test_episode_runs_its_shell_calls_in_its_sandbox_and_tampering_does_not_pay(env):
    """A hand-played episode: the shell tool sees the problem's files; an answer made true by rewriting data.txt
    is still judged against the original files."""
    tok = env.tokenizer
    problem = next(p for p in env.eval_problems() if p.fields["kind"] == "count")
    truth = int(problem.answer)

    async def play(commands, final):
        async with Sandbox(env.limits) as sb:
            for path, text in problem.fields["files"].items():
                await sb.write_file(path, text)
            with use_sandbox(sb):
                conv = env.new_conversation(problem)
                replies = []
                for command in commands:
                    conv.add_policy_turn(
                        _sample(tok, format_tool_call("shell", {"command": command})), SamplingParams(max_tokens=200)
                    )
                    messages, _ = await env.env_response(problem, conv)
                    replies.append(messages[0]["content"])
                    conv.add_messages(messages)
                conv.add_policy_turn(_sample(tok, final), SamplingParams(max_tokens=20))
                assert await env.env_response(problem, conv) == (None, {})
                rewards = await env.episode_rewards(problem, conv)
        return replies, rewards

    replies, rewards = asyncio.run(play([problem.fields["solution"]], problem.answer))
    assert replies == [str(truth)] and rewards == {"correct": 1.0, "used_tool": 1.0}
    forged = f"printf 'x\\n' > data.txt; {problem.fields['solution']}"
    replies, rewards = asyncio.run(play([forged], "0"))
    assert replies == ["0\nexit code 1"] and rewards["correct"] == 0.0
    replies, rewards = asyncio.run(play(["ls"], problem.answer))  # right without looking: still right
    assert replies == ["data.txt"] and rewards["correct"] == 1.0


def test_a_run_that_needs_a_sandbox_stops_before_it_starts_without_one(monkeypatch, tmp_path):
    config = parse_config(["--config", "experiments/terminal.yaml", "--output_dir", str(tmp_path / "run")])
    check_sandboxes(config)  # available here
    sandbox_module._bwrap_path.cache_clear()
    sandbox_module._check_cached.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        with pytest.raises(RunRefused) as err:
            check_sandboxes(config)
        assert str(err.value).startswith("missing tool: envs[terminal] runs tools in a sandbox: ")
        assert "bubblewrap (`bwrap`)" in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(SandboxUnavailable):
            TerminalEnvironment(build_char_tokenizer())
        with pytest.raises(RunRefused, match="^missing tool: envs\\[terminal\\]"):
            run(config)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started
    finally:
        sandbox_module._bwrap_path.cache_clear()
        sandbox_module._check_cached.cache_clear()


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return 0


def _sandbox_agents() -> list[int]:
    """Host PIDs of running sandbox agents started by this process (directly or through its children)."""
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if b"/opt/marin_rl/sandbox_agent.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            ancestor = pid
            while ancestor > 1 and ancestor != os.getpid():
                ancestor = _parent(ancestor)
        except OSError:
            continue
        if ancestor == os.getpid():
            found.append(pid)
    return found


@pytest.mark.slow
def test_terminal_run_end_to_end(tmp_path):
    """experiments/terminal.yaml, shortened to a short warm start and 3 RL steps: the loop runs, the policy's shell
    calls ran (in the episodes' sandboxes: the tool runs nowhere else), and no sandbox is left behind."""
    cfg = yaml.safe_load((ROOT / "experiments" / "terminal.yaml").read_text())
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["learner"]["warm_start"].update(steps=150, learning_rate=3.0e-3)
    cfg["orchestrator"].update(num_steps=3, eval_every=3)
    cfg["envs"][0].update(num_eval_problems=12)
    cfg["envs"][0]["args"].update(num_train=400, num_eval=12)
    path = tmp_path / "terminal.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    summary = run(parse_config(["--config", str(path)]))
    assert summary["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    used = [r["eval/terminal/rewards/used_tool"] for r in records if "eval/terminal/rewards/used_tool" in r]
    trained = [
        r["replays/terminal/rewards/used_tool/mean"] for r in records if "replays/terminal/rewards/used_tool/mean" in r
    ]
    assert len(used) == 2 and max(used) > 0 and max(trained) > 0, (used, trained)
    assert _sandbox_agents() == []
