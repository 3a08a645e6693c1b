"""Terminal tasks: small file-system and data-wrangling problems solved with a `shell` tool in a per-episode sandbox.

An episode gets its own sandbox (`marin_rl.envs.sandbox`) holding the problem's files (data.txt, data.csv, a logs/
directory); the policy calls

    <tool_call>{"name": "shell", "arguments": {"command": "grep -c ab data.txt"}}</tool_call>

as often as it likes (up to `max_turns`), reads the output as a tool turn, and answers. A verifier script then runs
in a fresh sandbox holding the problem's original files (and, for tasks that ask for a file, the file the episode
produced), so nothing the policy did to its own files changes the verdict: exit status 0 means correct. Kinds:

* `count`: how many lines of data.txt contain a pattern (`grep -c PAT data.txt`);
* `sum`: the sum of a column of data.csv (`awk -F, '{s+=$2}END{print s}' data.csv`);
* `max`: the largest value of a column of data.csv (`cut -d, -f2 data.csv|sort -n|tail -1`);
* `files`: how many files of an extension are in logs/ (`ls logs|grep -c log$`);
* `write`: save the lines of data.txt containing a pattern to out.txt (`grep PAT data.txt > out.txt`).

Answers are the last number of the final answer (a turn without a tool call); `write` asks for the file only.

    python -m marin_rl.try_env terminal --config experiments/terminal.yaml
"""

from __future__ import annotations

import random
import shlex
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from marin_rl.bounds import bounded
from marin_rl.envs.base import PolicyClient, Problem, SamplingParams
from marin_rl.envs.calculator import extract_final_number
from marin_rl.envs.code_tools import format_result, make_shell
from marin_rl.envs.multi_turn import Conversation
from marin_rl.envs.sandbox import (
    ExecResult,
    Sandbox,
    SandboxLimits,
    check_sandbox_available,
    current_sandbox,
    use_sandbox,
)
from marin_rl.envs.tools import ToolEnvironment, format_tool_call
from marin_rl.types import Rollout

KINDS = ("count", "sum", "max", "files", "write")
"""Every task kind, in the order `kinds` defaults to."""
OUTPUT_FILE = "out.txt"
"""The file `write` tasks ask for."""
_LETTERS = "abcdef"  # few letters, so that two-letter patterns match some lines and not others
_EXTENSIONS = ("log", "txt", "csv")


def _count(rng: random.Random) -> dict:
    # many lines (they cost the policy nothing: it reads them with the tool), so the count is hard to guess
    lines = [" ".join("".join(rng.choices(_LETTERS, k=3)) for _ in range(3)) for _ in range(rng.randint(20, 60))]
    present = sorted({w[i : i + 2] for line in lines for w in line.split() for i in range(2)})
    pattern = rng.choice(present)  # at least one line matches (grep exits 1 on none)
    q = shlex.quote(pattern)
    return {
        "prompt": f"lines of data.txt containing {pattern}?",
        "files": {"data.txt": "\n".join(lines) + "\n"},
        "answer": str(sum(pattern in line for line in lines)),
        "solution": f"grep -c {q} data.txt",
        "check": f'[ "$(grep -c -- {q} data.txt)" = "$(cat)" ]',
    }


def _table(rng: random.Random) -> tuple[list[list[int]], str]:
    rows = [[rng.randint(0, 999) for _ in range(3)] for _ in range(rng.randint(4, 12))]
    names = ["".join(rng.choices(string.ascii_lowercase, k=4)) for _ in rows]
    return rows, "".join(f"{n},{r[0]},{r[1]},{r[2]}\n" for n, r in zip(names, rows, strict=True))


def _column(rng: random.Random, what: str, of: Callable[[list[int]], int], command: Callable[[int], str]) -> dict:
    """A question about one column of a random data.csv: `what` (its name in the prompt) is `of` the column's
    values, and `command(col)` is the shell command that prints it."""
    rows, text = _table(rng)
    col = rng.randint(2, 4)
    shell = command(col)
    return {
        "prompt": f"{what} of column {col} of data.csv?",
        "files": {"data.csv": text},
        "answer": str(of([r[col - 2] for r in rows])),
        "solution": shell,
        "check": f'[ "$({shell})" = "$(cat)" ]',
    }


def _sum(rng: random.Random) -> dict:
    return _column(rng, "sum", sum, lambda col: f"awk -F, {shlex.quote(f'{{s+=${col}}}END{{print s}}')} data.csv")


def _max(rng: random.Random) -> dict:
    return _column(rng, "max", max, lambda col: f"cut -d, -f{col} data.csv|sort -n|tail -1")


def _files(rng: random.Random) -> dict:
    count = rng.randint(10, 40)
    names = {f"{''.join(rng.choices(string.ascii_lowercase, k=5))}.{rng.choice(_EXTENSIONS)}" for _ in range(count)}
    ext = rng.choice(sorted({n.rsplit(".", 1)[1] for n in names}))  # at least one file matches
    pattern = f"{ext}$"  # every name ends with its extension
    return {
        "prompt": f"number of .{ext} files in logs?",
        "files": {f"logs/{n}": "x\n" for n in sorted(names)},
        "answer": str(sum(n.endswith(f".{ext}") for n in names)),
        "solution": f"ls logs|grep -c {pattern}",
        "check": f'[ "$(ls logs | grep -c -- {pattern})" = "$(cat)" ]',
    }


def _write(rng: random.Random) -> dict:
    task = _count(rng)
    pattern = task["prompt"].split()[-1].rstrip("?")
    q = shlex.quote(pattern)
    lines = task["files"]["data.txt"].splitlines(keepends=True)
    return {
        "prompt": f"save lines of data.txt containing {pattern} to {OUTPUT_FILE}",
        "files": task["files"],
        "answer": "".join(line for line in lines if pattern in line),
        "solution": f"grep {q} data.txt > {OUTPUT_FILE}",
        "check": f"grep -- {q} data.txt | cmp -s - {OUTPUT_FILE}",
    }


_MAKERS = {"count": _count, "sum": _sum, "max": _max, "files": _files, "write": _write}


def make_task(kind: str, rng: random.Random) -> dict:
    """One task of `kind`: its prompt, files (path -> text), answer (the number, or `write`'s file contents), a
    shell command that solves it, and the verifier script (reads the answer on stdin; exit status 0 = correct)."""
    if kind not in _MAKERS:
        raise ValueError(f"unknown terminal task kind {kind!r}; choose from {', '.join(KINDS)}")
    return {"kind": kind, **_MAKERS[kind](rng)}


async def verify(problem: Problem, final_answer: str | None, output: bytes | None, limits: SandboxLimits) -> bool:
    """Whether an episode solved `problem`: the problem's verifier script, run in a fresh sandbox holding the
    problem's original files (and `output` as out.txt for `write` tasks), with the final answer's last number on
    stdin, exits 0."""
    fields = problem.fields
    if fields["kind"] == "write":
        if output is None:
            return False
        answer = ""
    else:
        number = extract_final_number(final_answer)
        if number is None:
            return False
        answer = str(number)
    async with Sandbox(limits) as sb:
        for path, text in fields["files"].items():
            await sb.write_file(path, text)
        if output is not None:
            await sb.write_file(OUTPUT_FILE, output)
        result = await sb.exec(fields["check"], stdin=answer)
    return result.returncode == 0 and not result.timed_out


class TerminalEnvironment(ToolEnvironment):
    """Terminal tasks (see the module docstring) with a `shell` tool; reward 1 when the verifier accepts.

    Named rewards: 'correct' (the verifier) and 'used_tool' (a shell call ran without an error; weight 0 unless
    `reward_weights` gives it one). Each episode runs in its own sandbox, created before its first turn and
    destroyed after its verdict; constructing the environment checks that sandboxes can be made here. The reference
    completion, for warm start, runs the task's solution command and answers with its output.

    Its arguments (`Args`) add the tasks' and the sandbox's to `ToolEnvironment`'s, with smaller defaults for the
    turn and tool-call limits.
    """

    name = "terminal"
    reward_weights = {"correct": 1.0, "used_tool": 0.0}
    needs_sandbox = True

    @dataclass
    class Args(ToolEnvironment.Args):
        # ToolEnvironment's limits, with defaults for one shell command a turn
        max_turns: int = bounded(3, ge=1)
        max_tool_calls_per_turn: int = bounded(1, ge=1)
        max_tool_output_chars: int = bounded(400, ge=1)

        kinds: Sequence[str] = KINDS
        """The task kinds problems are drawn from (a list of them, or one name)."""
        num_train: int = bounded(2000, ge=1)
        """Training problems."""
        num_eval: int = bounded(100, ge=1)
        """Held-out problems."""
        shell_timeout_s: float = bounded(5.0, gt=0)
        """Wall-time limit of a shell command (seconds; below `tool_timeout_s`)."""
        memory_mb: int = bounded(256, ge=1)
        """Memory limit of each process in the sandbox."""
        disk_mb: int = bounded(16, ge=1)
        """Size of the sandbox's workspace."""

        def __post_init__(self):
            super().__post_init__()
            self.kinds = [self.kinds] if isinstance(self.kinds, str) else list(self.kinds)
            if not self.kinds or any(k not in KINDS for k in self.kinds):
                raise ValueError(f"kinds: must be a non-empty list of {', '.join(KINDS)}, got {self.kinds!r}")
            if self.shell_timeout_s >= self.tool_timeout_s:
                limit = f"tool_timeout_s={self.tool_timeout_s:g}"
                raise ValueError(f"shell_timeout_s: must be in (0, {limit}), got {self.shell_timeout_s}")

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        kinds, num_train, num_eval = self.args.kinds, self.args.num_train, self.args.num_eval
        shell_timeout_s, memory_mb = self.args.shell_timeout_s, self.args.memory_mb
        check_sandbox_available()
        self.limits = SandboxLimits(timeout_s=shell_timeout_s, memory_mb=memory_mb, disk_mb=self.args.disk_mb)
        """Limits of the episode's sandbox and of each shell command."""
        rng = random.Random(self.seed)
        seen: set[str] = set()
        problems: list[Problem] = []
        while len(problems) < num_train + num_eval:
            task = make_task(kinds[len(problems) % len(kinds)], rng)
            key = repr(sorted(task["files"].items())) + task["prompt"]
            if key in seen:
                continue
            seen.add(key)
            problems.append(
                Problem(id=f"{task['kind']}-{len(problems)}", prompt=task["prompt"], answer=task["answer"], fields=task)
            )
        self._eval, self._train = problems[:num_eval], problems[num_eval:]
        self.register_tool(make_shell(timeout_s=shell_timeout_s, memory_mb=memory_mb, max_output_chars=400))

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    async def run_episode(self, policy: PolicyClient, problem: Problem, sampling: SamplingParams) -> Rollout:
        """The multi-turn episode, inside a new sandbox holding the problem's files (its `shell` calls run there)."""
        async with Sandbox(self.limits) as sandbox:
            for path, text in problem.fields["files"].items():
                await sandbox.write_file(path, text)
            with use_sandbox(sandbox):
                rollout = await super().run_episode(policy, problem, sampling)
        rollout.metadata["sandbox"] = "bwrap"
        return rollout

    async def episode_rewards(self, problem: Problem, conversation: Conversation) -> dict[str, float]:
        """'correct': the verifier accepts the final answer (and out.txt, for `write`); 'used_tool': a shell call
        ran without an error."""
        used = any(
            m["role"] == "tool" and m.get("name") == "shell" and not m["content"].startswith("error:")
            for m in conversation.messages
        )
        output = None
        sandbox = current_sandbox()
        if problem.fields["kind"] == "write" and sandbox is not None:
            try:
                output = await sandbox.read_file(OUTPUT_FILE, max_bytes=1 << 16)
            except OSError:
                output = None
        final = self.final_answer(conversation)
        correct = await verify(problem, final, output, self.limits) if final is not None else False
        return {"correct": float(correct), "used_tool": float(used)}

    def solution_output(self, problem: Problem) -> str:
        """The text the `shell` tool returns for the problem's solution command (what the reference shows)."""
        fields = problem.fields
        stdout = b"" if fields["kind"] == "write" else (problem.answer + "\n").encode()
        return format_result(
            ExecResult(returncode=0, stdout=stdout, stderr=b""),
            timeout_s=self.limits.timeout_s,
            memory_mb=self.limits.memory_mb,
            max_output_chars=400,
        )

    def reference_messages(self, problem: Problem) -> list[dict]:
        """Run the solution command, read its output, answer with it ('done' for `write`)."""
        fields = problem.fields
        return [
            {"role": "assistant", "content": format_tool_call("shell", {"command": fields["solution"]})},
            {"role": "tool", "name": "shell", "content": self.solution_output(problem)},
            {"role": "assistant", "content": "done" if fields["kind"] == "write" else problem.answer},
        ]
