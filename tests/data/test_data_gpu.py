"""accelfn.data.gpu batch transforms, run on the CPU: per-sample randomness, exactness."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict

import accelfn.data as ad
from accelfn.data import gpu


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def coords_batch(b: int, h: int = 10, w: int = 12) -> TensorDict:
    """Images whose pixels say where they come from: channel 0 = row + 1, channel 1 = col + 1."""
    rows = torch.arange(1, h + 1, dtype=torch.uint8)[:, None].expand(h, w)
    cols = torch.arange(1, w + 1, dtype=torch.uint8)[None, :].expand(h, w)
    ids = torch.arange(b, dtype=torch.uint8)[:, None, None, None].expand(b, 1, h, w)
    img = torch.cat([rows.expand(b, 1, h, w), cols.expand(b, 1, h, w), ids], dim=1)
    return TensorDict({"image": img.contiguous(), "label": torch.arange(b)}, batch_size=[b])


def random_batch(b: int = 64, c: int = 3, h: int = 16, w: int = 16, seed: int = 1) -> TensorDict:
    x = torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=gen(seed))
    return TensorDict({"image": x}, batch_size=[b])


# --------------------------------------------------------------------------------------------
# RandomCrop


def test_random_crop_is_a_crop_of_the_padded_sample_at_a_per_sample_offset():
    pad, b = 3, 500
    batch = coords_batch(b)
    out = ad.RandomCrop((10, 12), padding=pad)(batch, generator=gen())
    x, y = batch["image"], out["image"]
    assert y.shape == x.shape and y.dtype == torch.uint8
    offsets = []
    for i in range(b):
        padded = F.pad(x[i], (pad, pad, pad, pad))
        # The first in-image pixel tells where the crop starts.
        inside = (y[i, 0] > 0).nonzero()
        r0, c0 = inside[0].tolist()
        oy = int(y[i, 0, r0, c0]) - 1 + pad - r0
        ox = int(y[i, 1, r0, c0]) - 1 + pad - c0
        assert torch.equal(y[i], padded[:, oy : oy + 10, ox : ox + 12])
        offsets.append((oy, ox))
    oys = torch.tensor([o[0] for o in offsets])
    oxs = torch.tensor([o[1] for o in offsets])
    # Every offset in [0, 2 * pad] occurs, about uniformly (expected 500 / 7 ~ 71 each).
    for counts in (torch.bincount(oys, minlength=7), torch.bincount(oxs, minlength=7)):
        assert counts.numel() == 7 and counts.min() > 35 and counts.max() < 115
    assert len(set(offsets)) > 40  # crops differ per sample


def test_random_crop_keys_share_offsets_and_modes():
    batch = coords_batch(32)
    batch["mask"] = batch["image"][:, :1].clone()
    out = ad.RandomCrop(8, padding=2, keys=("image", "mask"))(batch, generator=gen(3))
    assert torch.equal(out["mask"], out["image"][:, :1])
    refl = ad.RandomCrop(10, padding=2, padding_mode="reflect")(batch, generator=gen(3))
    assert (refl["image"][:, 0] > 0).all()  # reflection never shows the constant fill
    filled = ad.RandomCrop(10, padding=2, fill=200)(batch, generator=gen(3))
    assert (filled["image"] == 200).any()


def test_random_crop_without_padding_smaller_size():
    out = ad.RandomCrop(4)(random_batch(8), generator=gen())
    assert out["image"].shape == (8, 3, 4, 4)
    with pytest.raises(ValueError, match="larger than the padded image"):
        ad.RandomCrop(20, padding=1)(random_batch(2))


# --------------------------------------------------------------------------------------------
# Flip


def test_flip_rate_is_half_and_flipped_samples_are_mirrors():
    b = 4000
    batch = random_batch(b, h=4, w=5)
    out = ad.RandomHorizontalFlip()(batch, generator=gen(7))
    x, y = batch["image"], out["image"]
    flipped = (y == x.flip(-1)).flatten(1).all(1)
    kept = (y == x).flatten(1).all(1)
    assert (flipped | kept).all()
    assert abs(flipped.float().mean().item() - 0.5) < 0.04  # ~5 standard deviations


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_flip_extremes(p):
    batch = random_batch(16)
    y = ad.RandomHorizontalFlip(p)(batch, generator=gen())["image"]
    assert torch.equal(y, batch["image"].flip(-1) if p else batch["image"])


def test_same_generator_seed_same_output_and_different_seed_different():
    t = ad.Compose(ad.RandomCrop(16, padding=4), ad.RandomHorizontalFlip())
    batch = random_batch()
    a = t(batch, generator=gen(1))["image"]
    assert torch.equal(a, t(batch, generator=gen(1))["image"])
    assert not torch.equal(a, t(batch, generator=gen(2))["image"])


def test_transforms_do_not_modify_their_input():
    batch = random_batch(8)
    before = batch["image"].clone()
    out = ad.RandomHorizontalFlip(1.0)(batch)
    assert torch.equal(batch["image"], before) and out is not batch


# --------------------------------------------------------------------------------------------
# RandomResizedCrop


def test_random_resized_crop_full_box_is_identity():
    batch = random_batch(8)
    out = ad.RandomResizedCrop(16, scale=(1.0, 1.0), ratio=(1.0, 1.0))(batch, generator=gen())
    assert out["image"].dtype == torch.uint8
    assert torch.equal(out["image"], batch["image"])


class _FixedBoxes(ad.RandomResizedCrop):
    def __init__(self, boxes, size):
        super().__init__(size)
        self._boxes = boxes

    def boxes(self, b, height, width, generator, device):
        return self._boxes


def test_random_resized_crop_resamples_the_box_bilinearly():
    x = torch.rand(2, 3, 16, 16, generator=gen())
    boxes = torch.tensor([[2.0, 3.0, 10.0, 11.0], [5.0, 1.0, 13.0, 9.0]])  # 8x8 boxes
    out = _FixedBoxes(boxes, 16)(TensorDict({"image": x}, [2]))["image"]
    for i, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
        ref = F.interpolate(x[i : i + 1, :, y1:y2, x1:x2], size=16, mode="bilinear")[0]
        # 2x upsampling is bilinear interpolation of the box alone, edges included (clamped
        # to the box's pixels, never reading its neighbours outside).
        torch.testing.assert_close(out[i], ref, rtol=0, atol=1e-6)


def test_random_resized_crop_boxes_follow_scale_and_ratio_per_sample():
    t = ad.RandomResizedCrop(8, scale=(0.2, 0.6), ratio=(0.5, 2.0))
    boxes = t.boxes(3000, 64, 64, gen(5), torch.device("cpu"))
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 64).all() and (boxes[:, 3] <= 64).all()
    area = w * h / 64**2
    assert area.min() > 0.17 and area.max() < 0.64  # rounding of w and h aside
    aspect = w / h
    assert aspect.min() > 0.45 and aspect.max() < 2.2
    # log-aspect uniform: about as many wide as tall crops; area mean ~ 0.4.
    assert abs((aspect > 1).float().mean().item() - 0.5) < 0.05
    assert abs(area.mean().item() - 0.4) < 0.02
    assert torch.unique(boxes, dim=0).shape[0] > 2500  # per-sample boxes


def test_random_resized_crop_falls_back_to_a_centre_crop():
    # A 1x100 strip fits no box with aspect in [0.9, 1.1] and area >= 50%: every sample gets
    # the largest centred crop within the ratio range, 1x1 at column (100 - 1) // 2.
    t = ad.RandomResizedCrop(4, scale=(0.5, 1.0), ratio=(0.9, 1.1))
    boxes = t.boxes(10, 1, 100, gen(), torch.device("cpu"))
    assert torch.equal(boxes, torch.tensor([[49.0, 0.0, 50.0, 1.0]]).expand(10, 4))


def test_random_resized_crop_output_shape_and_variety():
    batch = random_batch(32, h=20, w=24)
    out = ad.RandomResizedCrop((8, 6))(batch, generator=gen())["image"]
    assert out.shape == (32, 3, 8, 6) and out.dtype == torch.uint8
    assert torch.unique(out.flatten(1).float().mean(1)).numel() > 25


# --------------------------------------------------------------------------------------------
# Normalize, dtype, memory format


def test_normalize_uint8_matches_torchvision():
    from torchvision.transforms import v2

    mean, std = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]
    batch = random_batch(8)
    out = ad.Normalize(mean, std)(batch)["image"]
    ref = v2.Normalize(mean, std)(v2.ToDtype(torch.float32, scale=True)(batch["image"]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    halves = ad.Normalize(mean, std, dtype=torch.float16)(batch)["image"]
    assert halves.dtype == torch.float16
    with pytest.raises(ValueError, match="channels"):
        ad.Normalize([0.5], [0.5])(batch)


def test_to_dtype_scaling_round_trips():
    batch = random_batch(4)
    f = ad.ToDtype(torch.float32, scale=True)(batch)
    assert f["image"].max() <= 1.0 and f["image"].dtype == torch.float32
    back = ad.ToDtype(torch.uint8, scale=True)(f)
    assert torch.equal(back["image"], batch["image"])
    plain = ad.ToDtype(torch.float32)(batch)
    assert torch.equal(plain["image"], batch["image"].float())


def test_channels_last():
    out = ad.ChannelsLast()(random_batch(4))["image"]
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_missing_key_names_the_key():
    with pytest.raises(ValueError, match="no key 'pixels'"):
        ad.RandomHorizontalFlip(keys="pixels")(random_batch(2))


# --------------------------------------------------------------------------------------------
# JPEG decoding


def _jpeg_batch(images):
    from torchvision.io import encode_jpeg

    blobs = [encode_jpeg(img, quality=90) for img in images]
    n = max(b.numel() for b in blobs)
    data = torch.zeros(len(blobs), n + 5, dtype=torch.uint8)
    for i, b in enumerate(blobs):
        data[i, : b.numel()] = b
    lengths = torch.tensor([b.numel() for b in blobs])
    return blobs, TensorDict(
        {"jpeg": data, "jpeg_lengths": lengths, "label": torch.arange(len(blobs))},
        batch_size=[len(blobs)],
    )


def test_decode_jpeg_matches_single_image_decoding():
    from torchvision.io import ImageReadMode, decode_jpeg

    imgs = [
        torch.randint(0, 256, (3, 12, 10), dtype=torch.uint8, generator=gen(i)) for i in range(5)
    ]
    blobs, batch = _jpeg_batch(imgs)
    out = ad.DecodeJPEG()(batch)
    assert sorted(out.keys()) == ["image", "label"]
    assert out["image"].shape == (5, 3, 12, 10) and out["image"].dtype == torch.uint8
    for i, blob in enumerate(blobs):
        assert torch.equal(out["image"][i], decode_jpeg(blob, mode=ImageReadMode.RGB))


def test_decode_jpeg_sizes_and_errors():
    imgs = [torch.zeros(3, 12, 10, dtype=torch.uint8), torch.zeros(3, 20, 30, dtype=torch.uint8)]
    _, batch = _jpeg_batch(imgs)
    with pytest.raises(ValueError, match="different shapes"):
        ad.DecodeJPEG()(batch)
    out = ad.DecodeJPEG(size=8)(batch)
    assert out["image"].shape == (2, 3, 8, 8)
    bad = batch.clone()
    bad["jpeg"][1, :20] = 7
    with pytest.raises(ValueError, match="sample 1 of the batch"):
        ad.DecodeJPEG(size=8)(bad)


def _smooth(h: int, w: int, seed: int) -> torch.Tensor:
    """A photo-like uint8 image (smooth: JPEG keeps it close), of size ``h`` x ``w``."""
    low = torch.rand(1, 3, 3, 4, generator=gen(seed)) * 255
    return F.interpolate(low, size=(h, w), mode="bilinear").round().to(torch.uint8)[0]


def test_decode_jpeg_crop_equals_random_resized_crop_of_the_decoded_batch():
    # Same-size images: the crop done per decoded image is, bitwise, RandomResizedCrop of the
    # decoded batch with the same generator state (the same boxes, the same resampling).
    _, batch = _jpeg_batch([_smooth(30, 40, i) for i in range(6)])
    crop = ad.RandomResizedCrop((12, 10))
    out = ad.DecodeJPEG(crop=crop)(batch, generator=gen(5))
    ref = crop(ad.DecodeJPEG()(batch), generator=gen(5))
    assert out["image"].shape == (6, 3, 12, 10) and out["image"].dtype == torch.uint8
    assert torch.equal(out["image"], ref["image"])
    assert torch.equal(out["label"], batch["label"]) and "jpeg" not in out.keys()


def test_decode_jpeg_crop_takes_each_box_in_its_own_image():
    # Images of different sizes, each cropped on its own size: with the whole image as the
    # only box (scale 1, the images' aspect ratio), each output is RandomResizedCrop of that
    # image alone; no image is resized to a common size first.
    from torchvision.io import ImageReadMode, decode_jpeg

    sizes = [(12, 16), (24, 32), (45, 60), (30, 40)]
    blobs, batch = _jpeg_batch([_smooth(h, w, i) for i, (h, w) in enumerate(sizes)])
    crop = ad.RandomResizedCrop(8, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    out = ad.DecodeJPEG(crop=crop)(batch, generator=gen(1))["image"]
    assert out.shape == (4, 3, 8, 8)
    for i, blob in enumerate(blobs):
        one = TensorDict({"image": decode_jpeg(blob, mode=ImageReadMode.RGB)[None]}, [1])
        assert torch.equal(out[i], crop(one, generator=gen(2))["image"][0]), i


def test_decode_jpeg_crop_is_torchvision_resized_crop_of_each_decoded_image():
    # Each image cropped on its own size is torchvision's crop then resize (antialiased) of
    # the decoded image, within one level (torchvision resizes uint8 in fixed point): no
    # pixel from outside the box is blended in at its edges.
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as TF

    sizes = [(30, 40), (45, 60), (20, 50), (37, 29)] * 3
    imgs = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen(i))
            for i, (h, w) in enumerate(sizes)]
    blobs, batch = _jpeg_batch(imgs)
    for size in [(12, 10), (64, 48)]:
        crop = ad.RandomResizedCrop(size)
        out = ad.DecodeJPEG(crop=crop)(batch, generator=gen(5))["image"]
        boxes = crop.boxes_per_sample(sizes, gen(5), torch.device("cpu"))
        for i, blob in enumerate(blobs):
            x1, y1, x2, y2 = (int(v) for v in boxes[i])
            ref = TF.resized_crop(decode_jpeg(blob, mode=ImageReadMode.RGB), y1, x1, y2 - y1,
                                  x2 - x1, list(size), antialias=True)
            assert (out[i].int() - ref.int()).abs().max().item() <= 1, (size, i, boxes[i])


def test_random_resized_crop_boxes_per_sample():
    crop = ad.RandomResizedCrop(8)
    sizes = [(30, 40), (7, 90), (500, 20), (375, 500)] * 50
    boxes = crop.boxes_per_sample(sizes, gen(0), torch.device("cpu"))
    assert boxes.shape == (200, 4) and boxes.dtype == torch.float32
    hw = torch.tensor(sizes, dtype=torch.float32)
    x1, y1, x2, y2 = boxes.unbind(1)
    assert (x1 >= 0).all() and (y1 >= 0).all() and (x2 > x1).all() and (y2 > y1).all()
    assert (x2 <= hw[:, 1]).all() and (y2 <= hw[:, 0]).all()
    # All of one size: the boxes of `boxes`, bitwise, from the same generator state.
    assert torch.equal(crop.boxes_per_sample([(30, 40)] * 9, gen(3), torch.device("cpu")),
                       crop.boxes(9, 30, 40, gen(3), torch.device("cpu")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nvJPEG)")
def test_decode_jpeg_crop_on_cuda_from_files(tmp_path):
    # ImageFiles' bytes through the loader: decoded by nvJPEG, each cropped on its own size,
    # flipped and normalised on the GPU; nvJPEG's pixels are libjpeg's within a few levels.
    from torchvision.io import write_file

    sizes = [(24, 32), (45, 60), (30, 40), (36, 48)] * 2
    blobs, batch = _jpeg_batch([_smooth(h, w, i) for i, (h, w) in enumerate(sizes)])
    files = []
    for i, blob in enumerate(blobs):
        files.append(str(tmp_path / f"{i}.jpg"))
        write_file(files[-1], blob)
    train = ad.loader(
        ad.ImageFiles(files, list(range(8)), jpeg=True), batch_size=4, device="cuda",
        num_workers=2, transform=ad.Compose(ad.DecodeJPEG(crop=ad.RandomResizedCrop(16)),
                                            ad.RandomHorizontalFlip(),
                                            ad.Normalize([0.5] * 3, [0.5] * 3)))
    out = list(train)
    train.close()
    assert [b["image"].shape for b in out] == [(4, 3, 16, 16)] * 2
    assert all(b["image"].device.type == "cuda" and b["image"].dtype == torch.float32
               for b in out)
    assert all(b["image"].abs().max().item() <= 1.0 for b in out)
    whole = ad.RandomResizedCrop(8, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    on_gpu = ad.DecodeJPEG(crop=whole, device="cuda")(batch)["image"]
    on_cpu = ad.DecodeJPEG(crop=whole)(batch)["image"]
    assert on_gpu.device.type == "cuda" and on_gpu.shape == on_cpu.shape == (8, 3, 8, 8)
    assert (on_gpu.cpu().float() - on_cpu.float()).abs().mean().item() < 3


def test_decode_jpeg_crop_refusals():
    with pytest.raises(ValueError, match=r"either size=.* or crop="):
        ad.DecodeJPEG(size=8, crop=ad.RandomResizedCrop(8))
    with pytest.raises(TypeError, match="crop must be a RandomResizedCrop"):
        ad.DecodeJPEG(crop=ad.RandomCrop(8))  # type: ignore[arg-type]


def test_decode_jpeg_declares_host_keys_through_compose():
    t = ad.Compose(ad.DecodeJPEG("raw", out_key="img"), ad.RandomHorizontalFlip(keys="img"))
    assert t.host_keys == ("raw", "raw_lengths")
    assert gpu.host_keys(t) == ("raw", "raw_lengths")


# --------------------------------------------------------------------------------------------
# Compose


def test_compose_passes_generator_and_mixes_plain_callables():
    calls = []

    def plain(batch):
        calls.append("plain")
        return batch

    def seeded(batch, generator=None):
        calls.append(generator)
        return batch

    g = gen()
    t = ad.Compose([plain, seeded])
    t(random_batch(2), generator=g)
    assert calls == ["plain", g]
    with pytest.raises(TypeError, match="not a TensorDict"):
        ad.Compose(lambda b: None)(random_batch(2))
    with pytest.raises(TypeError, match="callables"):
        ad.Compose(3)


def test_loader_passes_a_seeded_generator_on_the_batch_device():
    seen = []

    def spy(batch, generator):
        seen.append((generator.device, generator.initial_seed()))
        return batch

    td = TensorDict({"x": torch.arange(20)}, [20])
    loader = ad.loader(td, batch_size=5, transform=spy, seed=1)
    list(loader), list(loader)
    seeds = [s for _, s in seen]
    assert all(d.type == "cpu" for d, _ in seen)
    assert len(set(seeds)) == 8  # one stream per (epoch, batch)
