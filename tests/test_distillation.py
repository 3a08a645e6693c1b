"""On-policy distillation: the teacher's scoring through a real server's HTTP route equals the teacher's own
learner-side logprobs, teacher logprobs travel token-exactly from rollouts to batches (and to disk) and are
validated, the `opd_reverse_kl` loss and its gradient match the formula computed in NumPy, and the configuration
refuses what cannot run."""

import asyncio
import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.config import RunConfig, parse_config
from marin_rl.frozen import thaw
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.teacher import TeacherConfig, TeacherScorer, teacher_checkpoint
from marin_rl.learner.algorithm import get_algorithm
from marin_rl.learner.batch import RlExample
from marin_rl.learner.config import LossConfig
from marin_rl.learner.losses import opd_reverse_kl
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.model.logprobs import token_logprobs
from marin_rl.replay.packing import Sequence, pack
from marin_rl.replay.store import rollout_to_row, row_to_stored
from marin_rl.replay.validation import GroupRejected, check_group
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.types import InferenceMetadata, PackedBatch, Rollout, RolloutGroup, Turn

MAX_SEQ_LEN = 64


def _rollout(prompt: list[int], sampled: list[list[int]], between: list[list[int]] | None = None) -> Rollout:
    """A rollout of `prompt`, then sampled turns (with environment turns `between` them)."""
    turns = [Turn("user", "", list(prompt))]
    for i, ids in enumerate(sampled):
        meta = InferenceMetadata(server="s", version_start=0, version_end=0)
        turns.append(Turn("assistant", "", list(ids), sampler_logprobs=[-0.5] * len(ids), inference_metadata=meta))
        if between and i < len(between):
            turns.append(Turn("user", "", list(between[i])))
    return Rollout("addition", "p0", turns)


# ---- scoring through the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher_server():
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(seed=3), len(tok))
    config = InferenceConfig(
        max_seqs=16,
        max_seq_len=MAX_SEQ_LEN,
        levanter=LevanterServerConfig(engine="dense", kv_cache_dtype="float32"),
    )
    server = LevanterInferenceServer(model, tok, config, name="teacher-0")
    address = server.start()
    yield model, server, address
    server.stop()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_teacher_scoring_over_http_equals_the_teachers_learner_logprobs(teacher_server, temperature):
    """Scored through the server's completions route (echo, max_tokens 0) and written on the rollouts' sampled turns,
    the teacher's logprobs equal the teacher model's learner-side logprobs of the same tokens, computed on a packed
    batch (two rollouts in one row, a multi-turn one among them) to 1e-4; also at a sharper temperature."""
    model, server, address = teacher_server
    rng = np.random.default_rng(0)
    vocab = model.Vocab.size

    def ids(n):
        return [int(x) for x in rng.integers(3, vocab, n)]

    single = _rollout(ids(9), [ids(5)])
    multi = _rollout(ids(7), [ids(4), ids(3)], between=[ids(6)])
    group = RolloutGroup("addition", "p0", [single, multi])
    scorer = TeacherScorer([address], temperature=temperature)

    async def score():
        try:
            return await scorer.score_group(group)
        finally:
            await scorer.aclose()

    asyncio.run(score())
    assert scorer.scored_tokens == single.num_sampled_tokens + multi.num_sampled_tokens
    for r in group.rollouts:
        r.validate(vocab)  # one finite teacher logprob per sampled token, none elsewhere
    check_group(group, "addition", vocab)

    batch, placed = pack([Sequence.from_rollout(r, 0.0) for r in group.rollouts], 1, MAX_SEQ_LEN, [0, 0])
    assert placed == [0, 1] and batch.teacher_logprobs is not None
    axes = (hax.Axis("batch", 1), hax.Axis("position", MAX_SEQ_LEN))
    learner_lp, _ = token_logprobs(
        model,
        hax.named(jnp.asarray(batch.input_ids), axes),
        hax.named(jnp.asarray(batch.position_ids), axes),
        hax.named(jnp.asarray(batch.segment_ids), axes),
        temperature=temperature,
    )
    learner_lp = np.asarray(learner_lp.array)
    mask = batch.loss_mask
    assert mask.sum() == single.num_sampled_tokens + multi.num_sampled_tokens == 12
    np.testing.assert_allclose(batch.teacher_logprobs[mask], learner_lp[mask], atol=1e-4, rtol=0)
    assert np.all(batch.teacher_logprobs[~mask] == 0.0)
    assert server.stats()["scored_tokens"] >= single.num_tokens + multi.num_tokens


@pytest.mark.parametrize("k,temperature", [(0, 1.0), (3, 1.0), (3, 0.5)])
def test_in_process_scoring_answers_what_http_scoring_answers(teacher_server, k, temperature):
    """The local backend's teacher client (`InProcessPolicyClient`, no HTTP) gives the same logprobs and top-k as
    `PolicyClient` over the server's completions route, and refuses a bad scoring request with the same status,
    message and field."""
    from marin_rl.inference.client import PolicyClient, ServerError
    from marin_rl.inference.local_client import InProcessPolicyClient

    _, server, address = teacher_server
    prompts = [[5, 9, 11, 7, 3], [4] * 12, [8, 6]]

    async def both(batch):
        http, local = PolicyClient([address], timeout_s=60), InProcessPolicyClient(server)
        try:
            out = []
            for client in (http, local):
                try:
                    out.append(await client.score_top_k(batch, temperature, k))
                except ServerError as e:
                    out.append(e)
            return out
        finally:
            await http.aclose()

    over_http, in_process = asyncio.run(both(prompts))
    for a, b in zip(over_http, in_process, strict=True):
        assert a.logprobs == b.logprobs and len(b.logprobs) > 0
        if k:
            np.testing.assert_array_equal(a.top_ids, b.top_ids)
            np.testing.assert_array_equal(a.top_logprobs, b.top_logprobs)
            assert b.top_ids.shape == (len(b.logprobs), k)
        else:
            assert a.top_ids is None and b.top_ids is None
    refused_http, refused_local = asyncio.run(both([[5] * (MAX_SEQ_LEN + 1)]))
    assert isinstance(refused_http, ServerError) and isinstance(refused_local, ServerError)
    assert (refused_local.status, refused_local.detail, refused_local.param) == (
        refused_http.status,
        refused_http.detail,
        refused_http.param,
    )


def test_a_teacher_scorer_takes_servers_or_a_client():
    with pytest.raises(ValueError, match="one of the two"):
        TeacherScorer()
    with pytest.raises(ValueError, match="one of the two"):
        TeacherScorer(["127.0.0.1:1"], client=object())


def test_a_scoring_answer_is_openais_echo_shape(teacher_server):
    """The answer to a scoring request echoes the prompt's ids with a null first logprob and samples nothing."""
    import httpx

    _, server, address = teacher_server
    prompt = [5, 9, 11, 7]
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 0, "return_token_ids": True}
    r = httpx.post(f"http://{address}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    [choice] = answer["choices"]
    assert choice["token_ids"] == prompt and choice["finish_reason"] == "length"
    lps = choice["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) == len(prompt) and all(x < 0 for x in lps[1:])
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(prompt)
    # the whole context may be scored (nothing is generated)
    r = httpx.post(f"http://{address}/v1/completions", json={**body, "prompt": [5] * MAX_SEQ_LEN}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == MAX_SEQ_LEN


def test_scoring_in_chunks_gives_the_same_logprobs(teacher_server, monkeypatch):
    """Prompts beyond one forward pass's token budget are scored in chunks of rows, with the same results."""
    import marin_rl.inference.levanter_server as levanter_server

    _, server, _ = teacher_server
    prompts = [[5, 9, 11, 7, 3], [4] * 12, [8, 6, 2]]
    whole = asyncio.run(server.score(prompts))
    monkeypatch.setattr(levanter_server, "SCORE_TOKENS", 16)  # one 16-token row per pass
    chunked = asyncio.run(server.score(prompts))
    assert [len(x) for x in chunked] == [4, 11, 2]
    np.testing.assert_allclose(np.concatenate(chunked), np.concatenate(whole), atol=1e-6)


# ---- transport and validation -----------------------------------------------------------------------------------
def _scored(rollout: Rollout, rng) -> Rollout:
    for t in rollout.turns:
        if t.is_sampled:
            t.teacher_logprobs = [float(x) for x in -rng.random(len(t.token_ids)) * 4]
    return rollout


def test_teacher_logprobs_travel_token_exactly_through_packing_and_the_store():
    rng = np.random.default_rng(1)
    rollouts = [
        _scored(_rollout([3, 4, 5], [[6, 7]], None), rng),
        _scored(_rollout([8, 9], [[10], [11, 12]], [[13]]), rng),
    ]
    back = [row_to_stored(rollout_to_row(r, "g", 0.5, 0.0)).rollout for r in rollouts]
    for r, b in zip(rollouts, back, strict=True):
        assert [t.teacher_logprobs for t in b.turns] == [t.teacher_logprobs for t in r.turns]
    batch, _ = pack([Sequence.from_rollout(r, 0.0) for r in back], 2, 16, [1, 0])
    for row, r in ((1, rollouts[0]), (0, rollouts[1])):
        n = r.num_tokens
        expected = np.concatenate([t.teacher_logprobs or [0.0] * len(t.token_ids) for t in r.turns]).astype(np.float32)
        np.testing.assert_array_equal(batch.teacher_logprobs[row, :n], expected)
        np.testing.assert_array_equal(batch.loss_mask[row, :n], r.loss_mask())
    ex = RlExample.from_packed(batch, hax.Axis("batch", 2), hax.Axis("position", 16))
    np.testing.assert_array_equal(np.asarray(ex.teacher_logprobs.array), batch.teacher_logprobs)
    # a batch is scored whole or not at all
    with pytest.raises(ValueError, match="no teacher logprobs"):
        pack([Sequence.from_rollout(rollouts[0], 0.0), Sequence.from_rollout(_rollout([1], [[2]]), 0.0)], 2, 16)


@pytest.mark.parametrize(
    "corrupt,detail",
    [
        (lambda r: r.turns[1].teacher_logprobs.append(-1.0), "teacher logprobs for"),
        (lambda r: r.turns[1].teacher_logprobs.__setitem__(0, float("nan")), "finite"),
        (lambda r: r.turns[1].teacher_logprobs.__setitem__(0, 0.5), "<= 0"),
        (lambda r: setattr(r.turns[0], "teacher_logprobs", [-1.0] * 3), "not sampled"),
        (lambda r: setattr(r.turns[3], "teacher_logprobs", None), "without teacher"),
    ],
    ids=["one too many", "NaN", "positive", "on a prompt turn", "missing on one sampled turn"],
)
def test_bad_teacher_logprobs_are_refused_with_their_reason(corrupt, detail):
    rollout = _scored(_rollout([3, 4, 5], [[6, 7], [8]], [[9]]), np.random.default_rng(2))
    corrupt(rollout)
    with pytest.raises(GroupRejected, match=detail) as e:
        check_group(RolloutGroup("addition", "p0", [rollout]), "addition", 100)
    assert e.value.reason == "teacher_logprobs"


# ---- the loss ---------------------------------------------------------------------------------------------------
B, P = hax.Axis("batch", 2), hax.Axis("position", 8)


def _example(rng) -> RlExample:
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
    mask = (rng.random((2, 8)) < 0.7) & (seg >= 0)

    def named(x):
        return hax.named(x, (B, P))

    return RlExample(
        input_ids=named(np.zeros((2, 8), np.int32)),
        position_ids=named(np.zeros((2, 8), np.int32)),
        segment_ids=named(seg),
        loss_mask=named(mask),
        advantages=named(rng.normal(size=(2, 8)).astype(np.float32)),
        sampler_logprobs=named((-rng.random((2, 8)) * 3).astype(np.float32)),
        token_versions=named(np.zeros((2, 8), np.int32)),
        teacher_logprobs=named(np.where(mask, -rng.random((2, 8)) * 3, np.nan).astype(np.float32)),
    )


@pytest.mark.parametrize("coef,task_coef,baseline", [(1.0, 0.0, False), (0.5, 2.0, False), (2.0, 0.5, True)])
def test_opd_reverse_kl_value_gradient_and_metrics_match_the_formula(coef, task_coef, baseline):
    """A_t = -coef·(logp_sampler - logp_teacher - b) + task_coef·A_task (b: 0, or with opd_baseline the mean of
    logp_sampler - logp_teacher over sampled tokens); loss = -mean over sampled tokens of
    min(r·A, clip(r)·A) with r = exp(logp - logp_sampler); d loss / d logp = -(r·A where unclipped) / N. Teacher
    logprobs off the mask hold NaN: they must not leak in."""
    rng = np.random.default_rng(5)
    ex = _example(rng)
    lp0 = (np.asarray(ex.sampler_logprobs.array) + rng.normal(size=(2, 8)) * 0.3).astype(np.float32)
    cfg = LossConfig(
        objective="opd_reverse_kl",
        clip_low=0.2,
        clip_high=0.28,
        opd_coef=coef,
        opd_task_coef=task_coef,
        opd_baseline=baseline,
    )
    entropy = hax.named(jnp.zeros((2, 8)), (B, P))

    def f(lp):
        return opd_reverse_kl(hax.named(lp, (B, P)), entropy, ex, config=cfg)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp0))

    mask = np.asarray(ex.loss_mask.array)
    lp, sampler = lp0.astype(np.float64), np.asarray(ex.sampler_logprobs.array, np.float64)
    teacher = np.where(mask, np.asarray(ex.teacher_logprobs.array, np.float64), 0.0)
    gap = sampler - teacher
    b = (gap * mask).sum() / mask.sum() if baseline else 0.0
    adv = -coef * (gap - b) + task_coef * np.asarray(ex.advantages.array, np.float64)
    r = np.exp(lp - sampler)
    unclipped, clipped = r * adv, np.clip(r, 0.8, 1.28) * adv
    n = mask.sum()
    expected = -np.where(mask, np.minimum(unclipped, clipped), 0.0).sum() / n
    takes_unclipped = unclipped <= clipped
    expected_grad = np.where(mask & takes_unclipped, -r * adv / n, 0.0)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["opd/reverse_kl"]), ((sampler - teacher) * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["opd/teacher_logprob"]), (teacher * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["opd/advantage"]), (adv * mask).sum() / n, rtol=1e-5)


def test_opd_reverse_kl_needs_teacher_logprobs():
    ex = dataclasses.replace(_example(np.random.default_rng(0)), teacher_logprobs=None)
    lp = hax.named(jnp.zeros((2, 8)), (B, P))
    with pytest.raises(ValueError, match="teacher_logprobs"):
        opd_reverse_kl(lp, lp, ex)


# ---- graph and configuration ------------------------------------------------------------------------------------
def test_the_opd_graph_scores_on_the_rollout_side_and_delivers_teacher_logprobs_to_the_learner():
    algorithm = get_algorithm("opd")
    calls = {c.name: c for c in algorithm.ordered()}
    assert calls["teacher_inf"].role == "teacher" and calls["teacher_inf"].side == "rollout"
    assert calls["teacher_inf"].writes == ("teacher_logprobs",)
    [train] = algorithm.learner_calls()
    assert "teacher_logprobs" in train.reads and algorithm.uses_teacher and algorithm.loss == "opd_reverse_kl"


def _opd_config(**teacher) -> RunConfig:
    """experiments/distill_addition.yaml as reverse-KL distillation (it ships the top-k objective)."""
    cfg = thaw(parse_config(["--config", "experiments/distill_addition.yaml"]))  # variants follow
    cfg.learner.loss.objective = "opd_reverse_kl"
    cfg.teacher = TeacherConfig(**teacher) if teacher else None
    return cfg


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: setattr(c, "teacher", None), "set teacher.path"),
        (lambda c: setattr(c.teacher, "path", " "), "set teacher.path"),
        (lambda c: setattr(c.learner.loss, "objective", "decoupled"), "trains with 'opd_reverse_kl'"),
        (lambda c: setattr(c.learner, "algorithm", "rloo"), "uses no teacher"),
        (
            lambda c: (setattr(c.orchestrator, "backend", "local"), setattr(c.teacher, "num_servers", 2)),
            "set teacher.num_servers: 1",
        ),
        (
            lambda c: (setattr(c.orchestrator, "backend", "local"), setattr(c.learner, "hosts", 2)),
            "does not serve a teacher yet",
        ),
        (
            lambda c: (setattr(c.teacher, "temperature", 0.5), setattr(c.inference, "backend", "vllm")),
            "vLLM scores prompts at temperature 1 only",
        ),
    ],
    ids=[
        "no teacher",
        "empty path",
        "another loss",
        "an algorithm without a teacher",
        "local backend, two teachers",
        "local backend, two hosts",
        "vllm sharp",
    ],
)
def test_a_distillation_config_that_cannot_run_is_refused_in_one_line(change, message):
    cfg = _opd_config(path="runs/some_teacher")
    cfg.validate()
    local = _opd_config(path="runs/some_teacher")
    local.orchestrator.backend = "local"
    local.validate()  # the local backend serves a teacher (one engine in the learner's process)
    change(cfg)
    with pytest.raises(ValueError, match=message) as e:
        cfg.validate()
    assert "\n" not in str(e.value)


def test_the_opd_loss_without_the_opd_algorithm_is_refused():
    with pytest.raises(SystemExit, match="reads a teacher's logprobs"):
        parse_config(["--config", "experiments/quickstart.yaml", "--learner.loss.objective", "opd_reverse_kl"])


def test_teacher_fields_are_checked():
    with pytest.raises(ValueError, match="teacher.num_servers"):
        TeacherConfig(path="x", num_servers=0)


def test_teacher_checkpoint_finds_a_runs_newest_export(tmp_path):
    assert teacher_checkpoint(str(tmp_path)) is None
    for step in (100, 300, 20):
        (tmp_path / "hf" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "hf" / f"step-{step}" / "config.json").write_text("{}")
    assert teacher_checkpoint(str(tmp_path)) == str(tmp_path / "hf" / "step-300")
    assert teacher_checkpoint(str(tmp_path / "hf" / "step-20")) == str(tmp_path / "hf" / "step-20")
    assert teacher_checkpoint("someone/some-model") == "someone/some-model"  # a hub id, resolved by the loader
    assert teacher_checkpoint("runs/teacher", local=True) is None  # where a recipe will write it
    assert teacher_checkpoint("gs://bucket/teacher") == "gs://bucket/teacher"


def test_packed_batch_has_no_teacher_logprobs_without_a_teacher():
    batch, _ = pack([Sequence.from_rollout(_rollout([1, 2], [[3]]), 1.0)], 1, 8)
    assert isinstance(batch, PackedBatch) and batch.teacher_logprobs is None


def _sharp_teacher(tmp_path, tokenizer, model_config) -> str:
    """A tiny teacher with a peaked distribution (another random policy, its output layer scaled up 3x): far from
    the student, so that distillation has something to learn in a few steps. Saved as a Hugging Face checkpoint."""
    import equinox as eqx

    from marin_rl.model.hf import export_hf_checkpoint

    model = build_model(dataclasses.replace(model_config, seed=7), len(tokenizer))
    head = model.lm_head
    model = eqx.tree_at(lambda m: m.lm_head, model, dataclasses.replace(head, weight=head.weight * 3.0))
    return export_hf_checkpoint(model, tokenizer, str(tmp_path / "teacher"))


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("ray", marks=pytest.mark.slow),
        pytest.param("local", marks=pytest.mark.gate_run),
    ],  # a distillation step
)
def test_a_short_distillation_run_scores_every_token_and_moves_the_student_towards_its_teacher(tmp_path, backend):
    """Through Ray (the embedded policy server and a teacher server of its own), and in one process without Ray
    (the local backend: the teacher a second engine beside the colocated one): every trained token carries the
    teacher's logprob, the persisted rollouts hold them, and the student's reverse KL to the teacher (measured on
    its own samples) falls over a few steps."""
    import json

    from marin_rl.run import run

    cfg = thaw(
        parse_config(
            [
                "--config",
                "experiments/distill_addition.yaml",
                "--output_dir",
                str(tmp_path / "run"),
                "--learner.loss.objective",
                "opd_reverse_kl",
                "--teacher.top_k",
                "0",
                "--learner.warm_start.steps",
                "0",
                "--learner.optimizer.learning_rate",
                "3e-3",
                "--orchestrator.num_steps",
                "12",
                "--orchestrator.eval_every",
                "0",
                "--orchestrator.num_cpus",
                "2",
                "--checkpoint.every",
                "0",
                "--orchestrator.backend",
                backend,
            ]
        )
    )  # its teacher is made below
    cfg.teacher.path = _sharp_teacher(tmp_path, build_char_tokenizer(), cfg.model)
    cfg.teacher.recipe = None
    summary = run(cfg)
    assert summary["steps"] == 12
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/opd/reverse_kl" in r]
    assert len(steps) == 12
    kl = [r["learner/opd/reverse_kl"] for r in steps]
    assert all(np.isfinite(kl)) and all(r["learner/opd/teacher_logprob"] < 0 for r in steps)
    assert np.mean(kl[-3:]) < 0.9 * np.mean(kl[:3]), kl  # about 4.3 nats per token at first
    from marin_rl.replay.store import read_rollouts

    stored = read_rollouts(str(tmp_path / "run" / "rollouts" / "addition")).rollouts
    assert stored and all(s.rollout.has_teacher_logprobs for s in stored)


def test_a_missing_teacher_without_a_recipe_or_with_a_failing_one_is_named(tmp_path):
    from marin_rl.orchestrator.teacher_recipe import ensure_teacher

    cfg = _opd_config(path=str(tmp_path / "teacher"))
    with pytest.raises(FileNotFoundError, match="set teacher.recipe"):
        ensure_teacher(cfg)
    cfg.teacher.recipe = str(tmp_path / "no_such_recipe.yaml")
    with pytest.raises(RuntimeError, match="no_such_recipe.yaml failed"):
        ensure_teacher(cfg)
