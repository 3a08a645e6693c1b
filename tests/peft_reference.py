"""PEFT's per-token logprobs of a base checkpoint with LoRA adapters, and of the same adapters merged by PEFT.

Run by an interpreter with torch, transformers and peft (the vLLM environment), never imported by the test process:

    python tests/peft_reference.py BASE_DIR ADAPTER_DIR SEQUENCES_JSON OUT_JSON

SEQUENCES_JSON holds [[id, ...], ...]; OUT_JSON gets {"peft": [[...], ...], "merged": [[...], ...], "versions": {...}}
where [s][t] is log p(sequences[s][t + 1] | sequences[s][: t + 1]) under the eager float32 forward of the adapted
model ("peft") and of `merge_and_unload()`'s plain model ("merged").

The shipped reference (`tests/data/peft_reference/`) is made by the test process's interpreter with

    python tests/peft_reference.py --ship REF_PYTHON

which exports a LoRA policy as the learner does (a tiny Llama, PEFT's format), sets its tensors to seeded values
(`tests/seeded_checkpoints.py`), has REF_PYTHON run this script on it, and keeps the small files and the logprobs.
"""

from __future__ import annotations

import json
import sys

RANK, ALPHA = 2, 4.0
"""The shipped adapters' rank and α (`tests/test_lora.py` loads them with the same)."""


def logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    import torch

    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits.float()[0]
            lp = torch.log_softmax(logits, dim=-1)
            out.append([float(lp[t, seq[t + 1]]) for t in range(len(seq) - 1)])
    return out


def main(base_dir: str, adapter_dir: str, sequences_path: str, out_path: str) -> None:
    import peft
    import torch
    import transformers

    sequences = json.loads(open(sequences_path).read())
    load = dict(dtype=torch.float32, attn_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, **load)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    result = {"peft": logprobs(adapted, sequences)}
    result["merged"] = logprobs(adapted.merge_and_unload().eval(), sequences)
    result["versions"] = {
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


def ship(reference_python: str) -> None:
    """Write `tests/data/peft_reference/` (see the module's docstring)."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import numpy as np
    from seeded_checkpoints import DATA, seed_directory, strip

    from marin_rl.learner.config import LearnerConfig
    from marin_rl.learner.learner import Learner
    from marin_rl.model.config import LoraConfig, ModelConfig, tiny_llama
    from marin_rl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = LearnerConfig(lora=LoraConfig(rank=RANK, alpha=ALPHA, init="zero_b"))
    learner = Learner(ModelConfig(architecture=tiny_llama()), config, len(tok))
    assert learner.add_adapters()
    shipped = DATA / "peft_reference"
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "export"
        learner.export_hf(str(export), tok)
        seed_directory(export / "base", "peft_reference/base")
        seed_directory(export / "peft", "peft_reference/adapters")
        adapter_config = json.loads((export / "peft" / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = "../base"  # the shipped layout; the tests name the base anew
        (export / "peft" / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        rng = np.random.default_rng(0)
        sequences = [rng.integers(0, len(tok), size=n).tolist() for n in (12, 20, 31)]
        (Path(tmp) / "sequences.json").write_text(json.dumps(sequences))
        out = Path(tmp) / "out.json"
        args = [str(export / "base"), str(export / "peft"), str(Path(tmp) / "sequences.json"), str(out)]
        subprocess.run([reference_python, __file__, *args], check=True)
        if shipped.exists():
            shutil.rmtree(shipped)
        strip(export / "base", shipped / "base", "peft_reference/base")
        strip(export / "peft", shipped / "adapters", "peft_reference/adapters")
        reference = {"sequences": sequences, **json.loads(out.read_text())}
        (shipped / "reference.json").write_text(json.dumps(reference))


if __name__ == "__main__":
    if sys.argv[1] == "--ship":
        ship(sys.argv[2])
    else:
        main(*sys.argv[1:5])
