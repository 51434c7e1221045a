"""A process that saves checkpoints into a directory another process also saves into, for
test_writers.py.

    python writer_worker.py hold DIR writing|committing
        save once (step 2), pausing in the middle (while writing the files, or just before the
        commit marker): prints "paused", continues when a line arrives on stdin
    python writer_worker.py loop DIR N
        prints "ready", waits for a line on stdin (so that two writers start together), then
        saves N times back to back (keep=3); prints a JSON summary: saves that succeeded,
        refusals (their messages) and any other error
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import torch
from checkpoint_helpers import run, setup

from accelfn import checkpointing
from accelfn.checkpointing import files, format

WORKER = Path(__file__).resolve()


def pause_at(where: str) -> None:
    real_torch, real_json = files.write_torch, files.write_json

    def wait() -> None:
        print("paused", flush=True)
        sys.stdin.readline()

    def write_torch(path: Path, obj: Any) -> Any:
        if where == "writing" and path.name == format.STATE_FILE:
            wait()
        return real_torch(path, obj)

    def write_json(path: Path, obj: Any) -> Any:
        if where == "committing" and path.name.startswith(format.MARKER):
            wait()
        return real_json(path, obj)

    files.write_torch, files.write_json = write_torch, write_json


def main() -> None:
    torch.set_num_threads(1)
    mode, directory = sys.argv[1], Path(sys.argv[2])
    state, loader, step = setup()
    it = iter(loader)
    run(state, it, step, 2)
    if mode == "hold":
        pause_at(sys.argv[3])
        print(checkpointing.save(directory, state, loader=loader, step=step), flush=True)
        return
    summary: dict[str, Any] = {"pid": os.getpid(), "saved": [], "refused": [], "other": []}
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(int(sys.argv[3])):
        try:
            summary["saved"].append(str(checkpointing.save(directory, state, loader=loader,
                                                           step=step, keep=3)))
        except OSError as error:
            if "is being written by" in str(error):
                summary["refused"].append(str(error))
            else:
                summary["other"].append(traceback.format_exc())
        except Exception:
            summary["other"].append(traceback.format_exc())
        state.step += 1
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
