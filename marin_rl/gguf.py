"""GGUF checkpoints in: a GGUF file (llama.cpp's format) written out as the Hugging Face directory it describes, which
`model.init_from_hf` and `tokenizer.path` then read like any other (`python -m marin_rl.gguf FILE OUT_DIR`, or
`gguf_to_hf`). `model.init_from_hf` and `tokenizer.path` also take the `.gguf` file itself (a local path or an fsspec
URL): it is converted once into a cache directory (`hf_directory`) that every later run reuses.

Tensors are dequantised to float32 with the `gguf` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants: whatever
its `dequantize` supports), so a quantised file gives a close relative of the model it was made from, not the model
itself. The config, the tokenizer and its chat template come from the file's metadata through transformers' own GGUF
tables (`transformers.integrations.ggml`: key names, the tokenizer converters) and its Llama tensor processor (which
undoes llama.cpp's permutation of the query and key rows); none of it needs torch. Families: Llama (and what llama.cpp
files as `llama`, e.g. SmolLM2). Anything else, or a tensor type `gguf` cannot dequantise, is refused in one line
naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 2
"""Part of the cache key of a converted file (`hf_directory`): bumped when what the converter writes changes, so a
directory an older converter wrote is not reused (2: the tokenizer does not clean up spaces on decode)."""

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
"""GGUF `general.architecture` values this converter writes, and the Hugging Face class each becomes."""

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of GGUF tensor `name` (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    ValueError naming it when there is none."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.{match.group(3)}"
    match = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if match and match.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"
    raise ValueError(f"tensor {name!r} has no Hugging Face counterpart in this converter")


def _metadata(reader) -> tuple[str, dict, dict, dict]:
    """(architecture, config, tokenizer, tokenizer_config) parsed from the file's fields with transformers' tables."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING, GGUF_TOKENIZER_MAPPING
    from transformers.modeling_gguf_pytorch_utils import _gguf_parse_value

    def value(field):
        parsed = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        return parsed[0] if len(parsed) == 1 else parsed

    architecture = value(reader.fields["general.architecture"])
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"general.architecture {architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    config = {"model_type": architecture, "architectures": [SUPPORTED_ARCHITECTURES[architecture]]}
    tokenizer, tokenizer_config = {}, {}
    for key, field in reader.fields.items():
        prefix, _, rest = key.partition(".")
        if prefix == architecture and rest in GGUF_CONFIG_MAPPING[architecture]:
            target = GGUF_CONFIG_MAPPING[architecture][rest]
            if target is not None:
                config[target] = value(field)
        elif prefix == "tokenizer":
            if rest in GGUF_TOKENIZER_MAPPING["tokenizer"]:
                tokenizer[GGUF_TOKENIZER_MAPPING["tokenizer"][rest]] = value(field)
            if rest in GGUF_TOKENIZER_MAPPING["tokenizer_config"]:
                tokenizer_config[GGUF_TOKENIZER_MAPPING["tokenizer_config"][rest]] = value(field)
        elif key == f"{architecture}.rope.scaling.type" and (scaling := value(field)) not in ("none", ""):
            raise ValueError(f"{key} {scaling!r} is not supported (only unscaled rotary embeddings)")
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    config.setdefault("vocab_size", len(tokenizer.get("tokens", [])))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tokenizer:
            config[key] = tokenizer[key]
    return architecture, config, tokenizer, tokenizer_config


def _tensors(reader, architecture: str, config: dict) -> dict[str, np.ndarray]:
    """Every tensor dequantised to float32 under its Hugging Face name, llama.cpp's query/key permutation undone."""
    from gguf import GGMLQuantizationType, dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    out = {}
    for tensor in reader.tensors:
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            raise ValueError(f"tensor {tensor.name!r}: type {kind} cannot be dequantised by the gguf package") from None
        weights = processor.process(weights=np.asarray(weights), name=tensor.name).weights
        out[hf_tensor_name(tensor.name)] = np.ascontiguousarray(weights, dtype=np.float32)
    return out


def _tokenizer(architecture: str, tokenizer: dict, tokenizer_config: dict):
    """The file's tokenizer as a `PreTrainedTokenizerFast`, with its chat template (transformers' GGUF converters)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import convert_gguf_tokenizer

    fast, extra = convert_gguf_tokenizer(architecture, dict(tokenizer))
    tokens = tokenizer.get("tokens", [])

    def token(key):
        index = tokenizer_config.get(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id")}
    special |= {"unk_token": token("unk_token_id"), "pad_token": token("pad_token_id")}
    # The file's own ids win: transformers 4.x's Llama converter swaps bos and eos in its `extra`.
    kwargs = {k: v for k, v in {**extra, **special}.items() if v is not None}
    # No clean-up on decode (transformers' converter asks for it): it deletes the space before punctuation and quotes
    # ("'#### ' and" -> "'####'and"), which a byte-level BPE encodes exactly; transformers 5 refuses it for BPE.
    kwargs["clean_up_tokenization_spaces"] = False
    result = PreTrainedTokenizerFast(tokenizer_object=fast, **kwargs)
    if tokenizer_config.get("chat_template"):
        result.chat_template = tokenizer_config["chat_template"]
    return result


def gguf_to_hf(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the GGUF file at `path` as a Hugging Face directory at `out` (config.json, model.safetensors, the
    tokenizer with its chat template) and return `out`. ValueError, one line naming the cause, for a file this cannot
    convert (another architecture, a tensor type the gguf package cannot dequantise, not a GGUF file)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    try:
        architecture, config, tokenizer, tokenizer_config = _metadata(reader)
        tensors = _tensors(reader, architecture, config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config |= {"torch_dtype": "float32", "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _tokenizer(architecture, tokenizer, tokenizer_config).save_pretrained(str(out))
    return out


def is_gguf(path: str | None) -> bool:
    """Whether `path` (a checkpoint or tokenizer path of the config) names a GGUF file rather than a directory."""
    return path is not None and path.lower().endswith(".gguf")


def default_cache_dir() -> Path:
    """Where converted GGUF files are kept: `$MARIN_RL_CACHE/gguf`, else `~/.cache/marin_rl/gguf`."""
    from marin_rl.bpe import cache_root

    return cache_root() / "gguf"


def hf_directory(path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """`path` itself, unless it names a GGUF file (local or fsspec URL, ending '.gguf'): then the Hugging Face
    directory it converts to (`gguf_to_hf`), written once under `cache_dir` (default `default_cache_dir()`) in a
    directory named after the file, its size and modification time, so a changed file converts again. Concurrent
    callers never see a partial directory (each writes a temporary one, then renames it into place). ValueError, one
    line naming the file, when it is missing or cannot be converted."""
    if not is_gguf(path):
        return path
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, local = fsspec.core.url_to_fs(path)
    try:
        info = fs.info(local)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such GGUF file") from None
    mtime = str(info.get("mtime") or info.get("updated"))
    stamp = json.dumps([CONVERTER_VERSION, fs.unstrip_protocol(local), info.get("size"), mtime])
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{Path(local).stem}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        t = time.time()
        source = local
        if not isinstance(fs, LocalFileSystem):
            source = str(tmp / "download.gguf")
            fs.get(local, source)
        gguf_to_hf(source, tmp / "hf")
        logger.info("converted %s to a Hugging Face directory at %s (%.1fs)", path, target, time.time() - t)
        try:
            os.rename(tmp / "hf", target)
        except OSError:  # another process converted the same file first: use theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m marin_rl.gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf_file", help="the GGUF file to convert")
    parser.add_argument("out_dir", help="where to write the Hugging Face directory")
    args = parser.parse_args(argv)
    try:
        out = gguf_to_hf(args.gguf_file, args.out_dir)
    except ValueError as e:
        sys.exit(f"marin_rl.gguf: {e}")
    print(f"wrote {out} (model.init_from_hf and tokenizer.path read it)")


if __name__ == "__main__":
    main()
