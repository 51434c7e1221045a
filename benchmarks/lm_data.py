"""Language-model data: the token-file loader against np.memmap, and packing against padding.

First, the token-file loader against what a competent user writes without accelfn: nanoGPT's
``get_batch``, a plain ``np.memmap`` slicing loop (the map re-created per batch, random
windows sliced, cast to int64, stacked into inputs and targets). The same batch shape, the
same synthetic GPT-2-vocabulary file (hot in the page cache), the same number of batches; the
two alternate (interleaved), repeated, and the median rate of each gives the ratio
(``token_loader(packing="windows")`` also builds ``document_ids`` and ``positions``, and
reads ahead in its prefetch thread).

Then four ways to turn documents into rows of ``seq_len`` positions, on the same documents:

* ``pad``: what ``examples/gpt.py --packing pad`` does: each document cut into rows, its last
  row padded, rows shuffled by ``accelfn.data.loader`` from a TensorDict;
* ``windows``: ``token_loader(packing="windows")``, nanoGPT's random windows of the token
  stream (no padding; rows cross documents, ``document_ids`` mark where);
* ``greedy`` / ``best-fit``: ``token_loader(packing=...)``, documents walked in order and
  packed without padding but at the end of the data.

For each: the loader's real tokens (targets that are not padding) per second over whole
epochs (host batches, prefetch thread), the padding share (positions holding no real
target), the share of documents cut across rows, the mean context of a target (its position
in its document's piece + 1: what a cut costs), and the ratio of real tokens per row against
``pad``'s (the factor of useful work per step at the same batch shape). Two corpora: the
documentation of Python's standard library that ``examples/gpt.py`` trains on (byte-level,
real documents), at its ``seq_len`` 128 and at 1024; and a synthetic GPT-2-vocabulary corpus
(uint16 ids, log-normal document lengths, median 400 tokens) at 1024, large enough to time
the loaders. Prints one JSON object.

Last, the validation loss of ``examples/gpt.py`` trained on padded rows and on best-fit packed
rows with document masks, at the same number of real tokens (the targets that are not
padding), on the same validation targets (every held-out document, one a row), over several
runs (``--seed 0, 1, ...``: the initial weights and the data's order; the three runs of one
``--seed`` are interleaved). Padded rows carry ``1 - padding share`` real tokens a position,
so the same real tokens are reached either with fewer packed rows an update (the same
updates) or with as many rows and fewer updates (the same compute an update); both are run:

* ``pad``: ``--packing pad --batch-size B`` for ``--steps S``;
* ``best_fit_same_updates``: ``--batch-size round(B x density)`` (``density``: the padded
  rows' share of real targets), for the updates that bring its real tokens to at most the
  padded run's expected ones (about ``S``);
* ``best_fit_same_rows``: ``--batch-size B``, ``floor(S x density)`` updates.

Each gives the validation loss's mean, sample standard deviation, range, and each packed
arm's difference from ``pad`` paired by ``--seed`` (mean and standard error).

Run: ``python benchmarks/lm_data.py`` (``--help`` for sizes); the JSON is also written to
``benchmarks/results/cpu-lm-data.json`` (``--out``). ``--parts training`` runs the last part
alone and writes only where ``--out`` says (the results page reads the whole run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # gpt's corpus

import accelfn.data as ad


def pad_rows(lengths_ids: list[np.ndarray], seq_len: int) -> dict[str, torch.Tensor]:
    """``examples/gpt.py``'s padded rows (``pad_rows``), vectorised per document."""
    rows = []
    for ids in lengths_ids:
        for start in range(0, len(ids) - 1, seq_len):
            piece = ids[start:start + seq_len + 1]
            rows.append(piece)
    n = len(rows)
    inputs = np.zeros((n, seq_len), dtype=np.int64)
    targets = np.full((n, seq_len), -100, dtype=np.int64)
    positions = np.zeros((n, seq_len), dtype=np.int64)
    ids_ = np.full((n, seq_len), -1, dtype=np.int64)
    for r, piece in enumerate(rows):
        k = len(piece) - 1
        inputs[r, :k], targets[r, :k], positions[r, :k], ids_[r, :k] = (
            piece[:-1], piece[1:], np.arange(k), 0)
    return {"inputs": torch.from_numpy(inputs), "targets": torch.from_numpy(targets),
            "document_ids": torch.from_numpy(ids_), "positions": torch.from_numpy(positions)}


def measure(make, epochs: int) -> dict[str, float]:
    """Whole epochs of ``make()``'s loader (the first a warm-up): median real tokens/s, and
    the layout's figures from the last epoch."""
    loader = make()
    rates, real, positions, context, pieces = [], 0, 0, 0.0, 0
    for e in range(epochs + 1):
        real = positions = pieces = 0
        context = 0.0
        t0 = time.perf_counter()
        for batch in loader:
            valid = batch["targets"] != -100
            real += int(valid.sum())
            positions += valid.numel()
            context += float((batch["positions"] + 1)[valid].sum())
            ids = batch["document_ids"]
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            pieces += int((starts & valid).sum())
        if e:
            rates.append(real / (time.perf_counter() - t0))
    loader.close()
    return {"real_tokens_per_s": round(statistics.median(rates)),
            "padding_share": round(1 - real / positions, 4),
            "mean_context": round(context / real, 1),
            "pieces": pieces, "real_tokens": real}


def compare(documents: list[np.ndarray], eot: int, seq_len: int, batch_size: int,
            epochs: int, folder: Path, name: str) -> dict[str, object]:
    path = folder / f"{name}.bin"
    ad.write_tokens(path, np.concatenate([np.append(d, eot) for d in documents]))
    with_eot = [np.append(d, eot) for d in documents]
    padded = pad_rows(with_eot, seq_len)
    n = len(padded["inputs"])
    makers = {
        "pad": lambda: ad.loader(padded, batch_size=batch_size, seed=0),
        "windows": lambda: ad.token_loader(path, batch_size=batch_size, seq_len=seq_len,
                                           eot=eot),
        "greedy": lambda: ad.token_loader(path, batch_size=batch_size, seq_len=seq_len,
                                          packing="greedy", eot=eot),
        "best-fit": lambda: ad.token_loader(path, batch_size=batch_size, seq_len=seq_len,
                                            packing="best-fit", eot=eot),
    }
    out: dict[str, object] = {"documents": len(documents),
                              "tokens": int(sum(len(d) + 1 for d in documents)),
                              "seq_len": seq_len, "batch_size": batch_size, "pad_rows": n}
    pad_density = None
    for mode, make in makers.items():
        result: dict[str, float | int | str] = dict(measure(make, epochs))
        if mode != "windows":  # windows cross documents: pieces are not cuts
            result["documents_cut"] = round(
                (int(result.pop("pieces")) - len(documents)) / len(documents), 4)
        else:
            result.pop("pieces")
        density = 1 - float(result["padding_share"])
        pad_density = density if mode == "pad" else pad_density
        assert pad_density is not None
        result["real_tokens_per_row_vs_pad"] = round(density / pad_density, 3)
        out[mode] = result
    return out


def memmap_batches(path: Path, batches: int, batch_size: int, seq_len: int,
                   rng: np.random.Generator) -> int:
    """The baseline: nanoGPT's ``get_batch`` loop over a raw uint16 file; tokens given."""
    tokens = 0
    for _ in range(batches):
        data = np.memmap(path, dtype=np.uint16, mode="r")  # re-created per batch, as nanoGPT
        ix = rng.integers(0, len(data) - seq_len, size=batch_size)
        x = torch.stack([torch.from_numpy(data[i:i + seq_len].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq_len].astype(np.int64))
                         for i in ix])
        tokens += x.numel()
        del data, y
    return tokens


def loader_vs_memmap(tokens: int, batch_size: int, seq_len: int, repeats: int,
                     folder: Path) -> dict[str, object]:
    """``token_loader(packing="windows")`` against the ``np.memmap`` loop, interleaved."""
    ids = np.random.default_rng(1).integers(0, 50257, size=tokens).astype(np.uint16)
    path = folder / "train.bin"
    ids.tofile(path)  # nanoGPT's raw layout
    loader = ad.token_loader(path, batch_size=batch_size, seq_len=seq_len, seed=0)
    batches = len(loader)
    rng = np.random.default_rng(0)
    for _ in loader:  # warm-up: the page cache, the prefetch thread
        pass
    memmap_batches(path, batches, batch_size, seq_len, rng)
    rates: dict[str, list[float]] = {"token_loader": [], "np_memmap": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = 0
        for batch in loader:  # one epoch: every window once
            n += batch["inputs"].numel()
        rates["token_loader"].append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        n = memmap_batches(path, batches, batch_size, seq_len, rng)
        rates["np_memmap"].append(n / (time.perf_counter() - t0))
    loader.close()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "tokens_in_file": tokens, "batch_size": batch_size, "seq_len": seq_len,
        "batches_per_repeat": batches, "repeats": repeats,
        "token_loader_tokens_per_s": round(medians["token_loader"]),
        "np_memmap_tokens_per_s": round(medians["np_memmap"]),
        "token_loader_all": [round(r) for r in rates["token_loader"]],
        "np_memmap_all": [round(r) for r in rates["np_memmap"]],
        "ratio": round(medians["token_loader"] / medians["np_memmap"], 3),
    }


def stdlib_documents(limit: int) -> list[np.ndarray]:
    from gpt import stdlib_text  # examples/gpt.py's corpus

    return [np.frombuffer(d, dtype=np.uint8).astype(np.int64) for d in stdlib_text(limit)]


def synthetic_documents(tokens: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < tokens:
        n = max(1, int(rng.lognormal(np.log(400), 1.0)))
        docs.append(rng.integers(0, 50256, size=n))
        total += n + 1
    return docs


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.mean(values), 4),
            "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4), "max": round(max(values), 4)}


def training(runs_of_each: int, steps: int, seq_len: int, dim: int, depth: int, batch_size: int,
             accumulation: int, text_bytes: int, folder: Path) -> dict[str, object]:
    """``examples/gpt.py`` padded against best-fit packed, at the same real tokens."""
    import gpt

    documents, _ = gpt.split(gpt.stdlib_text(text_bytes))
    padded = gpt.pad_rows(documents, seq_len)
    density = float((padded["targets"] != -100).float().mean())  # real targets a position
    packed_batch = max(accumulation, round(batch_size * density))
    expected = steps * batch_size * seq_len * density  # the padded run's real tokens, expected
    arms = {
        "pad": ["--packing", "pad", "--batch-size", str(batch_size), "--steps", str(steps)],
        "best_fit_same_updates": [
            "--batch-size", str(packed_batch),
            "--steps", str(math.floor(expected / (packed_batch * seq_len)))],
        "best_fit_same_rows": ["--batch-size", str(batch_size),
                               "--steps", str(math.floor(expected / (batch_size * seq_len)))],
    }
    common = ["--seq-len", str(seq_len), "--dim", str(dim), "--depth", str(depth),
              "--accumulation", str(accumulation), "--text-bytes", str(text_bytes),
              "--eval-every", str(10 * steps), "--quiet"]
    runs: dict[str, list[dict[str, float | int]]] = {arm: [] for arm in arms}
    for seed in range(runs_of_each):
        for arm, options in arms.items():  # interleaved: a seed's three runs in a row
            argv = [*common, *options, "--seed", str(seed), "--out", str(folder / f"{arm}-{seed}")]
            with contextlib.redirect_stdout(io.StringIO()):  # the example's own report
                report = gpt.main(argv)
            runs[arm].append({"seed": seed, "updates": int(report["updates"]),
                              "real_tokens": int(report["real_tokens"]),
                              "val_loss": float(report["val_loss"]),
                              "real_tokens_per_s": float(report["real_tokens_per_s"])})
            print(f"  {arm} seed {seed}: {runs[arm][-1]}", file=sys.stderr, flush=True)
    out: dict[str, object] = {
        "model": {"dim": dim, "depth": depth, "seq_len": seq_len, "accumulation": accumulation,
                  "text_bytes": text_bytes},
        "pad_density": round(density, 4), "runs_of_each": runs_of_each,
        "validation_tokens": int(report["val_tokens"]),
        "options": {arm: " ".join(o) for arm, o in arms.items()},
    }
    pad_losses = [r["val_loss"] for r in runs["pad"]]
    for arm, results in runs.items():
        losses = [float(r["val_loss"]) for r in results]
        summary: dict[str, object] = {
            "updates": results[0]["updates"],
            "real_tokens_mean": round(statistics.mean(r["real_tokens"] for r in results)),
            "val_loss": _spread(losses),
            "real_tokens_per_s_median": round(statistics.median(
                float(r["real_tokens_per_s"]) for r in results)),
            "runs": results,
        }
        if arm != "pad":
            diffs = [a - b for a, b in zip(losses, pad_losses)]
            sem = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
            summary["minus_pad"] = {"mean": round(statistics.mean(diffs), 4),
                                    "standard_error": round(sem, 4),
                                    "per_run": [round(d, 4) for d in diffs]}
        out[arm] = summary
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text-bytes", type=int, default=1_500_000, help="examples/gpt.py's corpus")
    p.add_argument("--synthetic-tokens", type=int, default=8_000_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (after a warm-up)")
    p.add_argument("--loader-tokens", type=int, default=16_000_000,
                   help="tokens of the file of the loader-vs-np.memmap comparison")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of it")
    p.add_argument("--parts", default="loader,packing,training",
                   help="comma-separated parts to run: loader, packing, training")
    p.add_argument("--runs", type=int, default=5,
                   help="training: runs of each arm (--seed 0, 1, ...)")
    p.add_argument("--train-steps", type=int, default=100, help="training: the padded updates")
    p.add_argument("--train-seq-len", type=int, default=512)
    p.add_argument("--train-batch-size", type=int, default=8, help="training: padded rows")
    p.add_argument("--out", default=None,
                   help="the JSON file (default: benchmarks/results/cpu-lm-data.json when "
                        "every part runs, none otherwise)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    every = {"loader", "packing", "training"}
    if parts - every:
        p.error(f"--parts: unknown {sorted(parts - every)}")
    if args.out is None and parts == every:
        args.out = str(Path(__file__).resolve().parent / "results" / "cpu-lm-data.json")
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results: dict[str, object] = {}
    corpus_s = None
    if "loader" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            results["token_loader_vs_np_memmap"] = loader_vs_memmap(
                args.loader_tokens, args.batch_size, 1024, args.repeats, Path(tmp))
    if "packing" in parts:
        t = time.perf_counter()
        stdlib = stdlib_documents(args.text_bytes)
        corpus_s = round(time.perf_counter() - t, 1)
        synthetic = synthetic_documents(args.synthetic_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            results.update({
                "stdlib_seq128": compare(stdlib, 256, 128, args.batch_size, args.epochs,
                                         folder, "stdlib"),
                "stdlib_seq1024": compare(stdlib, 256, 1024, args.batch_size, args.epochs,
                                          folder, "stdlib"),
                "synthetic_seq1024": compare(synthetic, 50256, 1024, args.batch_size, 1,
                                             folder, "synthetic"),
            })
    if "training" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            results["training"] = training(args.runs, args.train_steps, args.train_seq_len,
                                           64, 2, args.train_batch_size, 2, args.text_bytes,
                                           Path(tmp))
    report = {
        "benchmark": "lm_data",
        "setup": {"date": started, "machine": platform.machine(),
                  "processor": platform.processor() or platform.machine(),
                  "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                  "torch": torch.__version__, "numpy": np.__version__,
                  "python": platform.python_version(),
                  "device": "cpu (host batches)", "epochs": args.epochs,
                  "stdlib_corpus_seconds": corpus_s, "parts": sorted(parts),
                  "load_average_before": round(load_before, 1),
                  "load_average_after": round(os.getloadavg()[0], 1)},
        **results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
