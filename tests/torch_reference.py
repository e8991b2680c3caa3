"""A small PyTorch re-implementation of the reference architectures, for parity tests only.

Module attribute names and ``Sequential`` layouts follow the reference
repositories (``xxxnell/spatial-smoothing``, ``trungtrinh44/ibnn``) so that its
``state_dict`` keys are the reference's.  Written from the reference's documented
semantics; only the deterministic paths are needed.
"""
import torch
from torch import nn


def conv(cin, cout, k, stride=1, padding=0, groups=1, bias=False):
  return nn.Conv2d(cin, cout, k, stride=stride, padding=padding, groups=groups, bias=bias)


class TanhBlur(nn.Module):
  def __init__(self, temp=10.0):
    super().__init__()
    self.temp = temp
    self.layer1 = nn.AvgPool2d(kernel_size=2, stride=1, padding=1)

  def forward(self, x):
    return self.layer1(torch.relu(self.temp * torch.tanh(x / self.temp)))


class GAP(nn.Module):
  def __init__(self, cin, num_classes, bn=False):
    super().__init__()
    if bn:
      self.bn = nn.BatchNorm2d(cin)
    self.use_bn = bn
    self.dense = nn.Linear(cin, num_classes)

  def forward(self, x):
    if self.use_bn:
      x = torch.relu(self.bn(x))
    return self.dense(x.mean(dim=(2, 3)))


class MLP(nn.Module):
  def __init__(self, cin, num_classes):
    super().__init__()
    self.dense1, self.dense2, self.dense3 = nn.Linear(cin, 4096), nn.Linear(4096, 4096), nn.Linear(4096, num_classes)

  def forward(self, x):
    x = torch.relu(self.dense1(x.flatten(1)))
    return self.dense3(torch.relu(self.dense2(x)))


class Block(nn.Module):
  def __init__(self, cin, channels, stride, bottleneck, preact, groups=1, width_per_group=64):
    super().__init__()
    exp = 4 if bottleneck else 1
    width = int(channels * width_per_group / 64) * groups
    cout = channels * exp
    self.preact, self.bottleneck = preact, bottleneck
    sc = []
    if stride != 1 or cin != cout:
      sc.append(conv(cin, cout, 1, stride))
      if not preact:
        sc.append(nn.BatchNorm2d(cout))
    self.shortcut = nn.Sequential(*sc)
    if bottleneck:
      self.conv1, self.conv2, self.conv3 = conv(cin, width, 1), conv(width, width, 3, stride, 1, groups), conv(width, cout, 1)
      bn_channels = [cin, width, width] if preact else [width, width, cout]
      self.bn1, self.bn2, self.bn3 = (nn.BatchNorm2d(c) for c in bn_channels)
    else:
      self.conv1, self.conv2 = conv(cin, width, 3, stride, 1), conv(width, cout, 3, 1, 1)
      bn_channels = [cin, width] if preact else [width, cout]
      self.bn1, self.bn2 = (nn.BatchNorm2d(c) for c in bn_channels)

  def forward(self, x):
    if self.preact:
      if len(self.shortcut):
        x = torch.relu(self.bn1(x))
        skip = self.shortcut(x)
      else:
        skip = x
        x = torch.relu(self.bn1(x))
      if self.bottleneck:
        x = self.conv2(torch.relu(self.bn2(self.conv1(x))))
        x = self.conv3(torch.relu(self.bn3(x)))
      else:
        x = self.conv2(torch.relu(self.bn2(self.conv1(x))))
      return skip + x
    skip = self.shortcut(x)
    x = torch.relu(self.bn1(self.conv1(x)))
    if self.bottleneck:
      x = torch.relu(self.bn2(self.conv2(x)))
      x = self.bn3(self.conv3(x))
    else:
      x = self.bn2(self.conv2(x))
    return torch.relu(skip + x)


class ResNet(nn.Module):
  def __init__(self, stages, bottleneck, num_classes, width=64, preact=False, smoothing=False, mlp=False,
               groups=1, width_per_group=64):
    super().__init__()
    self.layer0 = nn.Sequential(conv(3, width, 3, 1, 1)) if preact else nn.Sequential(
        conv(3, width, 3, 1, 1), nn.BatchNorm2d(width), nn.ReLU())
    cin, exp = width, 4 if bottleneck else 1
    for i, n in enumerate(stages, start=1):
      blocks = []
      for j in range(n):
        blocks.append(Block(cin, width * 2 ** (i - 1), 2 if i > 1 and j == 0 else 1, bottleneck, preact,
                            groups, width_per_group))
        cin = width * 2 ** (i - 1) * exp
      setattr(self, f"layer{i}", nn.Sequential(*blocks))
      smooth = smoothing and not (preact and i == len(stages))
      setattr(self, f"smooth{i}", nn.Sequential(TanhBlur()) if smooth else nn.Sequential())
    self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d((7, 7)), MLP(49 * cin, num_classes)) if mlp else \
        nn.Sequential(GAP(cin, num_classes, bn=preact))

  def forward(self, x):
    x = self.layer0(x)
    for i in range(1, 5):
      x = getattr(self, f"smooth{i}")(getattr(self, f"layer{i}")(x))
    return self.classifier(x)


class VGGBlock(nn.Module):
  def __init__(self, cin, cout, preact):
    super().__init__()
    self.preact = preact
    self.conv = conv(cin, cout, 3, 1, 1)
    self.bn = nn.BatchNorm2d(cin if preact else cout)

  def forward(self, x):
    return self.conv(torch.relu(self.bn(x))) if self.preact else torch.relu(self.bn(self.conv(x)))


class VGG(nn.Module):
  def __init__(self, stages, num_classes, width=64, preact=False, smoothing=False):
    super().__init__()
    widths = [width, 2 * width, 4 * width, 8 * width, 8 * width]
    cin = 3
    for i, (n, w) in enumerate(zip(stages, widths)):
      layers = [nn.MaxPool2d(2, 2)] if i > 0 else []
      for _ in range(n):
        layers.append(VGGBlock(cin, w, preact))
        cin = w
      setattr(self, f"layer{i}", nn.Sequential(*layers))
      setattr(self, f"smooth{i}", nn.Sequential(TanhBlur()) if smoothing else nn.Sequential())
    self.classifier = nn.Sequential(nn.MaxPool2d(2, 2), nn.AdaptiveAvgPool2d((7, 7)), MLP(49 * cin, num_classes))

  def forward(self, x):
    for i in range(5):
      x = getattr(self, f"smooth{i}")(getattr(self, f"layer{i}")(x))
    return self.classifier(x)


class AlexBlock(nn.Module):
  def __init__(self, cin, cout, k, stride=1, padding=0):
    super().__init__()
    self.conv = conv(cin, cout, k, stride, padding)

  def forward(self, x):
    return torch.relu(self.conv(x))


class AlexNetCifar(nn.Module):
  def __init__(self, num_classes, width=64):
    super().__init__()
    w = width
    self.layer0 = nn.Sequential(AlexBlock(3, w, 3, 2, 1))
    self.layer1 = nn.Sequential(nn.MaxPool2d(2, 2), AlexBlock(w, 3 * w, 5, 1, 2))
    self.layer2 = nn.Sequential(nn.MaxPool2d(2, 2), AlexBlock(3 * w, 6 * w, 3, 1, 1),
                                AlexBlock(6 * w, 4 * w, 3, 1, 1), AlexBlock(4 * w, 4 * w, 3, 1, 1))
    self.classifier = nn.Sequential(nn.MaxPool2d(2, 2), nn.AdaptiveAvgPool2d((2, 2)), MLP(4 * 4 * w, num_classes))

  def forward(self, x):
    return self.classifier(self.layer2(self.layer1(self.layer0(x))))


class WideBasic(nn.Module):
  def __init__(self, cin, planes, stride):
    super().__init__()
    self.bn1 = nn.BatchNorm2d(cin)
    self.conv1 = nn.Conv2d(cin, planes, 3, padding=1, bias=True)
    self.bn2 = nn.BatchNorm2d(planes)
    self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=True)
    self.shortcut = nn.Conv2d(cin, planes, 1, stride=stride, bias=True) if stride != 1 or cin != planes \
        else nn.Identity()

  def forward(self, x):
    out = self.conv1(torch.relu(self.bn1(x)))
    out = self.conv2(torch.relu(self.bn2(out)))
    return out + self.shortcut(x)


class WideResNet(nn.Module):
  def __init__(self, depth, k, num_classes, width=16):
    super().__init__()
    n = (depth - 4) // 6
    widths = [width * k, 2 * width * k, 4 * width * k]
    self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=True)
    cin = width
    for i, w in enumerate(widths, start=1):
      blocks = []
      for j in range(n):
        blocks.append(WideBasic(cin, w, 2 if i > 1 and j == 0 else 1))
        cin = w
      setattr(self, f"layer{i}", nn.Sequential(*blocks))
    self.bn1 = nn.BatchNorm2d(cin, momentum=0.9)
    self.linear = nn.Linear(cin, num_classes)

  def forward(self, x):
    x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
    return self.linear(torch.relu(self.bn1(x)).mean(dim=(2, 3)))


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
  """Random weights *and* BatchNorm running statistics (so the conversion of both is tested)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, tensor in model.state_dict().items():
      if name.endswith("num_batches_tracked"):
        continue
      if name.endswith("running_var"):
        tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))
      elif name.endswith("weight") and tensor.ndim > 1:
        fan_in = tensor[0].numel()
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
      else:
        tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))
  return model.eval()
