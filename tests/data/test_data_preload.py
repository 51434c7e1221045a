"""accelfn.data preloading: memory-mapped TensorDicts written once, image folders, JPEG bytes."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import MemoryMappedTensor, TensorDict

import accelfn.data as ad


class Images:
    """Map-style uint8 images with int labels (as (image, label) tuples)."""

    def __init__(self, n: int = 50) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (n, 3, 6, 6), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i % 5


class Exploding(Images):
    def __getitem__(self, i: int):
        raise AssertionError("a complete preload must not be read again")


def test_preload_writes_uint8_memmap_and_training_reads_it(tmp_path):
    ds = Images()
    td = ad.preload(ds, tmp_path / "p", batch_size=16, num_workers=2)
    assert td.batch_size == torch.Size([50])
    assert isinstance(td["image"], MemoryMappedTensor)
    assert td["image"].dtype == torch.uint8  # uint8 images stay uint8
    assert torch.equal(td["image"], ds.x)
    assert td["label"].tolist() == [i % 5 for i in range(50)]
    assert (tmp_path / "p" / "image.memmap").stat().st_size == 50 * 3 * 6 * 6

    reopened = ad.open_preloaded(tmp_path / "p")
    in_memory = TensorDict({"image": ds.x, "label": td["label"].clone()}, batch_size=[50])
    a = list(ad.loader(reopened, batch_size=8, seed=2, transform=ad.RandomHorizontalFlip()))
    b = list(ad.loader(in_memory, batch_size=8, seed=2, transform=ad.RandomHorizontalFlip()))
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(a, b)) and len(a) == 6


def test_preload_is_written_once(tmp_path):
    ad.preload(Images(), tmp_path / "p")
    stamp = os.stat(tmp_path / "p" / "image.memmap").st_mtime_ns
    again = ad.preload(Exploding(), tmp_path / "p")  # complete: opened, not rewritten
    assert again.batch_size == torch.Size([50])
    assert os.stat(tmp_path / "p" / "image.memmap").st_mtime_ns == stamp
    with pytest.raises(ValueError, match="overwrite=True"):
        ad.preload(Images(40), tmp_path / "p")
    assert ad.preload(Images(40), tmp_path / "p", overwrite=True).batch_size == torch.Size([40])


def test_preload_tensordict_source_and_metadata(tmp_path):
    src = TensorDict({"x": torch.arange(30.0).view(10, 3), "y": torch.arange(10)}, [10])
    td = ad.preload(src, tmp_path / "t", metadata={"classes": ["a", "b"]})
    assert torch.equal(td["x"], src["x"]) and torch.equal(td["y"], src["y"])
    info = ad.preload_info(tmp_path / "t")
    assert info["num_samples"] == 10 and info["metadata"] == {"classes": ["a", "b"]}


def test_unfinished_preload_is_detected(tmp_path):
    ad.preload(Images(), tmp_path / "p")
    os.remove(tmp_path / "p" / "accelfn_preload.json")  # as if interrupted before the end
    with pytest.raises(ValueError, match="unfinished"):
        ad.open_preloaded(tmp_path / "p")
    with pytest.raises(FileNotFoundError):
        ad.open_preloaded(tmp_path / "nothing")


def test_preload_refuses_foreign_directories_and_bad_sources(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a preloaded dataset"):
        ad.preload(Images(), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").exists()
    with pytest.raises(TypeError, match="sized source"):
        ad.preload(iter([1, 2]), tmp_path / "x")
    with pytest.raises(ValueError, match="empty"):
        ad.preload([], tmp_path / "x")


def test_preload_reports_inconsistent_samples(tmp_path):
    data = [{"image": torch.zeros(3, 4, 4)} for _ in range(9)] + [{"image": torch.zeros(3, 5, 4)}]
    with pytest.raises(ValueError, match="sample 9"):
        ad.preload(data, tmp_path / "p", batch_size=4)


# --------------------------------------------------------------------------------------------
# Image folders


@pytest.fixture
def image_folder(tmp_path):
    from torchvision.io import write_jpeg, write_png

    root = tmp_path / "folder"
    g = torch.Generator().manual_seed(0)
    sizes = [(20, 30), (32, 24), (16, 16)]
    for c, cls in enumerate(["cat", "dog"]):
        (root / cls).mkdir(parents=True)
        for i, (h, w) in enumerate(sizes):
            img = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
            img[0] = 40 + 150 * c  # class-dependent red level survives compression
            write_jpeg(img, str(root / cls / f"{i}.jpg"), quality=95)
    write_png(torch.zeros(3, 8, 8, dtype=torch.uint8), str(root / "dog" / "extra.png"))
    return root


def test_preload_image_folder_recipe(tmp_path, image_folder):
    td = ad.preload_image_folder(image_folder, tmp_path / "pre", size=12, num_workers=2)
    assert td["image"].shape == (7, 3, 12, 12) and td["image"].dtype == torch.uint8
    assert td["label"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert ad.preload_info(tmp_path / "pre")["metadata"]["classes"] == ["cat", "dog"]
    red = td["image"][:6, 0].float().mean((1, 2))
    assert (red[:3] < 70).all() and (red[3:6] > 160).all()
    # ... then train from it with GPU-side augmentation.
    train = ad.loader(
        ad.open_preloaded(tmp_path / "pre"),
        batch_size=4,
        device="cpu",
        transform=ad.Compose(
            ad.RandomResizedCrop(8), ad.RandomHorizontalFlip(), ad.Normalize([0.5] * 3, [0.5] * 3)
        ),
    )
    b = next(iter(train))
    assert b["image"].shape == (4, 3, 8, 8) and b["image"].dtype == torch.float32


def test_jpeg_files_decoded_by_the_batch_transform(image_folder):
    files, labels, _ = ad.find_images(image_folder)
    jpgs = [(f, y) for f, y in zip(files, labels) if f.endswith(".jpg")]
    ds = ad.ImageFiles([f for f, _ in jpgs], [y for _, y in jpgs], jpeg=True)
    loader = ad.loader(
        ds,
        batch_size=3,
        shuffle=False,
        device="cpu",
        num_workers=2,
        transform=ad.Compose(ad.DecodeJPEG(size=10), ad.RandomHorizontalFlip()),
    )
    batches = list(loader)
    assert len(batches) == 2
    b = batches[0]
    assert sorted(b.keys()) == ["image", "label"]
    assert b["image"].shape == (3, 3, 10, 10) and b["label"].tolist() == [0, 0, 0]
    red = torch.cat([x["image"][:, 0].float().mean((1, 2)) for x in batches])
    assert (red[:3] < 70).all() and (red[3:] > 160).all()


def test_jpeg_files_are_read_as_bytes_without_torchvision_io(image_folder):
    # jpeg=True reads the file's bytes with Python's own file reading (a per-sample cost the
    # loader's threads pay under the GIL: torchvision's read_file and tensor-by-tensor checks
    # cost 2.5x more), not torchvision.io's read_file, deprecated since torchvision 0.29.
    import warnings

    jpgs = [f for f in ad.find_images(image_folder)[0] if f.endswith(".jpg")]
    ds = ad.ImageFiles(jpgs, list(range(len(jpgs))), jpeg=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sample = ds[4]
    with open(jpgs[4], "rb") as f:
        assert bytes(sample["jpeg"].numpy()) == f.read()
    assert sample["jpeg"].dtype == torch.uint8 and sample["jpeg"].dim() == 1
    assert sample["label"].dtype == torch.int64 and sample["label"].item() == 4


def test_image_files_rejects_non_jpeg_in_jpeg_mode(image_folder):
    ds = ad.ImageFiles([str(image_folder / "dog" / "extra.png")], jpeg=True)
    with pytest.raises(ValueError, match="not a JPEG"):
        ds[0]


def test_preload_a_torchvision_dataset_of_pil_images(tmp_path):
    from torchvision.datasets import FakeData

    ds = FakeData(size=12, image_size=(3, 6, 5), num_classes=4, random_offset=3)
    td = ad.preload(ds, tmp_path / "fake", batch_size=5)
    assert td["image"].shape == (12, 3, 6, 5) and td["image"].dtype == torch.uint8
    assert td["label"].dtype == torch.int64
    from torchvision.transforms.v2.functional import pil_to_tensor

    img, label = ds[7]
    assert torch.equal(td["image"][7], pil_to_tensor(img)) and int(td["label"][7]) == label


def test_preload_a_dict_of_columns(tmp_path):
    np = pytest.importorskip("numpy")
    src = {"x": torch.arange(30.0).view(10, 3), "y": np.arange(10)}
    td = ad.preload(src, tmp_path / "d")
    assert td.batch_size == torch.Size([10])
    assert ad.preload_info(tmp_path / "d")["num_samples"] == 10
    assert torch.equal(td["x"], src["x"]) and td["y"].tolist() == list(range(10))
    with pytest.raises(TypeError, match="key 'name' holds a list"):
        ad.preload({"x": torch.zeros(4), "name": list("abcd")}, tmp_path / "e")
    assert not (tmp_path / "e").exists()  # refused before anything is written


# --------------------------------------------------------------------------------------------
# A preload is reused only when it was built with the same options


def test_preload_image_folder_with_another_size_is_refused_not_reused(tmp_path, image_folder):
    pre = tmp_path / "pre"
    ad.preload_image_folder(image_folder, pre, size=12, num_workers=1)
    with pytest.raises(ValueError) as info:
        ad.preload_image_folder(image_folder, pre, size=8, num_workers=1)
    message = str(info.value)
    assert "size" in message and "[12, 12]" in message and "[8, 8]" in message
    assert "overwrite=True" in message and str(pre) in message
    assert ad.open_preloaded(pre)["image"].shape == (7, 3, 12, 12)  # left as it was
    again = ad.preload_image_folder(image_folder, pre, size=12, num_workers=2)  # same: reused
    assert again["image"].shape == (7, 3, 12, 12)
    rebuilt = ad.preload_image_folder(image_folder, pre, size=8, overwrite=True)
    assert rebuilt["image"].shape == (7, 3, 8, 8)
    info_ = ad.preload_info(pre)
    assert info_["options"]["size"] == [8, 8]
    assert info_["shapes"] == {"image": [3, 8, 8], "label": []}
    assert info_["dtypes"] == {"image": "torch.uint8", "label": "torch.int64"}


def test_preload_image_folder_with_other_files_is_refused(tmp_path, image_folder):
    ad.preload_image_folder(image_folder, tmp_path / "pre", size=8)
    os.rename(image_folder / "cat" / "0.jpg", image_folder / "cat" / "9.jpg")  # same count
    with pytest.raises(ValueError, match=r"files.*overwrite=True"):
        ad.preload_image_folder(image_folder, tmp_path / "pre", size=8)


def test_preload_with_other_keys_or_sample_transform_is_refused(tmp_path):
    ad.preload(Images(), tmp_path / "p")
    with pytest.raises(ValueError, match=r"keys: built with None, asked for \['a', 'b'\]"):
        ad.preload(Exploding(), tmp_path / "p", keys=["a", "b"])
    with pytest.raises(ValueError, match=r"sample_transform: built with None, asked for"):
        ad.preload(Exploding(), tmp_path / "p", sample_transform=_halve)
    assert ad.preload(Exploding(), tmp_path / "p").batch_size == torch.Size([50])


def _halve(sample):
    return sample[0] // 2, sample[1]


def test_preload_of_a_tensordict_with_another_dtype_is_refused(tmp_path):
    src = TensorDict({"x": torch.arange(30.0).view(10, 3), "y": torch.arange(10)}, [10])
    ad.preload(src, tmp_path / "t")
    ad.preload(src.clone(), tmp_path / "t")  # the same: reused
    with pytest.raises(ValueError, match=r"'x'.*torch.float32.*torch.float64"):
        ad.preload(src.apply(lambda t: t.double() if t.is_floating_point() else t),
                   tmp_path / "t")
    with pytest.raises(ValueError, match=r"'x'.*\[3\].*\[1, 3\]"):
        ad.preload(src.apply(lambda t: t.unsqueeze(1) if t.dim() == 2 else t), tmp_path / "t")


def test_a_preload_from_before_the_options_were_recorded_is_not_reused(tmp_path):
    import json

    ad.preload(Images(), tmp_path / "p")
    marker = tmp_path / "p" / "accelfn_preload.json"
    old = {k: v for k, v in json.loads(marker.read_text()).items()
           if k in ("num_samples", "keys", "metadata")}
    marker.write_text(json.dumps({**old, "format": 1}))
    with pytest.raises(ValueError, match=r"older accelfn.*not record.*overwrite=True"):
        ad.preload(Exploding(), tmp_path / "p")
    assert ad.open_preloaded(tmp_path / "p").batch_size == torch.Size([50])  # still opens
    assert ad.preload(Images(), tmp_path / "p", overwrite=True).batch_size == torch.Size([50])
