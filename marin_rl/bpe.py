"""A byte-level BPE tokenizer with Qwen-style special tokens and a ChatML chat template, built locally.

Nothing is downloaded: the tokenizer is trained with the `tokenizers` library on a corpus generated here from a
fixed seed (arithmetic, GSM8K-style word problems with worked solutions, chat and tool-call text). The same
arguments always give the same tokenizer, so every process of a run (learner, servers, env workers) builds or
loads identical ids. A build is cached on disk under a name derived from its inputs (`build_bpe_tokenizer`).

The tokenizer is shaped like Qwen2.5's: Qwen2's pre-tokenizer (digits one by one, so arithmetic looks the same
as to the character tokenizer), byte-level BPE over all 256 bytes (any text encodes, nothing is unknown), NFC
normalisation, the special tokens <|endoftext|> (padding), <|im_start|> and <|im_end|> (EOS: what ends an assistant
turn, as in Qwen2.5-Instruct), and <tool_call> / </tool_call> as added (non-special) tokens. The chat template is
ChatML as Qwen2.5 writes it, tools included (schemas in a system message between <tools> tags, calls in
<tool_call> tags, results as user turns in <tool_response> tags), except that a conversation without a system
message gets none (as Qwen3's template does; Qwen2.5's adds a default one).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens (skipped when a completion is decoded), ids 0, 1 and 2."""
ADDED_TOKENS = ("<tool_call>", "</tool_call>")
"""Tokens matched whole in any text but kept in decoded completions (the tool-call markers). When the corpus has
fewer merges than `vocab_size` asks for, special tokens '<|reserved_N|>' (never produced by encoding text) fill
the vocabulary, so that it always has exactly `vocab_size` tokens."""
BPE_VERSION = 1
"""Bump when the corpus, the pre-tokenizer or the template changes: it is part of the cache key."""
CORPUS_SEED = 0
"""Seed of the generated training corpus."""
CORPUS_DOCUMENTS = 20_000
"""Documents in the generated corpus (~2 MB of text)."""

# Qwen2's pre-tokenizer split (digits one at a time; letters with one leading non-letter; punctuation runs).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_POSTAMBLE) + " }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen2.5 renders it (tools in the system turn, consecutive tool results in one user turn), without a
default system message. An assistant turn is '<|im_start|>assistant\\n' + content + '<|im_end|>\\n'."""

_NAMES = (
    "Ava Ben Carla Dev Elena Farid Grace Hiro Iris Jamal Kira Leo Maya Nora Omar Priya Quinn Rosa Sam Tara Uma Victor "
    "Wen Xavier Yara Zane Natalia Weng Betty James Julie Mark Tina"
).split()
_ITEMS = (
    "apples pencils books marbles cookies stickers oranges tickets cards shells coins flowers eggs muffins toys "
    "bottles boxes candles stamps balloons cupcakes notebooks plants beads"
).split()
_PLACES = "store market bakery library farm school park garden shop fair".split()
_TOOLS = (
    {"name": "calculate", "description": "Evaluate an arithmetic expression.", "arg": "expression"},
    {"name": "python", "description": "Run Python code and return what it prints.", "arg": "code"},
    {"name": "search", "description": "Search the notes for a phrase.", "arg": "query"},
)


def _word_problem(rng: random.Random) -> tuple[str, str]:
    """A GSM8K-style question and its worked answer ('... #### N')."""
    name, other = rng.sample(_NAMES, 2)
    item, place = rng.choice(_ITEMS), rng.choice(_PLACES)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
        s = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}"
    elif kind == 1:
        q = f"{name} buys {c} packs of {item} at the {place}. Each pack has {b} {item}. How many {item} in all?"
        s = f"{c} packs of {b} is {c} * {b} = <<{c}*{b}={c * b}>>{c * b} {item}.\n#### {c * b}"
    elif kind == 2:
        big = a + b
        q = f"{name} had {big} {item} and sold {b} at the {place}. How many {item} are left?"
        s = f"{name} has {big} - {b} = <<{big}-{b}={a}>>{a} {item} left.\n#### {a}"
    else:
        price = rng.randint(1, 12)
        q = f"A {item[:-1]} costs ${price} at the {place}. {name} buys {c} of them and pays with ${price * c + b}. "
        q += "How much change does " + name + " get?"
        s = (
            f"The {item} cost {c} * {price} = <<{c}*{price}={c * price}>>{c * price} dollars.\n"
            f"The change is {price * c + b} - {c * price} = <<{price * c + b}-{c * price}={b}>>{b} dollars.\n#### {b}"
        )
    return q, s


def _tool_text(rng: random.Random) -> str:
    tool = rng.choice(_TOOLS)
    schema = {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool["description"],
            "parameters": {
                "type": "object",
                "properties": {tool["arg"]: {"type": "string", "description": f"The {tool['arg']}."}},
                "required": [tool["arg"]],
            },
        },
    }
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    call = json.dumps({"name": tool["name"], "arguments": {tool["arg"]: f"{a}*{b}"}})
    return (
        f"{TOOLS_PREAMBLE}\n{json.dumps(schema)}{TOOLS_POSTAMBLE}\n"
        f"<tool_call>\n{call}\n</tool_call>\n<tool_response>\n{a * b}\n</tool_response>\n"
        f"The result is {a * b}."
    )


def corpus(documents: int = CORPUS_DOCUMENTS, seed: int = CORPUS_SEED) -> Iterator[str]:
    """The generated training text, one document at a time (the same documents for the same arguments)."""
    rng = random.Random(seed)
    for i in range(documents):
        kind = i % 5
        if kind == 0:
            lines = []
            for _ in range(8):
                a, b = rng.randint(0, 999), rng.randint(0, 999)
                lines.append(rng.choice([f"{a}+{b}={a + b}", f"{a} + {b} = {a + b}", f"{a}*{b}={a * b}"]))
            yield "\n".join(lines)
        elif kind in (1, 2):
            q, s = _word_problem(rng)
            yield f"Question: {q}\nAnswer: {s}" if kind == 1 else json.dumps({"question": q, "answer": s})
        elif kind == 3:
            q, s = _word_problem(rng)
            system = rng.choice(["You are a helpful assistant.", "Solve the problem step by step.", ""])
            head = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
            yield f"{head}{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{s}{IM_END}\n"
        else:
            yield _tool_text(rng)


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    # The corpus may hold fewer merges (seen twice) than asked for: reserved tokens fill the vocabulary to its size.
    reserved = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(reserved)])
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def cache_key(vocab_size: int) -> str:
    """The name of a build's cache directory: its inputs (version, size, template, corpus) hashed."""
    h = hashlib.sha256(json.dumps([BPE_VERSION, vocab_size, CHATML_TEMPLATE, CORPUS_SEED, CORPUS_DOCUMENTS]).encode())
    return f"bpe-v{BPE_VERSION}-{vocab_size}-{h.hexdigest()[:12]}"


def cache_root() -> Path:
    """The project's cache on this machine: `$MARIN_RL_CACHE`, else `~/.cache/marin_rl` (tokenizer builds here,
    converted GGUF files in `marin_rl.gguf`)."""
    return Path(os.environ.get("MARIN_RL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "marin_rl"))


def default_cache_dir() -> Path:
    """Where builds are cached: `$MARIN_RL_CACHE/tokenizers`, else `~/.cache/marin_rl/tokenizers`."""
    return cache_root() / "tokenizers"


def build_bpe_tokenizer(vocab_size: int = 1024, cache_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """The BPE tokenizer of `vocab_size` tokens (bytes, merges, special and added tokens), with the ChatML template.

    Loaded from the cache when an identical build is there; otherwise trained (a few seconds) and saved there in the
    Hugging Face format (written to a temporary directory first, then renamed, so concurrent builders never see a
    partial one). Raises ValueError for a size that cannot hold the 256 bytes and the special tokens.
    """
    floor = 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor} (256 bytes and the special tokens), got {vocab_size}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / cache_key(vocab_size)
    if (target / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(target))
    hf = _wrap(_train(vocab_size))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        hf.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:  # another process saved the same build first: use theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(target)) if (target / "tokenizer.json").exists() else hf
