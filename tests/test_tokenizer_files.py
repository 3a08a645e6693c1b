"""Tokenizer directories as checkpoints ship them: one written by transformers 5 (`tokenizer_class:
TokenizersBackend`, the chat template in `chat_template.jinja`) loads with its chat template and encodes as
transformers 5 does (`tests/tokenizer_reference.py` computed the shipped reference); a directory that cannot be loaded
is one line naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from marin_rl.tokenizer import TokenizerConfig, load_tokenizer

SHIPPED = Path(__file__).with_name("data") / "transformers5_tokenizer"


def test_a_transformers5_directory_loads_with_its_chat_template_and_encodes_as_transformers5_does():
    import tokenizer_reference

    tok = load_tokenizer(TokenizerConfig(path=str(SHIPPED)))
    ref = json.loads((SHIPPED / "reference.json").read_text())
    assert json.loads((SHIPPED / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert len(tok) == ref["vocab"]
    assert tok.chat_template == (SHIPPED / "chat_template.jinja").read_text()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for chat, want in zip(tokenizer_reference.CHATS, ref["chats"], strict=True):
        assert tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True) == want
    for text, want in zip(tokenizer_reference.TEXTS, ref["texts"], strict=True):
        assert tok.encode(text, add_special_tokens=False) == want
        assert tok.decode(want) == text
    # Special tokens stay single tokens, as in the file.
    assert tok.convert_tokens_to_ids("<|im_start|>") == ref["chats"][0][0]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "tokenizer.json").unlink(), r"tokenizer\.json is missing"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), r"cannot be loaded: \w+"),
        (lambda d: (d / "tokenizer_config.json").write_text("{not json"), r"tokenizer_config\.json is not valid JSON"),
        (lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"), r"tokenizer_config\.json is not a JSON object"),
    ],
)
def test_a_directory_that_cannot_be_loaded_is_one_line_naming_the_file(tmp_path, damage, message):
    directory = tmp_path / "tok"
    shutil.copytree(SHIPPED, directory)
    damage(directory)
    with pytest.raises(ValueError, match=message) as info:
        load_tokenizer(TokenizerConfig(path=str(directory)))
    assert "\n" not in str(info.value) and str(info.value).startswith(f"tokenizer.path={str(directory)!r}")


@pytest.mark.slow
def test_the_shipped_directory_is_what_transformers5_writes(tmp_path):
    """transformers >= 5, run now on the project's 512-token BPE, writes the shipped directory (its tokenizer files
    and chat template) and encodes as the shipped reference says: the fixture has not drifted from its source."""
    import subprocess

    from reference_python import reference_python

    from marin_rl.bpe import build_bpe_tokenizer

    build_bpe_tokenizer(512, cache_dir=tmp_path / "cache").save_pretrained(str(tmp_path / "source"))
    script = Path(__file__).with_name("tokenizer_reference.py")
    done = subprocess.run(
        [reference_python("transformers"), str(script), str(tmp_path / "source"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for f in sorted(SHIPPED.iterdir()):
        ours, theirs = f.read_text(), (tmp_path / "out" / f.name).read_text()
        if f.suffix == ".json":  # the reference names the transformers version that computed it: any 5.x will do
            ours, theirs = json.loads(ours), json.loads(theirs)
            if f.name == "reference.json":
                ours.pop("transformers"), theirs.pop("transformers")
        assert ours == theirs, f"{f.name} differs from what transformers writes now"
