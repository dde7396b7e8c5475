"""SD^2 steering: the verifier's hidden states steer a pretrained drafter (docs/steering.md).

Berdoz, Rheinboldt, Wattenhofer, "Steering Pretrained Drafters during Speculative Decoding" (arXiv
2511.09844). :class:`SteeringModule` reads the verifier's hidden states entering three of its layers
(early, middle, late) at one position, concatenated (3d), and maps them to one bias per drafter layer::

    combine: Linear(3d -> d, bias), initialised to [I I I] (the sum of the three states)
    norm:    LayerNorm(d)
    project: Linear(d -> d_ff x L, no bias), zero-initialised

:meth:`SteeringModule.attach` installs the biases in every SwiGLU MLP of the drafter, on the up branch,
``down(act(gate(x)) * (up(x) + delta_l))``, with a forward hook on each ``up_proj``: the drafter's
modeling code is neither copied nor edited, and :meth:`SteeringHandle.remove` leaves the drafter as it
was. At zero initialisation (or with no guide set) the steered drafter computes exactly what the plain
one computes. ``save_pretrained`` / ``from_pretrained`` come from ``PyTorchModelHubMixin``; the config
records the verifier layers read and the sizes of the pair it fits.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from train.renames import renamed_keywords

__all__ = [
    "SteeredDrafter",
    "SteeringHandle",
    "SteeringModule",
    "default_verifier_layers",
    "guide_for",
    "guide_positions",
    "simulated_guides",
    "stale_guide_states",
    "swiglu_mlps",
]


def default_verifier_layers(num_layers: int) -> list[int]:
    """The authors' layers 3, 16 and 29 of a 32-layer verifier, scaled to ``num_layers`` (indices into
    Hugging Face's ``hidden_states``: i = the input of layer i), distinct and in range."""
    if num_layers < 1:
        raise ValueError(f"the verifier needs at least one layer, got {num_layers}")
    picked = sorted({min(num_layers - 1, round(x * num_layers / 32)) for x in (3, 16, 29)})
    return picked


def swiglu_mlps(drafter: nn.Module) -> list[nn.Module]:
    """The drafter's SwiGLU MLPs (modules with ``gate_proj``, ``up_proj`` and ``down_proj``), in order."""
    return [
        m
        for m in drafter.modules()
        if all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj"))
    ]


def guide_positions(prompt_length: int, commits: Iterable[int]) -> list[int]:
    """The verifier positions whose states guide the drafter, from the tokens each verification commits.

    A verification commits c >= 1 tokens (accepted drafts, then the correction or bonus token); the
    guide it hands the drafter is the verifier's state at the position that produced the last of them,
    one before it: with n tokens committed after a prompt of ``prompt_length``, position
    prompt_length + n - 2. Decoding observes exactly these (:mod:`train.decoding.proposers.steered_proposer`);
    training simulates verifications that each commit ``offset`` tokens (:func:`simulated_guides`). The
    first block is drafted before any verification, so it has no guide."""
    out, n = [], 0
    for c in commits:
        if c < 1:
            raise ValueError(f"a verification commits at least one token, got {c}")
        n += int(c)
        out.append(prompt_length + n - 2)
    return out


def guide_for(position: int, guides: Sequence[int]) -> int:
    """The one rule, in training and decoding, for which verifier state steers the drafter at
    ``position`` (where it reads token ``position`` and predicts the next): the latest of ``guides``
    (increasing verifier positions, :func:`guide_positions`) strictly before ``position``; -1: none
    (no bias). Never ``position`` itself: the verifier's state there already encodes its distribution of
    the drafter's target. In decoding, the last draft of a fully accepted block sits at the new guide's
    position, so it keeps the previous guide while the bonus token after it gets the new one."""
    i = bisect.bisect_left(guides, position)
    return guides[i - 1] if i else -1


@renamed_keywords(response_start="answer_start")
def simulated_guides(answer_start: int, offset: int, length: int) -> list[int]:
    """Training's guide positions for a sequence of ``length`` whose answer starts at
    ``answer_start``: decoding's (:func:`guide_positions`) when every verification commits ``offset``
    tokens (the authors draw one o in 1..gamma per batch). The answer's first ``offset`` tokens are
    drafted unsteered (the first block), then block after block the drafter sees staleness 1..offset,
    as decoding's draft i of a block is predicted with staleness i."""
    if offset < 1:
        raise ValueError(f"offset must be >= 1, got {offset}")
    if answer_start < 1:
        raise ValueError(f"answer_start must be >= 1 (a prompt of one token or more), got {answer_start}")
    blocks = max(0, (length - answer_start) // offset + 1)
    return [g for g in guide_positions(answer_start, [offset] * blocks) if g < length - 1]


def stale_guide_states(states: torch.Tensor, guides: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier states each drafter position is steered with in training, exactly as in decoding.

    states: (B, T, S, d), the verifier's states at every position; guides: the guide positions
    (:func:`simulated_guides`; the same for every row: answers start at one column). Position t gets
    the states of ``guide_for(t, guides)``; positions with no guide (the prompt and the first block) get
    zeros and ``has_guide`` False, where the caller must zero the biases (a trained module maps zero
    states to a nonzero bias). Returns (states (B, T, S, d), has_guide (B, T) bool)."""
    batch, length = states.shape[:2]
    source = torch.tensor([guide_for(t, guides) for t in range(length)], device=states.device)
    has_guide = (source >= 0).expand(batch, length)
    picked = states[:, source.clamp(min=0)]
    return torch.where(has_guide[..., None, None], picked, torch.zeros_like(picked)), has_guide


class SteeringHandle:
    """The hooks that add the current guide's biases to a drafter's MLPs; ``set`` a guide or None (no
    steering), ``remove`` to detach. A context manager that removes itself. A guide is (L, d_ff), one
    bias per layer for every position (decoding), or (B, T, L, d_ff), one per position (training with
    stale guides, :func:`stale_guide_states`)."""

    def __init__(self, mlps: Sequence[nn.Module]) -> None:
        self.deltas: torch.Tensor | None = None
        self._hooks = [
            mlp.up_proj.register_forward_hook(self._hook(i))  # type: ignore[union-attr]
            for i, mlp in enumerate(mlps)
        ]

    def _hook(self, layer: int) -> Any:
        def add_bias(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            if self.deltas is None:
                return output
            return output + self.deltas[..., layer, :].to(output.dtype)

        return add_bias

    def set(self, deltas: torch.Tensor | None) -> None:
        self.deltas = deltas

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.deltas = None

    def __enter__(self) -> SteeringHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class SteeringModule(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="draftsmith",
    tags=["speculative-decoding", "sd2", "steering", "draftsmith"],
):
    """Verifier hidden states (..., S, d) at S = len(verifier_layers) layers
    -> drafter biases (..., L, d_ff)."""

    def __init__(
        self,
        verifier_hidden_size: int,
        drafter_intermediate_size: int,
        drafter_layers: int,
        verifier_layers: list[int],
        verifier_name: str | None = None,
        drafter_name: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("verifier_hidden_size", verifier_hidden_size),
            ("drafter_intermediate_size", drafter_intermediate_size),
            ("drafter_layers", drafter_layers),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not verifier_layers:
            raise ValueError("verifier_layers must name at least one verifier layer")
        d, sources = verifier_hidden_size, len(verifier_layers)
        self.verifier_hidden_size, self.drafter_intermediate_size = d, drafter_intermediate_size
        self.drafter_layers, self.verifier_layers = drafter_layers, [int(i) for i in verifier_layers]
        # which pair it was trained for (recorded in its config.json; the sizes are what is checked)
        self.verifier_name, self.drafter_name = verifier_name, drafter_name
        self.combine = nn.Linear(sources * d, d)
        self.norm = nn.LayerNorm(d)
        self.project = nn.Linear(d, drafter_intermediate_size * drafter_layers, bias=False)
        with torch.no_grad():
            self.combine.weight.copy_(torch.cat([torch.eye(d)] * sources, dim=1))
            self.combine.bias.zero_()
            self.project.weight.zero_()

    def standalone_copy(self) -> SteeringModule:
        """A float32 copy on the CPU whose tensors own their storage, to save: under FSDP the gathered
        weights are views into one flat parameter, which safetensors refuses to save (shared storage)."""
        copy = SteeringModule(
            self.verifier_hidden_size,
            self.drafter_intermediate_size,
            self.drafter_layers,
            self.verifier_layers,
            verifier_name=self.verifier_name,
            drafter_name=self.drafter_name,
        )
        copy.load_state_dict(
            {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in self.state_dict().items()}
        )
        return copy

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states: (..., S, d), the verifier's hidden states entering ``verifier_layers`` at one position."""
        x = self.combine(states.flatten(-2))
        out = self.project(self.norm(x))
        return out.unflatten(-1, (self.drafter_layers, self.drafter_intermediate_size))

    @classmethod
    def for_pair(
        cls, verifier: nn.Module, drafter: nn.Module, layers: Sequence[int] | None = None
    ) -> SteeringModule:
        """A zero-initialised module for this pair (the verifier's width and depth, the drafter's MLPs),
        on the verifier's device and dtype."""
        v_cfg = getattr(verifier, "config", None)
        d_cfg = getattr(drafter, "config", None)
        hidden = getattr(v_cfg, "hidden_size", None)
        depth = getattr(v_cfg, "num_hidden_layers", None)
        mlps = swiglu_mlps(drafter)
        if hidden is None or depth is None:
            raise ValueError("the verifier needs config.hidden_size and config.num_hidden_layers")
        if not mlps:
            raise ValueError(
                f"{type(drafter).__name__} has no SwiGLU MLP (gate_proj / up_proj / down_proj) to steer; "
                "SD^2 steers Llama- and Qwen-style drafters"
            )
        ff = int(mlps[0].up_proj.out_features)  # type: ignore[union-attr, arg-type]
        if getattr(d_cfg, "intermediate_size", ff) != ff:
            raise ValueError("the drafter's MLP width differs from its config.intermediate_size")
        module = cls(
            int(hidden),
            ff,
            len(mlps),
            list(layers) if layers else default_verifier_layers(int(depth)),
            verifier_name=getattr(v_cfg, "_name_or_path", None) or None,
            drafter_name=getattr(d_cfg, "_name_or_path", None) or None,
        )
        param = next(verifier.parameters())
        return module.to(device=param.device, dtype=param.dtype)

    def check_pair(self, verifier: nn.Module, drafter: nn.Module) -> None:
        """Refuse a pair this module was not made for, naming both sizes."""
        v_cfg = getattr(verifier, "config", None)
        hidden = getattr(v_cfg, "hidden_size", None)
        depth = getattr(v_cfg, "num_hidden_layers", None)
        if hidden is not None and int(hidden) != self.verifier_hidden_size:
            raise ValueError(
                f"the steering module reads verifier states of width {self.verifier_hidden_size}, "
                f"but this verifier's hidden size is {hidden}"
            )
        if depth is not None and max(self.verifier_layers) > int(depth):
            raise ValueError(
                f"the steering module reads verifier layers {self.verifier_layers}, but this verifier has "
                f"{depth} layers"
            )
        mlps = swiglu_mlps(drafter)
        sizes = {int(m.up_proj.out_features) for m in mlps}  # type: ignore[union-attr, arg-type]
        if len(mlps) != self.drafter_layers or sizes != {self.drafter_intermediate_size}:
            raise ValueError(
                f"the steering module steers {self.drafter_layers} drafter MLPs of width "
                f"{self.drafter_intermediate_size}, but this drafter has {len(mlps)} of width "
                f"{sorted(sizes) or 'none'}"
            )

    def attach(self, drafter: nn.Module) -> SteeringHandle:
        """Hooks on ``drafter``'s MLPs that add the guide set on the returned handle."""
        mlps = swiglu_mlps(drafter)
        if len(mlps) != self.drafter_layers:
            raise ValueError(
                f"the drafter has {len(mlps)} SwiGLU MLPs, the module steers {self.drafter_layers}"
            )
        return SteeringHandle(mlps)


class SteeredDrafter(nn.Module):
    """A drafter together with the steering module trained for it, measured as one drafter.

    The evaluator hands it to decoders that take ``steered`` drafters (``SpeculativeDecoder``), which
    unpack it; its parameters count both (the drafter's cost includes the projection). ``config`` is the
    drafter's, for context-length checks."""

    drafter_kind: ClassVar[str] = "steered"

    def __init__(self, drafter: nn.Module, steering: SteeringModule) -> None:
        super().__init__()
        self.drafter = drafter
        self.steering = steering

    @property
    def config(self) -> Any:
        return self.drafter.config
