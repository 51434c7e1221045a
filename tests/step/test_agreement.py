"""accelfn.step.agreement: adaptive accumulation's agreement across processes (the two-process
runs are in tests/transforms/test_accumulation_adaptive.py; here what needs no process group)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from helpers import classify

import accelfn as af
from accelfn.step import agreement
from accelfn.step.spec import Sharding


def _sharding(refusal=None, declared=True):
    seen = []

    def micro(ctx, index, sync):
        seen.append(sync)
        return contextlib.nullcontext()

    part = Sharding(lambda prepared, state: prepared, micro, lambda ctx: None,
                    unsynced_refusal=(lambda ctx: refusal) if declared else None)
    return af.Transform("distributed", part), seen


def test_one_process_or_a_fixed_count_needs_no_agreement():
    adaptive = af.with_accumulation(2, adaptive=True)(classify)
    assert not agreement.needed(adaptive, SimpleNamespace(distributed=None))
    grouped, _ = _sharding()
    assert not agreement.needed(grouped(af.with_accumulation(2)(classify)),
                                SimpleNamespace(distributed="group"))
    assert agreement.needed(grouped(adaptive), SimpleNamespace(distributed="group"))


@pytest.mark.parametrize("refusal, declared, words", [
    ("FSDP2 (strategy='fsdp')", True, "got FSDP2 (strategy='fsdp')"),
    (None, False, "got a sharding that cannot run its backward unsynced"),
])
def test_a_sharding_that_cannot_skip_the_sync_is_refused_naming_it(refusal, declared, words):
    grouped, _ = _sharding(refusal, declared)
    step = grouped(af.with_accumulation(2, adaptive=True)(classify))
    with pytest.raises(ValueError, match="needs distributed\\(\\) with DDP") as error:
        agreement.needed(step, SimpleNamespace(distributed="group"))
    assert words in str(error.value) and "with_accumulation(n)" in str(error.value)


def test_unsynced_never_syncs_a_micro_batch_and_leaves_the_spec_alone():
    grouped, seen = _sharding()
    spec = grouped(classify).spec
    quiet = agreement.unsynced(spec)
    quiet.sharding.micro(None, 1, True)
    spec.sharding.micro(None, 1, True)
    assert seen == [False, True]
    assert agreement.unsynced(af.lift(classify).spec) is af.lift(classify).spec or \
        agreement.unsynced(af.lift(classify).spec).sharding is None


def test_only_an_agreed_error_says_so():
    assert not agreement.agreed(RuntimeError("x"))
