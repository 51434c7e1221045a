"""A GPT-style byte-level language model trained with accelfn on embedded text.

    python examples/gpt.py                                        # one CPU or GPU
    python examples/gpt.py --compile --steps 300                  # torch.compile the model
    accelfn launch --nproc_per_node=2 examples/gpt.py --fsdp      # FSDP2 across processes
    accelfn launch --nproc_per_node=4 examples/gpt.py --hsdp 2    # 2 replicas, each sharded
    accelfn launch --nproc_per_node=4 examples/gpt.py --fsdp --tp 2 # MLPs tensor parallel
    python examples/gpt.py --resume runs/gpt                      # continue the newest run
    python examples/gpt.py --packing pad                          # one document a row, padded

Time: 6 min on a 2-core CPU shared with other work, for the 150 updates (load average 5 to 7,
each update about 2.4 s); less on an idle machine. Validation 2.8 bits per byte (1.92 nats;
1.97 with ``--packing pad``, whose rows hold 6% fewer real tokens at this ``--seq-len``).

The text is the documentation of Python's standard library (every module's docstring, which
ships with every Python), cut into documents, each ended by an end-of-text id (256: the
vocabulary is the 256 bytes and it). By default the training documents are written once to a
token file (``<run>/data/train.bin``, llm.c's shard layout) and packed into rows of
``--seq-len`` positions by ``accelfn.data.token_loader`` (best-fit, no padding but at the end
of the data), with a document mask so that no position attends across a document boundary
and positions restarting at each document. ``--packing pad`` instead cuts each document
into rows of its own and pads its last row (the padding share is computation spent on
nothing). The loss is the mean over real targets, computed by ``af.linear_cross_entropy``
from the hidden states and the head's weight (the logits never whole in memory), and the step
function returns their count as ``"weight"``, so accumulation and data parallelism average
over tokens exactly. Throughput (``real_tokens_per_s``) counts real tokens only, and the
padding share is reported. The validation loss is taken on every held-out document, one a
row (the same targets whatever ``--batch-size`` and ``--packing``); ``--seed`` seeds the
weights and the data's order.

Packed against padded, at the same real tokens (``python benchmarks/lm_data.py``: five runs
of each, ``--seed 0`` to ``4``, with ``--seq-len 512 --dim 64 --depth 2 --accumulation 2``,
where padding leaves 26% of the positions empty): padded rows, ``--batch-size 8`` for 100
updates, reach a validation loss of 2.542 (standard deviation 0.068 across the runs); packed
rows, ``--batch-size 6`` for 98 updates (the same real tokens an update), 2.535 (0.048): no
worse, the difference (-0.007, standard error 0.033) inside the runs' spread. At the same
batch shape (``--batch-size 8``) packed rows carry 1.35 times the real tokens an update, so
the same real tokens take 73 updates, and a run this short is then 0.23 worse: short of
updates, not of data (at the same updates they train 1.35 times the tokens).

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

import numpy as np
import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import accelfn as af
from accelfn import checkpointing, data

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


EOT = 256  # the end-of-text id after each document's bytes
VOCAB = 257


def split(documents: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(training documents, validation documents): every 20th document is held out."""
    return ([d for i, d in enumerate(documents) if i % 20],
            [d for i, d in enumerate(documents) if i % 20 == 0])


def write_documents(documents: list[bytes], path: str) -> int:
    """Write the documents' bytes, each followed by ``EOT``, as a token file; its pairs."""
    ids = np.concatenate([np.append(np.frombuffer(d, dtype=np.uint8), EOT) for d in documents])
    data.write_tokens(path, ids, dtype="uint16")
    return int(sum(len(d) for d in documents))  # the pairs (input, target) within documents


def pad_rows(documents: list[bytes], seq_len: int) -> TensorDict:
    """Each document (its bytes, then ``EOT``) cut into rows of ``seq_len`` positions, its
    last row padded: the batch layout of ``token_loader`` (targets -100 and document id -1
    at padding), with one document per row."""
    rows = []
    for doc in documents:
        ids = torch.tensor([*doc, EOT], dtype=torch.long)
        for start in range(0, len(ids) - 1, seq_len):
            piece = ids[start:start + seq_len + 1]
            n = len(piece) - 1
            row = {"inputs": torch.zeros(seq_len, dtype=torch.long),
                   "targets": torch.full((seq_len,), -100, dtype=torch.long),
                   "document_ids": torch.full((seq_len,), -1, dtype=torch.long),
                   "positions": torch.zeros(seq_len, dtype=torch.long)}
            row["inputs"][:n], row["targets"][:n] = piece[:-1], piece[1:]
            row["document_ids"][:n], row["positions"][:n] = 0, torch.arange(n)
            rows.append(row)
    return TensorDict({k: torch.stack([r[k] for r in rows]) for k in rows[0]},
                      batch_size=[len(rows)])


def validation_rows(documents: list[bytes], seq_len: int) -> TensorDict:
    """The validation rows: every held-out document in rows of its own (``pad_rows``), so
    that runs of any batch size and packing are measured on the same targets, each with
    the context a document alone gives it."""
    return pad_rows(documents, seq_len)


EVAL_POSITIONS = 32768  # positions evaluated at once: memory bounded whatever the corpus


def validation_loss(step: af.Step, state: af.TrainState, rows: TensorDict) -> torch.Tensor:
    """The mean cross-entropy over every real target of ``rows``, evaluated in chunks of
    ``EVAL_POSITIONS`` positions, each chunk's mean weighted by its real targets (on the
    device: no host sync)."""
    chunk = max(1, EVAL_POSITIONS // rows["inputs"].shape[1])
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    count = torch.zeros((), dtype=torch.float32, device=rows.device)
    for i in range(0, len(rows), chunk):
        part = rows[i:i + chunk]
        n = (part["targets"] != -100).sum()
        total += step.evaluate(state, part)["loss"].float() * n
        count += n
    return total / count.clamp(min=1)


# ------------------------------------------------------------------------------ model


Mask = torch.Tensor | BlockMask | None  # boolean (B, 1, T, T), flex's, or plain causal


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.transpose(1, 2) for z in
                   self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2))
        if isinstance(mask, BlockMask):
            y = flex_attention(q, k, v, block_mask=mask)
            assert isinstance(y, torch.Tensor)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


HEADS = 4  # attention heads of every block; --dim must be a multiple of them


class GPT(nn.Module):
    """``attention``: ``"causal"`` (rows of one document), ``"documents"`` (packed rows, a
    boolean document mask) or ``"flex"`` (packed rows, flex attention's block mask)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 128, depth: int = 4, heads: int = HEADS,
                 seq_len: int = 128, attention: str = "documents") -> None:
        super().__init__()
        self.attention = attention
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

    def forward(self, ids: torch.Tensor, document_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The logits, or with ``targets`` ``(loss, count)``: the mean cross-entropy over the
        targets that are not -100 (padding) and their number, from the hidden states and the
        head's weight by ``af.linear_cross_entropy`` (the logits never whole in memory). The
        loss is computed here, in ``forward``, so that DDP and FSDP see the head's use."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        mask: Mask = None  # one document per row (or no document_ids): causal
        if document_ids is not None and self.attention == "documents":
            mask = data.document_causal_mask(document_ids)
        elif document_ids is not None and self.attention == "flex":
            mask = data.document_block_mask(document_ids)
        h = self.embed(ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h, mask)
        h = self.ln(h)
        if targets is not None:  # a micro-batch of padding only has loss 0 and weight 0
            total, count = af.linear_cross_entropy(h, self.head.weight, targets,
                                                   reduction="sum", return_count=True)
            return total / count.clamp(min=1), count
        logits: torch.Tensor = self.head(h)
        return logits


def lm_step(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """Token-mean cross-entropy over real targets (-100 marks padding); their count is the
    weight, so micro-batches and processes are averaged over tokens."""
    loss, count = model(batch["inputs"], batch["document_ids"], batch["positions"],
                        targets=batch["targets"])
    return {"loss": loss, "weight": count}


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, n: int, seq_len: int) -> str:
    ids = torch.tensor(list(prompt), dtype=torch.long,
                       device=next(model.parameters()).device)[None]
    for _ in range(n):
        logits = model(ids[:, -seq_len:])[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return bytes(ids[0].tolist()).decode("utf-8", "replace")


# ------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    """The command line: one option a line (parallelism options go beside --fsdp)."""
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
    parser.add_argument("--seed", type=run_options.non_negative_int, default=0,
                        help="seed of the initial weights and of the data's order")
    parser.add_argument("--packing", choices=("best-fit", "greedy", "pad"), default="best-fit",
                        help="documents packed into full rows with a document mask (best-fit or "
                             "greedy, no padding but at the end of the data), or each "
                             "document's last row padded (pad)")
    parser.add_argument("--flex", action="store_true",
                        help="document masks with flex_attention (CUDA: torch 2.14 has no flex "
                             "backward on the CPU; fused under --compile)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--hsdp", type=run_options.positive_int, default=None, metavar="R",
                        help="HSDP: FSDP2 over R replicas (shard inside a node, replicate "
                             "across nodes)")
    parser.add_argument("--tp", type=run_options.positive_int, default=None, metavar="K",
                        help="tensor parallelism of the blocks' MLPs over K consecutive "
                             "processes (with --fsdp or --hsdp; each group reads one batch)")
    parser.add_argument("--eval-every", type=run_options.positive_int, default=50,
                        help="log the validation loss every this many updates")
    parser.add_argument("--quiet", action="store_true")
    run_options.add_arguments(parser)
    return parser


def strategy(args: argparse.Namespace) -> str:
    """The ``distributed`` strategy the options ask for."""
    return "hsdp" if args.hsdp else "fsdp" if args.fsdp else "ddp"


def parallelism(args: argparse.Namespace) -> af.Transform:
    """``af.distributed`` as the options ask: the strategy, HSDP's replicas, the
    tensor-parallel plan (the MLPs' first Linear column-wise, the second row-wise: one
    all-reduce per MLP; the rest is FSDP2's only)."""
    plan = None
    if args.tp:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}
    return af.distributed(strategy=strategy(args), replicate=args.hsdp, tp=args.tp or 1,
                          tensor_parallel=plan)


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dim % HEADS:
        parser.error(f"--dim {args.dim} must be a multiple of the {HEADS} attention heads")
    if args.hsdp and args.fsdp:
        parser.error("--hsdp is FSDP2 over replicas: pass --hsdp R or --fsdp, not both")
    if args.tp and not (args.fsdp or args.hsdp):
        parser.error("--tp shards the MLPs inside FSDP2's mesh: pass --fsdp or --hsdp too")
    if args.tp and (4 * args.dim) % args.tp:
        parser.error(f"--tp {args.tp} must divide the MLP width 4 x --dim ({4 * args.dim})")
    if args.flex and (args.packing == "pad" or not torch.cuda.is_available()):
        parser.error("--flex needs CUDA (torch 2.14 has no flex-attention backward on the CPU) "
                     "and packed rows (not --packing pad)")

    device = af.init_distributed()
    # a tensor-parallel group (--tp consecutive processes) reads one batch: the data is
    # sharded by data-parallel rank
    tp = args.tp or 1
    rank = torch.distributed.get_rank() if af.world_size() > 1 else 0
    dp_rank, dp_size = (rank // tp, af.world_size() // tp) if tp > 1 else (None, None)
    documents, val_documents = split(stdlib_text(args.text_bytes))
    padded = pad_rows(documents, args.seq_len) if args.packing == "pad" else None
    # rows of the packed data: no padding but in the last one
    rows = len(padded) if padded is not None else -(-sum(map(len, documents)) // args.seq_len)
    run_options.check_batch(args.batch_size, rows, args.accumulation)
    run = run_options.open_run(args, "gpt")  # after every refusal: it makes the folder
    out = str(run.path)
    torch.manual_seed(args.seed)
    if padded is not None:
        train = data.loader(padded, batch_size=args.batch_size, device=device, seed=args.seed,
                            rank=dp_rank, world_size=dp_size)
    else:
        path = os.path.join(out, "data", "train.bin")
        if af.is_main_process():  # written once, read by every process
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # shuffled once here: the packer walks the documents in the file's order
            g = torch.Generator().manual_seed(args.seed)
            order = torch.randperm(len(documents), generator=g)
            write_documents([documents[i] for i in order.tolist()], path)
        if af.world_size() > 1:
            torch.distributed.barrier()
        # the corpus is small: its rows are packed ahead and shuffled as one block (a large
        # corpus keeps the default blocks of 1024 rows, shuffled within each)
        train = data.token_loader(path, batch_size=args.batch_size, seq_len=args.seq_len,
                                  packing=args.packing, eot=EOT, device=device,
                                  shuffle_rows=rows, seed=args.seed, rank=dp_rank,
                                  world_size=dp_size)
    # every held-out document, one a row: the same tokens whatever --batch-size and --packing
    val = validation_rows(val_documents, args.seq_len).to(device)

    attention = "causal" if args.packing == "pad" else "flex" if args.flex else "documents"
    model = GPT(dim=args.dim, depth=args.depth, seq_len=args.seq_len,
                attention=attention).to(device)
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
    step = parallelism(args)(step)
    if args.compile:
        step = af.compiled(step)

    if args.resume:
        step.prepare(state)  # FSDP2 shards the model before its state is loaded
    # the schedule spans --steps updates: another plan is refused before anything loads
    run_options.resume(args, state, loader=train, step=step, total=args.steps)
    extra = {"total_steps": args.steps}
    main_process = af.is_main_process()
    shape = (args.batch_size, args.seq_len)  # FLOPs depend on the shapes only
    flops = af.training_flops(model, torch.zeros(shape, dtype=torch.long, device=device),
                           torch.zeros(shape, dtype=torch.long, device=device),
                           torch.arange(args.seq_len, device=device).expand(shape))
    if main_process:
        params = sum(p.numel() for p in model.parameters())
        print(f"step: {af.describe(step)}")
        print(f"model: {params / 1e6:.2f}M parameters; corpus: {len(documents)} training "
              f"documents in {rows} rows of {args.seq_len} bytes ({args.packing}); "
              f"{af.world_size()} process(es) on {device}")

    stop = min(args.steps, args.stop_at or args.steps)
    monitor: af.Monitor | None = None
    result = None
    elapsed = 0.0
    first = state.step
    # the targets that are real bytes (padding left out), summed on the device as batches
    # arrive and read once, after training (the monitor counts the same from each update's
    # "weight" metric, the real targets the loss returns)
    real_tokens = torch.zeros((), dtype=torch.int64, device=device)
    if state.step >= stop:  # a resumed run with nothing left to train
        if main_process:
            print(run_options.nothing_to_train(
                out, state.step, stop, args.steps,
                "Its learning-rate schedule ends there: to train longer, start a new run "
                f"(without --resume) with more updates, e.g. --steps {2 * args.steps}"))
    else:
        monitor = af.Monitor(total=stop, initial=state.step,  # a resumed run's bar goes on
                             progress=not args.quiet, desc="gpt",
                             throughput=af.Throughput(
                                 samples_per_step=args.batch_size / tp,  # this process'
                                 flops_per_step=flops / tp),
                             log_every=10, sync_check=None, state=state,
                             sinks=[af.JsonlSink(run.metrics_file)])
        start = time.perf_counter()
        with monitor, af.PreemptionGuard() as guard:
            while state.step < stop:
                for batch in monitor.iterate(train):
                    real_tokens += (batch["targets"] != -100).sum()  # no host sync
                    monitor.step(step(state, batch))
                    guard.exit_if_requested(out, state, loader=train, step=step, extra=extra)
                    if state.step >= stop:
                        break
                    if state.step % args.eval_every == 0:  # read when the sink writes
                        monitor.log({"val_loss": validation_loss(step, state, val)})
            elapsed = time.perf_counter() - start
            result = validation_loss(step, state, val)  # the trained weights', logged too
            monitor.log({"val_loss": result})  # beside the last update's row
        state.sync()
        if af.world_size() > 1:
            torch.distributed.all_reduce(real_tokens)  # every process's batches
            real_tokens //= tp  # a tensor-parallel group's processes read the same batch

    if result is None:
        result = validation_loss(step, state, val)
    val_loss = float(result)
    report: dict[str, float | str] = {
        "updates": state.step,
        "val_loss": round(val_loss, 4),
        "val_bits_per_byte": round(val_loss / math.log(2), 4),
        "val_tokens": int((val["targets"] != -100).sum()),
        "train_seconds": round(elapsed, 2),
        "processes": af.world_size(),
        "strategy": strategy(args),
        "packing": args.packing,
        "out": out,
    }
    positions = (state.step - first) * args.batch_size * args.seq_len * af.world_size() // tp
    if monitor is not None:  # something was trained: save it
        real = int(real_tokens)  # the one read of the count
        report["real_tokens"] = real
        report["real_tokens_per_s"] = round(real / elapsed, 1) if elapsed > 0 else 0.0
        report["padding_share"] = round(1 - real / positions, 4)
        checkpointing.save(out, state, loader=train, step=step, keep=2,  # DCP under FSDP2
                           extra=extra)
    if main_process:
        if strategy(args) == "ddp":  # a sharded model is not one process' to sample from
            sample = generate(model.eval(), b"The ", 60, args.seq_len)
            report["sample"] = sample
        if monitor is not None:
            print(monitor.report())
            print(f"tokens/s        {report['real_tokens_per_s']:,.0f}, padding excluded: "
                  f"{report['real_tokens']:,} real target bytes of the {positions:,} positions "
                  f"trained on, in {elapsed:.1f} s (padding share "
                  f"{float(report['padding_share']):.1%})")
        print(json.dumps(report, indent=2))
    train.close()  # stop background threads before the process group goes
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
