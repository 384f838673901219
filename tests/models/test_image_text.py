"""The image-text model: data, stage splits, TP shards, reference trainer."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import rrfp_async as rr
from rrfp_lab.models import (
    ColumnParallelLinear,
    ImageTextConfig,
    RowParallelLinear,
    TPContext,
    build_stage_modules,
    full_model,
    loss_fn,
    make_microbatches,
    parallel_kind,
    reference_train,
    shard_dim,
    stage_layers,
    unshard,
)
from tests._pool import pooled_spawn

CFG = ImageTextConfig()


def _mb(cfg: ImageTextConfig, index: int, images: int, text: int, seed: int) -> rr.Microbatch:
    """A microbatch with exactly ``images`` images and ``text`` text tokens."""
    g = torch.Generator().manual_seed(seed)
    ppi = cfg.patches_per_image
    return rr.Microbatch(
        index=index,
        tokens=images * ppi + text,
        patches=images * ppi,
        images=images,
        data={
            "images": torch.rand(
                (images, cfg.channels, cfg.image_size, cfg.image_size), generator=g
            ),
            "text": torch.randint(0, cfg.vocab, (text,), generator=g),
        },
    )


def _edge_mbs(cfg: ImageTextConfig) -> list[rr.Microbatch]:
    """Microbatches with 0 and max images (shortest and longest text)."""
    return [
        _mb(cfg, 0, 0, cfg.min_text, seed=10),
        _mb(cfg, 1, cfg.max_images, cfg.max_text, seed=11),
        _mb(cfg, 2, 1, 20, seed=12),
    ]


def _run(modules: dict[int, torch.nn.Module], mb: rr.Microbatch) -> torch.Tensor:
    h: Any = mb.data
    for v in sorted(modules):
        h = modules[v](h)
    assert isinstance(h, torch.Tensor)
    return h


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.detach().clone()
    return out


# ------------------------------------------------------------------------------------------
# Data


def test_make_microbatches_is_deterministic_and_in_range() -> None:
    a = make_microbatches(60, CFG, seed=3)
    b = make_microbatches(60, CFG, seed=3)
    c = make_microbatches(60, CFG, seed=4)
    assert a == b  # index / tokens / patches / images
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.data["images"], y.data["images"])
        assert torch.equal(x.data["text"], y.data["text"])
    assert [m.tokens for m in a] != [m.tokens for m in c]
    ppi = CFG.patches_per_image
    seen = set()
    for i, m in enumerate(a):
        images, text = m.data["images"], m.data["text"]
        k, length = images.shape[0], text.shape[0]
        seen.add(k)
        assert m.index == i and m.images == k and m.patches == k * ppi
        assert m.tokens == k * ppi + length
        assert 0 <= k <= CFG.max_images and CFG.min_text <= length <= CFG.max_text
        assert images.dtype == torch.float32
        assert tuple(images.shape) == (k, CFG.channels, CFG.image_size, CFG.image_size)
        assert text.dtype == torch.long and int(text.max()) < CFG.vocab and int(text.min()) >= 0
    assert seen == set(range(CFG.max_images + 1))
    assert make_microbatches(0, CFG, seed=0) == []


def test_variable_shapes_zero_and_max_images() -> None:
    model = full_model(CFG)
    for mb in _edge_mbs(CFG)[:2]:
        model.zero_grad(set_to_none=True)
        logits = model(mb.data)
        assert tuple(logits.shape) == (1, mb.tokens, CFG.vocab)
        loss = loss_fn(logits, mb)
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        grads = _grads(model)  # every parameter gets a gradient, even without images
        assert torch.count_nonzero(grads["embed.token"]) > 0
        img_grad = torch.count_nonzero(grads["embed.patch_in.weight"])
        assert (img_grad > 0) == (mb.images > 0)


def test_loss_is_next_token_cross_entropy_on_text() -> None:
    mb = _edge_mbs(CFG)[2]
    logits = torch.randn(1, mb.tokens, CFG.vocab)
    text = mb.data["text"]
    want = torch.nn.functional.cross_entropy(logits[0, mb.patches : -1], text[1:])
    assert torch.equal(loss_fn(logits, mb), want)
    with pytest.raises(rr.PlanError, match="do not fit"):
        loss_fn(logits[:, 1:], mb)


def test_attention_is_causal() -> None:
    model = full_model(CFG)
    mb = _edge_mbs(CFG)[2]
    text = mb.data["text"].clone()
    text[-1] = (text[-1] + 1) % CFG.vocab
    with torch.no_grad():
        a = model(mb.data)
        b = model({"images": mb.data["images"], "text": text})
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


# ------------------------------------------------------------------------------------------
# Pipeline split


def test_stage_layers_split_evenly() -> None:
    assert stage_layers(CFG, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    cfg = ImageTextConfig(n_layers=7)
    sizes = [len(r) for r in stage_layers(cfg, 3)]
    assert sizes == [2, 2, 3] and sum(sizes) == 7
    assert [len(r) for r in stage_layers(cfg, 7)] == [1] * 7


def test_stage_chain_equals_full_model_bitwise() -> None:
    full = full_model(CFG)
    stages = build_stage_modules(CFG, 4, range(4))
    names = [n for m in stages.values() for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    full_params = dict(full.named_parameters())
    for m in stages.values():  # same initial values, by name
        for n, p in m.named_parameters():
            assert torch.equal(p, full_params[n]), n
    # Stage 0 has the embedding, the last stage the head; only the first takes data.
    assert hasattr(stages[0], "embed") and stages[0].embed is not None
    assert stages[3].head is not None and stages[1].head is None
    with pytest.raises(TypeError, match="hidden state"):
        stages[1]({"text": torch.zeros(3, dtype=torch.long)})

    mbs = _edge_mbs(CFG)
    for mb in mbs:
        a, b = full(mb.data), _run(stages, mb)
        assert torch.equal(a, b)
        (loss_fn(a, mb) / len(mbs)).backward()
        (loss_fn(b, mb) / len(mbs)).backward()
    g_full = _grads(full)
    for m in stages.values():
        for n, g in _grads(m).items():
            assert torch.equal(g, g_full[n]), n


# ------------------------------------------------------------------------------------------
# Tensor parallelism


def test_parallel_linears_are_named_by_suffix() -> None:
    m = build_stage_modules(CFG, 2, [0, 1], TPContext(None, 2, 1))
    n_col = n_row = 0
    for stage in m.values():
        for name, mod in stage.named_modules():
            if isinstance(mod, ColumnParallelLinear):
                n_col += 1
                assert parallel_kind(f"{name}.weight") == "column"
            elif isinstance(mod, RowParallelLinear):
                n_row += 1
                assert parallel_kind(f"{name}.weight") == "row"
        for name, _ in stage.named_parameters():
            if parallel_kind(name) is None:
                assert shard_dim(name) is None
    assert n_col == n_row == 2 * CFG.n_layers
    assert shard_dim("blocks.0.attn.qkv_col.bias") == 0
    assert shard_dim("blocks.0.mlp.down_row.weight") == 1
    assert shard_dim("blocks.0.mlp.down_row.bias") is None
    assert shard_dim("embed.token") is None


def test_tp_shards_concatenate_to_the_full_parameters() -> None:
    full = build_stage_modules(CFG, 2, [0, 1])
    shards = [build_stage_modules(CFG, 2, [0, 1], TPContext(None, 2, r)) for r in range(2)]
    for v in range(2):
        sds = [s[v].state_dict() for s in shards]
        assert list(sds[0]) == list(sds[1])  # same names on every TP rank
        qkv = sds[0]["blocks.0.attn.qkv_col.weight"] if v == 0 else None
        if qkv is not None:
            assert tuple(qkv.shape) == (3 * CFG.d_model // 2, CFG.d_model)
        got, want = unshard(sds, CFG), full[v].state_dict()
        assert list(got) == list(want)
        for n in want:
            assert torch.equal(got[n], want[n]), n


def _tp_worker(rank: int, world: int, cfg: ImageTextConfig, lr: float) -> bytes:
    """Forward/backward of the edge microbatches on 2 stages x TP=2, then one SGD step.

    The result is serialised with ``torch.save``: tensors sent through a
    ``torch.multiprocessing`` queue share storage with the sending process, which may have
    exited by the time the parent reads them.
    """
    import torch.distributed as dist

    tp = TPContext.of(dist.new_group([0, 1]))
    assert (tp.size, tp.rank) == (world, rank)
    modules = build_stage_modules(cfg, 2, [0, 1], tp)
    mbs = _edge_mbs(cfg)
    logits = []
    for mb in mbs:
        out = _run(modules, mb)
        logits.append(out.detach().clone())
        (loss_fn(out, mb) / len(mbs)).backward()
    grads = {v: _grads(m) for v, m in modules.items()}
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=lr)
    opt.step()
    params = {v: {n: t.clone() for n, t in m.state_dict().items()} for v, m in modules.items()}
    buf = io.BytesIO()
    torch.save({"logits": logits, "grads": grads, "params": params}, buf)
    return buf.getvalue()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_tp2_matches_tp1_forward_grads_and_one_sgd_step() -> None:
    lr = 0.05
    res = [torch.load(io.BytesIO(b)) for b in pooled_spawn(_tp_worker, 2, CFG, lr, timeout=100)]

    ref = build_stage_modules(CFG, 2, [0, 1])
    mbs = _edge_mbs(CFG)
    for i, mb in enumerate(mbs):
        out = _run(ref, mb)
        for r in range(2):  # every TP rank sees the full logits
            torch.testing.assert_close(res[r]["logits"][i], out.detach(), rtol=0, atol=1e-5)
        (loss_fn(out, mb) / len(mbs)).backward()
    after = reference_train(CFG, [mbs], lr=lr, num_virtual=2)
    for v in range(2):
        want = _grads(ref[v])
        shards = [res[r]["grads"][v] for r in range(2)]
        for n, g in shards[0].items():  # replicated gradients agree across TP ranks
            if shard_dim(n) is None:
                torch.testing.assert_close(g, shards[1][n], rtol=0, atol=1e-6)
        got = unshard(shards, CFG)
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-5, msg=n)
        params = unshard([res[r]["params"][v] for r in range(2)], CFG)
        for n, t in after[v].items():
            torch.testing.assert_close(params[n], t, rtol=0, atol=1e-5, msg=n)


# ------------------------------------------------------------------------------------------
# Reference trainer


def test_reference_train_changes_parameters_deterministically() -> None:
    mbs = make_microbatches(4, CFG, seed=5)
    steps = [mbs[:2], mbs[2:]]
    init = {v: m.state_dict() for v, m in build_stage_modules(CFG, 2, [0, 1]).items()}
    a = reference_train(CFG, steps, num_virtual=2)
    b = reference_train(CFG, steps, num_virtual=2)
    assert set(a) == {0, 1}
    changed = 0
    for v in a:
        assert list(a[v]) == list(init[v])
        for n in a[v]:
            assert torch.equal(a[v][n], b[v][n]), n
            changed += not torch.equal(a[v][n], init[v][n])
    assert changed > 0.9 * sum(len(x) for x in init.values())
    # The split does not change the result (beyond float summation order).
    one = reference_train(CFG, steps, num_virtual=1)[0]
    for v in a:
        for n, t in a[v].items():
            torch.testing.assert_close(t, one[n], msg=n)
    # Training lowers the loss on the data it saw.
    model = full_model(CFG)
    with torch.no_grad():
        before = sum(loss_fn(model(m.data), m).item() for m in mbs)
        model.load_state_dict(one)
        trained = sum(loss_fn(model(m.data), m).item() for m in mbs)
    assert trained < before


# ------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 30, "n_heads": 4}, "multiple of n_heads"),
        ({"image_size": 15}, "multiple of patch"),
        ({"min_text": 10, "max_text": 9}, "must be >= min_text"),
        ({"min_text": 1}, "min_text must be >= 2"),
        ({"vocab": 1}, "vocab must be >= 2"),
        ({"n_layers": 0}, "n_layers must be >= 1"),
        ({"max_images": -1}, "max_images must be >= 0"),
        ({"d_ff": 2.5}, "d_ff must be an int"),
        ({"patch": True}, "patch must be an int"),
    ],
)
def test_bad_config_raises(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        ImageTextConfig(**kwargs)


def test_bad_split_and_tp_raise() -> None:
    with pytest.raises(rr.PlanError, match="cannot split 8 transformer blocks over 9"):
        build_stage_modules(CFG, 9, [0])
    with pytest.raises(rr.PlanError, match="outside"):
        build_stage_modules(CFG, 4, [4])
    with pytest.raises(rr.PlanError, match="must not repeat"):
        build_stage_modules(CFG, 4, [1, 1])
    with pytest.raises(rr.PlanError, match=r"n_heads .* multiple of the TP size"):
        build_stage_modules(CFG, 4, [1], TPContext(None, 4, 0))
    with pytest.raises(rr.PlanError, match="rank must be in"):
        TPContext(None, 2, 2)
    with pytest.raises(rr.PlanError, match="size must be >= 1"):
        TPContext(None, 0, 0)
    with pytest.raises(rr.PlanError, match="at least one TP rank"):
        unshard([], CFG)
    sd = build_stage_modules(CFG, 4, [1])[1].state_dict()
    with pytest.raises(rr.PlanError, match="reassemble"):
        unshard([sd, sd], CFG)
    with pytest.raises(rr.PlanError, match="other keys"):
        unshard([sd, {}], CFG)
    mb = _mb(ImageTextConfig(max_images=5), 0, 5, 8, seed=0)
    with pytest.raises(rr.PlanError, match="max_images"):
        full_model(CFG)(mb.data)
