"""examples/distill.py: the student's step equals the plain distillation loop bitwise (fp32).

The reference loop imports nothing from accelfn: the teacher frozen and called under
``no_grad``, the loss written out, ``backward()``, ``optimizer.step()``,
``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from example_modules import load_example
from tensordict import TensorDict

import accelfn as af
from accelfn import checkpointing

distill = load_example("distill")
T, ALPHA = 4.0, 0.9


def batches(n: int = 4, size: int = 32):
    dataset = distill.digits()
    image = (dataset["image"].float() / 255 - 0.3) / 0.38
    return [(image[i * size:(i + 1) * size], dataset["label"][i * size:(i + 1) * size])
            for i in range(n)]


def models():
    torch.manual_seed(0)
    teacher, student = distill.mlp(64), distill.mlp(16)
    teacher.requires_grad_(False).eval()
    return teacher, student


def test_student_step_equals_the_plain_distillation_loop_bitwise():
    teacher, student = models()
    plain = copy.deepcopy(student)
    frozen = copy.deepcopy(teacher.state_dict())
    state = af.TrainState(student, torch.optim.AdamW(student.parameters(), lr=3e-3))
    step = af.lift(distill.distillation(teacher, temperature=T, alpha=ALPHA))
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    for image, label in batches():
        metrics = step(state, TensorDict({"image": image, "label": label}, batch_size=[32]))
        logits = plain(image)  # the plain loop
        with torch.no_grad():
            target = teacher(image)
        soft = F.kl_div(F.log_softmax(logits / T, dim=-1), F.log_softmax(target / T, dim=-1),
                        reduction="batchmean", log_target=True) * T * T
        loss = ALPHA * soft + (1 - ALPHA) * F.cross_entropy(logits, label)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert torch.equal(metrics["loss"], loss.detach())
    for a, b in zip(student.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    for key, value in teacher.state_dict().items():  # untouched, and given no gradient
        assert torch.equal(value, frozen[key]), key
    assert all(p.grad is None for p in teacher.parameters())
    assert not torch.equal(student[1].weight, models()[1][1].weight)  # it trained


def test_alpha_zero_is_plain_cross_entropy_and_alpha_one_the_teacher_alone():
    teacher, student = models()
    image, label = batches(1)[0]
    batch = TensorDict({"image": image, "label": label}, batch_size=[32])
    labels_only = distill.distillation(teacher, temperature=T, alpha=0.0)(student, batch)
    assert torch.equal(labels_only["loss"], F.cross_entropy(student(image), label))
    teacher_only = distill.distillation(teacher, temperature=T, alpha=1.0)(student, batch)
    assert torch.equal(teacher_only["loss"], teacher_only["soft"])
    same = distill.distillation(student, temperature=T, alpha=1.0)(student, batch)
    assert float(same["soft"].detach()) < 1e-6  # a student equal to its teacher: nothing left


@pytest.mark.slow
def test_distill_example_trains_and_resumes_without_training_the_teacher_again(tmp_path,
                                                                                capsys):
    small = ["--teacher-steps", "20"]
    straight = str(tmp_path / "straight")
    report = distill.main([*small, "--steps", "8", "--out", straight])
    assert report["updates"] == 8 and report["teacher_accuracy"] > 0.5  # chance is 0.1
    split = str(tmp_path / "split")
    distill.main([*small, "--steps", "4", "--out", split])
    capsys.readouterr()
    resumed = distill.main([*small, "--steps", "8", "--resume", split])
    assert "teacher:" not in capsys.readouterr().out  # loaded from the checkpoint
    assert resumed["updates"] == 8
    assert resumed["teacher_accuracy"] == report["teacher_accuracy"]
    a = torch.load(checkpointing.latest(straight) / "state.pt", weights_only=True)
    b = torch.load(checkpointing.latest(split) / "state.pt", weights_only=True)
    for key, value in a["state"]["model"].items():
        assert torch.equal(value, b["state"]["model"][key]), key
