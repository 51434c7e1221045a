"""export(): the weights in a safetensors file that loads into the plain model bitwise, from
one process or gathered from FSDP2 and HSDP shards and DDP (2 gloo processes), the EMA on
request, tied weights written once, a dtype option; refusals before anything is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import torchrun_results
from torch import nn

import accelfn as af
from accelfn.checkpointing.exporting import EXPORT_FILE, export, tied_names

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

WORKER = Path(__file__).with_name("export_worker.py")
sys.path.insert(0, str(WORKER.parent))
import export_worker as worker  # noqa: E402


def load_plain(path: Path) -> nn.Module:
    """What a user without accelfn does: load_file, re-tie what the header records, and
    load_state_dict(strict=True) into a new model."""
    weights = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        for dropped, kept in json.loads(f.metadata()["accelfn.tied"]).items():
            weights[dropped] = weights[kept]
    model = worker.TiedLM()
    model.load_state_dict(weights, strict=True)
    return model


def trained(ema: bool = True) -> tuple[af.TrainState, af.Step]:
    torch.manual_seed(0)
    model = worker.TiedLM()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = worker.lm_loss
    step = af.with_ema(decay=0.5)(step) if ema else af.with_clipping(max_norm=1.0)(step)
    batches = worker.data()
    for i in range(worker.STEPS):
        step(state, batches[8 * i: 8 * (i + 1)])
    return state, step


def assert_equal(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_the_file_is_the_model_state_dict_written_by_hand(tmp_path):
    state, _ = trained()
    path = export(tmp_path / "out", state)
    assert path == tmp_path / "out" / EXPORT_FILE
    assert_equal(load_plain(path), state.model.state_dict())
    # the same tensors as safetensors' save_file of the plain state_dict, the tie dropped
    by_hand = {k: v for k, v in state.model.state_dict().items() if k != "head.weight"}
    save_file(by_hand, str(tmp_path / "by_hand.safetensors"))
    written, reference = load_file(str(path)), load_file(str(tmp_path / "by_hand.safetensors"))
    assert set(written) == set(reference)
    assert all(torch.equal(written[k], reference[k]) for k in reference)
    with safe_open(str(path), "pt") as f:
        header = f.metadata()
    assert json.loads(header["accelfn.tied"]) == {"head.weight": "embed.weight"}
    assert header["format"] == "pt" and header["accelfn.step"] == str(worker.STEPS)
    assert header["accelfn.ema"] == "false"


def test_ema_exports_the_average_and_leaves_the_model_as_it_was(tmp_path):
    state, _ = trained()
    own = {k: v.clone() for k, v in state.model.state_dict().items()}
    expected = af.ema_state_dict(state)
    assert not torch.equal(expected["embed.weight"], own["embed.weight"])  # they differ
    path = export(tmp_path, state, ema=True, metadata={"run": "tiny"})
    assert_equal(load_plain(path), expected)
    assert_equal(state.model, own)
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["accelfn.ema"] == "true" and f.metadata()["run"] == "tiny"


def test_a_dtype_casts_the_floating_point_tensors_only(tmp_path):
    state, _ = trained()
    weights = load_file(str(export(tmp_path, state, dtype=torch.bfloat16)))
    for key, value in state.model.state_dict().items():
        if key == "head.weight":
            continue
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert weights[key].dtype == want.dtype and torch.equal(weights[key], want), key
    assert weights["blocks.0.norm.num_batches_tracked"].dtype == torch.int64


def test_a_plain_model_without_ties_and_an_export_over_an_older_one(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert tied_names(model) == {}
    export(tmp_path, state)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    path = export(tmp_path, state)  # replaced
    weights = load_file(str(path))
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == [EXPORT_FILE]  # no temporary left


def test_bad_calls_are_refused_before_anything_is_written(tmp_path):
    state, _ = trained(ema=False)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"ema=True.*no EMA weights: build the step with "
                                         r"af.with_ema"):
        export(out, state, ema=True)
    with pytest.raises(ValueError, match=r"format='onnx'.*'safetensors'"):
        export(out, state, format="onnx")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype=torch.int8.*floating-point"):
        export(out, state, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"TiedLM has no save_pretrained.*format='safetensors'"):
        export(out, state, format="transformers")
    with pytest.raises(TypeError, match="metadata maps str to str"):
        export(out, state, metadata={"step": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"must be an accelfn\.TrainState"):
        export(out, state.model)  # type: ignore[arg-type]
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        export(tmp_path / "file", state)
    assert not out.exists()


def plain_loop() -> dict[str, torch.Tensor]:
    """The FSDP and DDP runs by hand: each update's global batch, whole, in one process (the
    mean gradient over 2 equal halves is the full batch's). BatchNorm's running statistics
    are per process there, so only the parameters are compared."""
    torch.manual_seed(0)
    model = worker.TiedLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = worker.data()
    n = 2 * worker.BATCH
    for i in range(worker.STEPS):
        batch = batches[n * i: n * (i + 1)]
        # each process normalises its own half: run the halves apart, average their losses
        halves = [F.cross_entropy(model(batch["x"][h * worker.BATCH:(h + 1) * worker.BATCH]),
                                  batch["y"][h * worker.BATCH:(h + 1) * worker.BATCH])
                  for h in range(2)]
        optimizer.zero_grad()
        (sum(halves) / 2).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.distributed
def test_export_from_fsdp2_and_hsdp_shards_and_ddp_on_2_processes(tmp_path):
    ranks = torchrun_results(WORKER, tmp_path)
    by_hand = plain_loop()
    for strategy in ("fsdp", "hsdp", "ddp"):
        run = ranks[0][strategy]
        assert run["files"] == ranks[1][strategy]["files"]  # every process gets the path
        assert run["sharded"] is (strategy != "ddp")
        assert run["untouched"] and ranks[1][strategy]["untouched"]
        model = load_plain(Path(run["files"]["weights"]))
        assert_equal(model, run["weights"])  # bitwise: what the shards hold
        assert_equal(load_plain(Path(run["files"]["ema"])), run["ema"])
        for name, param in model.named_parameters():  # and what a plain loop trains
            torch.testing.assert_close(param.detach(), by_hand[name], atol=1e-5, rtol=1e-5)
        bf16 = load_file(run["files"]["bf16"])
        assert torch.equal(bf16["embed.weight"], run["weights"]["embed.weight"].bfloat16())


def test_transformers_save_pretrained_layout(tmp_path):
    import transformers  # the test extra installs it (accelfn[hf]): never skipped in CI

    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2,
                                     n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    folder = export(tmp_path / "hf", state, format="transformers")
    assert (folder / "config.json").is_file() and (folder / EXPORT_FILE).is_file()
    again = transformers.GPT2LMHeadModel.from_pretrained(folder)
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
