"""accelfn.parts: each built-in's options are a frozen dataclass, checked when built (before
any step exists), whose repr is the label the stack prints; the engine calls the built-in's
functions with them by name."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import accelfn as af
from accelfn.parts.accumulation import Accumulation
from accelfn.parts.activation_checkpointing import COMPUTE_INTENSIVE_OPS, Checkpointing
from accelfn.parts.averaging import Averaging
from accelfn.parts.clipping import Clipping
from accelfn.parts.compilation import Compilation
from accelfn.parts.float8 import Float8
from accelfn.parts.nonfinite import NonFinite
from accelfn.parts.precision import Precision

BUILT = [
    (af.with_clipping(max_norm=0.5, norm_type=math.inf), Clipping(0.5, math.inf)),
    (af.with_clipping(max_value=3), Clipping(max_value=3.0)),
    (af.with_amp(dtype=torch.float16, fp32="head", cache=False),
     Precision(torch.float16, ("head",), cache=False)),
    (af.with_accumulation(4, mode="calls", dim=1), Accumulation(4, "calls", 1)),
    (af.with_nonfinite(policy="raise", skipped="advance"), NonFinite("raise", advance=True)),
    (af.checkpointed(blocks=torch.nn.Linear, every=2, selective=True),
     Checkpointing(torch.nn.Linear, 2, COMPUTE_INTENSIVE_OPS)),
    (af.compiled(mode="max-autotune", optimizer=True, regional="nested"),
     Compilation("max-autotune", optimizer=True, regional="nested")),
    (af.with_float8(min_features=32, recipe="rowwise"), Float8(32, recipe="rowwise")),
    (af.with_ema(decay=0.99, every=4, updates_per_epoch=10, warmup_epochs=1, adjust=2.0),
     Averaging(0.99, 4, updates_per_epoch=10, warmup_epochs=1, adjust=2.0)),
]


@pytest.mark.parametrize(("transform", "options"), BUILT, ids=lambda x: repr(x))
def test_a_transform_holds_its_options_whose_repr_is_its_label(transform, options):
    assert transform.part == options  # the options are the part: no closure record
    assert repr(transform) == repr(options)
    assert dict(transform.options) == {f.name: getattr(options, f.name)
                                       for f in dataclasses.fields(options)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.__setattr__(dataclasses.fields(options)[0].name, None)


def test_defaults_and_normalised_values():
    assert Clipping() == Clipping(max_norm=1.0) and repr(Clipping()) == "with_clipping(max_norm=1)"
    assert Clipping(max_norm=2).max_norm == 2.0 and isinstance(Clipping(max_norm=2).max_norm, float)
    assert Precision(fp32=torch.nn.LSTM).fp32 == (torch.nn.LSTM,)
    assert repr(Precision()) == "with_amp(auto)" and Precision().scales
    assert not Precision(torch.bfloat16).scales
    assert repr(NonFinite()) == "with_nonfinite(skip, max_consecutive=10)"
    assert repr(Accumulation(2, adaptive=True)) == "with_accumulation(2, adaptive)"
    # equal options share the key their settings are kept under on the blocks
    assert Averaging(0.9, adjust=2.0).schedule.decay == pytest.approx(0.8)  # torchvision's
    assert Checkpointing(every=2).key == Checkpointing(every=2).key != Checkpointing().key


@pytest.mark.parametrize(("build", "match"), [
    (lambda: Clipping(max_norm=1.0, max_value=1.0), "max_norm or max_value, not both"),
    (lambda: Clipping(max_norm=math.inf), "finite number > 0"),
    (lambda: Clipping(norm_type=0), "norm_type"),
    (lambda: Precision(torch.float32), "not a mixed-precision dtype"),
    (lambda: Precision(init_scale=math.inf), "init_scale"),
    (lambda: Accumulation(0), "n >= 1"),
    (lambda: Accumulation(2, mode="calls", adaptive=True), "adaptive=True"),
    (lambda: NonFinite("ignore"), "policy='ignore'"),
    (lambda: NonFinite(max_consecutive=0), "max_consecutive"),
    (lambda: Checkpointing(every=0), "every"),
    (lambda: Compilation(mode="fast"), "mode='fast'"),
    (lambda: Averaging(decay=1.0), "decay=1.0"),
    (lambda: Float8(min_features=8), "min_features=8"),
    (lambda: Averaging(warmup_epochs=2), "needs updates_per_epoch"),
    (lambda: Compilation(backend="inductor", cache=""), "path of a file"),
    (lambda: Checkpointing(save=(), offload="cpu"), "pass one of them"),
])
def test_bad_options_are_refused_when_built_naming_the_option(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_sharding_options_compare_by_value_and_are_refused_when_built():
    from accelfn.parts.sharding import Sharding

    a, b = af.distributed(strategy="hsdp", replicate=2), af.distributed(strategy="hsdp",
                                                                         replicate=2)
    assert isinstance(a.part, Sharding) and a.part is not b.part
    assert a == b and repr(a) == repr(a.part) == "distributed(hsdp, replicate=2)"
    assert dict(a.options)["replicate"] == 2 and a != af.distributed(strategy="hsdp")
    with pytest.raises(ValueError, match="ZeRO-3 is strategy='fsdp'"):
        Sharding(strategy="zero3")
    with pytest.raises(ValueError, match="pass strategy='hsdp' with it"):
        Sharding(replicate=2)
