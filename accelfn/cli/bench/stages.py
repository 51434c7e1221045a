"""The stages of ``accelfn bench``: each one trained and timed, the DDP stage under
``torchrun``, accelfn's per-step overhead against the same loop by hand, and :func:`run_bench`
running them in order."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from ...observe.timing import (
    PeakMemory,
    SavedActivations,
    environment,
    interleaved,
    resolve_device,
    state_mib,
    sync,
    time_steps,
)
from .config import SEED_CASE_STUDY, STAGES, BenchConfig, Stage, cli_args
from .report import assemble, busy_machine_warning, combine_repeats, round_or_none
from .workload import (
    accelfn_loader,
    amp_dtype,
    build_model,
    build_step,
    endless,
    make_images,
    make_optimizer,
    prepare_model,
    torch_dataloader,
)

__all__ = ["ddp_worker", "run_bench"]


def _model_flops(cfg: BenchConfig, init: dict[str, torch.Tensor], device: torch.device) -> int:
    """Counted FLOPs (matmuls and convolutions, forward and backward) of one sample."""
    from ...observe.flops import training_flops

    model = prepare_model(cfg, init, device, channels_last=False)
    size = int(cfg.image_size or 32)
    x = torch.randn(2, 3, size, size, device=device)
    try:
        return training_flops(model, x) // 2
    finally:
        del model


def _peak(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None
    from ...observe.flops import peak_flops

    return peak_flops(torch.cuda.get_device_name(device), dtype)


def _run_stage(stage: Stage, cfg: BenchConfig, data: TensorDict,
               init: dict[str, torch.Tensor], device: torch.device,
               log: Callable[[str], None]) -> dict[str, Any]:
    """Train ``warmup + steps`` updates of one stage and time the last ``steps`` of them."""
    import accelfn as af

    assert cfg.steps is not None and cfg.warmup is not None and cfg.batch_size is not None
    model = prepare_model(cfg, init, device, stage.channels_last)
    optimizer = make_optimizer(model)
    loader: Any
    closer: Callable[[], None] = lambda: None
    if stage.hand_written:
        loader = torch_dataloader(data, cfg, device, tuned=stage.data == "dataloader_tuned")
        batches = endless(loader)

        def one() -> None:
            x, y = next(batches)
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        stack = "hand-written loop"
    else:
        loader = accelfn_loader(data, cfg, device, stage.channels_last)
        closer = loader.close
        batches = endless(loader)
        step = build_step(stage, cfg, device)
        state = af.TrainState(model, optimizer)

        def one() -> None:
            step(state, next(batches))

        stack = af.describe(step)

    timing = time_steps(one, warmup=cfg.warmup, steps=cfg.steps, device=device)
    first, elapsed, per_step = timing.first_s, timing.elapsed_s, timing.per_step_s
    activation: float | None = None
    try:  # one more (untimed) step, counting what autograd saves for the backward
        with SavedActivations(model) as acts:
            one()
        activation = acts.mib
    except Exception as exc:  # e.g. a compiled graph refusing the hooks: report, go on
        log(f"  {stage.name}: saved activations not measured ({type(exc).__name__}: {exc})")
    sync(device)
    if not stage.hand_written:
        state.sync()
    closer()
    rate = cfg.steps * cfg.batch_size / elapsed
    log(f"  {stage.name}: {rate:,.1f} samples/s ({elapsed / cfg.steps * 1e3:.1f} ms/step)")
    return {
        "samples_per_s": rate,
        "step_ms": elapsed / cfg.steps * 1e3,
        "step_ms_median": statistics.median(per_step) * 1e3 if per_step else None,
        "first_step_s": first,
        "peak_memory_mib": timing.peak_mib,
        "activation_mib": activation,
        "state_mib": state_mib(model, optimizer),
        "stack": stack,
    }


def _warm_up(cfg: BenchConfig, init: dict[str, torch.Tensor], device: torch.device) -> None:
    """A few untimed fp32 steps, so that the first stage does not pay the process's one-time
    costs (kernel selection, allocator growth, lazy initialisation)."""
    assert cfg.batch_size is not None and cfg.image_size is not None
    model = prepare_model(cfg, init, device, channels_last=False)
    optimizer = make_optimizer(model)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=g).to(device)
    y = torch.randint(0, cfg.classes, (cfg.batch_size,), generator=g).to(device)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)


def _run_ddp(stage: Stage, cfg: BenchConfig, device: torch.device,
             log: Callable[[str], None]) -> dict[str, Any]:
    """Run the DDP stage under ``torchrun`` on every GPU (or ``ddp_procs`` CPU processes)."""
    procs = cfg.ddp_procs or (torch.cuda.device_count() if device.type == "cuda" else 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        args = cli_args(cfg, exclude={"stages", "ddp", "ddp_procs", "notes", "classes",
                                      "threads"})
        # the free cores shared among the processes: more would oversubscribe the CPU
        args += ["--threads", str(max(1, (cfg.threads or 1) // procs))]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={procs}", "-m", "accelfn.cli.bench", "--ddp-worker", str(out),
               *args]
        log(f"  ddp: {shlex.join(cmd)}")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            raise RuntimeError(f"torchrun exited with {proc.returncode}: {tail}")
        result: dict[str, Any] = json.loads(out.read_text())
    result["processes"] = procs
    return result


def ddp_worker(cfg: BenchConfig, out: str) -> int:
    """One rank of the DDP stage (started by :func:`_run_ddp` through torchrun)."""
    import torch.distributed as dist

    import accelfn as af

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = af.init_distributed()
    cfg.device = str(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert cfg.model and cfg.image_size and cfg.batch_size and cfg.samples
    assert cfg.steps is not None and cfg.warmup is not None
    last = STAGES[-1]
    stage = Stage(last.name, last.title, "accelfn", amp=True, compile=bool(cfg.compile),
                  channels_last=True, ddp=True)
    # Each rank preloads its own images (seeded by rank): as many per rank as one device had.
    data = make_images(cfg.data, cfg.samples, cfg.image_size, cfg.classes, cfg.seed + rank)
    init = build_model(cfg.model, cfg.image_size, cfg.classes, cfg.seed).state_dict()
    model = prepare_model(cfg, init, device, stage.channels_last)
    optimizer = make_optimizer(model)
    state = af.TrainState(model, optimizer)
    step = build_step(stage, cfg, device)
    loader = accelfn_loader(data, cfg, device, stage.channels_last, rank=0, world=1)
    batches = endless(loader)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        step(state, next(batches))
        sync(device)
        first = time.perf_counter() - t0
        for _ in range(cfg.warmup - 1):
            step(state, next(batches))
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg.steps):
            step(state, next(batches))
        sync(device)
        dist.barrier()
        elapsed = time.perf_counter() - t0
    state.sync()
    loader.close()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "samples_per_s": cfg.steps * cfg.batch_size * world / elapsed,
            "step_ms": elapsed / cfg.steps * 1e3,
            "first_step_s": first,
            "peak_memory_mib": mem.peak_mib,
            "activation_mib": None,
            "state_mib": state_mib(model, optimizer),
            "stack": af.describe(step),
            "world_size": world,
            "batch_per_process": cfg.batch_size,
        }))
    dist.destroy_process_group()
    return 0


def _overhead(stage: Stage, cfg: BenchConfig, data: TensorDict, init: dict[str, torch.Tensor],
              device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    """accelfn's step against the same update written by hand, on fixed device batches.

    Three sides, interleaved step by step: the hand-written loop (autocast, and GradScaler
    for fp16, as in the case study), the accelfn step (with its default non-finite guard) and the
    accelfn step with ``with_nonfinite(policy="off")``. Compile is left out (both sides would
    compile the same model; accelfn adds the same Python around it)."""
    import accelfn as af

    assert cfg.batch_size is not None and cfg.overhead_steps is not None
    loader = accelfn_loader(data, cfg, device, stage.channels_last)
    batch = next(iter(loader)).clone()
    loader.close()
    x, y = batch["image"], batch["label"]
    dtype = amp_dtype(cfg, device)

    models = [prepare_model(cfg, init, device, stage.channels_last) for _ in range(3)]
    opts = [make_optimizer(m) for m in models]
    scaler = (torch.amp.GradScaler(device.type) if stage.amp and dtype == torch.float16
              else None)

    def hand() -> None:
        model, opt = models[0], opts[0]
        with (torch.autocast(device.type, dtype=dtype) if stage.amp
              else contextlib.nullcontext()):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        opt.zero_grad(set_to_none=True)

    step_on = build_step(stage, cfg, device, compile_=False)
    step_off = build_step(stage, cfg, device, nonfinite=False, compile_=False)
    st_on = af.TrainState(models[1], opts[1])
    st_off = af.TrainState(models[2], opts[2])
    fns: list[Callable[[], Any]] = [
        hand, lambda: step_on(st_on, batch), lambda: step_off(st_off, batch)]
    for _ in range(3):
        for fn in fns:
            fn()
    sync(device)
    t_hand, t_on, t_off = interleaved(fns, cfg.overhead_steps, device)
    st_on.sync()
    m_hand, m_on, m_off = (statistics.median(t) for t in (t_hand, t_on, t_off))
    same = all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                  models[2].parameters()))
    log(f"  overhead: hand-written {m_hand * 1e3:.2f} ms, accelfn {m_on * 1e3:.2f} ms "
        f"(guard off {m_off * 1e3:.2f} ms) per step")
    return {
        "stack": af.describe(step_on),
        "stack_guard_off": af.describe(step_off),
        "timing": "fixed device batch; per-step times interleaved, order rotated; medians",
        "steps": cfg.overhead_steps,
        "hand_written_step_ms": m_hand * 1e3,
        "accelfn_step_ms": m_on * 1e3,
        "accelfn_guard_off_step_ms": m_off * 1e3,
        "ratio": m_on / m_hand,
        "ratio_guard_off": m_off / m_hand,
        "added_us_per_step": (m_on - m_hand) * 1e6,
        "added_us_per_step_guard_off": (m_off - m_hand) * 1e6,
        "parameters_equal_guard_off": same,
    }


def _skip_reason(stage: Stage, cfg: BenchConfig, device: torch.device) -> str | None:
    if cfg.stages is not None and stage.name not in cfg.stages:
        return "not selected (--stages)"
    if stage.name == "compiled" and not cfg.compile:
        return ("--quick leaves compile out (10-60 s per graph on a CPU); add --compile to "
                "include it; later stages run without it" if cfg.quick else
                "--no-compile; later stages run without it")
    if stage.ddp:
        if not cfg.ddp:
            return "DDP skipped (--no-ddp)"
        if cfg.ddp_procs:
            return None
        if device.type != "cuda":
            return ("DDP needs several GPUs; this run is on the CPU (--ddp-procs N runs it "
                    "with gloo, to check the harness only)")
        if torch.cuda.device_count() < 2:
            return (f"{torch.cuda.device_count()} CUDA device visible; DDP needs at least 2")
    return None


def run_bench(cfg: BenchConfig, log: Callable[[str], None] | None = None,
              on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every stage of the case study and the overhead check; return the JSON result.

    ``on_progress(result)`` receives the result so far after each stage (``"complete":
    false``), so that a run cut short still leaves its figures."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    cfg = cfg.resolved()
    device = resolve_device(cfg.device)
    assert cfg.model and cfg.image_size and cfg.samples and cfg.batch_size
    env = environment(device)
    busy = busy_machine_warning()  # before the run's own processes add to the load
    if busy is not None:
        log(f"accelfn bench: warning: {busy}")
    log(f"accelfn bench: {cfg.model}, {cfg.image_size}px, batch {cfg.batch_size}, "
        f"{cfg.steps} steps (+{cfg.warmup} warm-up) per stage on {env['device_name']}, "
        f"{cfg.threads} torch thread(s)")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or threads_before)
    try:
        return _run_all(cfg, device, env, busy, log, on_progress)
    finally:
        torch.set_num_threads(threads_before)


def _run_all(cfg: BenchConfig, device: torch.device, env: dict[str, Any], busy: str | None,
             log: Callable[[str], None],
             on_progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    assert cfg.model and cfg.image_size and cfg.samples and cfg.batch_size
    t_all = time.perf_counter()
    data = make_images(cfg.data, cfg.samples, cfg.image_size, cfg.classes, cfg.seed)
    init = build_model(cfg.model, cfg.image_size, cfg.classes, cfg.seed).state_dict()
    flops = _model_flops(cfg, init, device)
    dtype = amp_dtype(cfg, device)
    peak = _peak(device, dtype)
    info = {"cfg": cfg, "env": env, "flops": flops, "peak": peak, "dtype": dtype,
            "t_all": t_all, "device": device, "warnings": [] if busy is None else [busy]}

    _warm_up(cfg, init, device)
    stages: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(cfg.repeats):
        if cfg.repeats > 1:
            log(f" repeat {rep + 1} of {cfg.repeats}")
        for listed in STAGES:
            stage = dataclasses.replace(listed, compile=listed.compile and bool(cfg.compile))
            if rep == 0:
                entry: dict[str, Any] = {
                    "name": stage.name, "title": stage.title,
                    "techniques": {k: v for k, v in asdict(stage).items()
                                   if k not in ("name", "title")}}
                if stage.name in SEED_CASE_STUDY:
                    entry["seed_v100"] = {k: round_or_none(v)
                                          for k, v in SEED_CASE_STUDY[stage.name].items()}
                stages.append(entry)
                reason = _skip_reason(stage, cfg, device)
                if reason is not None:
                    entry.update(status="skipped", reason=reason)
                    log(f"  {stage.name}: skipped ({reason})")
                    continue
            entry = next(e for e in stages if e["name"] == stage.name)
            if entry.get("status") in ("skipped", "error"):
                continue
            try:
                if stage.ddp:
                    result = _run_ddp(stage, cfg, device, log)
                else:
                    result = _run_stage(stage, cfg, data, init, device, log)
            except Exception as exc:  # a failing stage is reported; the others still run
                entry.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:2000])
                log(f"  {stage.name}: error ({entry['reason'][:300]})")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            runs.setdefault(stage.name, []).append(result)
            entry.update(combine_repeats(runs[stage.name]), status="ok")
            flops_s = flops * entry["samples_per_s"]
            entry["model_tflops_per_s"] = flops_s / 1e12
            procs = entry.get("world_size", 1)
            entry["mfu"] = None if peak is None else flops_s / (peak * procs)
            if on_progress is not None:
                on_progress(assemble(info, stages, None, complete=False))

    overhead: dict[str, Any] | None = None
    accel = [s for s in stages if s.get("status") == "ok" and not s["techniques"]["ddp"]
             and s["techniques"]["data"] == "accelfn"]
    if accel and cfg.overhead_steps:
        last = next(st for st in STAGES if st.name == accel[-1]["name"])
        last = dataclasses.replace(last, compile=False)
        try:
            overhead = _overhead(last, cfg, data, init, device, log)
        except Exception as exc:
            overhead = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    return assemble(info, stages, overhead, complete=True)

