"""Which stacks of built-in transforms build: every pair of different built-ins does (their
hooks that share an ordered phase are independent and declare so), in either order, and a
stack refused is refused when it is built. Nothing here calls a step, so nothing compiles."""

from __future__ import annotations

import itertools

import pytest
import torch

import accelfn as af


def _loss(model, batch):
    return model(batch["x"]).sum()


def builtins(tmp_path) -> dict[str, af.Transform]:
    """Every built-in, in each configuration that changes which hooks it fills."""
    return {
        "with_amp()": af.with_amp(),
        "with_amp(fp16)": af.with_amp(dtype=torch.float16),
        "with_amp(bf16)": af.with_amp(dtype=torch.bfloat16),
        "with_accumulation(2)": af.with_accumulation(2),
        "with_accumulation(2, calls)": af.with_accumulation(2, mode="calls"),
        "with_clipping": af.with_clipping(max_norm=1.0),
        "with_nonfinite": af.with_nonfinite(),
        "with_ema": af.with_ema(decay=0.9),
        "with_float8": af.with_float8(),
        "with_float8(fsdp_float8_all_gather)": af.with_float8(fsdp_float8_all_gather=True),
        "compiled": af.compiled(),
        "compiled(eager)": af.compiled(backend="eager"),
        "compiled(cache)": af.compiled(cache=tmp_path / "compile-cache.bin"),
        "checkpointed": af.checkpointed(),
        "distributed": af.distributed(),
    }


def _pairs(tmp_path):
    found = builtins(tmp_path)
    return [(a, b, found[a], found[b]) for a, b in itertools.permutations(found, 2)
            if found[a].name != found[b].name]


def test_every_pair_of_different_builtins_builds_in_either_order(tmp_path):
    refused = []
    for a, b, outer, inner in _pairs(tmp_path):
        try:
            outer(inner(_loss))
        except ValueError as error:
            refused.append(f"{a} over {b}: {error}")
    assert not refused, "\n".join(refused)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_every_after_update_hook_together_builds_in_any_order(tmp_path, order):
    """The four built-ins with an after_update hook: the scaler's update, the EMA average,
    float8's scale precompute and the compile cache's write are independent."""
    stack = [af.with_amp(dtype=torch.float16), af.with_ema(decay=0.9),
             af.with_float8(fsdp_float8_all_gather=True), af.compiled(cache=tmp_path / "c.bin")]
    step = _loss
    for i in order:
        step = stack[i](step)
    assert {t.name for t in step.transforms} == {"with_amp", "with_ema", "with_float8",
                                                 "compiled"}


@pytest.mark.parametrize("amp", [af.with_amp(), af.with_amp(dtype=torch.float16),
                                 af.with_amp(dtype=torch.bfloat16)])
def test_calls_mode_accumulation_stacks_with_amp_either_way(amp):
    """Closing the window and the scaler forgetting its step (their abort hooks) commute."""
    calls = af.with_accumulation(4, mode="calls")
    assert calls(amp(_loss)).transforms and amp(calls(_loss)).transforms
    full = af.with_ema(decay=0.9)(calls(amp(af.with_clipping(max_norm=1.0)(_loss))))
    assert len(full.transforms) == 4


def test_refused_stacks_are_refused_when_built(tmp_path):
    with pytest.raises(ValueError, match="applied twice"):
        af.with_amp(af.with_amp(dtype=torch.float16)(_loss))
    with pytest.raises(ValueError, match="applied twice"):
        af.compiled(af.compiled(cache=tmp_path / "c.bin")(_loss))
    with pytest.raises(ValueError, match="applied twice"):
        af.with_accumulation(2)(af.with_accumulation(2, mode="calls")(_loss))
    # a user gradient transform stacks next to every built-in, in any order
    mine = af.GradientTransform("mine", lambda grads, params, state: None)
    for builtin in (af.compiled(cache=tmp_path / "c.bin"), af.with_ema(),
                    af.distributed(strategy="fsdp"), af.with_amp(dtype=torch.float16),
                    af.with_accumulation(2, mode="calls"), af.with_clipping(max_norm=1.0)):
        assert len(mine(builtin(_loss)).transforms) == 2
        assert len(builtin(mine(_loss)).transforms) == 2
