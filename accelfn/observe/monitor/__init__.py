"""The monitor wing: [`Monitor`][accelfn.Monitor] and the modules that serve
it alone (its records, aggregates, sinks and trackers, progress bar, GPU sampler, straggler
check, report, verdict and plot).

The rest of `accelfn.observe` (diagnostics, the sync probe, the profiler, memory, FLOPs,
timing, the doctor) stands on its own and never imports this package; the monitor uses it.
"""

from .monitor import Monitor
from .options import GPUSampling, SyncCheck, Throughput
from .sinks import CsvSink, JsonlSink, Sink, TensorBoardSink
from .trackers import MlflowSink, WandbSink

__all__ = ["CsvSink", "GPUSampling", "JsonlSink", "MlflowSink", "Monitor", "Sink", "SyncCheck",
           "TensorBoardSink", "Throughput", "WandbSink"]
