"""A small, deterministic image-text transformer that splits into pipeline stages and TP shards.

The model is a decoder-only transformer over one sequence per microbatch: the image patches
first (a patch encoder maps every ``patch x patch`` patch to one token), then the text tokens.
It is meant for equivalence tests of the distributed runtime, so everything is
deterministic on CPU and independent of how the model is split:

* **Initialisation.** Every parameter is generated in FULL (unsharded) from its own
  ``torch.Generator``, seeded from ``(cfg.seed, parameter name)``, and only then sliced for
  a tensor-parallel shard. A parameter's name is the same in every stage split (blocks keep
  their global layer index: ``blocks.5.attn.qkv_col.weight``) and on every TP rank, so the
  one-process model, any pipeline split and any TP sharding start from the same numbers.
* **Pipeline stages.** ``build_stage_modules`` splits the ``n_layers`` blocks over
  ``num_virtual`` stages (``stage_layers``); stage 0 also holds the embedding, the last stage
  the final LayerNorm and the LM head.
* **Tensor parallelism (Megatron-style).** Attention heads and the MLP hidden width are split
  across the TP ranks of a ``TPContext`` with the generic layers of ``_tp`` (exported by
  ``rrfp_lab.models``): a block's QKV and MLP-up projections are ``ColumnParallelLinear``,
  its attention-output and MLP-down projections ``RowParallelLinear``. The fused QKV weight
  is laid out per head (``[q_h; k_h; v_h]`` for head ``h``), so a contiguous row block is a
  set of whole heads. Parallel linears are registered only under names ending in ``_col`` /
  ``_row``, the rule by which ``shard_dim`` tells them apart, so ``unshard`` can reassemble
  a stage's state dict from its TP shards.

``reference_train`` is the single-process trainer a distributed run is compared against.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rrfp_async import Microbatch, PlanError

from ._tp import (
    COLUMN_SUFFIX,
    ROW_SUFFIX,
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    shard_dim,
)

__all__ = [
    "ImageTextConfig",
    "ImageTextStage",
    "build_stage_modules",
    "full_model",
    "loss_fn",
    "make_microbatches",
    "reference_train",
    "stage_layers",
    "unshard",
]

_INIT_STD = 0.02


# --------------------------------------------------------------------------------------------
# Configuration and data


@dataclass(frozen=True, kw_only=True)
class ImageTextConfig:
    """Sizes of the image-text model and of the synthetic data.

    Attributes:
        vocab: Text vocabulary size (>= 2).
        d_model: Hidden width; a multiple of ``n_heads``.
        n_heads: Attention heads.
        d_ff: MLP hidden width.
        n_layers: Transformer blocks.
        image_size: Height and width of an image in pixels; a multiple of ``patch``.
        patch: Side of a square patch in pixels.
        channels: Image channels.
        max_images: Most images per microbatch (>= 0).
        min_text: Fewest text tokens per microbatch (>= 2: the loss needs a next token).
        max_text: Most text tokens per microbatch (>= ``min_text``).
        seed: Seed of the parameter initialisation.

    Raises:
        PlanError: A value is not an integer or out of range.
    """

    vocab: int = 256
    d_model: int = 32
    n_heads: int = 2
    d_ff: int = 64
    n_layers: int = 8
    image_size: int = 16
    patch: int = 4
    channels: int = 3
    max_images: int = 4
    min_text: int = 8
    max_text: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab",
            "d_model",
            "n_heads",
            "d_ff",
            "n_layers",
            "image_size",
            "patch",
            "channels",
            "max_images",
            "min_text",
            "max_text",
            "seed",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise PlanError(f"ImageTextConfig.{name} must be an int, got {v!r}")
        for name in ("d_model", "n_heads", "d_ff", "n_layers", "image_size", "patch", "channels"):
            if getattr(self, name) < 1:
                raise PlanError(f"ImageTextConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 2:
            raise PlanError(f"ImageTextConfig.vocab must be >= 2, got {self.vocab}")
        if self.max_images < 0:
            raise PlanError(f"ImageTextConfig.max_images must be >= 0, got {self.max_images}")
        if self.min_text < 2:
            raise PlanError(
                f"ImageTextConfig.min_text must be >= 2 (the loss predicts the next text"
                f" token), got {self.min_text}"
            )
        if self.max_text < self.min_text:
            raise PlanError(
                f"ImageTextConfig.max_text ({self.max_text}) must be >= min_text ({self.min_text})"
            )
        if self.d_model % self.n_heads:
            raise PlanError(
                f"ImageTextConfig.d_model ({self.d_model}) must be a multiple of n_heads"
                f" ({self.n_heads})"
            )
        if self.image_size % self.patch:
            raise PlanError(
                f"ImageTextConfig.image_size ({self.image_size}) must be a multiple of patch"
                f" ({self.patch})"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``d_model // n_heads``)."""
        return self.d_model // self.n_heads

    @property
    def patches_per_image(self) -> int:
        """Patches (= image tokens) per image: ``(image_size // patch) ** 2``."""
        return (self.image_size // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: ``channels * patch * patch``."""
        return self.channels * self.patch * self.patch

    @property
    def max_positions(self) -> int:
        """Length of the longest sequence: ``max_images * patches_per_image + max_text``."""
        return self.max_images * self.patches_per_image + self.max_text


def make_microbatches(n: int, cfg: ImageTextConfig, *, seed: int) -> list[Microbatch]:
    """``n`` random image-text microbatches, the same for the same ``seed``.

    Microbatch ``i`` has ``k`` images (uniform in ``0..cfg.max_images``), a float32 tensor
    ``[k, channels, image_size, image_size]`` with values in ``[0, 1)``, and ``L`` text tokens
    (uniform in ``min_text..max_text``), a LongTensor ``[L]`` with values below ``vocab``.
    The transformer sees ``k * patches_per_image + L`` tokens, image tokens first.

    Args:
        n: Number of microbatches (>= 0).
        cfg: Model and data sizes.
        seed: Seed of the ``torch.Generator`` that draws everything.

    Returns:
        ``Microbatch(index=i, tokens=k*P + L, patches=k*P, images=k,
        data={"images": ..., "text": ...})`` for ``i`` in ``0..n-1`` (``P`` patches per image).

    Raises:
        PlanError: ``n`` is negative.
    """
    if n < 0:
        raise PlanError(f"make_microbatches needs n >= 0, got {n}")
    g = torch.Generator().manual_seed(seed)
    ppi = cfg.patches_per_image
    out = []
    for i in range(n):
        k = int(torch.randint(0, cfg.max_images + 1, (1,), generator=g).item())
        length = int(torch.randint(cfg.min_text, cfg.max_text + 1, (1,), generator=g).item())
        images = torch.rand(
            (k, cfg.channels, cfg.image_size, cfg.image_size), generator=g, dtype=torch.float32
        )
        text = torch.randint(0, cfg.vocab, (length,), generator=g, dtype=torch.long)
        out.append(
            Microbatch(
                index=i,
                tokens=k * ppi + length,
                patches=k * ppi,
                images=k,
                data={"images": images, "text": text},
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Deterministic initialisation


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"rrfp_async.image_text/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _full(
    cfg: ImageTextConfig,
    name: str,
    shape: tuple[int, ...],
    init: Literal["normal", "zeros", "ones"],
) -> Tensor:
    """The FULL value of parameter ``name``, independent of any split."""
    if init == "zeros":
        return torch.zeros(shape)
    if init == "ones":
        return torch.ones(shape)
    g = torch.Generator().manual_seed(_param_seed(cfg.seed, name))
    return torch.randn(shape, generator=g) * _INIT_STD


def _linear(cfg: ImageTextConfig, name: str, in_f: int, out_f: int) -> nn.Linear:
    lin = nn.Linear(in_f, out_f, device="meta")  # no draw from the global RNG
    lin.weight = nn.Parameter(_full(cfg, f"{name}.weight", (out_f, in_f), "normal"))
    lin.bias = nn.Parameter(_full(cfg, f"{name}.bias", (out_f,), "zeros"))
    return lin


def _layer_norm(cfg: ImageTextConfig, name: str) -> nn.LayerNorm:
    ln = nn.LayerNorm(cfg.d_model, device="meta")
    ln.weight = nn.Parameter(_full(cfg, f"{name}.weight", (cfg.d_model,), "ones"))
    ln.bias = nn.Parameter(_full(cfg, f"{name}.bias", (cfg.d_model,), "zeros"))
    return ln


def _column(
    cfg: ImageTextConfig, name: str, in_f: int, out_f: int, tp: TPContext
) -> ColumnParallelLinear:
    assert name.endswith(COLUMN_SUFFIX)
    w = _full(cfg, f"{name}.weight", (out_f, in_f), "normal")
    b = _full(cfg, f"{name}.bias", (out_f,), "zeros")
    return ColumnParallelLinear(in_f, out_f, tp, w, b)


def _row(
    cfg: ImageTextConfig, name: str, in_f: int, out_f: int, tp: TPContext
) -> RowParallelLinear:
    assert name.endswith(ROW_SUFFIX)
    w = _full(cfg, f"{name}.weight", (out_f, in_f), "normal")
    b = _full(cfg, f"{name}.bias", (out_f,), "zeros")
    return RowParallelLinear(in_f, out_f, tp, w, b)


# --------------------------------------------------------------------------------------------
# Model


class _Embedding(nn.Module):
    """Patch encoder + image-position embedding, token + position embedding, concatenated."""

    def __init__(self, cfg: ImageTextConfig, prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.patch_in = _linear(cfg, f"{prefix}.patch_in", cfg.patch_dim, d)
        self.patch_out = _linear(cfg, f"{prefix}.patch_out", d, d)
        self.image_pos = nn.Parameter(
            _full(cfg, f"{prefix}.image_pos", (cfg.patches_per_image, d), "normal")
        )
        self.token = nn.Parameter(_full(cfg, f"{prefix}.token", (cfg.vocab, d), "normal"))
        self.pos = nn.Parameter(_full(cfg, f"{prefix}.pos", (cfg.max_positions, d), "normal"))

    def forward(self, data: Mapping[str, Tensor]) -> Tensor:
        cfg = self.cfg
        images, text = data["images"], data["text"]
        shape = (cfg.channels, cfg.image_size, cfg.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != shape:
            raise PlanError(
                f"images must have shape [k, {', '.join(map(str, shape))}],"
                f" got {tuple(images.shape)}"
            )
        k = images.shape[0]
        if k > cfg.max_images:
            raise PlanError(f"{k} images exceed max_images={cfg.max_images}")
        if text.dim() != 1 or not 1 <= text.shape[0] <= cfg.max_text:
            raise PlanError(
                f"text must be a 1-D tensor of 1..{cfg.max_text} tokens, got {tuple(text.shape)}"
            )
        g, p, ppi = cfg.image_size // cfg.patch, cfg.patch, cfg.patches_per_image
        patches = (
            images.reshape(k, cfg.channels, g, p, g, p)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(k, ppi, cfg.patch_dim)
        )
        img = self.patch_out(F.gelu(self.patch_in(patches))) + self.image_pos
        off = k * ppi
        txt = F.embedding(text, self.token) + self.pos[off : off + text.shape[0]]
        return torch.cat([img.reshape(1, off, cfg.d_model), txt.unsqueeze(0)], dim=1)


class _Attention(nn.Module):
    """Causal multi-head self-attention; this TP rank's heads only."""

    def __init__(self, cfg: ImageTextConfig, prefix: str, tp: TPContext) -> None:
        super().__init__()
        d = cfg.d_model
        self.local_heads = cfg.n_heads // tp.size
        self.head_dim = cfg.head_dim
        # Fused QKV, laid out per head ([q_h; k_h; v_h]) so a row block is whole heads.
        self.qkv_col = _column(cfg, f"{prefix}.qkv_col", d, 3 * d, tp)
        self.out_row = _row(cfg, f"{prefix}.out_row", d, d, tp)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        h, hd = self.local_heads, self.head_dim
        qkv = self.qkv_col(x).view(b, s, h, 3, hd)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # [b, h, s, hd]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, h * hd)
        return cast(Tensor, self.out_row(out))


class _MLP(nn.Module):
    """``down(gelu(up(x)))`` with the hidden width split over the TP ranks."""

    def __init__(self, cfg: ImageTextConfig, prefix: str, tp: TPContext) -> None:
        super().__init__()
        self.up_col = _column(cfg, f"{prefix}.up_col", cfg.d_model, cfg.d_ff, tp)
        self.down_row = _row(cfg, f"{prefix}.down_row", cfg.d_ff, cfg.d_model, tp)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.down_row(F.gelu(self.up_col(x))))


class _Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: ImageTextConfig, prefix: str, tp: TPContext) -> None:
        super().__init__()
        self.norm1 = _layer_norm(cfg, f"{prefix}.norm1")
        self.attn = _Attention(cfg, f"{prefix}.attn", tp)
        self.norm2 = _layer_norm(cfg, f"{prefix}.norm2")
        self.mlp = _MLP(cfg, f"{prefix}.mlp", tp)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return cast(Tensor, x + self.mlp(self.norm2(x)))


class ImageTextStage(nn.Module):
    """One virtual pipeline stage of the image-text model.

    Stage 0 holds ``embed`` and takes a microbatch's ``data`` dict; the other stages take
    the hidden state ``[1, S, d_model]``. ``blocks`` is keyed by the global layer index. The
    last stage ends with ``norm_f`` and the replicated LM ``head`` and returns logits
    ``[1, S, vocab]``; the others return the hidden state.

    Args:
        cfg: Model sizes.
        layers: Global indices of the blocks this stage runs.
        first: Whether this stage holds the embedding.
        last: Whether this stage holds the final LayerNorm and the LM head.
        tp: The TP group the blocks are sharded over.
    """

    def __init__(
        self, cfg: ImageTextConfig, layers: range, *, first: bool, last: bool, tp: TPContext
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.first = first
        self.last = last
        self.embed = _Embedding(cfg, "embed") if first else None
        self.blocks = nn.ModuleDict({str(i): _Block(cfg, f"blocks.{i}", tp) for i in layers})
        self.norm_f = _layer_norm(cfg, "norm_f") if last else None
        self.head = _linear(cfg, "head", cfg.d_model, cfg.vocab) if last else None

    def forward(self, x: Mapping[str, Tensor] | Tensor | None = None, **data: Tensor) -> Tensor:
        """Run the stage.

        Args:
            x: Stage 0: the microbatch's ``data`` (``{"images": ..., "text": ...}``);
                other stages: the hidden state ``[1, S, d_model]``.
            data: Stage 0 may also take the data dict as keywords (``images=..., text=...``:
                how a pipeline calls a module with a dict input).

        Returns:
            The hidden state ``[1, S, d_model]``, or logits ``[1, S, vocab]`` on the last stage.

        Raises:
            TypeError: Stage 0 got no mapping, or another stage got no tensor.
        """
        if data:
            if x is not None:
                raise TypeError("give the data dict or its keywords, not both")
            x = data
        if self.embed is not None:
            if not isinstance(x, Mapping):
                raise TypeError(f"stage 0 takes the microbatch's data dict, got {type(x)}")
            h: Tensor = self.embed(x)
        else:
            if not isinstance(x, Tensor):
                raise TypeError(f"this stage takes the hidden state tensor, got {type(x)}")
            h = x
        for block in self.blocks.values():
            h = block(h)
        if self.norm_f is not None and self.head is not None:
            h = self.head(self.norm_f(h))
        return h


def stage_layers(cfg: ImageTextConfig, num_virtual: int) -> list[range]:
    """The global block indices of each of ``num_virtual`` stages, as even as possible.

    Stage ``v`` gets blocks ``v*n//V .. (v+1)*n//V - 1`` (``n = cfg.n_layers``); the extra
    blocks of an uneven split go to the later stages (stage 0 also runs the embedding).

    Raises:
        PlanError: ``num_virtual < 1`` or fewer blocks than stages.
    """
    if num_virtual < 1:
        raise PlanError(f"num_virtual must be >= 1, got {num_virtual}")
    n = cfg.n_layers
    if n < num_virtual:
        raise PlanError(
            f"cannot split {n} transformer blocks over {num_virtual} stages:"
            f" every stage needs at least one block (raise n_layers)"
        )
    return [range(v * n // num_virtual, (v + 1) * n // num_virtual) for v in range(num_virtual)]


def build_stage_modules(
    cfg: ImageTextConfig,
    num_virtual: int,
    stage_ids: Sequence[int],
    tp: TPContext | None = None,
) -> dict[int, nn.Module]:
    """Build the modules of the requested virtual stages.

    Parameter names are the same on every TP rank and in every split; values come from the
    deterministic full initialisation, sliced for ``tp``'s shard.

    Args:
        cfg: Model sizes.
        num_virtual: Number of virtual stages the model is split into.
        stage_ids: The stages to build, each in ``0 .. num_virtual-1``, no repeats.
        tp: The tensor-parallel group (default: none).

    Returns:
        ``{stage_id: ImageTextStage}`` in the order of ``stage_ids``.

    Raises:
        PlanError: Bad stage ids, fewer blocks than stages, or heads / MLP width not
            divisible by the TP size.
    """
    tp = TPContext.none() if tp is None else tp
    if cfg.n_heads % tp.size:
        raise PlanError(
            f"n_heads ({cfg.n_heads}) must be a multiple of the TP size ({tp.size}):"
            f" attention heads are split across TP ranks"
        )
    if cfg.d_ff % tp.size:
        raise PlanError(f"d_ff ({cfg.d_ff}) must be a multiple of the TP size ({tp.size})")
    layers = stage_layers(cfg, num_virtual)
    ids = list(stage_ids)
    if len(set(ids)) != len(ids):
        raise PlanError(f"stage_ids must not repeat, got {ids}")
    out: dict[int, nn.Module] = {}
    for v in ids:
        if not 0 <= v < num_virtual:
            raise PlanError(f"stage id {v} is outside 0..{num_virtual - 1}")
        out[v] = ImageTextStage(cfg, layers[v], first=v == 0, last=v == num_virtual - 1, tp=tp)
    return out


def full_model(cfg: ImageTextConfig) -> nn.Module:
    """The whole model in one module (no TP): embedding, every block, LM head.

    It is the one-stage split, so its parameter names and initial values equal those of the
    stage modules of any split; ``forward(data)`` returns logits ``[1, S, vocab]``.
    """
    return build_stage_modules(cfg, 1, [0])[0]


def loss_fn(logits: Tensor, mb: Microbatch) -> Tensor:
    """Mean next-token cross-entropy over the text positions.

    The hidden state at text token ``j`` predicts text token ``j + 1`` (``j = 0 .. L-2``);
    image positions carry no loss.

    Args:
        logits: ``[1, S, vocab]`` from the last stage.
        mb: The microbatch (``data["text"]`` and ``patches`` are read).

    Returns:
        A scalar tensor.

    Raises:
        PlanError: ``logits`` does not fit the microbatch.
    """
    text: Tensor = mb.data["text"]
    length = text.shape[0]
    if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[1] != mb.patches + length:
        raise PlanError(
            f"logits of shape {tuple(logits.shape)} do not fit microbatch {mb.index}"
            f" ({mb.patches} image tokens + {length} text tokens)"
        )
    pred = logits[0, mb.patches : mb.patches + length - 1]
    return F.cross_entropy(pred, text[1:])


# --------------------------------------------------------------------------------------------
# Reference trainer and checkpoint helpers


def reference_train(
    cfg: ImageTextConfig,
    steps: Sequence[Sequence[Microbatch]],
    *,
    lr: float = 0.05,
    num_virtual: int,
) -> dict[int, dict[str, Tensor]]:
    """Train in one process: what a pipeline-parallel run must reproduce.

    Every step runs its microbatches in order through all stages, backpropagates
    ``loss_fn(...) / len(step)`` (gradients accumulate in microbatch order), then takes one
    plain SGD step (``torch.optim.SGD``, no momentum) and clears the gradients.

    Args:
        cfg: Model sizes.
        steps: The microbatches of each step.
        lr: SGD learning rate.
        num_virtual: Number of virtual stages (the parameters are returned per stage).

    Returns:
        ``{virtual_stage: {name: tensor}}``: clones of each stage's final state dict.

    Raises:
        PlanError: A step has no microbatches, or the split is invalid.
    """
    modules = build_stage_modules(cfg, num_virtual, range(num_virtual))
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.0)
    for n, step in enumerate(steps):
        if not step:
            raise PlanError(f"step {n} has no microbatches")
        for mb in step:
            h: Any = mb.data
            for v in range(num_virtual):
                h = modules[v](h)
            loss = loss_fn(h, mb) / len(step)
            loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        v: {name: t.detach().clone() for name, t in m.state_dict().items()}
        for v, m in modules.items()
    }


def _full_shape(cfg: ImageTextConfig, name: str) -> tuple[int, ...] | None:
    d, f = cfg.d_model, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {
        "attn.qkv_col.weight": (3 * d, d),
        "attn.qkv_col.bias": (3 * d,),
        "attn.out_row.weight": (d, d),
        "mlp.up_col.weight": (f, d),
        "mlp.up_col.bias": (f,),
        "mlp.down_row.weight": (d, f),
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return shape
    return None


def unshard(shards: Sequence[Mapping[str, Tensor]], cfg: ImageTextConfig) -> dict[str, Tensor]:
    """Reassemble one virtual stage's full state dict from its TP shards.

    Column-parallel weights and biases are concatenated on dim 0, row-parallel weights on
    dim 1 (``shard_dim``); replicated tensors (including row-parallel biases) are taken
    from TP rank 0. Works on gradients keyed by parameter name as well.

    Args:
        shards: The stage's state dict from each TP rank, in TP-rank order.
        cfg: Model sizes (to check the reassembled shapes).

    Returns:
        ``{name: full tensor}``, the same as the TP=1 stage's state dict.

    Raises:
        PlanError: No shards, differing key sets, or a reassembled shape that does not fit
            ``cfg``.
    """
    if not shards:
        raise PlanError("unshard needs the state dict of at least one TP rank")
    keys = list(shards[0])
    for r, s in enumerate(shards[1:], start=1):
        if set(s) != set(keys):
            raise PlanError(f"TP rank {r}'s state dict has other keys than rank 0's")
    out: dict[str, Tensor] = {}
    for name in keys:
        dim = shard_dim(name)
        if dim is None:
            out[name] = shards[0][name]
            continue
        full = torch.cat([s[name] for s in shards], dim=dim)
        want = _full_shape(cfg, name)
        if want is not None and tuple(full.shape) != want:
            raise PlanError(
                f"{name}: the {len(shards)} shards reassemble to {tuple(full.shape)},"
                f" expected {want}"
            )
        out[name] = full
    return out
