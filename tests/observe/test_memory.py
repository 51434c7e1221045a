"""estimate_memory: the peak of one update, traced with fake tensors, against the peak of
live tensor storage measured during a real update on the CPU (a storage tracker written
here, apart from the library's)."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import accelfn as af
from accelfn.observe.memory import (
    MemoryEstimate,
    estimate_memory,
    estimate_script,
    format_estimate,
    oom_advice,
)


# ------------------------------------------------------------------ models and step functions
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, depth: int = 2, seq: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, 4) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[:ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, channels: int = 8, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[Residual(channels) for _ in range(depth)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


def lm_loss(model, batch):
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def classify(model, batch):
    return F.cross_entropy(model(batch["image"]), batch["label"])


def gpt_case():
    g = torch.Generator().manual_seed(0)
    batch = TensorDict({"ids": torch.randint(0, 128, (8, 16), generator=g),
                        "targets": torch.randint(0, 128, (8, 16), generator=g)}, batch_size=[8])
    return GPT, lm_loss, batch


def resnet_case():
    g = torch.Generator().manual_seed(0)
    batch = TensorDict({"image": torch.randn(8, 3, 16, 16, generator=g),
                        "label": torch.randint(0, 10, (8,), generator=g)}, batch_size=[8])
    return ResNet, classify, batch


def adamw_state(model):
    return af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


# ------------------------------------------------------------------ the measurement
class StoragePeak(TorchDispatchMode):
    """The peak bytes of live tensor storage: the storages present when it starts, plus
    every storage an operator makes, each alive until its last reference goes (storage
    objects are kept by torch as long as any tensor or autograd's saved tensors use them)."""

    def __init__(self, present):
        super().__init__()
        self.live, self.total, self.peak = {}, 0, 0
        for t in present:
            self._add(t)

    def _add(self, t):
        s = t.untyped_storage()
        if s._cdata not in self.live:
            self.live[s._cdata] = s.nbytes()
            self.total += s.nbytes()
            weakref.finalize(s, self._drop, s._cdata)
        self.peak = max(self.peak, self.total)

    def _drop(self, key):
        self.total -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        return out


def measured_peak(step, state, batch):
    """The peak of live storage during the second update (the first makes the optimizer's
    state, as the estimate assumes)."""
    step(state, batch)
    present = [*state.model.parameters(), *state.model.buffers(), *batch.values(),
               *[v for o in state.optimizers for entry in o.state.values()
                 for v in entry.values() if isinstance(v, torch.Tensor)]]
    meter = StoragePeak(present)
    with meter:
        step(state, batch)
    return meter.peak


STACKS = {
    "plain": lambda f: af.with_clipping(max_norm=1.0)(f),
    "checkpointed": lambda f: af.checkpointed(f),
    "bf16": lambda f: af.with_amp(dtype=torch.bfloat16)(f),
    "bf16_checkpointed": lambda f: af.with_amp(dtype=torch.bfloat16)(af.checkpointed(f)),
}


@pytest.mark.parametrize("case", [gpt_case, resnet_case], ids=["gpt", "resnet"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_the_estimate_is_within_ten_percent_of_the_measured_peak(case, stack):
    build, fn, batch = case()
    model = build()
    state = adamw_state(model)
    before = copy.deepcopy(model.state_dict())
    estimate = estimate_memory(STACKS[stack](fn), state, batch)
    # nothing allocated or changed: the state is as it was, and gets no optimizer state
    assert state.step == 0 and not state.optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    measured = measured_peak(STACKS[stack](fn), adamw_state(build()), batch)
    assert abs(estimate.peak - measured) <= 0.10 * measured, (estimate, measured)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert estimate.optimizer_state == 2 * params + 4 * len(list(model.parameters()))
    parts = (estimate.parameters + estimate.gradients + estimate.optimizer_state
             + estimate.activations + estimate.temporaries)
    assert parts == estimate.peak
    assert estimate.largest_temporary <= estimate.temporaries


@pytest.mark.slow
def test_checkpointing_and_bf16_shrink_the_activations_of_the_estimate():
    build, fn, batch = gpt_case()
    found = {name: estimate_memory(stack(fn), adamw_state(build()), batch)
             for name, stack in STACKS.items()}
    assert found["checkpointed"].peak < found["plain"].peak
    assert found["bf16"].activations < found["plain"].activations


@pytest.mark.slow
def test_accumulation_estimates_a_micro_batch_and_fsdp_divides_the_sharded_kinds():
    build, fn, batch = gpt_case()
    whole = estimate_memory(af.with_clipping(fn), adamw_state(build()), batch)
    micro = estimate_memory(af.with_accumulation(4)(fn), adamw_state(build()), batch)
    assert micro.activations < whole.activations / 2
    one = estimate_memory(af.distributed(strategy="fsdp")(fn), adamw_state(build()), batch,
                          world_size=1)
    four = estimate_memory(af.distributed(strategy="fsdp")(fn), adamw_state(build()), batch,
                           world_size=4)
    assert four.optimizer_state == one.optimizer_state // 4
    assert four.peak < one.peak and four.world_size == 4
    assert "per process" in format_estimate(four)
    ddp = estimate_memory(af.distributed(fn), adamw_state(build()), batch, world_size=4)
    assert ddp.optimizer_state == one.optimizer_state  # DDP replicates


def test_the_line_and_the_advice_name_the_kinds_and_the_fixes_for_the_stack():
    build, fn, batch = gpt_case()
    estimate = estimate_memory(fn, adamw_state(build()), batch)
    line = format_estimate(estimate)
    assert line.startswith("memory: peak ") and "activations" in line
    assert str(estimate) == line
    advice = oom_advice(estimate, fn)
    assert "with_accumulation(2)" in advice and "checkpointed" in advice
    assert "with_amp" in advice
    advice = oom_advice(estimate, af.with_amp(af.checkpointed(fn)))
    assert "with_amp (" not in advice and "checkpointed (" not in advice
    kinds = MemoryEstimate(1, 1, 100, 1, 1, 1, 104, "optimizer").kinds()
    assert next(iter(kinds)) == "optimizer state"


def test_bad_input_is_refused_clearly():
    build, fn, batch = gpt_case()
    with pytest.raises(TypeError, match="TrainState"):
        estimate_memory(fn, build(), batch)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(fn, adamw_state(build()), batch, world_size=0)


def test_a_script_is_estimated_through_its_memory_case(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, accelfn as af\n"
        "def memory_case():\n"
        "    model = torch.nn.Linear(64, 64)\n"
        "    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "    return af.with_clipping(lambda m, b: m(b['x']).square().mean()), state, "
        "{'x': torch.randn(32, 64)}\n"
        "if __name__ == '__main__':\n"
        "    raise SystemExit('training started')\n")
    estimate = estimate_script(script)
    assert estimate.parameters == (64 * 64 + 64) * 4
    assert estimate.peak >= estimate.parameters + 32 * 64 * 4
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="memory_case"):
        estimate_script(empty)


@pytest.mark.slow  # three estimates of a 4-micro-batch update (seconds each on a busy CPU)
def test_adaptive_accumulation_is_estimated_with_the_count_it_found():
    build, fn, batch = gpt_case()

    class Limited(GPT):
        def forward(self, ids):
            if ids.shape[0] > 2:
                raise torch.OutOfMemoryError("out of memory above 2 samples (test)")
            return super().forward(ids)

    step = af.with_accumulation(1, adaptive=True)(fn)
    state = adamw_state(Limited())
    fresh = estimate_memory(af.with_accumulation(4)(fn), adamw_state(build()), batch)
    assert int(step(state, batch)["micro_batches"]) == 4
    found = estimate_memory(step, state, batch)
    whole = estimate_memory(af.with_accumulation(1)(fn), adamw_state(build()), batch)
    assert found == fresh and found.peak < whole.peak
    assert int(step(state, batch)["micro_batches"]) == 4  # the state's count is its own
