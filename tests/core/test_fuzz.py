"""Fuzzing with hypothesis: malformed batches and configurations fed to steps (damaged
checkpoints fed to load: checkpointing/test_fuzz_checkpoints.py).

Every generated case must end in one of:

* ``config``    building the step raised TypeError/ValueError (a bad option);
* ``refused``   the step raised a documented error (TypeError, ValueError, KeyError,
                NonFiniteError; a missing key is the function's own KeyError) with the state
                untouched;
* ``fn_error``  the user's function raised something else (a wrong feature size reaching
                ``nn.Linear``, float targets): propagated unchanged, state untouched;
* ``skipped``   a NaN/Inf input was skipped by the guard, state untouched;
* ``update``    an update equal to the hand-written reference loop's.

Never a silent wrong result: a valid batch must update, a skip needs a non-finite input, and
an update must match the reference. The counts are printed (``pytest -s``) and each kind must
occur.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from fuzz_helpers import assert_untouched, fresh_state, snapshot
from helpers import classify
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reference import reference_update
from tensordict import TensorDict

import accelfn as af

DOCUMENTED = (TypeError, ValueError, KeyError, af.NonFiniteError)
INVALID_N = [0, -1, 2.5, True, "2"]
INVALID_NORM = [0.0, -1.0, "1"]
INVALID_POLICY = ["ignore", "SKIP", None]
INVALID_LIMIT = [0, -2, 1.5, True]
MUTATIONS = ["none", "none", "none", "nonfinite", "nonfinite",  # (drawn more often)
             "extra_key", "as_tensordict", "container", "drop_key", "non_tensor", "zero_dim",
             "mismatch", "empty", "meta_device", "int_targets_float", "feature_dim",
             "td_no_batch_dim"]


@st.composite
def configs(draw):
    """A valid configuration, or (one time in five) one with a single bad option."""
    config = {
        "n": draw(st.integers(1, 4)),
        "max_norm": draw(st.one_of(st.none(), st.floats(0.05, 5.0))),
        "policy": draw(st.sampled_from(["skip", "raise", "off", "default"])),
        "max_consecutive": draw(st.integers(1, 4)),
        "amp": draw(st.sampled_from([None, None, "bf16"])),
    }
    bad = draw(st.sampled_from([None] * 20 + list(config)))
    if bad is not None:
        if bad == "max_consecutive":
            config["policy"] = "skip"
        config[bad] = draw(st.sampled_from({"n": INVALID_N, "max_norm": INVALID_NORM,
                                            "policy": INVALID_POLICY,
                                            "max_consecutive": INVALID_LIMIT,
                                            "amp": ["float64"]}[bad]))
    return config


@st.composite
def batches(draw):
    size = draw(st.integers(1, 9))
    mutation = draw(st.sampled_from(MUTATIONS))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(size, 6, generator=g), "y": torch.randint(0, 4, (size,),
                                                                         generator=g)}
    if mutation == "extra_key":
        batch["z"] = torch.ones(size, 3)
    elif mutation == "as_tensordict":
        batch = TensorDict(batch, batch_size=[size])
    elif mutation == "container":
        batch = draw(st.sampled_from([[batch["x"], batch["y"]], (batch["x"],), batch["x"], None,
                                      3, "x"]))
    elif mutation == "drop_key":
        del batch[draw(st.sampled_from(["x", "y"]))]
    elif mutation == "non_tensor":
        batch["y"] = draw(st.sampled_from([batch["y"].tolist(), batch["y"].numpy(), 1]))
    elif mutation == "zero_dim":
        batch["x"] = torch.tensor(1.0)
    elif mutation == "mismatch":
        batch["y"] = torch.randint(0, 4, (size + draw(st.integers(1, 3)),), generator=g)
    elif mutation == "empty":
        batch = {"x": torch.randn(0, 6), "y": torch.zeros(0, dtype=torch.long)}
    elif mutation == "meta_device":
        batch["y"] = batch["y"].to("meta")
    elif mutation == "nonfinite":
        batch["x"][draw(st.integers(0, size - 1)), draw(st.integers(0, 5))] = draw(
            st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    elif mutation == "int_targets_float":
        batch["y"] = batch["y"].float()
    elif mutation == "feature_dim":
        batch["x"] = torch.randn(size, draw(st.sampled_from([1, 5, 7])), generator=g)
    elif mutation == "td_no_batch_dim":
        batch = TensorDict({"x": batch["x"], "y": batch["y"]}, batch_size=[])
    return mutation, size, batch


def _config(policy: str) -> dict:
    return {"n": 2, "max_norm": 1.0, "policy": policy, "max_consecutive": 3, "amp": None}


def _nan_case() -> tuple:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    x[1, 2] = float("nan")
    return "nonfinite", 5, {"x": x, "y": torch.tensor([0, 1, 2, 3, 0])}


def build(config):
    step = af.lift(classify)
    if config["max_norm"] is not None:
        step = af.with_clipping(max_norm=config["max_norm"])(step)
    step = af.with_accumulation(config["n"])(step)
    if config["policy"] != "default":
        step = af.with_nonfinite(policy=config["policy"],
                                 max_consecutive=config["max_consecutive"])(step)
    if config["amp"] is not None:
        step = af.with_amp(dtype={"bf16": torch.bfloat16, "float64": torch.float64}[
            config["amp"]])(step)
    return step


@pytest.mark.slow
def test_fuzz_steps_with_malformed_batches_and_configurations(capsys):
    outcomes: Counter[str] = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(config=configs(), case=batches())
    @example(config=_config("default"), case=_nan_case())   # skipped
    @example(config=_config("raise"), case=_nan_case())     # NonFiniteError
    @example(config=_config("off"), case=_nan_case())       # applied, as the reference does
    def check(config, case):
        mutation, size, batch = case
        try:
            step = build(config)
        except (TypeError, ValueError):
            outcomes["config"] += 1
            return
        state = fresh_state(size)
        af.lift(classify)(state, {"x": torch.randn(4, 6), "y": torch.tensor([0, 1, 2, 3])})
        before = snapshot(state)
        mirror = copy.deepcopy(state)  # model, optimizer, scheduler for the reference
        raised_in_fn = []

        def fn(model, b):
            try:
                return classify(model, b)
            except Exception as error:
                raised_in_fn.append(error)
                raise

        step = af.Step(fn, step.transforms)
        steps_before = state.step
        try:
            metrics = step(state, batch)
        except Exception as error:
            if isinstance(error, DOCUMENTED):  # a missing key: the function's own KeyError
                well_formed = mutation in ("none", "extra_key", "as_tensordict")
                assert not (well_formed and size >= config["n"]), f"refused a good batch: {error}"
                assert str(error), "an error without a message"
                outcome = "refused"
            else:
                assert raised_in_fn and error is raised_in_fn[-1], f"{mutation}: {error!r}"
                assert mutation in ("int_targets_float", "feature_dim"), (mutation, error)
                outcome = "fn_error"
            assert_untouched(before, state)
            assert state.step == steps_before
            outcomes[outcome] += 1
            return
        valid = mutation in ("none", "extra_key", "as_tensordict", "nonfinite")
        assert valid, f"{mutation} was accepted as a batch"
        if "skipped" in metrics.keys() and bool(metrics["skipped"]):
            assert mutation == "nonfinite", "a finite batch was skipped"
            assert_untouched(before, state)
            outcomes["skipped"] += 1
            return
        plain = {k: v for k, v in batch.items()}
        reference_update(mirror.model, mirror.optimizer, plain, classify, micro=config["n"],
                         amp_dtype=torch.bfloat16 if config["amp"] == "bf16" else None,
                         max_norm=config["max_norm"], scheduler=mirror.scheduler)
        tol = 1e-3 if config["amp"] == "bf16" else 1e-6
        for got, want in zip(state.model.parameters(), mirror.model.parameters()):
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)
        if mutation == "nonfinite":
            assert config["policy"] == "off"  # only "off" applies a non-finite update
        outcomes["update"] += 1

    check()
    total = sum(outcomes.values())
    with capsys.disabled():
        print(f"\nfuzzed steps: {total} cases: {dict(sorted(outcomes.items()))}")
    assert total == 303  # 300 generated and 3 explicit examples
    assert set(outcomes) == {"config", "refused", "fn_error", "skipped", "update"}, outcomes
