"""Memory of a GPT of at least 50M parameters: the estimate, the logits, adaptive accumulation.

Prints, for one AdamW update of a GPT (58.8M parameters, vocabulary 32768, 8 tokens x 64):

* ``estimate_memory``'s peak against the peak measured during a real update (the live
  tensor storage, followed operator by operator; on ``--device cuda``
  ``torch.cuda.max_memory_allocated``, what ``benchmarks/gpu_suite.sh`` runs), as a ratio,
  with the target: within 10%;
* the measured peak of the update with ``linear_cross_entropy`` against the full logits and
  ``F.cross_entropy`` (the plain code a user writes), as a ratio, on 16 sequences with plain
  SGD: with AdamW the peak is the optimizer step's (its state and foreach temporaries), where
  the loss plays no part (that peak is reported too);
* the loss alone, side by side: ``af.linear_cross_entropy``, torch's own chunked
  ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` (torch >= 2.14) and
  the full logits' ``F.cross_entropy``, on the GPT's head (16 x 64 tokens), in float32 and
  under bf16 autocast: the peak of the forward and backward, the median time over
  ``--rounds`` interleaved rounds, and the loss's distance from float64 (in float32 accelfn
  calls torch's op; under autocast it computes in bf16 where torch's op ignores autocast);
* adaptive accumulation's chosen count, the model standing in for a device that runs out
  of memory above 2 samples per micro-batch (it raises ``torch.OutOfMemoryError``, as a
  full GPU does), and its step time once settled against ``with_accumulation(count)`` set
  by hand: the sides interleave, rotating which goes first; the figure is the median over
  rounds of each side's thread CPU time per update (wall time on CUDA).

With ``--anchors``, also the estimate against the measured peak on the two models the
published figures are about: GPT-2 small (124M, ``benchmarks/gpt2.py``'s, 8 x 1024 tokens,
bf16 autocast, fused AdamW) and torchvision's ResNet-50 (64 images of 224 x 224,
channels_last, bf16 autocast, SGD with momentum); ``--tiny`` shrinks both (a 2-layer GPT,
ResNet-18 on 32 x 32 images).

    python benchmarks/memory.py [--rounds 7] [--threads 1] [--device cpu|cuda] [--out FILE]
                                [--tiny] [--anchors]

``--tiny``: a GPT of 59k parameters, every path in seconds (the GPU suite's dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import accelfn as af
from accelfn.observe.memory import estimate_memory

VOCAB, DIM, DEPTH, HEADS, SEQ, BATCH = 32768, 512, 8, 8, 64, 8
FITS = 2  # samples per micro-batch the stand-in device holds
TARGET = 0.10  # the estimate within 10% of the measured peak


def use_tiny() -> None:
    """The sizes of ``--tiny`` (read by the classes and functions below when they run)."""
    global VOCAB, DIM, DEPTH, HEADS, SEQ
    VOCAB, DIM, DEPTH, HEADS, SEQ = 512, 32, 2, 2, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, DIM))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self, fits: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.fits = fits

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fits is not None and ids.shape[0] > self.fits:
            raise torch.OutOfMemoryError("out of memory (the stand-in device holds "
                                         f"{self.fits} samples per micro-batch)")
        x = self.emb(ids) + self.pos[:ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.ln(x)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.hidden(ids))
        return out


def full_logits(model: nn.Module, batch: TensorDict) -> torch.Tensor:
    return F.cross_entropy(model(batch["ids"]).flatten(0, 1), batch["targets"].flatten())


def fused_loss(model: GPT, batch: TensorDict) -> torch.Tensor:
    hidden = model.hidden(batch["ids"])
    return af.linear_cross_entropy(hidden, model.head.weight, batch["targets"])


def make_batch(device: torch.device, size: int = BATCH) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return TensorDict({"ids": ids[:, :-1], "targets": ids[:, 1:]}, batch_size=[size]).to(device)


def new_state(device: torch.device, fits: int | None = None,
              sgd: bool = False) -> af.TrainState:
    model = GPT(fits).to(device)
    optimizer = (torch.optim.SGD(model.parameters(), lr=1e-3) if sgd else
                 torch.optim.AdamW(model.parameters(), lr=1e-4))
    return af.TrainState(model, optimizer)


class StoragePeak(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
    """The peak bytes of live tensor storage: storages present at the start plus each one an
    operator makes, alive until its last reference (autograd's included) goes."""

    def __init__(self, present: list[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live: dict[int, int] = {}
        self.total = self.peak = 0
        for t in present:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s._cdata not in self.live:
            self.live[s._cdata] = s.nbytes()
            self.total += s.nbytes()
            weakref.finalize(s, self.drop, s._cdata)
        self.peak = max(self.peak, self.total)

    def drop(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)
        return out


def measured_peak(step: Callable[..., Any], state: af.TrainState, batch: TensorDict) -> int:
    """The peak of the second update (the first makes AdamW's state, as the estimate's)."""
    step(state, batch)
    device = next(iter(batch.values())).device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(state, batch)
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    present: list[Any] = [*state.model.parameters(), *state.model.buffers(), *batch.values(),
               *[v for o in state.optimizers for e in o.state.values() for v in e.values()
                 if isinstance(v, torch.Tensor)]]
    meter = StoragePeak(present)
    with meter:
        step(state, batch)
    return meter.peak


def timed(step: Callable[..., Any], state: af.TrainState, batch: TensorDict) -> float:
    if batch["ids"].device.type == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(state, batch)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    start = time.thread_time()
    step(state, batch)
    return time.thread_time() - start


def _loss_peak_and_time(loss: Callable[[], torch.Tensor], inputs: list[torch.Tensor],
                        autocast: bool) -> tuple[int, float, float]:
    """The peak bytes of one forward and backward of ``loss`` (gradients included), its time,
    and the loss (as a float)."""
    device = inputs[0].device
    for t in inputs:
        t.grad = None

    def run() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            value = loss()
        value.backward()
        return float(value)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        value = run()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()) - base, time.perf_counter() - start, value
    meter = StoragePeak([])
    start = time.thread_time()
    with meter:
        value = run()
    return meter.peak, time.thread_time() - start, value


def loss_side_by_side(device: torch.device, rounds: int) -> dict[str, Any]:
    """af.linear_cross_entropy, torch's F.linear_cross_entropy (chunked) and the full logits
    on the GPT's head: peak bytes, median seconds, distance from float64, per precision."""
    g = torch.Generator().manual_seed(1)
    tokens = 2 * BATCH * SEQ
    hidden = torch.randn(tokens, DIM, generator=g).to(device).requires_grad_()
    weight = (torch.randn(VOCAB, DIM, generator=g) / DIM ** 0.5).to(device).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), generator=g).to(device)
    exact = float(F.cross_entropy(hidden.detach().double() @ weight.detach().double().T, targets))
    sides: dict[str, Callable[[], torch.Tensor]] = {
        "accelfn": lambda: af.linear_cross_entropy(hidden, weight, targets),
        "full_logits": lambda: F.cross_entropy(F.linear(hidden, weight), targets)}
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is not None:
        sides["torch"] = lambda: F.linear_cross_entropy(
            hidden, weight, targets, options=options(allow_retain_graph=True))
    out: dict[str, Any] = {"tokens": tokens, "classes": VOCAB, "features": DIM,
                           "torch_op": options is not None}
    for precision, autocast in (("float32", False), ("bf16_autocast", True)):
        seen: dict[str, dict[str, list[float]]] = {n: {"peak": [], "s": [], "loss": []}
                                                  for n in sides}
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                peak, seconds, value = _loss_peak_and_time(sides[name], [hidden, weight],
                                                           autocast)
                seen[name]["peak"].append(peak)
                seen[name]["s"].append(seconds)
                seen[name]["loss"].append(value)
        out[precision] = {name: {"peak_bytes": int(max(v["peak"])),
                                 "median_s": round(statistics.median(v["s"]), 5),
                                 "loss_error": abs(v["loss"][0] - exact)}
                          for name, v in seen.items()}
    return out


def _classify(model: nn.Module, batch: TensorDict) -> torch.Tensor:
    return F.cross_entropy(model(batch["images"]), batch["labels"])


def anchors(device: torch.device, tiny: bool) -> dict[str, Any]:
    """``estimate_memory``'s peak against the measured peak of a real update (the second,
    after the optimizer's state exists) on GPT-2 small and ResNet-50 (``tiny``: a 2-layer GPT
    and ResNet-18 on 32 x 32 images), each with the stack it trains with."""
    import gpt2
    import torchvision

    dtype = torch.bfloat16
    config = gpt2.TINY if tiny else gpt2.GPTConfig()
    tokens = gpt2.token_batches(config, 2 if tiny else 8, 1, device)[0]
    side = 32 if tiny else 224
    count = 4 if tiny else 64
    g = torch.Generator().manual_seed(0)
    images = TensorDict({"images": torch.randn(count, 3, side, side, generator=g),
                         "labels": torch.randint(0, 1000, (count,), generator=g)},
                        batch_size=[count]).to(device)

    def gpt_state() -> af.TrainState:
        model = gpt2.make_model(config, device)
        return af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=3e-4,
                                                      fused=device.type == "cuda"))

    def resnet_state() -> af.TrainState:
        torch.manual_seed(0)
        build = torchvision.models.resnet18 if tiny else torchvision.models.resnet50
        model = af.channels_last(build(num_classes=1000).to(device))
        return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                    momentum=0.9))

    out: dict[str, Any] = {}
    for name, make, step, batch in (
            ("gpt2_small", gpt_state, af.with_amp(dtype=dtype)(gpt2.lm_loss), tokens),
            ("resnet50", resnet_state, af.with_amp(dtype=dtype)(_classify), images)):
        estimate = estimate_memory(step, make(), batch)
        measured = measured_peak(step, make(), batch)
        out[name] = {"peak_bytes": estimate.peak, "measured_peak_bytes": measured,
                     "ratio": round(estimate.peak / measured, 4),
                     "meets_target": abs(estimate.peak / measured - 1) <= TARGET,
                     "line": str(estimate), "batch": batch.batch_size[0],
                     "model": "ResNet-18" if tiny and name == "resnet50" else
                     ("GPT 2 layers" if tiny else name)}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None, help="write the JSON here too")
    parser.add_argument("--tiny", action="store_true",
                        help="a GPT of 59k parameters: every path in seconds")
    parser.add_argument("--anchors", action="store_true",
                        help="also the estimate on GPT-2 small and ResNet-50")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1 round is needed for a median")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if args.tiny:
        use_tiny()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batch = make_batch(device)
    began = time.time()
    params = sum(p.numel() for p in GPT().parameters())

    # 1. the estimate against the measured peak
    step = af.with_clipping(max_norm=1.0)(full_logits)
    estimate = estimate_memory(step, new_state(device), batch)
    full = measured_peak(step, new_state(device), batch)
    # 2. linear_cross_entropy against the full logits: with AdamW, and where the loss counts
    fused_adamw = measured_peak(af.with_clipping(max_norm=1.0)(fused_loss), new_state(device),
                                batch)
    wide = make_batch(device, 2 * BATCH)
    logits_sgd = measured_peak(step, new_state(device, sgd=True), wide)
    fused_sgd = measured_peak(af.with_clipping(max_norm=1.0)(fused_loss),
                              new_state(device, sgd=True), wide)
    # 3. the loss alone: accelfn's, torch's own op, the full logits
    side_by_side = loss_side_by_side(device, args.rounds)
    # 4. adaptive accumulation: the count it settles on, then its time against that count
    adaptive_state = new_state(device, fits=FITS)
    adaptive = af.with_accumulation(1, adaptive=True)(full_logits)
    counts = [int(adaptive(adaptive_state, batch)["micro_batches"]) for _ in range(2)]
    chosen = counts[-1]
    by_hand_state = new_state(device, fits=FITS)
    by_hand = af.with_accumulation(chosen)(full_logits)
    for _ in range(2):  # both settled and warm
        by_hand(by_hand_state, batch)
    adaptive(adaptive_state, batch)
    sides = {"adaptive": (adaptive, adaptive_state), "by_hand": (by_hand, by_hand_state)}
    per_round: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            side_step, side_state = sides[name]
            per_round[name].append(timed(side_step, side_state, batch))
    medians = {name: statistics.median(times) for name, times in per_round.items()}
    report = {
        "benchmark": "memory",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores"
                   + (f", {torch.cuda.get_device_name()}" if device.type == "cuda" else
                      ", CPU only"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__, "threads": args.threads, "device": device.type,
        "command": "python benchmarks/memory.py " + " ".join(sys.argv[1:] if argv is None
                                                             else argv),
        "model": {"parameters": params, "vocab": VOCAB, "dim": DIM, "depth": DEPTH,
                  "batch": BATCH, "seq": SEQ, "optimizer": "AdamW", "tiny": args.tiny},
        "measured_by": ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
                        "peak of live tensor storage, operator by operator"),
        "estimate": {"peak_bytes": estimate.peak, "measured_peak_bytes": full,
                     "ratio": round(estimate.peak / full, 4), "line": str(estimate),
                     "target": f"within {TARGET:.0%} of the measured peak",
                     "meets_target": abs(estimate.peak / full - 1) <= TARGET},
        "linear_cross_entropy": {
            "sgd_batch": 2 * BATCH, "peak_bytes": fused_sgd, "full_logits_peak_bytes": logits_sgd,
            "ratio": round(fused_sgd / logits_sgd, 4),
            "adamw": {"batch": BATCH, "peak_bytes": fused_adamw, "full_logits_peak_bytes": full,
                      "ratio": round(fused_adamw / full, 4)}},
        "loss_side_by_side": side_by_side,
        "adaptive_accumulation": {
            "device_holds_samples": FITS, "batch": BATCH, "counts": counts,
            "chosen": chosen, "rounds": args.rounds,
            "adaptive_s": round(medians["adaptive"], 4),
            "by_hand_s": round(medians["by_hand"], 4),
            "ratio": round(medians["adaptive"] / medians["by_hand"], 4),
            "target": "<= 1.02", "meets_target": medians["adaptive"] / medians["by_hand"] <= 1.02,
            "adaptive_s_each": [round(t, 4) for t in per_round["adaptive"]],
            "by_hand_s_each": [round(t, 4) for t in per_round["by_hand"]]},
    }
    if args.anchors:
        report["estimate_anchors"] = anchors(device, args.tiny)
    report["seconds"] = round(time.time() - began, 1)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
            file.write("\n")
    return report


if __name__ == "__main__":
    main()
