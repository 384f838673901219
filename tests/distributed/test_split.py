"""``split_model`` and friends: stages that compose to the model bitwise (forward and
gradients), of the model's own block objects, named as in the model, with the parameters two
stages share found by identity (a hand-made tie, a tiny Hugging Face GPT-2's tied LM head,
torch's pipeline tracer's replicated parameters); every bad input is a ``PlanError`` that
names the argument and the value."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn

import rrfp_async as rr

# ------------------------------------------------------------------------------ helpers


class TanhLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


class Net(nn.Module):
    """``[embed, layers (a ModuleList), head]`` with its own forward running them in order."""

    def __init__(self, n_layers: int = 6, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList(TanhLinear(width, width) for _ in range(n_layers))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def run(split: rr.distributed.StageSplit, *args: Any) -> Any:
    """Run the stages in order, passing outputs on as a stage passes them between blocks."""
    out: Any = args
    for m in split.modules:
        if isinstance(out, tuple):
            out = m(*out)
        elif isinstance(out, dict):
            out = m(**out)
        else:
            out = m(out)
    return out


def grads(model: nn.Module, forward: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    forward().square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_forward_and_grads(
    model: nn.Module, split: rr.distributed.StageSplit, x: torch.Tensor
) -> None:
    assert torch.equal(run(split, x), model(x))
    whole = grads(model, lambda: model(x))
    staged = grads(model, lambda: run(split, x))
    assert whole.keys() == staged.keys() == {n for n, _ in model.named_parameters()}
    for n in whole:
        assert torch.equal(whole[n], staged[n]), n


def names(split: rr.distributed.StageSplit) -> list[tuple[str, ...]]:
    return [cast(rr.distributed.StageModule, m).block_names for m in split.modules]


# ------------------------------------------------------------------------------ splitting


def test_sequential_split_composes_to_the_model_bitwise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)
    )
    split = rr.split_model(model, ["2", "4"])
    assert names(split) == [("0", "1"), ("2", "3"), ("4", "5")]
    assert all(isinstance(m, rr.distributed.StageModule) for m in split.modules)
    # The model's own block objects, not copies.
    stages = [cast(nn.Sequential, m) for m in split.modules]
    assert list(stages[1]) == [model[2], model[3]]
    assert [len(m) for m in stages] == [2, 2, 2]
    assert_same_forward_and_grads(model, split, torch.randn(5, 4))


def test_embed_modulelist_head_split_inside_the_modulelist() -> None:
    net = make_net()
    split = rr.split_model(net, ["layers.3"])
    assert names(split) == [
        ("embed", "layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5", "head"),
    ]
    # Parameter names and state_dict keys are the model's, split between the stages.
    keys = [list(m.state_dict()) for m in split.modules]
    assert keys[0] + keys[1] == list(net.state_dict())
    assert keys[1][0] == "layers.3.weight"
    assert split.modules[1].get_parameter("layers.3.weight") is net.layers[3].weight
    assert_same_forward_and_grads(net, split, torch.randn(5, 4))
    # A child's own name begins a stage at its first block.
    assert names(rr.split_model(net, ["layers", "head"]))[1][0] == "layers.0"


def test_int_spec_splits_evenly_by_blocks_the_first_stages_one_more() -> None:
    assert names(rr.split_model(make_net(), 3)) == [
        ("embed", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "layers.4"),
        ("layers.5", "head"),
    ]
    for n_blocks in range(1, 13):
        model = nn.Sequential(*(nn.Identity() for _ in range(n_blocks)))
        for n in range(1, n_blocks + 1):
            sizes = [len(cast(nn.Sequential, m)) for m in rr.split_model(model, n).modules]
            q, r = divmod(n_blocks, n)
            assert sizes == [q + 1] * r + [q] * (n - r), (n_blocks, n)
    net = make_net()
    assert_same_forward_and_grads(net, rr.split_model(net, 4), torch.randn(3, 4))


class Residual(nn.Sequential):
    """A ``Sequential`` with a forward of its own: one block, not a container to look into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def test_a_sequential_with_its_own_forward_is_one_block() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), Residual(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 2))
    )
    split = rr.split_model(model, 2)
    assert names(split) == [("0", "1"), ("2.0",)]
    assert_same_forward_and_grads(model, split, torch.randn(3, 4))


class Fork(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x * 2


class Join(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b


class ToDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scale": x, "shift": x + 3}


class FromDict(nn.Module):
    def forward(self, *, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return shift / scale


def test_tuple_outputs_are_positional_args_and_dicts_keyword_args() -> None:
    x = torch.tensor([3.0, 5.0])
    expect = ((x + 1) - (x * 2) + 3) / ((x + 1) - (x * 2))
    model = nn.Sequential(Fork(), Join(), ToDict(), FromDict())
    assert torch.equal(rr.split_model(model, 1).modules[0](x), expect)
    assert torch.equal(expect, torch.tensor([-0.5, 0.25]))
    # Across stage boundaries too (the harness passes a tuple on as the next stage's args).
    split = rr.split_model(model, ["1", "3"])
    assert isinstance(split.modules[0](x), tuple)
    assert torch.equal(run(split, x), expect)
    # The stage's own arguments go to its first block as given.
    assert torch.equal(
        rr.split_model(model, ["1"]).modules[1](a=x, b=x * 3), (3 - 2 * x) / (-2 * x)
    )


def test_batchnorm_buffers_are_the_models_own() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    bn = model[1]
    split = rr.split_model(model, ["2"])
    assert split.modules[0].get_buffer("1.running_mean") is bn.running_mean
    before = bn.running_mean.clone()
    run(split, torch.randn(8, 4))  # training mode: the stage updates the statistics
    assert int(cast(torch.Tensor, bn.num_batches_tracked)) == 1
    assert not torch.equal(bn.running_mean, before)
    model.eval()
    x = torch.randn(3, 4)
    assert torch.equal(run(split, x), model(x))


# ------------------------------------------------------------------------------ ties


class Tied(nn.Module):
    """An embedding and an output projection that share one weight, and a body between."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


def test_a_parameter_in_two_stages_is_a_shared_group() -> None:
    torch.manual_seed(0)
    model = Tied()
    split = rr.split_model(model, ["body.1", "head"])
    assert split.shared == {"0:emb.weight": ((0, "emb.weight"), (2, "head.weight"))}
    assert split.modules[2].get_parameter("head.weight") is model.emb.weight
    # One stage split: nothing spans stages.
    assert rr.split_model(model, 1).shared == {}
    # The tied weight's gradient sums both uses, as in the whole model.
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    whole = nn.Sequential(model.emb, model.body, model.head)
    assert_same_forward_and_grads(whole, split, ids)


def test_shared_inside_one_stage_or_a_shared_buffer_is_no_tie() -> None:
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    assert rr.split_model([a, b, c], ["2"]).shared == {}
    # The same buffer tensor in two stages is not a tie either.
    n1, n2 = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    n2.running_mean = n1.running_mean
    split = rr.split_model([n1, n2], 2)
    assert split.modules[1].get_buffer("1.running_mean") is n1.running_mean
    assert split.shared == {}


def test_a_block_run_in_two_stages_shares_all_its_parameters() -> None:
    block, other = nn.Linear(4, 4), nn.Linear(4, 4)
    split = rr.split_model(nn.Sequential(block, other, block), 3)
    assert split.shared == {
        "0:0.weight": ((0, "0.weight"), (2, "2.weight")),
        "0:0.bias": ((0, "0.bias"), (2, "2.bias")),
    }
    assert list(split.shared) == ["0:0.weight", "0:0.bias"]  # the stage's parameter order


def test_hf_gpt2_tied_lm_head_is_declared() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()  # random init, no download
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = model.transformer.wte, model.transformer.wpe

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.ln_f(h))

    split = rr.split_model([Embed(), *model.transformer.h, Head()], 3)
    assert names(split) == [("0", "1"), ("2",), ("3",)]
    assert split.shared == {"0:0.wte.weight": ((0, "0.wte.weight"), (2, "3.lm_head.weight"))}
    ids = torch.randint(0, 100, (2, 7))
    assert torch.equal(run(split, ids), model(ids).logits)


def test_from_stage_modules_finds_ties_and_takes_declared_ones() -> None:
    emb, mid, head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    split = rr.distributed.from_stage_modules([emb, mid, head])
    assert split.modules == (emb, mid, head)
    assert split.shared == {"0:weight": ((0, "weight"), (2, "weight"))}
    assert split.modules_of([2, 0]) == {2: head, 0: emb}
    # Replicas that are different objects are ties only when declared.
    copy = nn.Linear(8, 10, bias=False)
    assert rr.distributed.from_stage_modules([emb, mid, copy]).shared == {}
    declared = rr.distributed.from_stage_modules(
        [emb, mid, copy], ties=[{2: "weight", 0: "weight"}]
    )
    assert declared.shared == {"0:weight": ((0, "weight"), (2, "weight"))}
    # A declared group meeting an identity group makes one group.
    joined = rr.distributed.from_stage_modules([emb, head, copy], ties=[{1: "weight", 2: "weight"}])
    assert joined.shared == {"0:weight": ((0, "weight"), (1, "weight"), (2, "weight"))}


class TracedTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        h = self.mid(self.emb(ids))
        pipe_split()
        return self.head(h)


def test_torch_pipeline_tracer_stages_with_their_replicated_tie() -> None:
    from torch.distributed.pipelining import pipeline

    torch.manual_seed(0)
    model = TracedTied()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with warnings.catch_warnings():
        # torch's own tracer, on torch 2.13: "isinstance(treespec, LeafSpec) is deprecated".
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        pipe = pipeline(model, mb_args=(ids,))
    split = rr.distributed.from_pipe(pipe)
    assert len(split.modules) == 2
    assert torch.equal(run(split, ids), model(ids))
    assert split.shared == {"0:emb.weight": ((0, "emb.weight"), (1, "head.weight"))}
    # The tracer copies the tied weight into each stage: identity alone finds no tie.
    assert pipe.get_stage_module(1).get_parameter("head.weight") is not model.emb.weight
    assert rr.distributed.from_stage_modules(split.modules).shared == {}


# ------------------------------------------------------------------------------ errors


def _bad_models() -> list[tuple[Any, str]]:
    own = Net()
    own.scale = nn.Parameter(torch.ones(1))
    with_dict = nn.Module()
    with_dict.a = nn.Linear(2, 2)
    with_dict.d = nn.ModuleDict({"x": nn.Linear(2, 2)})
    nested_list = nn.Sequential(nn.ModuleList([nn.ModuleList([nn.Linear(2, 2)])]))
    return [
        (nn.Linear(2, 2), r"model: the Linear has no blocks"),
        (nn.Sequential(), r"model: the Sequential has no blocks"),
        ([], r"model: the list has no blocks"),
        (42, r"model: expected an nn.Module .* got a int"),
        ([nn.Linear(2, 2), "relu"], r"model: item 1 of the list is a str"),
        (own, r"model: the Net holds scale outside its blocks"),
        (with_dict, r"model: child 'd' of the Module is a ModuleDict"),
        (nested_list, r"model: block '0.0' is a ModuleList"),
    ]


@pytest.mark.parametrize(("model", "match"), _bad_models())
def test_a_model_that_is_not_a_sequential_container(model: Any, match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        rr.split_model(model, 1)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (["layers.9"], r"split_spec: unknown split name 'layers.9'; the split points are embed,"),
        (["layers.2.weight"], r"unknown split name 'layers.2.weight'"),
        (["nope"], r"unknown split name 'nope'"),
        (["layers.4", "layers.2"], r"increasing order, but 'layers.2' comes before 'layers.4'"),
        (["head", "embed"], r"increasing order, but 'embed' comes before 'head'"),
        (["embed"], r"stage 0 would be empty: 'embed' begins at the same block \('embed'\)"),
        (["layers.2", "layers.2"], r"stage 1 would be empty: 'layers.2' begins"),
        (["layers", "layers.0"], r"stage 1 would be empty: 'layers.0' begins"),
        (0, r"split_spec: 0 stages; the model has 8 blocks, so 1 to 8 stages"),
        (-1, r"split_spec: -1 stages"),
        (9, r"split_spec: 9 stages; the model has 8 blocks"),
        (True, r"split_spec: expected a list .* got True"),
        ("layers.2", r"split_spec: expected a list .* got 'layers.2'"),
        (None, r"split_spec: expected a list .* got None"),
        ([2], r"split_spec: split names are str, got 2"),
    ],
)
def test_a_bad_split_spec(spec: Any, match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        rr.split_model(Net(), spec)


def test_bad_stage_modules_ties_and_stage_indices() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: rr.distributed.from_stage_modules([]),
            r"modules: a split needs at least one stage",
        ),
        (
            lambda: rr.distributed.from_stage_modules([a, "b"]),  # type: ignore[list-item]  # a str on purpose
            r"modules: stage 1 is a str",
        ),
        (
            lambda: rr.distributed.from_stage_modules([a, b], ties=[{0: "weight", 2: "weight"}]),
            r"ties: .* stage 2",
        ),
        (
            lambda: rr.distributed.from_stage_modules([a, b], ties=[{0: "w", 1: "weight"}]),
            r"ties: .*'w', which is no parameter of stage 0",
        ),
        (
            lambda: rr.distributed.from_stage_modules(
                [a, b], ties=[{0: "weight", 1: "weight"}, {0: "bias", 1: "weight"}]
            ),
            r"ties: stage 0's parameters 'weight' and 'bias' are declared tied",
        ),
        (
            lambda: rr.split_model([a, b], 2).modules_of([1, 2]),
            r"stages: 2 is no virtual stage of this split \(0 .. 1\)",
        ),
        (
            lambda: rr.distributed.StageSplit((a, b), {"g": ((0, "weight"),)}),
            r"shared: group 'g' must list two or more stages",
        ),
        (
            lambda: rr.distributed.StageSplit((a, b), {"g": ((1, "weight"), (0, "weight"))}),
            r"shared: group 'g' must list",
        ),
        (
            lambda: rr.distributed.StageSplit((a, b), {"g": ((0, "weight"), (3, "weight"))}),
            r"shared: group 'g' names stage 3",
        ),
        (
            lambda: rr.distributed.StageSplit((a, b), {"g": ((0, "weight"), (1, "w"))}),
            r"shared: group 'g' names 'w'",
        ),
        (lambda: rr.distributed.StageSplit((), {}), r"modules: a split needs at least one stage"),
        (lambda: rr.distributed.StageModule([]), r"blocks: a stage needs at least one block"),
    ]
    for call, match in cases:
        with pytest.raises(rr.PlanError, match=match):
            call()


def test_modules_of_keeps_the_order_asked() -> None:
    split = rr.split_model(Net(), 4)
    got = split.modules_of([3, 1])
    assert list(got) == [3, 1] and got[3] is split.modules[3]
