"""A tokenizer directory as transformers 5 writes it, and transformers 5's own encodings with it.

Run by an interpreter with transformers >= 5 (the vLLM environment), never imported by the test process:

    python tests/tokenizer_reference.py SOURCE_DIR OUT_DIR

loads the tokenizer at SOURCE_DIR, saves it at OUT_DIR (`tokenizer_class: TokenizersBackend`, the chat template in
`chat_template.jinja`) and writes OUT_DIR/reference.json: the ids of each of `CHATS` rendered with the chat template
(with the generation prompt) and of each of `TEXTS`.

The shipped copy (`tests/data/transformers5_tokenizer/`) is made by the test process's interpreter with

    python tests/tokenizer_reference.py --ship REF_PYTHON

from the project's byte-level BPE (`marin_rl.bpe`, 512 tokens, ChatML template).
"""

from __future__ import annotations

import json
import sys

CHATS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And twice that?"},
    ],
]
TEXTS = ["The answer is 42.", "  leading spaces, tabs\tand\nnew lines ", "<|im_start|>user\nhi<|im_end|>"]


def main(source: str, out: str) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.save_pretrained(out)
    chats = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        chats.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    reference = {"chats": chats, "texts": texts, "vocab": len(tokenizer), "transformers": transformers.__version__}
    with open(f"{out}/reference.json", "w") as f:
        json.dump(reference, f)


def ship(reference_python: str) -> None:
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from marin_rl.bpe import build_bpe_tokenizer

    shipped = Path(__file__).with_name("data") / "transformers5_tokenizer"
    with tempfile.TemporaryDirectory() as tmp:
        build_bpe_tokenizer(512).save_pretrained(tmp)
        if shipped.exists():
            shutil.rmtree(shipped)
        subprocess.run([reference_python, __file__, tmp, str(shipped)], check=True)


if __name__ == "__main__":
    if sys.argv[1] == "--ship":
        ship(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
