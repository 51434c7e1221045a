"""accelfn.core.carry: what a step function carries from one call to the next."""

from __future__ import annotations

import torch

from accelfn.core.carry import Carries


def test_a_carry_loaded_on_the_cpu_is_handed_on_the_steps_device_once():
    # a checkpoint loads its tensors on the CPU: a recurrent model on a GPU must get its
    # hidden state on the GPU (the meta device stands in for one here)
    saved = {"train": {0: (torch.ones(2, 3), {"c": torch.zeros(2)}), 1: None}, "evaluate": {}}
    carries = Carries()
    carries.load_state_dict(saved)
    meta = torch.device("meta")
    hidden, cell = carries.get("train", 0, meta)
    assert hidden.device == meta and cell["c"].device == meta and hidden.shape == (2, 3)
    assert carries.get("train", 0, meta)[0] is hidden  # moved once, kept there
    assert carries.get("train", 1, meta) is None
    cpu = torch.device("cpu")
    on_cpu = Carries()
    on_cpu.load_state_dict(saved)
    assert on_cpu.get("train", 0, cpu)[0] is saved["train"][0][0]  # already there: as it is
