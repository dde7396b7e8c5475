"""Loading the verifier/drafter pair from a Hub id or a local folder.

The verifier is always frozen: eval mode, gradients off, optional dtype. When the two models'
embedding sizes differ but their tokenizer is shared (Qwen3 pads its embeddings to different sizes),
logits are compared over the common vocabulary: the first ``common_vocab_size`` entries.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import huggingface_hub
import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from train.config import ConfigError, ModelConfig, looks_local
from train.models.rotary import pin_rotary_float32


class TokenizerMismatchError(ValueError):
    """The verifier's and drafter's tokenizers do not encode text the same way."""


class ModelNotFoundError(FileNotFoundError):
    """A model path or Hub id could not be loaded."""


class CorruptModelError(ValueError):
    """A model folder's weights file is truncated or not a valid safetensors/PyTorch file."""


def check_weight_files(folder: str) -> None:
    """Open every ``*.safetensors`` file in ``folder`` (header and tensor table, not the data) and raise
    :class:`CorruptModelError` naming the first one that does not parse (truncated copy, interrupted
    save or download)."""
    from safetensors import safe_open

    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
                for key in names[-1:]:  # reading the last tensor checks the file reaches its declared end
                    f.get_slice(key)
        except Exception as err:
            raise CorruptModelError(
                f"{path} is truncated or corrupt ({str(err).splitlines()[0]}); re-copy or re-export it "
                "(a tiny pair under checkpoints/tiny is rebuilt by deleting that folder)"
            ) from err


def torch_dtype(name: str | None) -> Any:
    """Map a config dtype name to a ``torch.dtype`` (``auto`` and None pass through)."""
    if name is None or name == "auto":
        return name
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


ModelT = TypeVar("ModelT", bound=torch.nn.Module)


def freeze(model: ModelT) -> ModelT:
    """Eval mode and no gradients: how the verifier is always held."""
    model.eval()
    model.requires_grad_(False)
    return model


@functools.lru_cache(maxsize=32)
def check_hub_reachable(repo_id: str, role: str) -> None:
    """Fail in well under a second, naming ``role``, when ``repo_id`` is neither in the local Hugging
    Face cache nor reachable (no network): ``from_pretrained`` would retry for about 50 s first.

    Only connection failures count; a private, gated or missing repository is left to
    ``from_pretrained``'s own message. Offline mode (``HF_HUB_OFFLINE=1``) skips the probe.
    """
    if hf_constants.HF_HUB_OFFLINE:
        return
    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return
    try:
        huggingface_hub.model_info(repo_id, timeout=10)
    except HfHubHTTPError:
        return  # the Hub answered: from_pretrained reports gated, private or missing repositories itself
    except Exception as err:  # connection refused, no DNS, timeout
        raise ModelNotFoundError(
            f"{role}: cannot reach the Hugging Face Hub for {repo_id!r} ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}) and it is not in the local cache; "
            "check the network, or download it where there is one and use its local path"
        ) from err


def load_model(
    source: str,
    dtype: str | None = "float32",
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    role: str = "model",
    device: str | torch.device | None = None,
) -> PreTrainedModel:
    """Load a causal LM, with a precise error (naming ``role``, the config key) when the source does
    not exist or its weights file is corrupt; ``device``: where to put it (None: where it loads, the CPU)."""
    path = os.path.expanduser(source)
    if looks_local(source) and not os.path.isdir(path):
        raise ModelNotFoundError(f"{role}: no model folder at {source!r}")
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if os.path.isdir(path):
        check_weight_files(path)
    elif not looks_local(source):
        check_hub_reachable(source, role)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        raise ModelNotFoundError(f"{role}: could not load a model from {source!r}: {err}") from err
    if device is not None:
        torch.nn.Module.to(model, device)  # in place; PreTrainedModel.to's stub takes no device
    pin_rotary_float32(model)
    return model


def load_tokenizer(
    source: str, trust_remote_code: bool = False, role: str = "tokenizer"
) -> PreTrainedTokenizerBase:
    """The tokenizer at ``source``; ``role`` names the config key it came from in errors."""
    path = os.path.expanduser(source)
    if looks_local(source) and not os.path.isdir(path):
        raise ModelNotFoundError(f"{role}: no folder at {source!r} (its tokenizer is loaded from there)")
    if not looks_local(source):
        check_hub_reachable(source, role)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise ModelNotFoundError(f"{role}: could not load a tokenizer from {source!r}: {err}") from err


_PROBE = "def f(x):\n    return x ** 2  # héllo, 世界!\n<|eos|> The quick brown fox."


def check_same_tokenizer(verifier_tok: PreTrainedTokenizerBase, drafter_tok: PreTrainedTokenizerBase) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers have the same content.

    Compares the vocabulary (token -> id over the shared range) and the special tokens, then the
    encoding of a probe string. Differing *embedding* sizes are fine; differing tokens are not.
    """
    v_vocab, d_vocab = verifier_tok.get_vocab(), drafter_tok.get_vocab()
    common = min(len(v_vocab), len(d_vocab))
    v_by_id = {i: t for t, i in v_vocab.items() if i < common}
    d_by_id = {i: t for t, i in d_vocab.items() if i < common}
    differing = [i for i in sorted(v_by_id) if d_by_id.get(i) != v_by_id[i]]
    if differing:
        i = differing[0]
        raise TokenizerMismatchError(
            f"verifier and drafter tokenizers differ: {len(differing)} of {common} shared ids map to other "
            f"tokens (id {i}: verifier {v_by_id[i]!r}, drafter {d_by_id.get(i)!r})"
        )
    for attr in ("bos_token_id", "eos_token_id"):
        a, b = getattr(verifier_tok, attr), getattr(drafter_tok, attr)
        if a != b:
            raise TokenizerMismatchError(f"verifier and drafter tokenizers differ in {attr}: {a} vs {b}")
    a_ids, b_ids = verifier_tok.encode(_PROBE), drafter_tok.encode(_PROBE)
    if a_ids != b_ids:
        raise TokenizerMismatchError("verifier and drafter tokenizers encode the same text differently")


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output embedding (may exceed the tokenizer's length when padded).

    model: a ``transformers`` causal LM, or a peft wrapper of one (it forwards the call).
    """
    lm: Any = model
    return int(lm.get_output_embeddings().weight.shape[0])


@dataclass
class ModelPair:
    verifier: PreTrainedModel
    drafter: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    @property
    def common_vocab_size(self) -> int:
        """Logit entries both models share (the tokenizer is common; embeddings may be padded)."""
        return min(output_vocab_size(self.verifier), output_vocab_size(self.drafter))

    @property
    def param_ratio(self) -> float:
        """Drafter parameters / verifier parameters (c_param in the metric contract)."""
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        return count(self.drafter) / count(self.verifier)


def drafter_tokenizer_source(drafter: str, key: str = "model.drafter") -> str | None:
    """The drafter folder's own tokenizer, if it ships one."""
    path = os.path.expanduser(drafter)
    if os.path.isdir(path):
        return path if os.path.exists(os.path.join(path, "tokenizer_config.json")) else None
    if looks_local(drafter):
        raise ModelNotFoundError(f"{key}: no model folder at {drafter!r}")
    return drafter


def load_drafter(
    cfg: ModelConfig,
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    verifier: PreTrainedModel,
    key: str = "model.drafter",
) -> PreTrainedModel:
    """A drafter from ``source`` (any exported drafter or Hub id) for the pair's verifier: its own
    tokenizer, when it ships one, must be the pair's, and its vocabulary must cover the tokenizer."""
    tok_source = drafter_tokenizer_source(source, key)
    if tok_source is not None and tok_source != cfg.tokenizer_source:
        check_same_tokenizer(tokenizer, load_tokenizer(tok_source, cfg.trust_remote_code, key))
    drafter = load_model(source, cfg.dtype, cfg.attn_implementation, cfg.trust_remote_code, key)
    check_vocab_covers_tokenizer(tokenizer, verifier, drafter)
    return drafter


def resolve_device(value: Any, key: str = "device") -> torch.device:
    """The device a config value names: ``auto`` (or None) is CUDA when available, else the CPU.

    A CUDA device on a machine without one is a config error naming ``key``, raised before any model
    loads (the alternative is an 8B verifier silently decoding on the CPU, or a crash mid-run)."""
    if value is None or str(value) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(str(value))
    except RuntimeError:
        raise ConfigError(f"{key} must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}={value}: CUDA is not available on this machine (use {key}=cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{key}={value}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def local_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank on its node, from the launcher (``LOCAL_RANK``: torchrun, Lightning;
    ``SLURM_LOCALID``: srun), 0 for a single process."""
    return int(environ.get("LOCAL_RANK") or environ.get("SLURM_LOCALID") or 0)


def one_local_device(accelerator: str, environ: Mapping[str, str] = os.environ) -> int | list[int]:
    """Lightning's ``devices`` for a one-device job inside a multi-process run (the pair build, which any
    rank may win the lock for): this rank's GPU, ``[LOCAL_RANK]``, not ``devices=1`` (GPU 0 whatever the
    rank, rank 0's GPU). Modulo the GPUs this process sees, so a task given one GPU (``--gpus-per-task``)
    uses it; ``1`` on the CPU or any other accelerator."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if not on_gpu:
        return 1
    return [local_rank(environ) % max(torch.cuda.device_count(), 1)]


def resolve_devices(device: Any, drafter_device: Any) -> tuple[torch.device, torch.device | None]:
    """An entry point's ``device`` (default auto) and ``drafter_device`` (None: the verifier's), checked
    before anything loads; ``device=cuda:0 drafter_device=cuda:1`` puts the two models on two GPUs."""
    drafter = None if drafter_device is None else resolve_device(drafter_device, "drafter_device")
    return resolve_device(device, "device"), drafter


def place_pair(
    pair: ModelPair, device: torch.device, drafter_device: torch.device | None = None
) -> ModelPair:
    """Move the verifier to ``device`` and the drafter to ``drafter_device`` (default: the same one).
    The engine reads each model's device from its parameters, so the two may differ."""
    modules: list[torch.nn.Module] = [pair.verifier, pair.drafter]
    modules[0].to(device)
    modules[1].to(drafter_device or device)
    return pair


def load_pair(cfg: ModelConfig, freeze_drafter: bool = False) -> ModelPair:
    """Verifier (frozen), drafter (trainable unless ``freeze_drafter``) and the shared tokenizer."""
    tokenizer_key = "model.tokenizer" if cfg.tokenizer else "model.verifier"
    tokenizer = load_tokenizer(cfg.tokenizer_source, cfg.trust_remote_code, tokenizer_key)
    verifier = freeze(
        load_model(
            cfg.verifier,
            cfg.verifier_dtype or cfg.dtype,
            cfg.attn_implementation,
            cfg.trust_remote_code,
            "model.verifier",
        )
    )
    drafter = load_drafter(cfg, cfg.drafter, tokenizer, verifier)
    if freeze_drafter:
        freeze(drafter)
    return ModelPair(verifier=verifier, drafter=drafter, tokenizer=tokenizer)


def check_vocab_covers_tokenizer(
    tokenizer: PreTrainedTokenizerBase, verifier: PreTrainedModel, drafter: PreTrainedModel
) -> None:
    """Raise :class:`TokenizerMismatchError` unless *both* models can score every real token.

    Embeddings may be padded beyond the tokenizer (Qwen3), so the smaller of the two output sizes must
    still hold ``len(tokenizer)`` ids: logits are compared over that common range.
    """
    sizes = {"verifier": output_vocab_size(verifier), "drafter": output_vocab_size(drafter)}
    if len(tokenizer) > min(sizes.values()):
        short = min(sizes, key=sizes.__getitem__)
        raise TokenizerMismatchError(
            f"tokenizer has {len(tokenizer)} tokens but the {short}'s output size is only {sizes[short]} "
            f"(verifier {sizes['verifier']}, drafter {sizes['drafter']}): both models must cover every token"
        )


def eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, *models: torch.nn.Module) -> list[int]:
    """Every id that ends a generation: the tokenizer's EOS, then each model's
    ``generation_config.eos_token_id`` (an int or a list: Llama 3 and Qwen3 name several).

    Order-stable, without duplicates; models without a generation config contribute nothing.
    """
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for v in [value] if isinstance(value, int) else list(value):
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(getattr(tokenizer, "eos_token_id", None))
    for model in models:
        add(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    return ids


@contextmanager
def on_device(model: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    """``model`` moved to ``device`` for the block, then back where it was."""
    before = next(model.parameters()).device
    if before == device:
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to(before)
