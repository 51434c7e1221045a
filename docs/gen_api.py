"""Write docs/api.md, the API reference, from the package's docstrings.

    python docs/gen_api.py          # rewrite docs/api.md
    python docs/gen_api.py --check  # exit 1 if docs/api.md is out of date (run by the tests)
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import accelfn
import accelfn.data

SECTIONS = {
    "Steps and state": ["lift", "Step", "TrainState", "describe", "NonFiniteError"],
    "Transforms": ["with_amp", "with_accumulation", "with_clipping", "compiled", "checkpointed",
                   "distributed", "with_nonfinite", "with_ema"],
    "Writing transforms": ["Transform", "Hooks", "PHASES", "Prepared", "CallContext",
                           "UpdateContext", "Plan", "Decision", "Sums", "apply_transform"],
}


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


def _entry(module: str, name: str, obj: object) -> str:
    kind = "class" if inspect.isclass(obj) else ("function" if callable(obj) else "value")
    doc = inspect.getdoc(obj) or "(no docstring)"
    if kind == "value":
        return f"### `{module}.{name}`\n\n```python\n{name} = {obj!r}\n```\n"
    return f"### `{module}.{name}{_signature(obj)}`\n\n{doc}\n"


def render() -> str:
    out = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.", ""]
    done: set[str] = set()
    for title, names in SECTIONS.items():
        out += [f"## {title}", ""]
        for name in names:
            out.append(_entry("accelfn", name, getattr(accelfn, name)))
            done.add(name)
    modules = {"data", "datasets", "checkpointing", "preemption"}
    rest = [n for n in accelfn.__all__ if n not in done and n not in modules]
    out += ["## Recipe, measurement and helpers", ""]
    out += [_entry("accelfn", n, getattr(accelfn, n)) for n in sorted(rest, key=str.lower)]
    out += ["## accelfn.data", ""]
    out += [_entry("accelfn.data", n, getattr(accelfn.data, n))
            for n in sorted(accelfn.data.__all__, key=str.lower)]
    out += ["## accelfn.checkpointing", ""]
    out += [_entry("accelfn.checkpointing", n, getattr(accelfn.checkpointing, n))
            for n in ("save", "load", "latest", "checkpoints", "rng_state", "set_rng_state")]
    out += ["## accelfn.data.datasets", "", _entry("accelfn.data.datasets", "digits",
                                              accelfn.data.datasets.digits)]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    path = Path(__file__).with_name("api.md")
    text = render()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
