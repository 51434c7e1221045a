"""linear_cross_entropy: the plain cross-entropy of ``hidden @ weight.T`` in value and
gradients, with at most one chunk of the logits alive at a time."""

from __future__ import annotations

import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import clone_setup
from tensordict import TensorDict
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import accelfn as af


def problem(n=96, dim=16, classes=200, shape=None, seed=0):
    """hidden (n, dim) or ``shape + (dim,)``, a head weight, targets with padding."""
    g = torch.Generator().manual_seed(seed)
    shape = shape or (n,)
    hidden = torch.randn(*shape, dim, generator=g).requires_grad_()
    weight = (torch.randn(classes, dim, generator=g) / math.sqrt(dim)).requires_grad_()
    targets = torch.randint(0, classes, shape, generator=g)
    targets.view(-1)[::5] = -100
    return hidden, weight, targets


def plain(hidden, weight, targets, reduction="mean", z_loss=0.0):
    """The computation linear_cross_entropy is equivalent to: the whole logits."""
    logits = (hidden @ weight.T).reshape(-1, weight.shape[0])
    labels = targets.reshape(-1)
    loss = F.cross_entropy(logits, labels, reduction=reduction)
    if z_loss:
        z = torch.logsumexp(logits.float(), -1)[labels != -100].square()
        loss = loss + z_loss * (z.mean() if reduction == "mean" else z.sum())
    return loss


def value_and_grads(fn, hidden, weight, amp=False):
    if amp:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn()
    else:
        loss = fn()
    return [loss.detach(), *torch.autograd.grad(loss, (hidden, weight))]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
@pytest.mark.parametrize("chunks", [1, 7, None])
def test_float32_equals_the_whole_logits_computation(reduction, z_loss, chunks):
    hidden, weight, targets = problem(shape=(4, 24))  # (batch, time, dim); 7 uneven chunks
    expected = value_and_grads(lambda: plain(hidden, weight, targets, reduction, z_loss),
                               hidden, weight)
    got = value_and_grads(lambda: af.linear_cross_entropy(
        hidden, weight, targets, chunks=chunks, reduction=reduction, z_loss=z_loss),
        hidden, weight)
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("size", [(512, 64, 1000), (300, 32, 500)])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_bf16_autocast_within_the_whole_computations_own_tolerance(size, z_loss):
    """The plain computation under bf16 autocast is some distance from float32 (measured
    here); linear_cross_entropy under autocast is no farther (10% slack)."""
    n, dim, classes = size
    hidden, weight, targets = problem(n, dim, classes)
    exact = value_and_grads(lambda: plain(hidden, weight, targets, z_loss=z_loss),
                            hidden, weight)
    bf16 = value_and_grads(lambda: plain(hidden, weight, targets, z_loss=z_loss),
                           hidden, weight, amp=True)
    ours = value_and_grads(lambda: af.linear_cross_entropy(hidden, weight, targets,
                                                           chunks=8, z_loss=z_loss),
                           hidden, weight, amp=True)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == hidden.dtype
    for name, a, b, x in zip(("loss", "hidden grad", "weight grad"), ours, bf16, exact):
        tolerance = (b.float() - x).abs().max().item()
        assert tolerance > 0  # the plain bf16 computation really is lower-precision
        assert (a.float() - x).abs().max().item() <= 1.1 * tolerance, name


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that the ops run under it made and that are still
    referenced (by a tensor, or by autograd's saved tensors); ``existing`` tensors' storages
    (the inputs) are not counted."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in existing}
        self.refs: dict[int, list[int]] = {}  # data_ptr -> [live tensors, nbytes]
        self.live = self.peak = 0

    def _gone(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr in self.skip or storage.nbytes() == 0:
                    continue
                entry = self.refs.setdefault(ptr, [0, storage.nbytes()])
                if entry[0] == 0:
                    self.live += entry[1]
                entry[0] += 1
                weakref.finalize(t, self._gone, ptr)
        self.peak = max(self.peak, self.live)
        return out


def peak_bytes(fn, hidden, weight, targets, amp=False):
    """The peak bytes made by ``fn``'s forward and backward (gradients included)."""
    hidden.grad = weight.grad = None
    with LiveBytes(hidden, weight, targets) as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = fn()
        loss.backward()
        del loss
    return tracker.peak


@pytest.mark.parametrize("chunks", [4, 16])
def test_at_most_one_chunk_of_logits_alive_in_forward_and_backward(chunks):
    n, dim, classes = 2048, 8, 1024
    hidden, weight, targets = problem(n, dim, classes)
    logits = n * classes * 4  # float32 bytes of the whole logits
    # what may be alive besides the logits: the gradients of hidden and weight (kept from the
    # forward, and the .grad made from them) and a few per-token vectors
    allowance = 2 * (hidden.numel() + weight.numel()) * 4 + 4 * n * 8
    whole = peak_bytes(lambda: plain(hidden, weight, targets), hidden, weight, targets)
    assert whole >= 2 * logits  # the tracker sees the plain computation's logits
    fp32 = peak_bytes(lambda: af.linear_cross_entropy(hidden, weight, targets, chunks=chunks),
                      hidden, weight, targets)
    assert fp32 <= logits / chunks + allowance
    # under bf16 autocast the chunk's logits exist in bf16 and float32 while cast
    bf16 = peak_bytes(lambda: af.linear_cross_entropy(hidden, weight, targets, chunks=chunks),
                      hidden, weight, targets, amp=True)
    assert bf16 <= 1.5 * logits / chunks + allowance
    print(f"chunks={chunks}: peak {whole} bytes with the whole logits ({logits}), "
          f"{fp32} in float32 and {bf16} under bf16 autocast")


class TiedLM(nn.Module):
    """A language model's shape: an embedding, a block, and a head tied to the embedding."""

    def __init__(self, vocab: int = 48, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.norm = nn.LayerNorm(dim)

    def body(self, tokens):
        h = self.embed(tokens)
        return self.norm(h + self.block(h))

    def forward(self, tokens, targets):  # nanoGPT's convention: the model returns the loss
        return af.linear_cross_entropy(self.body(tokens), self.embed.weight, targets, chunks=3,
                                       return_count=True)


def lm_batch(seed: int, n: int = 6, time: int = 10) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 48, (n, time), generator=g)
    targets = torch.randint(0, 48, (n, time), generator=g)
    for row in range(n):  # padding of a different length on each row
        targets[row, time - 2 * row:] = -100
    return TensorDict({"tokens": tokens, "targets": targets}, batch_size=[n])


def lm_step(model, batch):
    loss, tokens = af.linear_cross_entropy(model.body(batch["tokens"]), model.embed.weight,
                                           batch["targets"], chunks=4, return_count=True)
    return {"loss": loss, "weight": tokens}


def plain_lm_loss(model, batch):
    logits = model.body(batch["tokens"]) @ model.embed.weight.T  # the whole logits
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def test_tied_embedding_gets_both_gradients():
    torch.manual_seed(0)
    a = TiedLM()
    b = copy.deepcopy(a)
    batch = lm_batch(0)
    loss, tokens = lm_step(a, batch).values()
    loss.backward()
    plain_lm_loss(b, batch).backward()
    assert tokens.dtype == torch.int64 and tokens == (batch["targets"] != -100).sum()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)
    # the embedding's lookup gradient is in it too (rows of tokens never targeted)
    untargeted = sorted(set(batch["tokens"].flatten().tolist())
                        - set(batch["targets"].flatten().tolist()))
    assert untargeted and a.embed.weight.grad[untargeted].abs().sum() > 0


def test_token_weighted_accumulation_equals_the_whole_batch():
    """Micro-batches of different token counts, weighted by the returned count: the update
    of the whole batch's token mean."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(TiedLM())
    state = af.TrainState(m1, o1)
    step = af.with_accumulation(3)(lm_step)
    for i in range(3):
        metrics = step(state, lm_batch(i))
        loss = plain_lm_loss(m2, lm_batch(i))
        loss.backward()
        o2.step()
        o2.zero_grad(set_to_none=True)
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)


def test_no_grad_and_a_retained_graph():
    hidden, weight, targets = problem()
    with torch.no_grad():
        value = af.linear_cross_entropy(hidden, weight, targets)
    assert not value.requires_grad
    torch.testing.assert_close(value, plain(hidden, weight, targets).detach(), rtol=1e-6,
                               atol=1e-6)
    loss = af.linear_cross_entropy(hidden, weight, targets, chunks=3)
    loss.backward(retain_graph=True)
    once = hidden.grad.clone()
    loss.backward()
    torch.testing.assert_close(hidden.grad, 2 * once)
    frozen = weight.detach()  # a frozen head: only hidden's gradient
    (grad,) = torch.autograd.grad(af.linear_cross_entropy(hidden, frozen, targets), hidden)
    torch.testing.assert_close(grad, torch.autograd.grad(plain(hidden, frozen, targets),
                                                         hidden)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_a_mean_over_no_counted_token_is_zero_with_a_zero_gradient(z_loss):
    """All padding (a micro-batch of empty rows): the mean is 0 and the gradients are zero,
    not ``F.cross_entropy``'s NaN, so a token-weighted step can leave it out (see
    tests/core/test_micro.py)."""
    hidden, weight, targets = problem(shape=(4, 24))
    loss, count = af.linear_cross_entropy(hidden, weight, torch.full_like(targets, -100),
                                          z_loss=z_loss, return_count=True)
    assert loss.item() == 0 and count.item() == 0
    for grad in torch.autograd.grad(loss, (hidden, weight)):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_bad_arguments_say_how_to_fix_them():
    hidden, weight, targets = problem()
    with pytest.raises(ValueError, match="classes, features"):
        af.linear_cross_entropy(hidden, weight.T, targets)
    with pytest.raises(ValueError, match="class indices"):
        af.linear_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="class indices"):
        af.linear_cross_entropy(hidden, weight, targets.float())
    for chunks in (0, 2.0, True):
        with pytest.raises(ValueError, match="chunks"):
            af.linear_cross_entropy(hidden, weight, targets, chunks=chunks)
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        af.linear_cross_entropy(hidden, weight, targets, reduction="none")
    for z in (-1.0, float("nan"), "1e-4"):
        with pytest.raises(ValueError, match="z_loss"):
            af.linear_cross_entropy(hidden, weight, targets, z_loss=z)


@pytest.mark.compile
def test_under_compiled_in_one_graph():
    """A model whose forward returns the loss (nanoGPT's), compiled by af.compiled."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(TiedLM())

    def fn(model, batch):
        loss, tokens = model(batch["tokens"], batch["targets"])
        return {"loss": loss, "weight": tokens}

    compiled, eager = af.compiled(fullgraph=True)(fn), af.lift(fn)  # fullgraph: no break
    s1, s2 = af.TrainState(m1, o1), af.TrainState(m2, o2)
    for i in range(2):
        a, b = compiled(s1, lm_batch(i)), eager(s2, lm_batch(i))
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch < 2.14 has no op")
def test_torchs_own_op_computes_it_where_it_gives_the_same(monkeypatch):
    """torch's ``F.linear_cross_entropy(..., options=...)`` (chunked) computes the loss of a
    float32 or float64 head outside autocast; accelfn adds the count (and ``"mean"`` over
    it). Under autocast, for low-precision inputs, and with a z-loss it cannot (it ignores
    autocast, returns a bf16 loss for bf16 inputs, has no z-loss): the chunked path of this
    module computes those."""
    calls = []
    torchs = F.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs.get("options"))
        return torchs(*args, **kwargs)

    monkeypatch.setattr(F, "linear_cross_entropy", spy)
    hidden, weight, targets = problem(shape=(4, 24))
    for chunks in (None, 7):
        expected = value_and_grads(lambda: plain(hidden, weight, targets), hidden, weight)
        loss, count = af.linear_cross_entropy(hidden, weight, targets, chunks=chunks,
                                              return_count=True)
        got = [loss.detach(), *torch.autograd.grad(loss, (hidden, weight))]
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert int(count) == int((targets != -100).sum())
    assert len(calls) == 2 and all(o is not None for o in calls)  # its chunked path
    assert calls[1].batch_chunk_size == math.ceil(96 / 7)
    af.linear_cross_entropy(hidden, weight, targets, z_loss=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        af.linear_cross_entropy(hidden, weight, targets)
    af.linear_cross_entropy(hidden.detach().bfloat16(), weight.detach().bfloat16(), targets)
    assert len(calls) == 2
