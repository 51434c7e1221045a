"""A Hugging Face ``transformers`` LlamaForCausalLM as a client: built from a tiny
``LlamaConfig`` (no download), trained by accelfn's steps with the loss from
``model(ids, labels=ids)`` or outside ``forward`` (``model.model(ids).last_hidden_state`` and
``af.linear_cross_entropy`` over ``model.lm_head.weight``), each against the plain one-process
loop; ``checkpointed(blocks="auto")`` on its decoder layers; DDP, FSDP2 and FSDP2 x tensor
parallelism (``plans.llama()``, tp=2) in 4 gloo processes; exported with
``format="transformers"`` and reloaded by ``AutoModelForCausalLM.from_pretrained``.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=4
test_hf_llama.py OUT`` trains every case of CASES and saves what each rank saw in
``OUT/rank<r>.pt`` (a case that raises is recorded with its error, so that the others run).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: conftest and reference sit in tests/
    sys.path.insert(0, TESTS)

from helpers import save_rank_results, torchrun_results  # noqa: E402
from reference import reference_update  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import accelfn as af  # noqa: E402
from accelfn import checkpointing  # noqa: E402
from accelfn.transforms.distributed import plans  # noqa: E402

VOCAB, SEQ, ROWS, UPDATES, MICRO = 64, 16, 12, 3, 2
MAX_NORM = 0.5  # below every update's gradient norm: clipping acts each time
WORLD = 4
# each data shard's rows of the global batch: four shards, or two when tp=2 pairs the ranks
SHARDS = {4: [slice(0, 4), slice(4, 7), slice(7, 10), slice(10, 12)],
          2: [slice(0, 7), slice(7, 12)]}


def tiny_llama() -> LlamaForCausalLM:
    """Hidden 32, 2 decoder layers, 4 attention heads sharing 2 key-value heads, vocab 64."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def global_batch(update: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(update)
    return {"ids": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)}


SEEN: list[type] = []  # the class of every model a step function received


def labels_loss(model, batch):
    """The Hugging Face habit: the model shifts the labels and returns the mean loss."""
    SEEN.append(type(model))
    return model(batch["ids"], labels=batch["ids"]).loss


def hidden_loss(model, batch):
    """The loss outside ``forward``: the decoder's hidden states, then the head's weight in
    ``af.linear_cross_entropy`` (no logits in memory); the targets' count is the weight."""
    SEEN.append(type(model))
    ids = batch["ids"]
    h = model.model(ids).last_hidden_state
    loss, count = af.linear_cross_entropy(h[:, :-1], model.lm_head.weight, ids[:, 1:],
                                          return_count=True)
    return {"loss": loss, "weight": count}


LOSSES = {"labels": labels_loss, "hidden": hidden_loss}


def reference(updates: int = UPDATES) -> tuple[LlamaForCausalLM, list[torch.Tensor]]:
    """The plain loop, one process, every row: ``model(ids, labels=ids).loss.backward()``,
    ``clip_grad_norm_``, SGD with momentum. The trained model and each update's norm."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = [reference_update(model, optimizer, global_batch(i),
                              lambda m, b: m(b["ids"], labels=b["ids"]).loss,
                              max_norm=MAX_NORM)["grad_norm"] for i in range(updates)]
    return model, norms


def _count_block_calls(model: LlamaForCausalLM) -> list[int]:
    """A counter of the decoder layers' runs: it grows by one per layer per forward, and once
    more per layer when the layer is recomputed. It counts calls of each layer's first module
    (``input_layernorm``), as they start: a recompute stops once it has every tensor the
    backward needs, inside the layer's last matmul, before any hook after it."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    for layer in model.model.layers:
        layer.input_layernorm.register_forward_pre_hook(hook)
    return calls


# ------------------------------------------------------------------------- one process
def test_find_blocks_finds_the_decoder_layers():
    model = tiny_llama()
    found = af.find_blocks(model)
    assert [name for name, _ in found] == ["model.layers.0", "model.layers.1"]
    assert all(block is layer for (_, block), layer in zip(found, model.model.layers))


@pytest.mark.parametrize("loss", list(LOSSES))
def test_both_losses_equal_the_plain_loop(loss):
    """Accumulation over 2 micro-batches (samples, or the targets' count) and clipping."""
    want, norms = reference()
    model = tiny_llama()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = af.with_clipping(max_norm=MAX_NORM)(af.with_accumulation(MICRO)(LOSSES[loss]))
    SEEN.clear()
    for i in range(UPDATES):
        metrics = step(state, global_batch(i))
        torch.testing.assert_close(metrics["grad_norm"], norms[i], atol=1e-6, rtol=1e-5)
        assert norms[i] > MAX_NORM
    assert SEEN and all(issubclass(cls, LlamaForCausalLM) for cls in SEEN)
    for (name, a), b in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_checkpointed_auto_recomputes_the_decoder_layers_with_equal_gradients(loss):
    """Each layer runs twice per micro-batch (forward, then recomputed in the backward),
    whether the step calls ``model(...)`` or ``model.model(...)``; the update is bitwise the
    one without checkpointing."""
    plain, checkpointed = tiny_llama(), tiny_llama()
    calls = _count_block_calls(checkpointed)
    steps = [af.with_accumulation(MICRO)(LOSSES[loss]),
             af.with_accumulation(MICRO)(af.checkpointed(blocks="auto")(LOSSES[loss]))]
    states = [af.TrainState(m, torch.optim.SGD(m.parameters(), lr=0.1))
              for m in (plain, checkpointed)]
    for i in range(2):
        before = calls[0]
        for step, state in zip(steps, states):
            step(state, global_batch(i))
        assert calls[0] - before == 2 * 2 * MICRO, "layers x (forward + recompute) x micro"
    for (name, a), b in zip(checkpointed.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_export_in_transformers_format_reloads_with_equal_logits(tmp_path):
    model = tiny_llama()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.checkpointed(blocks="auto")(hidden_loss)
    for i in range(2):
        step(state, global_batch(i))
    folder = checkpointing.export(tmp_path / "hf", state, format="transformers")
    again = AutoModelForCausalLM.from_pretrained(folder)
    assert type(again) is LlamaForCausalLM
    mine, theirs = model.state_dict(), again.state_dict()
    assert sorted(mine) == sorted(theirs)  # a missing key would be initialised at random
    for key, value in mine.items():
        assert torch.equal(theirs[key], value), key
    ids = global_batch(5)["ids"]
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, model.eval()(ids).logits)


def test_the_llama_plan_names_every_projection_of_every_layer():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from accelfn.parts.distributed.plans import resolve_plan

    model = tiny_llama()
    resolved = resolve_plan(model, plans.llama(), tp=2)
    assert len(resolved) == 14 and list(resolved)[:7] == [
        f"model.layers.0.{name}" for name in ("self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj", "self_attn.o_proj",
                                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    rowwise = [name for name, style in resolved.items() if isinstance(style, RowwiseParallel)]
    assert [n.rsplit(".", 1)[1] for n in rowwise] == ["o_proj", "down_proj"] * 2
    assert sum(isinstance(s, ColwiseParallel) for s in resolved.values()) == 10
    assert next(iter(resolve_plan(model.model, plans.llama(model.config, tp=2), tp=2))) == \
        "layers.0.self_attn.q_proj"  # a bare LlamaModel's names too
    step = af.distributed(strategy="fsdp", tp=2, tensor_parallel=plans.llama())
    assert repr(step) == "distributed(fsdp, tp=2)"


def test_the_llama_plan_refuses_a_tp_that_splits_a_head():
    config = tiny_llama().config  # 4 attention heads, 2 key-value heads
    with pytest.raises(ValueError, match=r"num_key_value_heads=2, which 4 does not divide.*"
                                         r"pick tp among \[1, 2\]"):
        plans.llama(config, tp=4)
    with pytest.raises(TypeError, match="pass both"):
        plans.llama(config)


# ---------------------------------------------------------------------- torchrun worker
# name -> (loss, distributed options, tensor-parallel size); the "hidden" cases checkpoint
# the decoder layers too, and the FSDP cases export the trained model
CASES = {
    "ddp_labels": ("labels", {}, 1),
    "ddp_hidden": ("hidden", {}, 1),
    "fsdp_labels": ("labels", {"strategy": "fsdp"}, 1),
    "fsdp_hidden": ("hidden", {"strategy": "fsdp"}, 1),
    "fsdp_tp_labels": ("labels", {"strategy": "fsdp", "tp": 2}, 2),
    "fsdp_tp_hidden": ("hidden", {"strategy": "fsdp", "tp": 2}, 2),
}


def _step(name: str) -> af.Step:
    loss, options, tp = CASES[name]
    fn = af.checkpointed(blocks="auto")(LOSSES[loss]) if loss == "hidden" else LOSSES[loss]
    plan = {"tensor_parallel": plans.llama(tiny_llama().config, tp=tp)} if tp > 1 else {}
    return af.with_clipping(max_norm=MAX_NORM)(af.with_accumulation(MICRO)(
        af.distributed(**options, **plan)(fn)))


def _train(name: str, out_dir: str) -> dict:
    import torch.distributed as dist

    _, options, tp = CASES[name]
    model = tiny_llama()
    calls = _count_block_calls(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = _step(name)
    rows = SHARDS[WORLD // tp][dist.get_rank() // tp]  # a tp group shares its data shard
    SEEN.clear()
    norms, block_calls = [], []
    for i in range(UPDATES):
        before = calls[0]
        metrics = step(state, {k: v[rows] for k, v in global_batch(i).items()})
        norms.append(metrics["grad_norm"].clone())
        block_calls.append(calls[0] - before)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
              for n, p in model.named_parameters()}
    out = {"params": params, "norms": norms, "block_calls": block_calls,
           "seen": sorted({cls.__name__ for cls in SEEN}), "label": repr(step),
           "users_class": bool(SEEN) and all(issubclass(c, LlamaForCausalLM) for c in SEEN)}
    if options.get("strategy") == "fsdp":
        out["export"] = str(checkpointing.export(os.path.join(out_dir, name), state,
                                                 format="transformers"))
    return out


def worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    af.init_distributed()
    results: dict = {"seconds": {}}
    for name in CASES:
        start = time.perf_counter()
        try:
            results[name] = _train(name, out_dir)
        except Exception as exc:  # every rank fails alike; the next case still runs
            results[name] = {"error": "".join(traceback.format_exception(exc))[-3000:]}
        results["seconds"][name] = time.perf_counter() - start
    save_rank_results(out_dir, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_llama")
    start = time.perf_counter()
    got = torchrun_results(__file__, out, timeout=600, nproc=WORLD)
    print(f"\ntorchrun --nproc_per_node={WORLD}: {time.perf_counter() - start:.1f} s; per "
          f"case (rank 0): { {k: round(v, 2) for k, v in got[0]['seconds'].items()} }")
    return got


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_distributed_update_equals_one_process_on_every_ranks_rows(results, expected, case):
    want, norms = expected
    for rank in range(WORLD):
        got = results[rank][case]
        assert "error" not in got, f"{case} rank {rank}:\n{got.get('error')}"
        # the user's own model (FSDP2 makes its class a subclass, FSDPLlamaForCausalLM)
        assert got["users_class"], got["seen"]
        for name, value in want.named_parameters():
            torch.testing.assert_close(got["params"][name], value.detach(), atol=1e-5,
                                       rtol=1e-5, msg=f"{case} rank {rank} {name}")
        for i, (norm, norm_want) in enumerate(zip(got["norms"], norms)):
            torch.testing.assert_close(norm, norm_want, atol=1e-5, rtol=1e-5,
                                       msg=f"{case} rank {rank} update {i}")
        layers = 2
        per_update = layers * MICRO * (2 if CASES[case][0] == "hidden" else 1)
        assert got["block_calls"] == [per_update] * UPDATES, "recomputed once a micro-batch"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("fsdp")])
def test_a_sharded_model_exports_whole_and_reloads_with_equal_logits(results, expected, case):
    want, _ = expected
    got = results[0][case]
    assert "error" not in got, got.get("error")
    again = AutoModelForCausalLM.from_pretrained(got["export"])
    assert sorted(again.state_dict()) == sorted(want.state_dict())
    ids = global_batch(5)["ids"]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids).logits, copy.deepcopy(want).eval()(ids).logits,
                                   atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    worker(sys.argv[1])
