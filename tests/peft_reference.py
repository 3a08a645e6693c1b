"""Hugging Face's per-token logprobs of a base checkpoint with PEFT adapters, and of a merged checkpoint.

Run by an interpreter with torch, transformers and peft (the vLLM environment), never imported by the test process:

    python tests/peft_reference.py BASE_DIR ADAPTER_DIR MERGED_DIR SEQUENCES_JSON OUT_JSON

SEQUENCES_JSON holds [[id, ...], ...]; OUT_JSON gets {"peft": [[...], ...], "merged": [[...], ...]} where
[s][t] is log p(sequences[s][t + 1] | sequences[s][: t + 1]) under the eager float32 forward.
"""

from __future__ import annotations

import json
import sys

import peft
import torch
import transformers


def logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits.float()[0]
            lp = torch.log_softmax(logits, dim=-1)
            out.append([float(lp[t, seq[t + 1]]) for t in range(len(seq) - 1)])
    return out


def main() -> None:
    base_dir, adapter_dir, merged_dir, sequences_path, out_path = sys.argv[1:6]
    sequences = json.loads(open(sequences_path).read())
    load = dict(dtype=torch.float32, attn_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, **load)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, **load).eval()
    result = {
        "peft": logprobs(adapted, sequences),
        "merged": logprobs(merged, sequences),
        "peft_version": peft.__version__,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
