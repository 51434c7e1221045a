"""A GPT-style byte-level language model trained with accelfn on embedded text.

    python examples/gpt.py                                        # one CPU or GPU
    python examples/gpt.py --compile --steps 300                  # torch.compile the model
    torchrun --nproc_per_node=2 examples/gpt.py --fsdp            # FSDP2 across processes
    python examples/gpt.py --resume runs/gpt                      # continue the newest run

Time: 43 s on a 2-core CPU with little else running (load average 1), 4 min on the same
machine shared with other work (load average 5); validation about 2.6 bits per byte.

The text is the documentation of Python's standard library (every module's docstring, which
ships with every Python), cut into documents and packed into sequences with padding at
document ends. The loss is a mean over real tokens and the step function returns the token
count as ``"weight"``, so accumulation and data parallelism average over tokens exactly.
Throughput (``real_tokens_per_s``) counts those real tokens only, padding excluded.
Transforms: activation checkpointing of the transformer blocks, bf16 autocast, token-weighted
gradient accumulation, clipping, DDP or FSDP2, and optionally ``compiled``. Each run writes
into ``runs/gpt/<date>-<time>`` (``--out``, ``--resume``, ``--overwrite``,
``--allow-resharding`` as in classify_digits.py: an FSDP2 checkpoint of two processes resumes
in one with ``--fsdp --allow-resharding``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import json
import math
import os
import pkgutil
import sys
import time
import warnings

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn

import accelfn as af
from accelfn import checkpointing, data
from accelfn.checkpointing.preemption import PreemptionGuard
from accelfn.observe.flops import training_flops
from accelfn.observe.monitor import Monitor

# ------------------------------------------------------------------------------ data


def stdlib_text(limit_bytes: int = 1_500_000) -> list[bytes]:
    """Docstrings of the standard library's modules, classes and functions, as documents."""
    docs: list[bytes] = []
    total = 0
    stdlib = os.path.dirname(os.__file__)
    names = sorted(m.name for m in pkgutil.iter_modules()
                   if isinstance(m.module_finder, importlib.machinery.FileFinder)
                   and m.module_finder.path.startswith(stdlib) and not m.name.startswith("_"))
    for name in names:
        if name in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # some modules need a display or a platform
            continue
        objects = [module, *(getattr(module, a, None) for a in sorted(dir(module))
                             if not a.startswith("_"))]
        for obj in objects:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200 and getattr(
                    obj, "__module__", name) in (name, None):
                encoded = doc.strip().encode("utf-8", "replace")
                docs.append(encoded)
                total += len(encoded)
                if total >= limit_bytes:
                    return docs
    return docs


def pack(documents: list[bytes], seq_len: int) -> TensorDict:
    """Cut documents into sequences of ``seq_len + 1`` bytes, padding each document's end.

    ``mask`` marks the target positions that are real bytes (padding targets are left out of
    the loss), so sequences hold different numbers of tokens.
    """
    rows, masks = [], []
    for doc in documents:
        ids = torch.frombuffer(bytearray(doc), dtype=torch.uint8).long()
        for start in range(0, len(ids) - 1, seq_len):
            piece = ids[start:start + seq_len + 1]
            n = len(piece)
            row = torch.zeros(seq_len + 1, dtype=torch.long)
            row[:n] = piece
            mask = torch.zeros(seq_len, dtype=torch.bool)
            mask[:n - 1] = True
            rows.append(row)
            masks.append(mask)
    return TensorDict({"tokens": torch.stack(rows), "mask": torch.stack(masks)},
                      batch_size=[len(rows)])


# ------------------------------------------------------------------------------ model


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


HEADS = 4  # attention heads of every block; --dim must be a multiple of them


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, depth: int = 4, heads: int = HEADS,
                 seq_len: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                bias = getattr(module, "bias", None)  # Embedding has none, Linear may not
                if isinstance(bias, torch.Tensor):
                    nn.init.zeros_(bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.embed(ids) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.ln(h))
        return logits


def lm_step(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """Token-mean cross-entropy over real (unpadded) targets; the token count is the weight."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                reduction="none")
    weight = mask.flatten().float()
    count = weight.sum()
    return {"loss": (per_token * weight).sum() / count, "weight": count}


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, n: int, seq_len: int) -> str:
    ids = torch.tensor(list(prompt), dtype=torch.long,
                       device=next(model.parameters()).device)[None]
    for _ in range(n):
        logits = model(ids[:, -seq_len:])[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return bytes(ids[0].tolist()).decode("utf-8", "replace")


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=run_options.positive_int, default=150,
                        help="optimizer updates")
    parser.add_argument("--stop-at", type=run_options.positive_int, default=None,
                        help="save and stop after this many updates (continue with --resume)")
    parser.add_argument("--batch-size", type=run_options.positive_int, default=32)
    parser.add_argument("--accumulation", type=run_options.positive_int, default=4)
    parser.add_argument("--seq-len", type=run_options.positive_int, default=128)
    parser.add_argument("--dim", type=run_options.positive_int, default=128)
    parser.add_argument("--depth", type=run_options.positive_int, default=4)
    parser.add_argument("--lr", type=run_options.positive_float, default=2e-3)
    parser.add_argument("--text-bytes", type=run_options.positive_int, default=1_500_000)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--quiet", action="store_true")
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.dim % HEADS:
        parser.error(f"--dim {args.dim} must be a multiple of the {HEADS} attention heads")

    device = af.init_distributed()
    corpus = pack(stdlib_text(args.text_bytes), args.seq_len)
    is_val = torch.arange(len(corpus)) % 20 == 0
    run_options.check_batch(args.batch_size, int((~is_val).sum()), args.accumulation)
    out = run_options.run_folder(args, "gpt")  # after every refusal: it makes the folder
    torch.manual_seed(0)
    train = data.loader(corpus[~is_val], batch_size=args.batch_size, device=device, seed=0)
    val = corpus[is_val][: 8 * args.batch_size].to(device)

    model = GPT(dim=args.dim, depth=args.depth, seq_len=args.seq_len).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=True)
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, args.steps - warmup),
                                                   eta_min=args.lr / 10),
    ], milestones=[warmup])
    state = af.TrainState(model, optimizer, scheduler=scheduler)

    step = af.checkpointed(blocks=(Block,))(lm_step)  # 'auto' needs two blocks or more
    step = af.with_clipping(max_norm=1.0)(step)
    step = af.with_accumulation(args.accumulation)(step)
    step = af.with_amp(step)
    step = af.distributed(strategy="fsdp" if args.fsdp else "ddp")(step)
    if args.compile:
        step = af.compiled(step)

    if args.resume:
        step.prepare(state)  # FSDP2 shards the model before its state is loaded
    info = run_options.resume(args, state, loader=train, step=step)
    run_options.check_plan(info, args.steps)  # the schedule spans --steps updates
    extra = {"total_steps": args.steps}
    main_process = af.is_main_process()
    flops = training_flops(model, corpus[:args.batch_size]["tokens"][:, :-1].to(device))
    if main_process:
        params = sum(p.numel() for p in model.parameters())
        print(f"step: {af.describe(step)}")
        print(f"model: {params / 1e6:.2f}M parameters; corpus: {len(corpus)} sequences of "
              f"{args.seq_len} bytes; {af.world_size()} process(es) on {device}")

    stop = min(args.steps, args.stop_at or args.steps)
    monitor: Monitor | None = None
    elapsed = 0.0
    first = state.step
    # the targets that are real bytes (padding left out), summed on the device as batches
    # arrive and read once, after training: the monitor's own count would be positions
    real_tokens = torch.zeros((), dtype=torch.int64, device=device)
    if state.step >= stop:  # a resumed run with nothing left to train
        if main_process:
            print(run_options.nothing_to_train(
                out, state.step, stop, args.steps,
                "Its learning-rate schedule ends there: to train longer, start a new run "
                f"(without --resume) with more updates, e.g. --steps {2 * args.steps}"))
    else:
        monitor = Monitor(total=stop - state.step, progress=not args.quiet, desc="gpt",
                          samples_per_step=args.batch_size * af.world_size(),
                          flops_per_step=flops * af.world_size(), log_every=10,
                          sync_check_step=None)
        start = time.perf_counter()
        with monitor, PreemptionGuard() as guard:
            while state.step < stop:
                for batch in monitor.iterate(train):
                    real_tokens += batch["mask"].sum()  # on the device: no host sync
                    monitor.step(step(state, batch))
                    guard.exit_if_requested(out, state, loader=train, step=step, extra=extra)
                    if state.step >= stop:
                        break
        elapsed = time.perf_counter() - start
        state.sync()
        if af.world_size() > 1:
            torch.distributed.all_reduce(real_tokens)  # every process's batches

    result = step.evaluate(state, val)
    val_loss = float(result["loss"])
    report: dict[str, float | str] = {
        "updates": state.step,
        "val_loss": round(val_loss, 4),
        "val_bits_per_byte": round(val_loss / math.log(2), 4),
        "train_seconds": round(elapsed, 2),
        "processes": af.world_size(),
        "strategy": "fsdp" if args.fsdp else "ddp",
        "out": out,
    }
    if monitor is not None:  # something was trained: save it
        real = int(real_tokens)  # the one read of the count
        report["real_tokens"] = real
        report["real_tokens_per_s"] = round(real / elapsed, 1) if elapsed > 0 else 0.0
        checkpointing.save(out, state, loader=train, step=step, keep=2,  # DCP under FSDP2
                           extra=extra)
    if main_process:
        if not args.fsdp:
            sample = generate(model.eval(), b"The ", 60, args.seq_len)
            report["sample"] = sample
        if monitor is not None:
            print(monitor.report())
            positions = (state.step - first) * args.batch_size * args.seq_len * af.world_size()
            print(f"tokens/s        {report['real_tokens_per_s']:,.0f}, padding excluded: "
                  f"{report['real_tokens']:,} real target bytes of the {positions:,} positions "
                  f"trained on, in {elapsed:.1f} s")
        print(json.dumps(report, indent=2))
    train.close()  # stop background threads before the process group goes
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
