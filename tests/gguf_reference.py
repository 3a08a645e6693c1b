"""transformers' own load of a GGUF file (`gguf_file=`): its per-token logprobs and its tokenizer's ids, the reference
`tests/test_gguf.py` compares the converter (`marin_rl.gguf`) against.

Run by an interpreter with torch, transformers >= 5 and gguf, never imported by the test process:

    python tests/gguf_reference.py GGUF_FILE OUT_JSON

OUT_JSON gets {"chats": [[id, ...], ...], "logprobs": [[...], ...], "versions": {...}}: the ids of each of `CHATS`
rendered with the file's chat template (generation prompt added, then `ANSWERS`' text), and logprobs[s][t] =
log p(ids[s][t + 1] | ids[s][: t + 1]) under the eager float32 forward of the dequantised model.
"""

from __future__ import annotations

import json
import os
import sys

CHATS = [
    [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}],
    [
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"},
    ],
]
ANSWERS = ["42", "Tom has 7 apples."]


def main(path: str, out: str) -> None:
    from importlib.metadata import version

    import torch
    import transformers

    directory, name = os.path.split(os.path.abspath(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    chats, logprobs = [], []
    for chat, answer in zip(CHATS, ANSWERS, strict=True):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + answer
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits.float()[0], dim=-1)
        chats.append(ids)
        logprobs.append([float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)])
    versions = {"transformers": transformers.__version__, "torch": torch.__version__, "gguf": version("gguf")}
    with open(out, "w") as f:
        json.dump({"chats": chats, "logprobs": logprobs, "versions": versions}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
