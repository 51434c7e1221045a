"""``accelfn bench``: the staged ResNet-50 case study, reproduced on this machine.

Published on one V100: baseline 312 img/s, then pinned memory and workers 387 (+24%),
AMP 542 (+40%), ``torch.compile`` 798 (+47%), 4-GPU DDP 2832 (3.55x). This harness runs the
same story on your hardware, one stage after the other, each adding one technique to the
previous ones, on preloaded uint8 images (synthetic, or the embedded digits upscaled):

==================  ===========================================================================
stage               what it runs
==================  ===========================================================================
baseline            ``torch.utils.data.DataLoader`` (no workers, no pinning) with per-sample
                    torchvision transforms (random crop with padding, flip, normalise), fp32,
                    eager, a hand-written loop
dataloader_tuned    the same loop, ``num_workers``, ``pin_memory``, ``persistent_workers``,
                    ``prefetch_factor`` (the case study's first stage)
accelfn_data        ``accelfn.data.loader``: one gather per batch, augmentation on whole batches
                    on the device; the loop is an accelfn step
amp                 ``af.with_amp`` (bf16; fp16 with loss scaling where bf16 is missing)
compiled            ``af.compiled``
channels_last       the model and the input batches in NHWC (``ChannelsLast``)
ddp                 ``af.distributed`` on every GPU under ``torchrun`` (skipped, with the
                    reason, on fewer than two GPUs)
==================  ===========================================================================

For each stage: samples/s, mean step time, first-step time (compilation), peak memory,
speedup against the previous stage and the baseline, MFU where the GPU's peak is known, and
the published ratio for the same stage. The same run also measures accelfn's per-step overhead:
the last single-device stack (without compile) against the same loop written by hand, steps
interleaved on fixed device batches (medians).

    accelfn bench                          # ResNet-50: 224 px on a GPU, 32 px on a CPU
    accelfn bench --quick                  # a tiny CNN, a few steps, no compile (CI)
    accelfn bench --model resnet18 --out runs/resnet18

Every run prints the table and writes ``runs/bench/bench.json`` and ``runs/bench/bench.png``
(``--out DIR`` moves both; ``--json PATH`` moves the JSON and the PNG beside it, ``--json -``
prints the JSON instead; ``--plot PATH`` and ``--no-plot`` choose the PNG). A run warns when
the machine's load average exceeds its CPU cores (the figures then vary from run to run).

Also ``python -m accelfn.cli.bench``. The package, in the order a run goes through it:

==============  =============================================================================
``config``      the stages, the published figures, :class:`BenchConfig` and the command line
                that reproduces a configuration
``workload``    the images, models, optimizer, both data pipelines and the step of a stage
``stages``      each stage trained and timed, DDP under ``torchrun``, the overhead check,
                :func:`run_bench`
``report``      repeats combined, the JSON result, :func:`format_table`, :func:`plot_bench`
``command``     the ``accelfn bench`` options and the run
==============  =============================================================================

The measurement primitives (:func:`~accelfn.observe.timing.time_steps`,
:func:`~accelfn.observe.timing.interleaved`, :class:`~accelfn.observe.timing.PeakMemory`,
:class:`~accelfn.observe.timing.SavedActivations`, :func:`~accelfn.observe.timing.environment`,
...) live in :mod:`accelfn.observe.timing`, shared with the scripts in ``benchmarks/``; the
names are also importable from here, as before the split.
"""

from ...observe.timing import (
    PeakMemory,
    SavedActivations,
    StepTiming,
    environment,
    interleaved,
    resolve_device,
    state_mib,
    sync,
    time_steps,
)
from .command import DEFAULT_OUT, add_bench, main
from .config import SEED_CASE_STUDY, STAGES, BenchConfig, Stage
from .report import busy_machine_warning, format_table, plot_bench
from .stages import run_bench

__all__ = [
    "DEFAULT_OUT",
    "SEED_CASE_STUDY",
    "STAGES",
    "BenchConfig",
    "PeakMemory",
    "SavedActivations",
    "Stage",
    "StepTiming",
    "add_bench",
    "busy_machine_warning",
    "environment",
    "format_table",
    "interleaved",
    "main",
    "plot_bench",
    "resolve_device",
    "run_bench",
    "state_mib",
    "sync",
    "time_steps",
]
