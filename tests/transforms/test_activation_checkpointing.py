"""checkpointed: identical gradients to no checkpointing, fewer saved activations."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from helpers import Block, Net, as_dict, assert_params_equal, classify, clone_setup, make_batch
from reference import reference_update
from torch import nn
from trunk_models import TrunkNet, via_forward, via_method, via_submodule

import accelfn as af


class DropNet(Net):
    """Net with dropout inside blocks: recomputation must replay the same random mask."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = self.drop(block(h))
        return self.head(h)


def _assert_equals_plain_loop(net, step, updates: int) -> None:
    """``step`` on ``net`` against the plain loop on a copy, both seeded alike (dropout)."""
    (m1, o1), (m2, o2) = clone_setup(net)
    state = af.TrainState(m1, o1)
    for i in range(updates):
        batch = make_batch(seed=i)
        torch.manual_seed(100 + i)
        step(state, batch)
        torch.manual_seed(100 + i)
        reference_update(m2, o2, as_dict(batch), classify)
    assert_params_equal(m1, m2)


@pytest.mark.parametrize("options", [
    {}, {"every": 2}, {"blocks": (Block,)}, {"blocks": lambda n, m: n == "blocks.1"},
    {"selective": True}, {"selective": [torch.ops.aten.addmm.default]},
    {"offload": "cpu"}, {"offload": "cpu", "every": 2},
])
def test_gradients_identical_to_no_checkpointing(options):
    torch.manual_seed(0)
    _assert_equals_plain_loop(DropNet(), af.checkpointed(**options)(classify), updates=3)


def _saved_bytes(step, model) -> int:
    """The bytes saved for the backward by one call of ``step`` on ``model``, outside what
    the checkpointed regions keep for themselves (their own hooks take precedence)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    def counted(model, batch):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return step.fn(model, batch)

    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.Step(counted, step.transforms)(state, make_batch(n=64))
    return total[0]


@pytest.mark.parametrize("fn", [via_forward, via_submodule, via_method])
def test_checkpointing_saves_fewer_activations(fn):
    torch.manual_seed(0)
    model = TrunkNet(dim=64, depth=4)
    plain = _saved_bytes(af.lift(fn), copy.deepcopy(model))
    assert _saved_bytes(af.checkpointed(fn), model) < plain / 2
    # the model itself, called by a step without checkpointing on the same state, keeps
    # its activations
    assert _saved_bytes(af.lift(fn), model) == plain


def _block_runs(step, model, updates: int = 2) -> list[int]:
    """How many times each block's forward ran per update (a recompute runs it again: the
    block's own call is counted by its first layer's, which the recompute calls again)."""
    runs = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.fc1.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for u in range(updates):
        step(state, make_batch(seed=u))
    return [r // updates for r in runs]


@pytest.mark.parametrize("fn", [via_submodule, via_method])
def test_blocks_are_recomputed_through_a_submodule_or_method_as_through_forward(fn):
    torch.manual_seed(0)
    model = TrunkNet()
    through_forward = _block_runs(af.checkpointed(via_forward), copy.deepcopy(model))
    assert through_forward == [2, 2, 2]  # a forward, then a recompute in the backward
    assert _block_runs(af.checkpointed(fn), copy.deepcopy(model)) == through_forward
    assert _block_runs(af.lift(fn), copy.deepcopy(model)) == [1, 1, 1]


@pytest.mark.parametrize("fn", [via_forward, via_submodule, via_method])
def test_the_function_receives_the_model_itself(fn):
    seen = []

    def spy(model, batch):
        seen.append(model)
        return fn(model, batch)

    torch.manual_seed(0)
    model = TrunkNet()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.checkpointed(spy)
    step(state, make_batch())
    step.evaluate(state, make_batch())
    assert seen == [model, model]
    (m1, o1), (m2, o2) = clone_setup(TrunkNet())
    state = af.TrainState(m1, o1)
    for i in range(3):
        af.checkpointed(fn)(state, make_batch(seed=i))
        reference_update(m2, o2, as_dict(make_batch(seed=i)), fn)
    assert_params_equal(m1, m2)


def test_find_blocks_resnet_and_transformer():
    resnet = torchvision.models.resnet18()
    names = [n for n, _ in af.find_blocks(resnet)]
    assert names == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                                    num_layers=3, enable_nested_tensor=False)
    assert [n for n, _ in af.find_blocks(encoder)] == ["layers.0", "layers.1", "layers.2"]
    assert [n for n, _ in af.find_blocks(Net())] == ["blocks.0", "blocks.1", "blocks.2"]


def test_resnet_checkpointed_equals_plain_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    (m1, o1), (m2, o2) = clone_setup(model)

    def fn(model, batch):
        return F.cross_entropy(model(batch["image"]), batch["label"])

    batch = {"image": torch.randn(2, 3, 32, 32), "label": torch.tensor([0, 3])}
    state = af.TrainState(m1, o1)
    af.checkpointed(fn)(state, batch)
    reference_update(m2, o2, batch, fn)
    assert_params_equal(m1, m2)
    for (name, b1), (_, b2) in zip(m1.named_buffers(), m2.named_buffers()):
        assert torch.equal(b1, b2), f"buffer {name} differs"  # BatchNorm statistics once


def test_wrap_keeps_state_dict_and_deepcopy_runs_its_own_weights():
    torch.manual_seed(0)
    model = Net()
    keys = list(model.state_dict())
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_amp(dtype=torch.bfloat16, fp32=Block)(af.checkpointed(classify))
    step(state, make_batch())
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = make_batch()["x"]
    assert torch.all(twin(x) == 0)
    assert not torch.all(model(x) == 0)


def test_no_block_found_is_a_clear_error():
    model = nn.Linear(6, 4)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="found no block"):
        af.checkpointed(classify)(state, make_batch())


def test_bad_options():
    with pytest.raises(ValueError, match="every"):
        af.checkpointed(every=0)
    with pytest.raises(ValueError, match="blocks"):
        af.checkpointed(blocks="all")
    for selective in ("mm", 1, None, [1, 2], [torch.ops.aten.mm.default, "addmm"]):
        with pytest.raises(TypeError, match="selective"):
            af.checkpointed(selective=selective)
    with pytest.raises(TypeError, match="module classes"):
        af.checkpointed(blocks=())
    with pytest.raises(TypeError, match="module instance"):
        af.checkpointed(blocks=Net().blocks)  # callable, but not a predicate
    for offload in ("gpu", True, "cuda"):
        with pytest.raises(ValueError, match="offload"):
            af.checkpointed(offload=offload)
    for selective in (True, [torch.ops.aten.mm.default]):
        with pytest.raises(ValueError, match="one of them"):
            af.checkpointed(offload="cpu", selective=selective)


def test_selective_with_an_op_packet_keeps_its_overloads():
    """``torch.ops.aten.addmm`` (a packet) keeps what ``torch.ops.aten.addmm.default`` keeps;
    the policy is asked about overloads, so a packet kept as given would match nothing."""
    save = dict(af.checkpointed(selective=[torch.ops.aten.addmm]).options)["save"]
    assert torch.ops.aten.addmm.default in save and torch.ops.aten.addmm.out in save
    assert torch.ops.aten.addmm not in save
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(DropNet())
    torch.manual_seed(1)
    af.checkpointed(selective=[torch.ops.aten.addmm])(classify)(af.TrainState(m1, o1),
                                                                 make_batch())
    torch.manual_seed(1)
    reference_update(m2, o2, as_dict(make_batch()), classify)
    assert_params_equal(m1, m2)


class KwBlock(nn.Module):
    """A block taking keyword arguments, one named like a torch.utils.checkpoint option, and
    returning a tuple."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, mask=None, debug=False):
        h = self.drop(self.fc(x)) * mask
        return x + (2.0 * h if debug else h), h.mean()


class KwNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(KwBlock(8) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h, aux = self.inp(x), 0.0
        for block in self.blocks:
            h, a = block(h, mask=(h > 0).float(), debug=True)
            aux = aux + a
        return self.head(h) + aux


@pytest.mark.parametrize("options", [{}, {"offload": "cpu"}])
def test_blocks_keyword_arguments_reach_the_block_with_dropout_as_the_plain_loop(options):
    torch.manual_seed(0)
    _assert_equals_plain_loop(KwNet(), af.checkpointed(**options)(classify), updates=2)


class ResBlock(nn.Module):
    """A torchvision-style basic block: conv-BN-ReLU-conv-BN plus the identity."""

    def __init__(self, channels: int, momentum: float | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=momentum)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


class ResNetLike(nn.Module):
    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(*(ResBlock(4, momentum) for _ in range(3)))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def image_loss(model, batch):
    return F.cross_entropy(model(batch["image"]), batch["label"])


def image_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"image": torch.randn(4, 3, 6, 6, generator=g),
            "label": torch.randint(0, 3, (4,), generator=g)}


def assert_state_equal(m1, m2):
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert list(s1) == list(s2)
    for key in s1:
        assert torch.equal(s1[key], s2[key]), f"{key} differs from the plain loop"


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("options", [
    {}, {"every": 2}, {"blocks": (ResBlock,)}, {"blocks": lambda n, m: n == "blocks.1"},
    {"selective": True}, {"selective": [torch.ops.aten.convolution.default]},
    {"offload": "cpu"},
])
def test_batchnorm_statistics_updated_once_as_without_checkpointing(options, momentum):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(ResNetLike(momentum))
    step = af.checkpointed(**options)(image_loss)
    state = af.TrainState(m1, o1)
    for i in range(3):
        step(state, image_batch(i))
        reference_update(m2, o2, image_batch(i), image_loss)
    assert state.slots["checkpointed"]["blocks"] >= 1
    assert m1.blocks[1].bn1.num_batches_tracked == 3
    assert_state_equal(m1, m2)  # parameters and running_mean/var/num_batches_tracked


def test_batchnorm_statistics_with_accumulation_and_amp():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(ResNetLike())
    step = af.with_amp(dtype=torch.bfloat16)(af.with_accumulation(2)(af.checkpointed(image_loss)))
    state = af.TrainState(m1, o1)
    for i in range(2):
        step(state, image_batch(i))
        reference_update(m2, o2, image_batch(i), image_loss, micro=2, amp_dtype=torch.bfloat16)
    assert m1.blocks[0].bn2.num_batches_tracked == 4
    assert_state_equal(m1, m2)


def test_frozen_batchnorm_in_eval_mode_is_left_alone():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(ResNetLike())
    for model in (m1, m2):
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.eval()
    state = af.TrainState(m1, o1)
    step = af.checkpointed(image_loss)
    for i in range(2):
        step(state, image_batch(i))
        reference_update(m2, o2, image_batch(i), image_loss)
    assert m1.blocks[0].bn1.num_batches_tracked == 0
    assert_state_equal(m1, m2)


@pytest.mark.parametrize("early_stop", [True, False])
def test_batchnorm_last_in_block_with_and_without_early_stop(early_stop):
    # the block ends in its BatchNorm: an early-stopping recompute stops inside it
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Sequential(
            *(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2))),
            nn.Linear(8, 4))

    (m1, o1), (m2, o2) = clone_setup(make())
    step = af.checkpointed(classify)
    state = af.TrainState(m1, o1)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        for i in range(3):
            step(state, make_batch(seed=i))
            reference_update(m2, o2, as_dict(make_batch(seed=i)), classify)
    assert_state_equal(m1, m2)


def test_backward_twice_through_a_kept_graph_restores_statistics_each_time():
    torch.manual_seed(0)
    model = ResNetLike()
    plain = copy.deepcopy(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.checkpointed(image_loss).prepare(state)
    batch = image_batch(0)
    loss = image_loss(model, batch)
    loss.backward(retain_graph=True)
    loss.backward()
    image_loss(plain, batch).backward()
    assert model.blocks[0].bn1.num_batches_tracked == 1
    for (name, b1), (_, b2) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(b1, b2), name


# ------------------------------------------------------------------------ offload="cpu"
PACKED: list[int] = []  # the bytes of each tensor CountingSaveOnCpu's pack hook received


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu, recording in PACKED the tensors its pack hook receives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pack = self.pack_hook

        def counting(tensor):
            PACKED.append(tensor.numel() * tensor.element_size())
            return pack(tensor)

        self.pack_hook = counting


def saved_in_blocks(model, every: int = 1) -> list[int]:
    """The bytes of each tensor the plain model's blocks (every ``every``-th) save for the
    backward, less the parameters (and views of them), in one forward of a batch."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: list[int] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            sizes.append(t.numel() * t.element_size())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    handles = [h for _, block in af.find_blocks(model)[::every] for h in (
        block.register_forward_pre_hook(lambda m, a: hooks.__enter__()),
        block.register_forward_hook(lambda m, a, o: hooks.__exit__()))]
    classify(model, as_dict(make_batch(n=64)))
    for h in handles:
        h.remove()
    return sizes


def block_calls(model) -> list[int]:
    """A counter of the forwards of each block's first Linear, kept up to date."""
    calls = [0]
    for _, block in af.find_blocks(model):
        block.fc1.register_forward_hook(lambda m, a, o: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_offload_packs_the_blocks_activations_on_the_host_and_recomputes_nothing(monkeypatch):
    torch.manual_seed(0)
    model = Net(dim=64, depth=4)
    expected = saved_in_blocks(model)
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    PACKED.clear()
    calls = block_calls(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.checkpointed(offload="cpu")(classify)(state, make_batch(n=64))
    # every activation the blocks save went through save_on_cpu's pack hook, parameters not
    assert sorted(PACKED) == sorted(expected) and sum(expected) > 0
    assert calls[0] == 4  # one forward per block: nothing recomputed in the backward
    # checkpointing instead recomputes each block's forward and packs nothing
    torch.manual_seed(0)
    model = Net(dim=64, depth=4)
    calls = block_calls(model)
    PACKED.clear()
    af.checkpointed(classify)(af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                              make_batch(n=64))
    assert calls[0] == 8 and PACKED == []


def test_offload_every_other_block_and_its_label(monkeypatch):
    torch.manual_seed(0)
    model = Net(dim=16, depth=4)
    expected = saved_in_blocks(model, every=2)  # blocks 0 and 2
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    PACKED.clear()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.checkpointed(offload="cpu", every=2)(classify)
    assert "checkpointed(blocks=auto, every=2, offload=cpu)" in af.describe(step)
    step(state, make_batch(n=64))
    assert state.slots["checkpointed"]["blocks"] == 2
    assert sorted(PACKED) == sorted(expected) and sum(expected) > 0


def test_offload_passes_the_contract_kit():
    from accelfn.testing import check_transform, plain_update

    def loss_fn(model, batch):
        return {"loss": F.cross_entropy(model(batch["x"]), batch["y"])}

    report = check_transform(af.checkpointed(offload="cpu"), loss_fn=loss_fn, steps=2,
                             reference=lambda m, o, b: plain_update(m, o, b, loss_fn),
                             builtins=[af.with_amp(dtype=torch.bfloat16),
                                       af.with_accumulation(2)])
    assert report.passed == ["reference", "purity", "orders", "resume", "no host sync",
                             "bad input"]
    assert report.orders == 6  # with bf16 autocast and accumulation, in every order


@pytest.mark.compile
def test_offload_under_compiled_graph_breaks_at_each_block_and_still_offloads(monkeypatch):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(Net())
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    PACKED.clear()
    step = af.compiled(backend="aot_eager")(af.checkpointed(offload="cpu")(classify))
    state = af.TrainState(m1, o1)
    for i in range(2):
        step(state, make_batch(seed=i))
        reference_update(m2, o2, as_dict(make_batch(seed=i)), classify)
    assert_params_equal(m1, m2)
    assert PACKED
