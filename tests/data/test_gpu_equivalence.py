"""accelfn.data.gpu against torchvision.transforms.v2 applied per sample with the same random
parameters: bitwise where the docs claim equivalence."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

import accelfn.data as ad

CPU = torch.device("cpu")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randint(shape, low, high, dtype, seed=0):
    return torch.randint(low, high, shape, generator=gen(seed)).to(dtype)


# --------------------------------------------------------------------------------------------
# RandomResizedCrop: masks are resized with nearest-neighbour sampling, as v2 does for Mask


def _rrc_batch(b=48, h=20, w=24, mask_dtype=torch.int64, seed=0):
    img = randint((b, 3, h, w), 0, 256, torch.uint8, seed)
    labels = torch.tensor([0, 3, 7, 200])
    mask = labels[randint((b, 1, h, w), 0, 4, torch.int64, seed + 1)].to(mask_dtype)
    return TensorDict({"image": img, "mask": mask}, batch_size=[b])


@pytest.mark.parametrize("size", [(8, 6), (20, 24), (40, 48), (37, 29), 13])
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.uint8])
def test_random_resized_crop_mask_equals_torchvision_resized_crop_of_a_mask(size, mask_dtype):
    batch = _rrc_batch(mask_dtype=mask_dtype)
    b, h, w = batch["image"].shape[0], *batch["image"].shape[-2:]
    t = ad.RandomResizedCrop(size, keys=("image", "mask"))
    boxes = t.boxes(b, h, w, gen(3), CPU)
    out = t(batch, generator=gen(3))
    out_size = [size, size] if isinstance(size, int) else list(size)
    for i in range(b):
        x1, y1, x2, y2 = (int(v) for v in boxes[i])
        ref = TF.resized_crop(tv_tensors.Mask(batch["mask"][i]), y1, x1, y2 - y1, x2 - x1, out_size)
        assert torch.equal(out["mask"][i], ref.as_subclass(torch.Tensor)), (i, boxes[i])
    assert out["mask"].dtype == mask_dtype
    assert set(out["mask"].unique().tolist()) <= {0, 3, 7, 200}
    # The image is resampled as before (bilinear), with the same boxes as without a mask.
    alone = ad.RandomResizedCrop(size)(batch.exclude("mask"), generator=gen(3))
    assert torch.equal(out["image"], alone["image"])


def test_random_resized_crop_of_image_and_mask_equals_the_v2_class_on_a_fixed_box():
    # scale=(1, 1) and ratio=(w/h, w/h) fix the box to the whole image, so the v2 class draws
    # the same box as accelfn and the output of the class itself can be compared.
    batch = _rrc_batch(b=4, h=20, w=24)
    kw = dict(scale=(1.0, 1.0), ratio=(24 / 20, 24 / 20))
    out = ad.RandomResizedCrop((13, 30), keys=("image", "mask"), **kw)(batch, generator=gen())
    tv = v2.RandomResizedCrop((13, 30), **kw)
    for i in range(4):
        _, ref = tv(tv_tensors.Image(batch["image"][i]), tv_tensors.Mask(batch["mask"][i]))
        assert torch.equal(out["mask"][i], ref.as_subclass(torch.Tensor))


def test_random_resized_crop_nearest_names_the_keys():
    batch = _rrc_batch(b=8)
    batch["seg"] = batch["mask"].clone()
    t = ad.RandomResizedCrop(9, keys=("image", "seg", "mask"), nearest="seg")
    out = t(batch, generator=gen(1))
    assert set(out["seg"].unique().tolist()) <= {0, 3, 7, 200}
    # "mask" is not named, so it is resampled bilinearly like an image.
    assert not set(out["mask"].unique().tolist()) <= {0, 3, 7, 200}
    with pytest.raises(ValueError, match=r"nearest.*'label'.*keys"):
        ad.RandomResizedCrop(9, keys=("image", "mask"), nearest=("label",))
    assert ad.RandomResizedCrop(9).nearest == ()
    assert ad.RandomResizedCrop(9, keys=("image", "mask")).nearest == ("mask",)
    assert ad.RandomResizedCrop(9, keys=("image", "mask"), nearest=()).nearest == ()


class _FixedBox(ad.RandomResizedCrop):
    """The same box ``(x1, y1, x2, y2)`` for every sample."""

    def __init__(self, size, box) -> None:
        super().__init__(size)
        self.box = box

    def boxes(self, b, height, width, generator, device):
        return torch.tensor([self.box], dtype=torch.float32, device=device).expand(b, 4)


@pytest.mark.parametrize("size", [(40, 40), (10, 10), (3, 7), (25, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_random_resized_crop_reads_no_pixel_outside_the_box(size, dtype):
    # An all-zero box in a bright image: upsampled, kept, shrunk, or both, torchvision's crop
    # then resize has no pixel of the outside; neither may the batched resampling.
    bright = 1.0 if dtype.is_floating_point else 255
    img = torch.full((3, 2, 20, 20), bright).to(dtype)
    img[..., 5:15, 5:15] = 0
    out = _FixedBox(size, [5.0, 5.0, 15.0, 15.0])(TensorDict({"image": img}, [3]))["image"]
    assert out.shape == (3, 2, *size) and out.dtype == dtype
    assert out.count_nonzero().item() == 0
    for i in range(3):
        ref = TF.resized_crop(img[i], 5, 5, 10, 10, list(size), antialias=True)
        assert ref.count_nonzero().item() == 0


# upsampling, shrinking (antialiased, as torchvision by default), one axis each way, identity
RRC_SIZES = [(80, 60), (16, 16), (7, 100), (37, 53)]


@pytest.mark.parametrize("size", RRC_SIZES)
def test_random_resized_crop_equals_torchvision_resized_crop_per_sample(size):
    b, h, w = 32, 37, 53
    x = torch.rand(b, 3, h, w, generator=gen(0))
    t = ad.RandomResizedCrop(size)
    boxes = t.boxes(b, h, w, gen(1), CPU)
    out = t(TensorDict({"image": x}, [b]), generator=gen(1))["image"]
    for i in range(b):
        x1, y1, x2, y2 = (int(v) for v in boxes[i])
        ref = TF.resized_crop(x[i], y1, x1, y2 - y1, x2 - x1, list(size), antialias=True)
        torch.testing.assert_close(out[i], ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", RRC_SIZES)
def test_random_resized_crop_uint8_is_torchvision_within_one_level(size):
    # torchvision resizes uint8 on the CPU with fixed-point weights; accelfn in float32, then
    # rounds: at most one level apart.
    batch = _rrc_batch(b=32, h=37, w=53)
    b, h, w = 32, 37, 53
    t = ad.RandomResizedCrop(size)
    boxes = t.boxes(b, h, w, gen(2), CPU)
    out = t(batch.exclude("mask"), generator=gen(2))["image"]
    assert out.dtype == torch.uint8
    for i in range(b):
        x1, y1, x2, y2 = (int(v) for v in boxes[i])
        ref = TF.resized_crop(batch["image"][i], y1, x1, y2 - y1, x2 - x1, list(size),
                              antialias=True)
        assert (out[i].int() - ref.int()).abs().max().item() <= 1, (i, boxes[i])


# --------------------------------------------------------------------------------------------
# RandomCrop: padding as torchvision (int, [all], [left/right, top/bottom], [l, t, r, b])

PADDINGS = [2, [3], (2, 0), (0, 3), (1, 2, 3, 4), [4, 0, 0, 1]]
MODES = [("constant", "constant"), ("reflect", "reflect"), ("replicate", "edge"), ("edge", "edge")]


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("mode,tv_mode", MODES)
def test_random_crop_padding_equals_v2_random_crop_per_sample(padding, mode, tv_mode):
    b, h, w, size = 12, 7, 9, (5, 6)
    x = randint((b, 3, h, w), 0, 256, torch.uint8, seed=5)
    out = ad.RandomCrop(size, padding, fill=7, padding_mode=mode)(
        TensorDict({"image": x}, [b]), generator=gen(2)
    )["image"]
    assert out.shape == (b, 3, *size)
    offsets = set()
    for i in range(b):
        padded = TF.pad(x[i], list(padding) if not isinstance(padding, int) else padding,
                        fill=7, padding_mode=tv_mode)
        hp, wp = padded.shape[-2:]
        hits = [
            (oy, ox)
            for oy in range(hp - size[0] + 1)
            for ox in range(wp - size[1] + 1)
            if torch.equal(TF.crop(padded, oy, ox, *size), out[i])
        ]
        assert hits, f"sample {i} is no crop of the torchvision-padded sample"
        offsets.add(hits[0])
    assert len(offsets) > 3
    # A crop of the whole padded image leaves no randomness: the v2 class itself must agree.
    full = (hp, wp)
    whole = ad.RandomCrop(full, padding, fill=7, padding_mode=mode)(
        TensorDict({"image": x}, [b]), generator=gen(2)
    )["image"]
    tv = v2.RandomCrop(full, padding=padding, fill=7, padding_mode=tv_mode)
    for i in range(b):
        assert torch.equal(whole[i], tv(tv_tensors.Image(x[i])).as_subclass(torch.Tensor))


def test_random_crop_two_padding_values_are_left_right_then_top_bottom():
    img = torch.arange(1, 25, dtype=torch.uint8).view(1, 1, 4, 6)
    out = ad.RandomCrop((4, 10), padding=(2, 0))(TensorDict({"image": img}, [1]))["image"]
    assert out.shape == (1, 1, 4, 10)
    assert torch.equal(out[0], v2.RandomCrop((4, 10), padding=[2, 0])(img[0]))


@pytest.mark.parametrize("padding", [(1, 2, 3), (-1, 0), [], "2"])
def test_random_crop_bad_padding_says_what_is_accepted(padding):
    with pytest.raises(ValueError, match="padding"):
        ad.RandomCrop(4, padding)


def test_random_crop_rejects_symmetric_padding_with_a_way_out():
    with pytest.raises(ValueError, match="'constant', 'reflect', 'edge'"):
        ad.RandomCrop(4, 1, padding_mode="symmetric")


# --------------------------------------------------------------------------------------------
# ToDtype: torchvision's formulas for every pair of dtypes

INTS = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _sample(dtype, n=4096):
    if dtype.is_floating_point:
        edges = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.999, 0.9999, 1.0])
        return torch.cat([edges, torch.rand(n, generator=gen(7))]).to(dtype).view(1, 1, 1, -1)
    info = torch.iinfo(dtype)
    lo, hi = info.min, info.max
    edges = torch.tensor([lo, hi, 0, 1, hi // 2], dtype=torch.int64)
    if dtype == torch.int64:
        r = torch.randint(lo, hi, (n,), generator=gen(7), dtype=torch.int64)
    else:
        r = torch.randint(lo, hi + 1, (n,), generator=gen(7), dtype=torch.int64)
    return torch.cat([edges, r]).to(dtype).view(1, 1, 1, -1)


def _ours(x, dtype, scale):
    return ad.ToDtype(dtype, scale=scale)(TensorDict({"image": x}, [1]))["image"]


# torchvision refuses the first three; float16 cannot hold the scaled values of the others
# (its largest value is 65504), where torchvision's output is all overflow.
REFUSED = {
    (torch.float32, torch.int32), (torch.float32, torch.int64), (torch.float64, torch.int64),
    (torch.float16, torch.uint16), (torch.float16, torch.int32), (torch.float16, torch.int64),
}


def _largest_at_most(n, dtype):
    """The largest ``dtype`` value <= the integer ``n`` (stepping the bit pattern down)."""
    x = torch.tensor(float(n), dtype=torch.float64).to(dtype).view(1)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    while x.double().item() > n:
        x = (x.view(bits) - 1).view(dtype)
    return int(x.double().item())


@pytest.mark.parametrize("dst", INTS + FLOATS, ids=str)
@pytest.mark.parametrize("src", INTS + FLOATS, ids=str)
def test_to_dtype_scale_equals_torchvision_bitwise(src, dst):
    x = _sample(src)
    if (src, dst) in REFUSED:
        with pytest.raises(TypeError, match="cannot be converted safely"):
            _ours(x, dst, True)
        return
    ref = TF.to_dtype(x, dst, scale=True)
    out = _ours(x, dst, True)
    assert out.dtype == dst
    if src.is_floating_point and not dst.is_floating_point:
        # torchvision's product can land past the integer range (float32 1.0 * 65535.999 is
        # 65536.0; bfloat16 1.0 * 255.999 is 256), where its cast wraps around: accelfn
        # saturates there and is bitwise equal everywhere else.
        info = torch.iinfo(dst)
        p = x.mul(info.max + 1.0 - 1e-3).double().trunc()
        over, under = p >= float(info.max) + 1, p < info.min  # (exact in float64)
        inside = ~over & ~under
        assert torch.equal(out[inside], ref[inside])
        assert (out[over] == _largest_at_most(info.max, src)).all()
        assert (out[under] == info.min).all()
    else:
        assert torch.equal(out, ref)


def test_to_dtype_scale_examples_from_torchvision():
    x = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.999, 1.0]).view(1, 1, 1, 6)
    assert _ours(x, torch.uint8, True).flatten().tolist() == [0, 76, 127, 179, 255, 255]
    u = torch.tensor([0, 128, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    assert _ours(u, torch.int16, True).flatten().tolist() == [0, 16384, 32640]
    one = torch.ones(1, 1, 1, 1)
    assert _ours(one, torch.uint16, True).item() == 65535  # torchvision: 0 (wraps around)
    assert _ours(one.bfloat16(), torch.uint8, True).item() == 255  # torchvision: 0
    assert _ours(one.half(), torch.int16, True).item() == 32752  # torchvision: -32768


@pytest.mark.parametrize("dst", [torch.uint8, torch.int64, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("src", [torch.uint8, torch.int16, torch.float32, torch.float64], ids=str)
def test_to_dtype_without_scale_is_a_cast(src, dst):
    x = _sample(src) if not src.is_floating_point else _sample(src) * 300
    ref = TF.to_dtype(x, dst, scale=False)
    assert torch.equal(_ours(x, dst, False), ref)


def test_to_dtype_refuses_dtypes_it_cannot_scale():
    with pytest.raises(TypeError, match=r"ToDtype.*scale=True.*torch\.bool"):
        ad.ToDtype(torch.bool, scale=True)
    with pytest.raises(TypeError, match=r"ToDtype.*scale=True.*torch\.bool"):
        _ours(torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.uint8, True)
    assert _ours(torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.bool, False).dtype == torch.bool
    x = torch.tensor([True, False]).view(1, 1, 1, 2)
    assert torch.equal(_ours(x, torch.float32, True), TF.to_dtype(x, torch.float32, scale=True))


# --------------------------------------------------------------------------------------------
# Normalize


MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_normalize_uint8_is_bitwise_to_dtype_then_v2_normalize(dtype):
    x = randint((6, 3, 16, 16), 0, 256, torch.uint8, seed=9)
    x[0, :, 0, :] = torch.arange(16, dtype=torch.uint8) * 17
    out = ad.Normalize(MEAN, STD, dtype=dtype)(TensorDict({"image": x}, [6]))["image"]
    ref = v2.Normalize(MEAN, STD)(v2.ToDtype(dtype, scale=True)(x))
    assert out.dtype == dtype and torch.equal(out, ref)


@pytest.mark.parametrize("src,dtype", [(torch.float32, torch.float32),
                                       (torch.float64, torch.float64),
                                       (torch.float32, torch.float16)], ids=str)
def test_normalize_float_is_bitwise_v2_normalize(src, dtype):
    x = torch.rand(6, 3, 16, 16, generator=gen(4)).to(src)
    out = ad.Normalize(MEAN, STD, dtype=dtype)(TensorDict({"image": x}, [6]))["image"]
    ref = v2.Normalize(MEAN, STD)(v2.ToDtype(dtype)(x))
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(x, torch.rand(6, 3, 16, 16, generator=gen(4)).to(src))  # input kept


# --------------------------------------------------------------------------------------------
# RandomHorizontalFlip


@pytest.mark.parametrize(
    "dtype", [torch.uint16, torch.uint32, torch.uint64, torch.uint8, torch.int64, torch.float32,
              torch.bool])
def test_flip_equals_torchvision_horizontal_flip_per_sample(dtype):
    # uint16/32/64 have no multiplication in torch: they are selected, like floats
    b = 16
    x = randint((b, 3, 5, 7), 0, 2 if dtype == torch.bool else 60000, dtype)
    out = ad.RandomHorizontalFlip()(TensorDict({"image": x}, [b]), generator=gen(4))["image"]
    flip = torch.rand(b, generator=gen(4)) < 0.5  # the draw RandomHorizontalFlip makes
    assert 0 < flip.sum().item() < b and out.dtype == dtype
    for i in range(b):
        ref = TF.horizontal_flip(x[i]) if flip[i] else x[i]
        assert torch.equal(out[i], ref), i
