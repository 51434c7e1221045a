"""GPT-2-small training throughput, stage by stage: tokens/s, MFU, memory.

A compact GPT-2 small (12 layers, 768 wide, 12 heads, 1024 tokens, vocabulary 50304, tied
embeddings, causal ``F.scaled_dot_product_attention``) trained on random tokens held on the
device (data loading is not what this measures). Stages, each adding one technique:

* ``baseline``: hand-written loop, fp32, eager, fused AdamW;
* ``accelfn_fp32``: the same update as an accelfn step (its ratio is the step's overhead);
* ``amp``: ``af.with_amp`` (bf16; fp16 with loss scaling where bf16 is missing);
* ``compiled``: ``af.with_amp`` and ``af.compiled``, against ``amp``;
* ``checkpointed``: ``af.with_amp`` and ``af.checkpointed`` on every block, eager, against
  ``amp``: the memory saved against the time added.

Then the stack accelfn recommends, one lever at a time, each against the stage before it:

* ``chunked_ce``: ``compiled`` with the loss computed in the model's forward by
  ``af.linear_cross_entropy`` (the logits never whole in memory);
* ``sdpa``: with the fastest attention backend this GPU has (cuDNN, flash or memory-efficient,
  timed on the model's own attention shape; skipped where there is no choice, the CPU);
* ``batch``: with the largest micro-batch (of ``--batches``) whose ``af.estimate_memory``
  peak fits 85% of the device's memory (``--memory-mib`` on the CPU): the recommended stack;
* ``hand``: the recommended stack written by hand (bf16 autocast, ``torch.compile(model)``,
  the same model, batch, attention backend and fused AdamW; nothing of accelfn's in the
  step), against ``batch``: accelfn's stack over it is ``1 / speedup_vs_previous``.

The last two also count the host syncs of one update (``af.SyncProbe``: CUDA's sync debug
mode on a GPU; emulated on the CPU), the target being 0 with a fused optimizer.

``--stages`` runs some of them (the GPU suite leaves ``checkpointed`` out: its figures do not
change with the levers).

Per stage: tokens/s, step time, first-step time (compilation), peak CUDA memory, the peak of
the activations saved for the backward, MFU (FLOPs per token ``6N + 12 L d T``, PaLM's
estimate, against the GPU's dense bf16 datasheet peak, the same for every stage) and
ratios to the stage it is compared with (``speedup_vs_previous``, ``compared_with``) and to
the baseline, all measured in the same run.

    python benchmarks/gpt2.py [--json out.json]    # GPT-2 small on a GPU
    python benchmarks/gpt2.py --tiny               # a 2-layer toy, a few steps (CPU checks)
    python benchmarks/gpt2.py --stages compiled,chunked_ce,sdpa,batch,hand
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accelfn as af
from accelfn.observe.timing import SavedActivations, environment, resolve_device, sync, time_steps


@dataclass
class GPTConfig:
    """Sizes of the model; the defaults are GPT-2 small (124M parameters)."""

    vocab: int = 50304  # 50257 padded to a multiple of 64
    seq: int = 1024
    layers: int = 12
    dim: int = 768
    heads: int = 12


TINY = GPTConfig(vocab=512, seq=64, layers=2, dim=64, heads=4)
SMALL = GPTConfig(vocab=1024, seq=128, layers=4, dim=128, heads=4)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.ln2 = nn.LayerNorm(c.dim)
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.fc_proj = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2: token and position embeddings, blocks, final LayerNorm, tied output head."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; with ``targets``, the mean next-token loss instead, the head applied
        chunk by chunk (``af.linear_cross_entropy``: the logits are never whole)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if targets is not None:
            return af.linear_cross_entropy(self.ln_f(x), self.head.weight, targets)
        return self.head(self.ln_f(x))

    def flops_per_token(self) -> float:
        """``6 N + 12 L d T`` (PaLM, appendix B): N parameters without position embeddings."""
        c = self.config
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6 * n + 12 * c.layers * c.dim * c.seq


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Next-token cross-entropy (the step function of every stage)."""
    logits = model(batch["input"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())


def chunked_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Next-token cross-entropy computed in the model's forward, chunked."""
    return model(batch["input"], batch["target"])  # type: ignore[no-any-return]


def token_batches(c: GPTConfig, batch: int, count: int, device: torch.device,
                  seed: int = 0) -> list[TensorDict]:
    """``count`` batches of random tokens on ``device`` (input and shifted target)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, c.vocab, (batch, c.seq + 1), generator=g)
        out.append(TensorDict({"input": tokens[:, :-1], "target": tokens[:, 1:]},
                              batch_size=[batch]).to(device))
    return out


def make_model(c: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(c).to(device)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)


def amp_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


# (name, what it runs, the stage it is compared with)
STAGES: list[tuple[str, str, str | None]] = [
    ("baseline", "hand-written loop, fp32, eager, fused AdamW", None),
    ("accelfn_fp32", "the same update as an accelfn step", "baseline"),
    ("amp", "+ af.with_amp", "accelfn_fp32"),
    ("compiled", "amp + af.compiled", "amp"),
    ("checkpointed", "amp + af.checkpointed on every block (eager: memory against time)", "amp"),
    ("chunked_ce", "compiled + af.linear_cross_entropy in the forward", "compiled"),
    ("sdpa", "chunked_ce + the fastest attention backend", "chunked_ce"),
    ("batch", "sdpa + the largest micro-batch estimate_memory fits: the recommended stack",
     "sdpa"),
    ("hand", "the recommended stack by hand (torch.compile, autocast, fused AdamW)", "batch"),
]
LEVERS = ("chunked_ce", "sdpa", "batch", "hand")  # the model computes its loss in forward
_SDPA = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def fastest_sdpa(c: GPTConfig, batch: int, device: torch.device, dtype: torch.dtype,
                 repeats: int = 10) -> tuple[str | None, dict[str, float | str]]:
    """The attention backend of the shortest forward and backward on the model's attention
    shape, and every backend's milliseconds (or why it cannot run); None on the CPU, where
    torch has no choice to make."""
    if device.type != "cuda":
        return None, {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (batch, c.heads, c.seq, c.dim // c.heads)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    times: dict[str, float | str] = {}
    for name in _SDPA:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                for i in range(repeats + 2):
                    if i == 2:
                        sync(device)
                        t0 = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                sync(device)
            times[name] = (time.perf_counter() - t0) / repeats * 1e3
        except RuntimeError as error:  # not built, or not for this GPU or shape
            times[name] = f"unavailable: {error}"[:200]
    ran = {name: ms for name, ms in times.items() if isinstance(ms, float)}
    return (min(ran, key=lambda name: ran[name]) if ran else None), times


@contextlib.contextmanager
def attention(backend: str | None) -> Iterator[None]:
    """``sdpa_kernel(backend)``, or nothing for None."""
    if backend is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        yield


def fitting_batch(c: GPTConfig, device: torch.device, candidates: list[int],
                  budget_bytes: int, backend: str | None, seed: int
                  ) -> tuple[int, dict[int, int]]:
    """The largest of ``candidates`` whose ``af.estimate_memory`` peak for the recommended
    step (amp, chunked loss; compile does not change what is held) fits ``budget_bytes``,
    largest first, stopping at the first that fits; and the peaks estimated."""
    model = make_model(c, device, seed)
    state = af.TrainState(model, make_optimizer(model))
    step = af.with_amp(dtype=amp_dtype(device))(chunked_loss)
    peaks: dict[int, int] = {}
    for size in sorted(candidates, reverse=True):
        batch = token_batches(c, size, 1, device, seed)[0]
        with attention(backend):
            peaks[size] = af.estimate_memory(step, state, batch).peak
        if peaks[size] <= budget_bytes:
            return size, peaks
    return min(candidates), peaks


def build_step(name: str, device: torch.device, backend: str = "inductor") -> Any:
    """The accelfn step of stage ``name``."""
    step: Any = af.lift(chunked_loss if name in LEVERS else lm_loss)
    if name in ("amp", "compiled", "checkpointed", *LEVERS):
        step = af.with_amp(dtype=amp_dtype(device))(step)
    if name in ("compiled", *LEVERS):
        step = af.compiled(backend=backend)(step)
    if name == "checkpointed":
        step = af.checkpointed(step)
    return step


def run_stage(name: str, c: GPTConfig, batches: list[TensorDict], device: torch.device,
              args: argparse.Namespace, log: Callable[[str], None],
              backend: str | None = None) -> dict[str, Any]:
    model = make_model(c, device, args.seed)
    opt = make_optimizer(model)
    cursor = iter(range(10**9))

    if name == "baseline":
        def one() -> None:
            b = batches[next(cursor) % len(batches)]
            lm_loss(model, b).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        stack = "hand-written loop"
    elif name == "hand":
        compiled = torch.compile(model, backend=args.compile_backend)
        dtype = amp_dtype(device)

        def one() -> None:
            b = batches[next(cursor) % len(batches)]
            with attention(backend), torch.autocast(device.type, dtype=dtype):
                loss = compiled(b["input"], b["target"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        stack = f"hand-written: torch.compile(model), {dtype} autocast, fused AdamW"
    else:
        step = build_step(name, device, args.compile_backend)
        state = af.TrainState(model, opt)

        def one() -> None:
            with attention(backend):
                step(state, batches[next(cursor) % len(batches)])

        stack = af.describe(step)

    timing = time_steps(one, warmup=args.warmup, steps=args.steps, device=device)
    first, elapsed = timing.first_s, timing.elapsed_s
    with SavedActivations(model) as acts:
        one()
    sync(device)
    if name not in ("baseline", "hand"):
        state.sync()
    syncs = None
    if name in ("batch", "hand"):  # the recommended stack and its twin: host syncs, counted
        with af.SyncProbe() as probe:  # CUDA's sync debug mode on a GPU, emulated elsewhere
            one()
            sync(device)
        syncs = [str(point) for point in probe.syncs]
    tokens = args.steps * len(batches[0]) * c.seq
    rate = tokens / elapsed
    log(f"  {name}: {rate:,.0f} tokens/s ({elapsed / args.steps * 1e3:.1f} ms/step)")
    return {"tokens_per_s": rate, "step_ms": elapsed / args.steps * 1e3, "first_step_s": first,
            "peak_memory_mib": timing.peak_mib, "activation_mib": acts.mib, "stack": stack,
            "batch_size": len(batches[0]), "attention_backend": backend,
            "host_syncs_per_update": None if syncs is None else len(syncs),
            "host_syncs": syncs}


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    device = resolve_device(args.device)
    c = TINY if args.tiny else GPTConfig()
    if args.seq:
        c.seq = args.seq
    if args.layers:
        c.layers = args.layers
    env = environment(device)
    probe = make_model(c, torch.device("cpu"))
    flops_tok = probe.flops_per_token()
    params = sum(p.numel() for p in probe.parameters())
    del probe
    peak = None
    if device.type == "cuda":
        from accelfn.observe.flops import peak_flops

        peak = peak_flops(torch.cuda.get_device_name(device), torch.bfloat16)
    batches = token_batches(c, args.batch_size, 4, device, args.seed)
    log(f"GPT {params / 1e6:.1f}M parameters, {c.layers} layers, seq {c.seq}, batch "
        f"{args.batch_size} on {env['device_name']}")
    warm = make_model(c, device, args.seed)  # one-time costs kept out of the first stage
    for _ in range(2):
        lm_loss(warm, batches[0]).backward()
    del warm
    sync(device)
    stages: list[dict[str, Any]] = []
    done: dict[str, dict[str, Any]] = {}
    levers: dict[str, Any] = {}
    backend: str | None = None
    stage_batches = batches
    for name, title, ref in STAGES:
        if args.stages and name not in args.stages:
            continue
        entry: dict[str, Any] = {"name": name, "title": title, "compared_with": ref}
        if (name == "compiled" or name in LEVERS) and not args.compile:
            entry.update(status="skipped",
                         reason="compile left out (--no-compile, or --tiny without --compile)")
            stages.append(entry)
            continue
        if name == "sdpa":
            backend, levers["attention_ms"] = fastest_sdpa(c, args.batch_size, device,
                                                           amp_dtype(device))
            levers["attention_backend"] = backend
            if backend is None:
                entry.update(status="skipped", reason="no attention backend to choose from "
                             f"on {device.type} (or none ran)")
                stages.append(entry)
                continue
        if name == "batch":
            budget = (int(0.85 * torch.cuda.get_device_properties(device).total_memory)
                      if device.type == "cuda" else args.memory_mib * 2**20)
            size, peaks = fitting_batch(c, device, args.batches, budget, backend, args.seed)
            levers.update(batch_size=size, budget_bytes=budget, estimated_peak_bytes=peaks)
            stage_batches = token_batches(c, size, 4, device, args.seed)
            log(f"  batch: {size} sequences fit {budget / 2**20:,.0f} MiB "
                f"(estimated peaks {peaks})")
        try:
            entry.update(run_stage(name, c, stage_batches, device, args, log, backend),
                         status="ok")
        except Exception as exc:  # report and go on with the other stages
            entry.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:2000])
            log(f"  {name}: error {entry['reason'][:300]}")
            stages.append(entry)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        entry["model_tflops_per_s"] = entry["tokens_per_s"] * flops_tok / 1e12
        entry["mfu"] = None if peak is None else entry["tokens_per_s"] * flops_tok / peak
        prev = done.get(ref) if ref else None
        base = done.get("baseline")
        entry["speedup_vs_previous"] = None if prev is None else (
            entry["tokens_per_s"] / prev["tokens_per_s"])
        entry["speedup_vs_baseline"] = None if base is None else (
            entry["tokens_per_s"] / base["tokens_per_s"])
        if prev is not None and prev.get("activation_mib"):
            entry["activation_ratio_vs_previous"] = entry["activation_mib"] / prev[
                "activation_mib"]
        if prev is not None and prev.get("peak_memory_mib") and entry.get("peak_memory_mib"):
            entry["peak_memory_ratio_vs_previous"] = entry["peak_memory_mib"] / prev[
                "peak_memory_mib"]
        done[name] = entry
        stages.append(entry)
    env["load_average_end"] = environment(device).get("load_average")
    return {
        "benchmark": "gpt2",
        "machine": env,
        "model": {**asdict(c), "parameters": params, "flops_per_token": flops_tok},
        "batch_size": args.batch_size,
        "tokens_per_step": args.batch_size * c.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "compile_backend": args.compile_backend,
        "mfu_peak": None if peak is None else {"dtype": "bf16", "flop_per_s": peak},
        "stages": stages,
        "levers": levers,
        "notes": ["the levers' stages (chunked_ce, sdpa, batch, hand) each add one thing to "
                  "the stage before; 'hand' is the recommended stack without accelfn (the "
                  "model's forward, which calls af.linear_cross_entropy, is the same model "
                  "code on both sides)",
                  "tokens/s = steps x batch x seq / wall time of the timed steps",
                  "MFU uses the bf16 dense peak for every stage (fp32 stages included), so "
                  "MFU ratios equal throughput ratios",
                  "activation_mib: peak bytes autograd holds for the backward (parameters "
                  "excluded); checkpointing's recomputation in the backward is not counted, "
                  "peak_memory_mib (CUDA) includes it"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer, 64-wide toy with 64 tokens, a few steps, no compile unless "
                        "--compile (checks the code paths on a CPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--compile", dest="compile", action="store_true", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend ('eager' only traces: checks the code quickly)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", default=None,
                   help="comma-separated stages to run (default: all): "
                        + ",".join(name for name, _, _ in STAGES))
    p.add_argument("--batches", default="64,48,32,24,16",
                   help="the batch stage's candidate micro-batches (the largest that fits)")
    p.add_argument("--memory-mib", type=int, default=256,
                   help="the batch stage's memory budget off a GPU (on one: 85%% of it)")
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    args = p.parse_args(argv)
    if args.compile is None:
        args.compile = not args.tiny
    if args.batch_size is None:
        args.batch_size = 4 if args.tiny else 16
    if args.steps is None:
        args.steps = 3 if args.tiny else 10
    if args.warmup is None:
        args.warmup = 1 if args.tiny else 3
    if args.warmup < 1 or args.steps < 1:
        p.error("--steps and --warmup must be >= 1")
    known = [name for name, _, _ in STAGES]
    if args.stages is not None:
        args.stages = args.stages.split(",")
        unknown = sorted(set(args.stages) - set(known))
        if unknown:
            p.error(f"--stages: unknown {unknown}; the stages are {','.join(known)}")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: give comma-separated sizes, e.g. 64,32,16")

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    result = run(args, log)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 1 if any(s["status"] == "error" for s in result["stages"]) else 0


if __name__ == "__main__":
    sys.exit(main())
