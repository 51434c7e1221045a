"""A Hugging Face ``transformers`` Llama trained with accelfn: the model class as it is, no wrapper.

    python examples/finetune_hf.py                                    # one CPU or GPU
    accelfn launch --nproc_per_node=2 examples/finetune_hf.py         # DDP
    accelfn launch --nproc_per_node=2 examples/finetune_hf.py --fsdp  # FSDP2
    accelfn launch --nproc_per_node=4 examples/finetune_hf.py --fsdp --tp 2 # FSDP2 x TP
    python examples/finetune_hf.py --loss labels                      # model(ids, labels=ids)
    python examples/finetune_hf.py --from runs/hf/<run>/export --text textwrap  # fine-tune it
    python examples/finetune_hf.py --resume runs/hf                   # continue the newest run

Time: 15 s on a 2-core CPU with little else running (37 s at load average 6), 60 updates;
importing transformers takes 4 of them.

Needs ``transformers`` (``pip install 'accelfn[hf]'``). Nothing is downloaded: the model is a
``LlamaForCausalLM`` built from a small ``LlamaConfig`` (bytes as tokens: a vocabulary of
256), or, with ``--from FOLDER``, loaded by ``AutoModelForCausalLM.from_pretrained(FOLDER)``
from a ``save_pretrained`` folder such as an earlier run's export: the flow of a fine-tune
from a Hub checkpoint, whose name would go where the folder does. The text is the source of a
module of Python's standard library (``--text``, ``argparse`` by default), cut into rows of
``--seq-len`` bytes; every tenth row is held out.

The step function receives the ``LlamaForCausalLM`` itself, under every transform and
strategy, and computes the loss in one of two ways:

* ``--loss hidden`` (the default, torchtune's habit): the decoder's hidden states
  ``model.model(ids).last_hidden_state`` and the head's weight ``model.lm_head.weight`` in
  ``af.linear_cross_entropy`` (the logits never whole in memory); the targets' count is
  returned as ``"weight"``.
* ``--loss labels`` (Hugging Face's habit): ``model(ids, labels=ids).loss``, the model
  shifting the labels itself.

Both give the same loss (``tests/transforms/test_hf_llama.py`` shows each equal to the plain
loop). Transforms: ``checkpointed(blocks="auto")`` (it finds the decoder layers,
``model.layers.*``), clipping, accumulation, ``--bf16`` autocast, and ``distributed``:
DDP, ``--fsdp`` (FSDP2), or ``--fsdp --tp K`` with the plan shipped for Llama-style layers
(``accelfn.transforms.distributed.plans.llama()``: attention and MLP projections split over K
consecutive processes, which read the same batch). At the end the trained weights are
exported with ``checkpointing.export(..., format="transformers")`` into ``<run>/export``
(whole, gathered from the shards), reloaded by ``AutoModelForCausalLM.from_pretrained``, and
the reloaded model's held-out loss is reported beside the trained one's (equal in fp32;
under ``--bf16`` within autocast's rounding, 4e-4 measured), with a greedy sample from it
(``generate``). Each run writes into ``runs/hf/<date>-<time>`` (``--out``,
``--resume``, ``--overwrite``, ``--allow-resharding`` as in classify_digits.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

import accelfn as af
from accelfn import checkpointing, data
from accelfn.transforms.distributed import plans

HEADS, KV_HEADS = 4, 2  # attention heads, and the key-value heads they share (GQA)


def text_rows(module: str, seq_len: int) -> TensorDict:
    """The source of the standard library's ``module``, as bytes, cut into rows of
    ``seq_len`` token ids (the last, shorter piece left out)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a missing parent package, an empty name
        spec = None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        run_options.refuse(f"--text {module}: not a module of Python source; name one of the "
                           "standard library's, e.g. argparse, textwrap, json.decoder")
    raw = Path(spec.origin).read_bytes()
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    rows = ids[:len(ids) // seq_len * seq_len].view(-1, seq_len)
    return TensorDict({"ids": rows}, batch_size=[len(rows)])


def tiny_llama(dim: int, depth: int, seq_len: int) -> nn.Module:
    """A ``LlamaForCausalLM`` from a small config: bytes as tokens, ``depth`` decoder layers
    of width ``dim``, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=dim, intermediate_size=4 * dim,
                         num_hidden_layers=depth, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=seq_len,
                         tie_word_embeddings=False)
    model: nn.Module = LlamaForCausalLM(config)
    return model


def hidden_loss(model: Any, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """The loss outside ``forward``: next-byte cross-entropy from the decoder's hidden states
    and the head's weight, without the logits in memory; the targets' count as weight."""
    ids = batch["ids"]
    h = model.model(ids).last_hidden_state
    loss, count = af.linear_cross_entropy(h[:, :-1], model.lm_head.weight, ids[:, 1:],
                                          return_count=True)
    return {"loss": loss, "weight": count}


def labels_loss(model: Any, batch: TensorDictBase) -> torch.Tensor:
    """Hugging Face's loss: the model shifts the labels and averages over the targets."""
    loss: torch.Tensor = model(batch["ids"], labels=batch["ids"]).loss
    return loss


LossFn = Callable[[Any, TensorDictBase], dict[str, torch.Tensor] | torch.Tensor]
LOSSES: dict[str, LossFn] = {"hidden": hidden_loss, "labels": labels_loss}


def loss_value(out: dict[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The loss of a step function's result (a mapping with ``"loss"``, or the loss)."""
    return out["loss"] if isinstance(out, dict) else out


def held_out_loss(loss_of: Any, rows: TensorDict, batch_size: int = 64) -> torch.Tensor:
    """The mean loss over every held-out row (rows of equal length: a mean of the batches'
    means weighted by rows), summed on the device. ``loss_of(batch)`` is a batch's loss."""
    total = torch.zeros((), dtype=torch.float64, device=rows.device)
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        total += loss_of(part).double() * len(part)
    return total / len(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=run_options.positive_int, default=60,
                        help="optimizer updates (the schedule spans them)")
    parser.add_argument("--stop-at", type=run_options.positive_int, default=None,
                        help="save and stop after this many updates (continue with --resume)")
    parser.add_argument("--batch-size", type=run_options.positive_int, default=16)
    parser.add_argument("--accumulation", type=run_options.positive_int, default=2)
    parser.add_argument("--seq-len", type=run_options.positive_int, default=64)
    parser.add_argument("--dim", type=run_options.positive_int, default=64)
    parser.add_argument("--depth", type=run_options.positive_int, default=2)
    parser.add_argument("--lr", type=run_options.positive_float, default=3e-3)
    parser.add_argument("--loss", choices=sorted(LOSSES), default="hidden",
                        help="hidden: model.model(...) + af.linear_cross_entropy; labels: "
                             "model(ids, labels=ids).loss")
    parser.add_argument("--text", default="argparse",
                        help="the standard-library module whose source is the text")
    parser.add_argument("--from", dest="pretrained", default=None, metavar="FOLDER",
                        help="start from this save_pretrained folder (e.g. a run's export) "
                             "instead of fresh weights")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (af.with_amp)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    parser.add_argument("--tp", type=run_options.positive_int, default=None, metavar="K",
                        help="tensor parallelism of the decoder layers over K consecutive "
                             "processes (with --fsdp; each group reads one batch)")
    parser.add_argument("--eval-every", type=run_options.positive_int, default=20,
                        help="log the held-out loss every this many updates")
    parser.add_argument("--seed", type=run_options.non_negative_int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    run_options.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        run_options.refuse("this example needs transformers: pip install 'accelfn[hf]'")
    if args.dim % HEADS:
        parser.error(f"--dim {args.dim} must be a multiple of the {HEADS} attention heads")
    if args.tp and not args.fsdp:
        parser.error("--tp shards the decoder layers inside FSDP2's mesh: pass --fsdp too")
    if args.pretrained and not (Path(args.pretrained) / "config.json").is_file():
        parser.error(f"--from {args.pretrained}: no config.json there; give a folder written "
                     "by save_pretrained, e.g. an earlier run's <run>/export")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # writing, loading

    device = af.init_distributed()
    main_process = af.is_main_process()
    tp = args.tp or 1
    if af.world_size() % tp:
        run_options.refuse(f"--tp {tp} must divide the {af.world_size()} processes")
    rank = torch.distributed.get_rank() if af.world_size() > 1 else 0
    # a tensor-parallel group (--tp consecutive processes) reads one batch
    dp_rank, dp_size = (rank // tp, af.world_size() // tp) if tp > 1 else (None, None)
    rows = text_rows(args.text, args.seq_len)
    held = torch.arange(len(rows)) % 10 == 0
    run_options.check_batch(args.batch_size, int((~held).sum()) * tp, args.accumulation)
    run = run_options.open_run(args, "hf")  # after every refusal: it makes the folder
    out = str(run.path)
    train = data.loader(rows[~held], batch_size=args.batch_size, device=device,
                        seed=args.seed, rank=dp_rank, world_size=dp_size)
    val = rows[held].to(device)  # every process evaluates every held-out row

    torch.manual_seed(args.seed)
    if args.pretrained:
        loaded: Any = AutoModelForCausalLM.from_pretrained(args.pretrained)
        model = loaded.to(device).train()  # from_pretrained returns it in eval mode
    else:
        model = tiny_llama(args.dim, args.depth, args.seq_len).to(device)
    plan = None
    if args.tp:
        try:  # the heads against tp, before anything is sharded
            plan = plans.llama(model.config, tp=args.tp)
        except ValueError as error:
            run_options.refuse(str(error))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    scheduler = af.warmup_cosine(optimizer, warmup_steps=max(1, args.steps // 10),
                                 total_steps=args.steps)
    state = af.TrainState(model, optimizer, scheduler=scheduler)

    step = af.checkpointed(blocks="auto")(LOSSES[args.loss])  # the decoder layers
    step = af.with_clipping(max_norm=1.0)(step)
    step = af.with_accumulation(args.accumulation)(step)
    if args.bf16:
        step = af.with_amp(step)
    step = af.distributed(strategy="fsdp" if args.fsdp else "ddp", tp=tp,
                          tensor_parallel=plan)(step)

    if args.resume:
        step.prepare(state)  # FSDP2 shards the model before its state is loaded
    run_options.resume(args, state, loader=train, step=step, total=args.steps)
    if main_process:
        params = sum(p.numel() for p in model.parameters())
        print(f"step: {af.describe(step)}")
        print(f"model: {type(model).__name__}, {params / 1e6:.2f}M parameters"
              f"{f' from {args.pretrained}' if args.pretrained else ''}; text: {args.text} "
              f"({len(rows)} rows of {args.seq_len} bytes, {int(held.sum())} held out); "
              f"{af.world_size()} process(es) on {device}")

    def trained_loss(part: TensorDictBase) -> torch.Tensor:
        loss: torch.Tensor = step.evaluate(state, part)["loss"]
        return loss

    stop = min(args.steps, args.stop_at or args.steps)
    monitor: af.Monitor | None = None
    elapsed = 0.0
    final: torch.Tensor | None = None
    if state.step >= stop:  # a resumed run with nothing left to train
        if main_process:
            print(run_options.nothing_to_train(
                out, state.step, stop, args.steps,
                "Its learning-rate schedule ends there: to train longer, start a new run "
                f"(without --resume) with more updates, e.g. --steps {2 * args.steps}"))
    else:
        monitor = af.Monitor(total=stop, initial=state.step,  # a resumed run's bar goes on
                             progress=not args.quiet, desc="hf", log_every=10,
                             throughput=af.Throughput(
                                 samples_per_step=args.batch_size / tp,  # this process'
                                 tokens_per_step=args.batch_size * args.seq_len / tp),
                             sync_check=None, state=state,
                             sinks=[af.JsonlSink(run.metrics_file)])
        start = time.perf_counter()
        with monitor, af.PreemptionGuard() as guard:  # SIGTERM: checkpoint, exit 75
            while state.step < stop:
                for batch in monitor.iterate(train):
                    monitor.step(step(state, batch))
                    guard.exit_if_requested(out, state, loader=train, step=step,
                                            extra=run.extra)
                    if state.step >= stop:
                        break
                    if state.step % args.eval_every == 0:  # read when the sink writes
                        monitor.log({"val_loss": held_out_loss(trained_loss, val)})
            elapsed = time.perf_counter() - start
            final = held_out_loss(trained_loss, val)  # the trained weights', logged too
            monitor.log({"val_loss": final})
        state.sync()
    if final is None:
        final = held_out_loss(trained_loss, val)
    val_loss = float(final)

    report: dict[str, Any] = {
        "updates": state.step,
        "val_loss": round(val_loss, 4),
        "val_bits_per_byte": round(val_loss / math.log(2), 4),
        "loss": args.loss,
        "train_seconds": round(elapsed, 2),
        "processes": af.world_size(),
        "strategy": ("fsdp" if args.fsdp else "ddp") + (f", tp={tp}" if tp > 1 else ""),
        "out": out,
    }
    if monitor is not None:  # something was trained: save it, and export it
        run.save(state, loader=train, step=step)
    # the whole model in a save_pretrained folder (every process takes part: a gather)
    export = checkpointing.export(Path(out) / "export", state, format="transformers")
    report["export"] = str(export)
    if main_process:  # reloaded by transformers alone, evaluated by plain PyTorch
        again: Any = AutoModelForCausalLM.from_pretrained(export)
        again = again.to(device).eval()
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16
                    else contextlib.nullcontext())
        with torch.no_grad(), autocast:
            reloaded = held_out_loss(lambda part: loss_value(LOSSES[args.loss](again, part)),
                                     val)
            prompt = torch.tensor([list(b"def parse_args(")], device=device)
            sample = again.generate(prompt, max_new_tokens=48, do_sample=False,
                                    pad_token_id=0, attention_mask=torch.ones_like(prompt))
        report["reloaded_val_loss"] = round(float(reloaded), 4)
        report["sample"] = bytes(sample[0].tolist()).decode("utf-8", "replace")
        if monitor is not None:
            print(monitor.report())
        print(json.dumps(report, indent=2))
    train.close()  # stop background threads before the process group goes
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
