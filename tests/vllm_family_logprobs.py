"""vLLM's prompt logprobs on the checkpoints `tests/hf_reference.py` writes, for the family parity tests.

Run by the vLLM environment's interpreter, never imported by the test process:

    python tests/vllm_family_logprobs.py ROOT NAME[,NAME...]

prints one JSON object: {NAME: {"logprobs": [[...], ...]} or {"error": "..."}}, where logprobs[s][t] is vLLM's
log p(sequences[s][t + 1] | sequences[s][: t + 1]) in float32 for the sequences of ROOT/reference.json. The engine
runs in this process (no engine-core or worker processes), one checkpoint after another.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(root: Path, names: list[str]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sequences = json.loads((root / "reference.json").read_text())["sequences"]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = {}
    for name in names:
        try:
            llm = LLM(
                model=str(root / name),
                dtype="float32",
                skip_tokenizer_init=True,
                enforce_eager=True,
                max_model_len=64,
                seed=0,
                gpu_memory_utilization=0.08,  # on the CPU backend: the share of host memory for the KV cache
                distributed_executor_backend="uni",
            )
            results = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params)
            out[name] = {
                "logprobs": [
                    [step[seq[t + 1]].logprob for t, step in enumerate(r.prompt_logprobs[1:])]
                    for r, seq in zip(results, sequences, strict=True)
                ]
            }
            del llm
        except Exception as e:  # noqa: BLE001 - reported per checkpoint, the test names it
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
