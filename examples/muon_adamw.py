"""A small GPT trained with two optimizers: Muon for its hidden matrices, AdamW for the rest.

    python examples/muon_adamw.py                                 # one CPU or GPU
    accelfn launch --nproc_per_node=2 examples/muon_adamw.py      # DDP
    python examples/muon_adamw.py --steps 300 --resume runs/muon  # continue the newest run

Time: 9 s on a 2-core CPU with little else running, 150 updates.

The split nanochat's base training makes: ``torch.optim.Muon`` (momentum orthogonalised by
Newton-Schulz iterations; it takes 2-D parameters only) for the weight matrices of the
transformer blocks, ``AdamW`` for the token and position embeddings, the norms and the output
head. One TrainState holds both, each with its own schedule:

    state = af.TrainState(model, [muon, adamw], scheduler=[muon_schedule, adamw_schedule])

Every update steps both optimizers and both schedules; gradient accumulation and clipping
(``af.with_accumulation``, ``af.with_clipping``: one norm over all the parameters) are the
usual transforms, and one non-finite decision skips both optimizers or neither. The metrics
carry ``lr`` (Muon's, the first optimizer's), ``lr/muon`` and ``lr/adamw``. AdamW warms up
and decays along a cosine (``af.warmup_cosine``); Muon's rate is constant, then decays
linearly to zero over the last fifth of the run, and its momentum climbs from 0.85 to 0.95
over the first 50 updates, written into its groups by the loop (nanochat's schedules).

The text is the source of Python's own ``argparse`` module, as bytes. Each run writes into
``runs/muon/<date>-<time>`` (``--out``, ``--resume``, ``--overwrite``,
``--allow-resharding`` as in classify_digits.py). ``tests/test_example_muon_adamw.py`` shows
the step bitwise equal to the plain loop over the same two optimizers. The training rows go
to the run's ``metrics.jsonl`` through an ``af.Monitor`` (no progress bar: the loop prints
its own lines), with the held-out loss every ``--eval-every`` updates, summed on the device
and logged with ``Monitor.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn

import accelfn as af
from accelfn import data


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.relu(self.fc(self.norm2(x))).square())
        return out


class GPT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 2, heads: int = 4, seq_len: int = 64) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def lm_loss(model: nn.Module, batch: TensorDictBase) -> torch.Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def optimizers(model: GPT, *, muon_lr: float = 0.02,
               adamw_lr: float = 3e-3) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    """Muon for the blocks' 2-D weights; AdamW for embeddings, norms and head."""
    hidden = [p for p in model.blocks.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=muon_lr, momentum=0.95, weight_decay=0.0)
    adamw = torch.optim.AdamW(rest, lr=adamw_lr, betas=(0.8, 0.95), weight_decay=0.0)
    return muon, adamw


def warmdown(total: int, fraction: float = 0.2) -> int:
    """Updates before Muon's rate starts its linear decay to zero."""
    return total - max(1, round(fraction * total))


def muon_momentum(update: int) -> float:
    """0.85 rising linearly to 0.95 over the first 50 updates."""
    frac = min(update / 50, 1.0)
    return (1 - frac) * 0.85 + frac * 0.95


def schedules(muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer,
              total: int) -> list[torch.optim.lr_scheduler.LRScheduler]:
    start = warmdown(total)
    muon_schedule = torch.optim.lr_scheduler.LambdaLR(
        muon, lambda t: 1.0 if t < start else max(0.0, (total - t) / (total - start)))
    adamw_schedule = af.warmup_cosine(adamw, warmup_steps=max(1, total // 10), total_steps=total)
    return [muon_schedule, adamw_schedule]


def text_sequences(seq_len: int) -> TensorDict:
    """The bytes of argparse.py, cut into sequences of ``seq_len + 1`` bytes."""
    raw = Path(argparse.__file__).read_bytes()
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    rows = ids[:len(ids) // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    return TensorDict({"tokens": rows}, batch_size=[len(rows)])


def evaluate(step: af.Step, state: af.TrainState, loader: data.BatchLoader,
             device: torch.device) -> dict[str, torch.Tensor]:
    """The held-out loss over every process's share (and in bits per byte), as device
    tensors: summed on the device, read only when written out."""
    losses = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        losses += torch.stack([step.evaluate(state, batch)["loss"].double() * len(batch),
                               torch.tensor(float(len(batch)), device=device)])
    if af.world_size() > 1:
        torch.distributed.all_reduce(losses)
    loss = losses[0] / losses[1]
    return {"val_loss": loss, "val_bits_per_byte": loss / math.log(2)}


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=run_options.positive_int, default=150,
                        help="updates (the schedules span them)")
    parser.add_argument("--stop-at", type=run_options.positive_int, default=None,
                        help="save and stop after this many updates (resume with --resume)")
    parser.add_argument("--batch-size", type=run_options.positive_int, default=32)
    parser.add_argument("--accumulation", type=run_options.positive_int, default=2)
    parser.add_argument("--seq-len", type=run_options.positive_int, default=64)
    parser.add_argument("--log-every", type=run_options.positive_int, default=25)
    parser.add_argument("--eval-every", type=run_options.positive_int, default=50,
                        help="log the held-out loss every this many updates")
    parser.add_argument("--seed", type=int, default=0)
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)

    device = af.init_distributed()
    main_process = af.is_main_process()
    sequences = text_sequences(args.seq_len)
    held_out = torch.arange(len(sequences)) % 10 == 0
    run_options.check_batch(args.batch_size, int((~held_out).sum()), args.accumulation)
    run = run_options.open_run(args, "muon")
    out = str(run.path)
    train = data.loader(sequences[~held_out], batch_size=args.batch_size, device=device,
                        seed=args.seed)
    val = data.loader(sequences[held_out], batch_size=64, shuffle=False, drop_last=False,
                      device=device)

    torch.manual_seed(args.seed)
    model = GPT(seq_len=args.seq_len).to(device)
    muon, adamw = optimizers(model)
    state = af.TrainState(model, [muon, adamw], scheduler=schedules(muon, adamw, args.steps))
    step = af.distributed(af.with_accumulation(args.accumulation)(
        af.with_clipping(max_norm=1.0)(lm_loss)))

    # the schedules span --steps updates: a run planned for another number is refused
    # before anything is loaded; checkpoints of this run record it
    run_options.resume(args, state, loader=train, step=step, total=args.steps)
    if main_process:
        print(f"step: {af.describe(step)}")
        print(f"Muon: {sum(p.numel() for g in muon.param_groups for p in g['params'])} "
              f"parameters in matrices; AdamW: "
              f"{sum(p.numel() for g in adamw.param_groups for p in g['params'])} others")
    stop = min(args.steps, args.stop_at or args.steps)
    if main_process and state.step >= stop:
        print(run_options.nothing_to_train(
            out, state.step, stop, args.steps,
            "Its schedules end there: to train longer, start a new run (without "
            f"--resume) with more updates, e.g. --steps {2 * args.steps}"))
    trained = state.step < stop
    report: dict[str, float | str] = {}
    final: dict[str, torch.Tensor] | None = None
    elapsed = 0.0
    if trained:  # the rows and the held-out loss go to the run's metrics.jsonl
        monitor = af.Monitor(progress=False, log_every=args.log_every, sync_check=None,
                             throughput=af.Throughput(
                                 samples_per_step=args.batch_size),
                             state=state, sinks=[af.JsonlSink(run.metrics_file)])
        start = time.perf_counter()
        with monitor:
            while state.step < stop:
                for batch in monitor.iterate(train):
                    for group in muon.param_groups:  # nanochat's momentum warm-up, by update
                        group["momentum"] = muon_momentum(state.step)
                    metrics = step(state, batch)
                    monitor.step(metrics)
                    if state.step % args.log_every == 0 or state.step == stop:
                        m = af.reduce_metrics(metrics)  # one host read every few updates
                        report = {k: round(float(m[k]), 6)
                                  for k in ("loss", "grad_norm", "lr/muon", "lr/adamw")}
                        if main_process:
                            print(f"update {state.step}: " + ", ".join(
                                f"{k} {v:.4g}" for k, v in report.items()))
                    if state.step >= stop:
                        break
                    if state.step % args.eval_every == 0:
                        monitor.log(evaluate(step, state, val, device))
            elapsed = time.perf_counter() - start
            final = evaluate(step, state, val, device)  # the trained weights', logged too
            monitor.log(final)

    val_bits = (final or evaluate(step, state, val, device))["val_bits_per_byte"]
    report.update({"updates": state.step,
                   "val_bits_per_byte": round(float(val_bits), 4),
                   "train_seconds": round(elapsed, 2), "processes": af.world_size(),
                   "out": out})
    if trained:
        run.save(state, loader=train, step=step)
    if main_process:
        print(json.dumps(report, indent=2))
    train.close()  # stop background threads before the process group goes
    val.close()
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
