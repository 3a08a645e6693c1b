"""Tokenizers: load a Hugging Face tokenizer from a local or `gs://` path, or build one locally.

The character tokenizer (the default) needs no network: every printable ASCII character is one token, plus the
special tokens. The BPE tokenizer (`kind: bpe`, `marin_rl.bpe`) is a byte-level BPE trained locally, with Qwen's
special tokens and ChatML chat template. Both are standard HF tokenizers, which the inference server and
`transformers` use like any other.
"""

from __future__ import annotations

import json
import os
import string
import tempfile
from dataclasses import dataclass

import fsspec
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from marin_rl.bounds import bounded
from marin_rl.bpe import build_bpe_tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Every message is '<|role|>content<eos>' (roles system, user, assistant, tool); the generation prompt is
# '<|assistant|>', so a policy turn ends with the EOS token it samples as its stop token. Given `tools` (OpenAI
# function schemas), a system message first lists them, one JSON object a line, with the tool-call convention of
# `marin_rl.envs.tools` (the content of a leading system message comes first in it). Without tools the rendering
# is exactly the original template's.
TOOL_CALL_INSTRUCTIONS = 'To call a tool, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools:'
CHAT_TEMPLATE = (
    "{% set ns = namespace(skip_first=false) %}"
    "{% if tools %}<|system|>"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\\n' }}"
    "{% set ns.skip_first = true %}{% endif %}"
    + TOOL_CALL_INSTRUCTIONS
    + "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}{% if not (loop.first and ns.skip_first) %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class TokenizerConfig:
    """Which tokenizer to use."""

    path: str | None = None
    """Local or `gs://` directory of a Hugging Face tokenizer (e.g. a checkpoint's), or a GGUF file (its tokenizer and
    chat template, `marin_rl.gguf`). None builds the tokenizer that `kind` names."""
    kind: str = "char"
    """Without `path`: 'char' (one token per printable ASCII character, role markers, <eos>) or 'bpe' (a byte-level
    BPE of `vocab_size` tokens with Qwen's special tokens and ChatML chat template, trained locally and cached;
    `marin_rl.bpe`)."""
    vocab_multiple: int = bounded(64, ge=1)
    """The character tokenizer's vocabulary is padded to a multiple of this (friendlier matmul shapes)."""
    vocab_size: int = bounded(1024, ge=261)
    """The BPE tokenizer's vocabulary size (kind 'bpe'): 256 bytes, merges, special and added tokens."""

    def __post_init__(self):
        if self.kind not in TOKENIZER_KINDS:
            raise ValueError(f"tokenizer.kind must be one of {TOKENIZER_KINDS}, got {self.kind!r}")
        if self.path is not None and self.kind != "char":
            raise ValueError(f"tokenizer.kind: {self.kind!r} builds a tokenizer, but tokenizer.path loads one: set one")


TOKENIZER_KINDS = ("char", "bpe")


def build_char_tokenizer(vocab_multiple: int = 64) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII, with <pad>, <bos>, <eos>, <unk> and role markers."""
    specials = [PAD, BOS, EOS, UNK, "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    n = len(vocab)
    padded = -(-n // vocab_multiple) * vocab_multiple
    for i in range(n, padded):
        vocab[f"<unused{i - n}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Special tokens are matched first by the added-token trie; everything else splits into single characters.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=specials[4:],
        model_max_length=1 << 20,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def load_tokenizer(config: TokenizerConfig) -> PreTrainedTokenizerBase:
    """Load the configured tokenizer (copying a remote directory to a local temp dir first)."""
    if config.path is None:
        if config.kind == "bpe":
            return build_bpe_tokenizer(config.vocab_size)
        return build_char_tokenizer(config.vocab_multiple)
    from marin_rl.gguf import hf_directory

    try:
        path = hf_directory(config.path)  # a GGUF file: the directory it converts to, tokenizer and template included
    except ValueError as e:
        raise ValueError(f"tokenizer.path={config.path!r}: {e}") from None
    if "://" in path and not path.startswith("file://"):
        local = tempfile.mkdtemp(prefix="marin_rl_tok_")
        fs, root = fsspec.core.url_to_fs(path)
        for f in fs.ls(root, detail=False):
            fs.get(f, os.path.join(local, os.path.basename(f)))
        path = local
    settings = _tokenizer_settings(config.path, path)
    try:
        if settings.get("tokenizer_class") in TRANSFORMERS5_CLASSES:
            return _transformers5_tokenizer(path, settings)
        return AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise ValueError(f"tokenizer.path={config.path!r} is not a Hugging Face tokenizer directory: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever the library raises on a bad file becomes one line naming it
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tokenizer.path={config.path!r} cannot be loaded: {type(e).__name__}: {first}") from e


TRANSFORMERS5_CLASSES = ("TokenizersBackend",)
"""`tokenizer_class` values that transformers 5 writes and this line of transformers (4.x) does not know: such a
directory holds a plain `tokenizer.json`, which `PreTrainedTokenizerFast` reads (`_transformers5_tokenizer`)."""

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _tokenizer_settings(configured: str, path: str) -> dict:
    """The directory's tokenizer_config.json ({} when it has none); a file that is not a JSON object is named."""
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.exists(file):
        return {}
    try:
        with open(file) as f:
            settings = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer.path={configured!r}: tokenizer_config.json is not valid JSON: {e}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"tokenizer.path={configured!r}: tokenizer_config.json is not a JSON object")
    return settings


def _transformers5_tokenizer(path: str, settings: dict) -> PreTrainedTokenizerFast:
    """A tokenizer directory written by transformers 5 (`tokenizer_class: TokenizersBackend`, the chat template in
    `chat_template.jinja`, `extra_special_tokens` a list) as the `PreTrainedTokenizerFast` it describes."""

    def content(token):  # a special token is a string, or an AddedToken's fields
        return token.get("content") if isinstance(token, dict) else token

    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} is missing (transformers 5 tokenizers keep their vocabulary there)")
    kwargs = {k: content(settings[k]) for k in _SPECIAL_TOKENS if settings.get(k) is not None}
    extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # named extra tokens: {name: token}
        extra = list(extra.values())
    kwargs["additional_special_tokens"] = [content(t) for t in extra]
    for key in ("model_max_length", "clean_up_tokenization_spaces", "padding_side", "truncation_side"):
        if key in settings:
            kwargs[key] = settings[key]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=file, **kwargs)
    template = os.path.join(path, "chat_template.jinja")
    if os.path.exists(template):
        with open(template) as f:
            tokenizer.chat_template = f.read()
    elif settings.get("chat_template"):
        tokenizer.chat_template = settings["chat_template"]
    return tokenizer
