"""Top-k forward-KL distillation: the teacher's top-k from the server, its trip to the learner, the loss and a run."""

from __future__ import annotations

import asyncio
import dataclasses

import haliax as hax
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marin_rl.config import parse_config
from marin_rl.frozen import thaw
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.prompt_scores import top_logprobs_arrays
from marin_rl.inference.teacher import TeacherConfig, TeacherScorer
from marin_rl.learner.batch import TEACHER_TOP_K, RlExample
from marin_rl.learner.batch import chunked as _chunked
from marin_rl.learner.batch import from_raw as _from_raw
from marin_rl.learner.config import LossConfig
from marin_rl.learner.loss_registry import get_loss
from marin_rl.learner.losses import opd_forward_kl_topk
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.model.logprobs import packed_attention_mask, token_logprobs_at
from marin_rl.replay.packing import Sequence, pack
from marin_rl.replay.store import ROLLOUT_SCHEMA, rollout_to_row, row_to_stored
from marin_rl.replay.validation import GroupRejected, check_group
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn

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


def _full_log_softmax(model, ids: np.ndarray, temperature: float) -> np.ndarray:
    """log_softmax(logits / T) of one unpacked row, float64: row t is the distribution that predicts token t + 1."""
    axes = (hax.Axis("batch", 1), hax.Axis("position", ids.shape[0]))
    named = hax.named(jnp.asarray(ids[None]), axes)
    pos = hax.named(jnp.arange(ids.shape[0])[None], axes)
    seg = hax.named(jnp.zeros((1, ids.shape[0]), jnp.int32), axes)
    logits = model(named, attn_mask=packed_attention_mask(seg), pos_ids=pos)
    z = np.asarray(logits.rearrange((*axes, model.Vocab)).array[0], np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ---- the server's top-k -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher_server():
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(seed=3), len(tok))
    config = InferenceConfig(
        max_seqs=16, max_seq_len=MAX_SEQ_LEN, levanter=LevanterServerConfig(engine="dense", kv_cache_dtype="float32")
    )
    server = LevanterInferenceServer(model, tok, config, name="teacher-0")
    address = server.start()
    yield model, server, address
    server.stop()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_servers_top_k_equals_a_full_forward_passs_top_k(teacher_server, temperature):
    """Scored over HTTP (`logprobs: 5`, echo) and written on the sampled turns, the teacher's top-k ids and logprobs
    at every sampled position equal the top-k of the full log-softmax of the same model's logits / T (one forward
    pass, NumPy argsort) to 1e-5; the learner's gather at those ids (`token_logprobs_at`) gives them back."""
    model, _, address = teacher_server
    rng = np.random.default_rng(0)
    vocab, k = model.Vocab.size, 5

    def ids(n):
        return [int(x) for x in rng.integers(3, vocab, n)]

    single = _rollout(ids(9), [ids(5)])
    multi = _rollout(ids(7), [ids(4), ids(3)], between=[ids(6)])
    group = RolloutGroup("addition", "p0", [single, multi])
    scorer = TeacherScorer([address], temperature=temperature, top_k=k)

    async def score():
        try:
            return await scorer.score_group(group)
        finally:
            await scorer.aclose()

    asyncio.run(score())
    check_group(group, "addition", vocab)
    for rollout in group.rollouts:
        assert rollout.teacher_top_k == k
        full = _full_log_softmax(model, np.asarray(rollout.token_ids), temperature)
        top_ids, top_lps = rollout.teacher_top(k)
        mask = rollout.loss_mask()
        for t in np.flatnonzero(mask):
            expected_ids = np.argsort(-full[t - 1], kind="stable")[:k]
            np.testing.assert_array_equal(top_ids[t], expected_ids)
            np.testing.assert_allclose(top_lps[t], full[t - 1][expected_ids], atol=1e-5, rtol=0)
        assert not top_ids[~mask].any() and not top_lps[~mask].any()

    batch, _ = pack([Sequence.from_rollout(r, 0.0) for r in group.rollouts], 1, MAX_SEQ_LEN, [0, 0])
    axes = (hax.Axis("batch", 1), hax.Axis("position", MAX_SEQ_LEN))
    topk = hax.Axis(TEACHER_TOP_K, k)
    named = [hax.named(jnp.asarray(x), axes) for x in (batch.input_ids, batch.position_ids, batch.segment_ids)]
    cand = hax.named(jnp.asarray(batch.teacher_top_ids), (*axes, topk))
    lp, _, at = token_logprobs_at(model, *named, cand, temperature=temperature)
    mask = batch.loss_mask
    np.testing.assert_allclose(np.asarray(at.array)[mask], batch.teacher_top_logprobs[mask], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(lp.array)[mask], batch.teacher_logprobs[mask], atol=1e-5, rtol=0)


def test_a_top_k_scoring_answer_has_openais_top_logprobs_shape(teacher_server):
    """`logprobs: k` with echo: a null first entry, then k `{token: logprob}` entries per position (token strings,
    or `token_id:N` keys with return_tokens_as_token_ids); more than 20 is refused with a 400 naming logprobs."""
    _, _, address = teacher_server
    prompt = [5, 9, 11, 7]
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 3, "return_tokens_as_token_ids": True}
    r = httpx.post(f"http://{address}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    top = logprobs["top_logprobs"]
    assert top[0] is None and len(top) == len(prompt) and all(len(e) == 3 for e in top[1:])
    ids, lps = top_logprobs_arrays(top[1:], 3, "test")
    assert np.all(np.diff(lps, axis=1) <= 0) and np.all(lps[:, 0] >= np.asarray(logprobs["token_logprobs"][1:]))
    plain = httpx.post(f"http://{address}/v1/completions", json={**body, "return_tokens_as_token_ids": False})
    assert all(
        len(e) >= 1 and not any(key.startswith("token_id:") for key in e)
        for e in plain.json()["choices"][0]["logprobs"]["top_logprobs"][1:]
    )
    r = httpx.post(f"http://{address}/v1/completions", json={**body, "logprobs": 21}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_top_logprobs_parsing_keeps_the_k_likeliest_and_names_bad_answers():
    """vLLM's prompt logprobs may add the prompt's own token as a (k+1)-th entry: the k likeliest are kept."""
    entries = [{"token_id:4": -0.1, "token_id:9": -3.0, "token_id:2": -1.0}]
    ids, lps = top_logprobs_arrays(entries, 2, "s")
    assert ids.tolist() == [[4, 2]] and lps[0].tolist() == pytest.approx([-0.1, -1.0])
    with pytest.raises(RuntimeError, match="1 top logprobs, 2 asked for"):
        top_logprobs_arrays([{"token_id:4": -0.1}], 2, "s")
    with pytest.raises(RuntimeError, match="not a token id"):
        top_logprobs_arrays([{"a": -0.1}], 1, "s")
    with pytest.raises(RuntimeError, match="finite number"):
        top_logprobs_arrays([{"token_id:1": float("nan")}], 1, "s")


# ---- transport and validation -------------------------------------------------------------------------------------
def _scored(rollout: Rollout, rng, k: int) -> Rollout:
    """Random teacher scores (float32-exact values) with distinct top-k ids per token."""
    for t in rollout.turns:
        if t.is_sampled:
            n = len(t.token_ids)
            t.teacher_logprobs = [float(x) for x in (-rng.random(n) * 4).astype(np.float32)]
            t.teacher_top_ids = [[int(x) for x in rng.permutation(50)[:k]] for _ in range(n)]
            t.teacher_top_logprobs = [
                [float(x) for x in np.sort(-rng.random(k) * 5).astype(np.float32)[::-1]] for _ in range(n)
            ]
    return rollout


def test_top_k_arrays_travel_token_exactly_rollout_to_store_to_batch_to_learner_chunks(tmp_path):
    """Through the Parquet store (a file written and read with the schema), the replay buffer's dict form, packing
    (two rows, padding, a multi-turn rollout) and the learner's example and microbatch chunks: the same ids and
    logprobs at the same tokens, zero elsewhere."""
    rng, k = np.random.default_rng(1), 4
    rollouts = [
        _scored(_rollout([3, 4, 5], [[6, 7]]), rng, k),
        _scored(_rollout([8, 9], [[10], [11, 12]], [[13]]), rng, k),
        _scored(_rollout([1, 2, 3, 4], [[5, 6, 7]]), rng, k),
    ]
    table = pa.Table.from_pylist([rollout_to_row(r, "g", 0.5, 0.0) for r in rollouts], schema=ROLLOUT_SCHEMA)
    pq.write_table(table, tmp_path / "r.parquet")
    back = [row_to_stored(row).rollout for row in pq.read_table(tmp_path / "r.parquet").to_pylist()]
    back = [Rollout.from_dict(r.to_dict()) for r in back]  # the replay buffer's checkpointed form
    for r, b in zip(rollouts, back, strict=True):
        assert [t.teacher_top_ids for t in b.turns] == [t.teacher_top_ids for t in r.turns]
        assert [t.teacher_top_logprobs for t in b.turns] == [t.teacher_top_logprobs for t in r.turns]
    batch, placed = pack([Sequence.from_rollout(r, 0.0) for r in back], 2, 16, [1, 0, 1])
    assert placed == [0, 1, 2] and batch.teacher_top_ids.shape == (2, 16, k)
    starts = {0: (1, 0), 1: (0, 0), 2: (1, rollouts[0].num_tokens)}
    for i, r in enumerate(rollouts):
        row, a = starts[i]
        ids, lps = r.teacher_top(k)
        np.testing.assert_array_equal(batch.teacher_top_ids[row, a : a + r.num_tokens], ids)
        np.testing.assert_array_equal(batch.teacher_top_logprobs[row, a : a + r.num_tokens], lps)
    assert not batch.teacher_top_ids[batch.segment_ids < 0].any()
    ex = RlExample.from_packed(batch, hax.Axis("batch", 2), hax.Axis("position", 16))
    assert ex.teacher_top_ids.axes[-1] == hax.Axis(TEACHER_TOP_K, k)
    chunks = _chunked(ex, 2)
    for c in range(2):
        part = _from_raw({name: v[c] for name, v in chunks.items()})
        np.testing.assert_array_equal(np.asarray(part.teacher_top_ids.array[0]), batch.teacher_top_ids[c])
        np.testing.assert_array_equal(np.asarray(part.teacher_top_logprobs.array[0]), batch.teacher_top_logprobs[c])
    # without a top-k nothing is carried, and k is one per batch
    plain = _rollout([1, 2], [[3]])
    plain.turns[1].teacher_logprobs = [-1.0]
    assert pack([Sequence.from_rollout(plain, 0.0)], 1, 8)[0].teacher_top_ids is None
    with pytest.raises(ValueError, match="different k"):
        pack([Sequence.from_rollout(rollouts[0], 0.0), Sequence.from_rollout(plain, 0.0)], 2, 16)


@pytest.mark.parametrize(
    "corrupt,detail",
    [
        (lambda r: r.turns[1].teacher_top_ids.append([1, 2]), r"\[2 tokens, k=2\]"),
        (lambda r: r.turns[1].teacher_top_ids.__setitem__(0, [3, 3]), "repeated"),
        (lambda r: r.turns[1].teacher_top_ids.__setitem__(0, [3, 500]), "outside the vocabulary"),
        (lambda r: r.turns[1].teacher_top_logprobs.__setitem__(0, [0.5, -1.0]), "<= 0"),
        (lambda r: setattr(r.turns[3], "teacher_top_ids", None), "without the teacher's top-k"),
    ],
    ids=["one too many", "repeated id", "outside the vocabulary", "positive", "missing on a sampled turn"],
)
def test_a_bad_teacher_top_k_is_refused_with_its_reason(corrupt, detail):
    rollout = _scored(_rollout([3, 4, 5], [[6, 7], [8]], [[9]]), np.random.default_rng(2), 2)
    check_group(RolloutGroup("addition", "p0", [rollout]), "addition", 100)
    corrupt(rollout)
    with pytest.raises(GroupRejected, match=detail) as e:
        check_group(RolloutGroup("addition", "p0", [rollout]), "addition", 100)
    assert e.value.reason == "teacher_top_k"


# ---- the loss -----------------------------------------------------------------------------------------------------
B, P, V, K = hax.Axis("batch", 2), hax.Axis("position", 8), 11, 4
TOPK = hax.Axis(TEACHER_TOP_K, K)


def _example(rng) -> RlExample:
    """Two packed rows, several rollouts each, padding at the end of the first; NaN teacher values off the mask."""
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
    mask = (rng.random((2, 8)) < 0.7) & (seg >= 0)
    mask[:, 0] = False
    top_ids = np.stack([np.stack([rng.permutation(V)[:K] for _ in range(8)]) for _ in range(2)]).astype(np.int32)
    teacher_full = rng.normal(size=(2, 8, V)) * 2
    teacher_full -= np.log(np.exp(teacher_full).sum(-1, keepdims=True))
    top_lps = np.take_along_axis(teacher_full, top_ids, -1).astype(np.float32)

    def named(x):
        return hax.named(x, (B, P))

    return RlExample(
        input_ids=named(rng.integers(0, V, (2, 8)).astype(np.int32)),
        position_ids=named(np.zeros((2, 8), np.int32)),
        segment_ids=named(seg),
        loss_mask=named(mask),
        advantages=named(rng.normal(size=(2, 8)).astype(np.float32)),
        sampler_logprobs=named((-rng.random((2, 8)) * 3).astype(np.float32)),
        token_versions=named(np.zeros((2, 8), np.int32)),
        teacher_logprobs=named(np.where(mask, -rng.random((2, 8)) * 3, np.nan).astype(np.float32)),
        teacher_top_ids=hax.named(top_ids, (B, P, TOPK)),
        teacher_top_logprobs=hax.named(np.where(mask[..., None], top_lps, np.nan).astype(np.float32), (B, P, TOPK)),
    )


def _student(ex: RlExample, logits: jnp.ndarray):
    """The student's logprobs of the sampled tokens and of the teacher's top-k, from logits `(2, 8, V)` (row t the
    distribution of token t, already aligned)."""
    logp = jax.nn.log_softmax(logits, -1)
    sampled = jnp.take_along_axis(logp, ex.input_ids.array[..., None], -1)[..., 0]
    top = jnp.take_along_axis(logp, ex.teacher_top_ids.array, -1)
    return hax.named(sampled, (B, P)), hax.named(top, (B, P, TOPK))


def _numpy_kl(ex: RlExample, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(q || p_S) per position from the formula, float64, and d KL / d logits = p_S - q (q zero off the top-k)."""
    mask = np.asarray(ex.loss_mask.array)
    ids = np.asarray(ex.teacher_top_ids.array)
    t = np.where(mask[..., None], np.asarray(ex.teacher_top_logprobs.array, np.float64), 0.0)
    q = np.exp(t) / np.exp(t).sum(-1, keepdims=True)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    kl = (q * (np.log(q) - np.log(np.take_along_axis(p, ids, -1)))).sum(-1)
    q_full = np.zeros_like(p)
    np.put_along_axis(q_full, ids, q, -1)
    return np.where(mask, kl, 0.0), p - q_full


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_forward_kl_topk_value_and_gradient_match_the_formula(aggregation):
    """loss = opd_coef · aggregate over sampled tokens of Σ_i q_i (log q_i - log p_S(i)), q the teacher's top-k
    renormalised; d loss / d logits = opd_coef · (p_S - q) / N at each sampled token (token_mean; per sequence
    1 / (n_seq · tokens of the sequence) for sequence_mean); nothing elsewhere, NaN off the mask does not leak."""
    rng = np.random.default_rng(5)
    ex = _example(rng)
    logits0 = rng.normal(size=(2, 8, V)).astype(np.float32)
    cfg = LossConfig(objective="opd_forward_kl_topk", opd_coef=1.5, opd_task_coef=0.0, aggregation=aggregation)
    entropy = hax.named(jnp.zeros((2, 8)), (B, P))

    def f(z):
        lp, top = _student(ex, z)
        return opd_forward_kl_topk(lp, entropy, ex, config=cfg, student_top_logprobs=top)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logits0))
    mask = np.asarray(ex.loss_mask.array)
    seg = np.asarray(ex.segment_ids.array)
    kl, dkl = _numpy_kl(ex, logits0)
    weight = np.zeros((2, 8))
    if aggregation == "token_mean":
        weight[mask] = 1.0 / mask.sum()
    else:
        groups = {(r, s) for r in range(2) for s in np.unique(seg[r][mask[r]])}
        for r, s in groups:
            here = mask[r] & (seg[r] == s)
            weight[r][here] = 1.0 / (here.sum() * len(groups))
    np.testing.assert_allclose(float(loss), 1.5 * (kl * weight).sum(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), 1.5 * weight[..., None] * dkl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["opd/forward_kl_topk"]), (kl * weight).sum(), rtol=1e-6, atol=1e-6)
    t = np.asarray(ex.teacher_top_logprobs.array, np.float64)
    mass = np.where(mask, np.exp(np.where(mask[..., None], t, 0.0)).sum(-1), 0.0)
    np.testing.assert_allclose(float(metrics["opd/teacher_topk_mass"]), mass.sum() / mask.sum(), rtol=1e-5)
    assert 0 < float(metrics["opd/student_topk_mass"]) < 1


def test_forward_kl_topk_adds_the_task_rewards_clipped_policy_gradient():
    """With opd_task_coef c: loss = -mean over sampled tokens of min(r·cA, clip(r)·cA) (r = exp(logp -
    logp_sampler)) + opd_coef · mean KL, from the formula."""
    rng = np.random.default_rng(6)
    ex = _example(rng)
    logits0 = rng.normal(size=(2, 8, V)).astype(np.float32)
    cfg = LossConfig(objective="opd_forward_kl_topk", opd_coef=0.7, opd_task_coef=2.0)
    lp, top = _student(ex, jnp.asarray(logits0))
    loss, _ = get_loss("opd_forward_kl_topk")(
        lp, hax.named(jnp.zeros((2, 8)), (B, P)), ex, config=cfg, student_top_logprobs=top
    )
    mask = np.asarray(ex.loss_mask.array)
    n = mask.sum()
    kl, _ = _numpy_kl(ex, logits0)
    adv = 2.0 * np.asarray(ex.advantages.array, np.float64)
    r = np.exp(np.asarray(lp.array, np.float64) - np.asarray(ex.sampler_logprobs.array, np.float64))
    pg = -np.where(mask, np.minimum(r * adv, np.clip(r, 0.8, 1.28) * adv), 0.0).sum() / n
    np.testing.assert_allclose(float(loss), pg + 0.7 * kl.sum() / n, rtol=1e-5, atol=1e-6)


def test_forward_kl_topk_needs_the_teachers_top_k():
    ex = dataclasses.replace(_example(np.random.default_rng(0)), teacher_top_logprobs=None)
    lp = hax.named(jnp.zeros((2, 8)), (B, P))
    with pytest.raises(ValueError, match="teacher.top_k > 0"):
        opd_forward_kl_topk(lp, lp, ex)
    assert get_loss("opd_forward_kl_topk").takes_student_top_logprobs


# ---- configuration ------------------------------------------------------------------------------------------------
def _config(*overrides: str):
    return parse_config(["--config", "experiments/distill_addition.yaml", *overrides])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--teacher.top_k", "0"], "teacher.top_k: the objective 'opd_forward_kl_topk'"),
        (
            ["--teacher.top_k", "8", "--learner.loss.objective", "opd_reverse_kl"],
            "teacher.top_k: 8 top-k logprobs per token would be carried",
        ),
        (["--teacher.top_k", "21", "--learner.loss.objective", "opd_forward_kl_topk"], "teacher.top_k"),
        (["--teacher.top_k", "-1"], "teacher.top_k"),
    ],
    ids=["objective without top_k", "top_k without the objective", "top_k above 20", "negative top_k"],
)
def test_a_top_k_config_that_cannot_run_is_refused_in_one_line(overrides, message, capsys):
    with pytest.raises(SystemExit, match=message) as e:
        _config(*overrides)
    assert "\n" not in str(e.value)


def test_the_top_k_objective_without_the_opd_algorithm_is_refused():
    with pytest.raises(SystemExit, match="'opd_forward_kl_topk' reads a teacher's logprobs"):
        parse_config(["--config", "experiments/quickstart.yaml", "--learner.loss.objective", "opd_forward_kl_topk"])


def test_a_top_k_distillation_config_validates():
    cfg = _config("--teacher.top_k", "8", "--learner.loss.objective", "opd_forward_kl_topk")
    assert cfg.teacher.top_k == 8 and cfg.learner.loss.objective == "opd_forward_kl_topk"
    assert TeacherConfig(path="x").top_k == 0


# ---- a run --------------------------------------------------------------------------------------------------------
def _sharp_teacher(tmp_path, tokenizer, model_config) -> str:
    """A tiny teacher with a peaked distribution (another random policy, its output layer scaled up 3x), far from
    the student, saved as a Hugging Face checkpoint."""
    import equinox as eqx

    from marin_rl.model.hf import export_hf_checkpoint

    model = build_model(dataclasses.replace(model_config, seed=7), len(tokenizer))
    head = model.lm_head
    model = eqx.tree_at(lambda m: m.lm_head, model, dataclasses.replace(head, weight=head.weight * 3.0))
    return export_hf_checkpoint(model, tokenizer, str(tmp_path / "teacher"))


@pytest.mark.slow
def test_a_short_top_k_distillation_run_carries_the_top_k_and_lowers_the_forward_kl(tmp_path):
    """experiments/distill_addition.yaml with teacher.top_k: 8 and the top-k objective, on the local backend (the
    teacher an engine beside the student's; test_distillation runs a teacher server through Ray, and the top-k's way
    through a rollout's dict, Ray's form, is tested above), two microbatches per step: every step trains on the
    teacher's top-k, the persisted rollouts hold it, and the forward KL to the teacher's top-k falls over a few
    steps."""
    import json

    from marin_rl.replay.store import read_rollouts
    from marin_rl.run import run

    cfg = _config(
        "--output_dir",
        str(tmp_path / "run"),
        "--teacher.top_k",
        "8",
        "--learner.loss.objective",
        "opd_forward_kl_topk",
        "--learner.microbatches",
        "2",
        "--learner.warm_start.steps",
        "0",
        "--learner.optimizer.learning_rate",
        "3e-3",
        "--orchestrator.num_steps",
        "12",
        "--orchestrator.eval_every",
        "0",
        "--orchestrator.backend",
        "local",
        "--checkpoint.every",
        "0",
    )
    cfg = thaw(cfg)  # a parsed config is resolved and frozen: change a copy
    cfg.teacher.path = _sharp_teacher(tmp_path, build_char_tokenizer(), cfg.model)
    cfg.teacher.recipe = None
    assert run(cfg)["steps"] == 12
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/opd/forward_kl_topk" in r]
    assert len(steps) == 12
    kl = [r["learner/opd/forward_kl_topk"] for r in steps]
    assert all(np.isfinite(kl)) and all(0 < r["learner/opd/teacher_topk_mass"] <= 1 + 1e-5 for r in steps)
    assert np.mean(kl[-3:]) < 0.8 * np.mean(kl[:3]), kl
    stored = read_rollouts(str(tmp_path / "run" / "rollouts" / "addition")).rollouts
    assert stored and all(s.rollout.teacher_top_k == 8 for s in stored)
