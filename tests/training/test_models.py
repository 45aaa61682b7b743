"""examples/models.py: every network builds, has the right output and size, is
deterministic per seed, and bad names or depths are refused with the valid ones listed."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
from models import DEPTHS, get_network  # noqa: E402

# (name, num_layers, parameter count range for 10 classes on 3x32x32)
NETWORKS = [
    ("mlp", None, (0.40e6, 0.41e6)),            # 3072*128 + 128*64 + 64*10 (+ biases)
    ("lenet", None, (0.60e6, 0.70e6)),          # fc 1250 -> 500 dominates
    ("resnet", 20, (0.26e6, 0.29e6)),           # He et al.: 0.27M
    ("resnet", 56, (0.83e6, 0.88e6)),           # 0.85M
    ("resnet", 110, (1.70e6, 1.76e6)),          # 1.7M
    ("inception-bn", None, (1.5e6, 1.8e6)),
    ("vgg", 11, (9.0e6, 10.0e6)),
    ("vgg", 13, (9.2e6, 10.2e6)),
    ("vgg", 16, (14.5e6, 15.5e6)),
    ("vgg", 19, (19.8e6, 20.8e6)),
]


def count(model):
    return sum(p.numel() for p in model.parameters())


def test_every_listed_network_is_tested():
    listed = {(name, d) for name, depths in DEPTHS.items() for d in (depths or (None,))}
    assert listed == {(name, d) for name, d, _ in NETWORKS}


@pytest.mark.parametrize("name,num_layers,size", NETWORKS,
                         ids=[f"{n}-{d}" if d else n for n, d, _ in NETWORKS])
def test_builds_forward_and_size(name, num_layers, size):
    torch.manual_seed(0)
    model = get_network(name, num_classes=10, num_layers=num_layers).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert size[0] <= count(model) <= size[1], count(model)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    fcs = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if name == "resnet":
        # conv + 3 stages of (n-2)/6 units of two 3x3 convs + fc = n layers (1x1 shortcuts aside)
        assert len([c for c in convs if c.kernel_size == (3, 3)]) + len(fcs) == num_layers
    if name == "vgg":
        assert len(convs) + 3 == num_layers          # as ImageNet VGG-n: n - 3 convs, 3 fc layers
        assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == len(convs)


@pytest.mark.parametrize("name,num_layers", [("mlp", None), ("lenet", None), ("resnet", 20),
                                             ("inception-bn", None), ("vgg", 11)])
def test_other_class_counts_and_training_step(name, num_layers):
    torch.manual_seed(0)
    model = get_network(name, num_classes=7, num_layers=num_layers).train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 6])
    out = model(x)
    assert out.shape == (2, 7)
    torch.nn.functional.cross_entropy(out, y).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_lenet_on_mnist_shape_and_mlp_on_any_shape():
    torch.manual_seed(0)
    lenet = get_network("lenet", image_shape=(1, 28, 28))
    assert lenet(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert lenet[-3].in_features == 50 * 4 * 4
    assert get_network("lenet")[-3].in_features == 50 * 5 * 5
    mlp = get_network("mlp", image_shape=(1, 28, 28))
    assert mlp(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert [m.out_features for m in mlp if isinstance(m, torch.nn.Linear)] == [128, 64, 10]
    assert get_network("resnet", num_layers=20, image_shape=(1, 28, 28))(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("name,num_layers", [("lenet", None), ("resnet", 20), ("inception-bn", None),
                                             ("vgg", 11)])
def test_same_seed_same_weights(name, num_layers):
    def weights(seed):
        torch.manual_seed(seed)
        return [p.detach().clone() for p in get_network(name, num_layers=num_layers).parameters()]
    a, b, c = weights(1), weights(1), weights(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(a, c, strict=True))


@pytest.mark.parametrize("args,kwargs,fragment", [
    (("resnet50",), {}, "unknown network 'resnet50'"),
    (("ResNet",), {"num_layers": 20}, "unknown network"),
    (("resnet",), {"num_layers": 18}, "got 18"),
    (("resnet",), {}, "got None"),
    (("vgg",), {"num_layers": 20}, "needs num_layers in 11, 13, 16, 19"),
    (("mlp",), {"num_layers": 3}, "fixed depth"),
    (("inception-bn",), {"num_layers": 28}, "fixed depth"),
])
def test_bad_name_or_depth(args, kwargs, fragment):
    with pytest.raises(ValueError) as info:
        get_network(*args, **kwargs)
    message = str(info.value)
    assert fragment in message
    for valid in ("mlp", "lenet", "resnet (num_layers 20, 56, 110)", "inception-bn",
                  "vgg (num_layers 11, 13, 16, 19)"):
        assert valid in message


def test_bad_shapes():
    with pytest.raises(ValueError, match="image_shape"):
        get_network("mlp", image_shape=(32, 32))
    with pytest.raises(ValueError, match="at least 12x12"):
        get_network("lenet", image_shape=(3, 8, 8))
    with pytest.raises(ValueError, match="num_classes"):
        get_network("mlp", num_classes=0)
