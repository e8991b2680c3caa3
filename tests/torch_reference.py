"""A small PyTorch re-implementation of the reference architectures, for parity checks only.

Module attribute names and ``Sequential`` layouts follow the reference
repositories (``xxxnell/spatial-smoothing``, ``trungtrinh44/ibnn``) so that its
``state_dict`` keys are the reference's.  Written from the reference's documented
semantics; only the deterministic paths are needed.  Used by the parity tests
(``tests/convert/test_convert_reference.py``, ``tests/models/test_transformers.py``,
``tests/experiment/test_init_from.py``; the iBNN repository's Bayesian layers and models, whose
weights are sampled, ``tests/layers/test_mean_field.py``) and by
``experiments/bench_hessian.py`` and ``experiments/bench_accelerator.py``; not part of the
installed package.  It also transcribes torchmetrics' calibration error
(:func:`torchmetrics_calibration_error`, ``tests/test_metrics.py``).

PyTorch is an optional dependency (``pip install -r requirements-test.txt``, or the
``torch`` extra of pyproject.toml); importing this module without torch installed raises
``ImportError``.
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
    self.dense1, self.dense2 = nn.Linear(cin, 4096), nn.Linear(4096, 4096)
    self.dense3 = nn.Linear(4096, num_classes)

  def forward(self, x):
    x = torch.relu(self.dense1(x.flatten(1)))
    return self.dense3(torch.relu(self.dense2(x)))


class Block(nn.Module):
  def __init__(self, cin, channels, stride, bottleneck, preact, groups=1, width_per_group=64,
               mcdo=False):
    super().__init__()
    exp = 4 if bottleneck else 1
    width = int(channels * width_per_group / 64) * groups
    cout = channels * exp
    self.preact, self.bottleneck = preact, bottleneck
    sc = []
    if stride != 1 or cin != cout:
      sc.append(conv(cin, cout, 1, stride))
      # SS preresnet_dnn_block: no BN on the shortcut; preresnet_mcdo_block.Bottleneck has one.
      if not preact or (mcdo and bottleneck):
        sc.append(nn.BatchNorm2d(cout))
    self.shortcut = nn.Sequential(*sc)
    if bottleneck:
      self.conv1 = conv(cin, width, 1)
      self.conv2 = conv(width, width, 3, stride, 1, groups)
      self.conv3 = conv(width, cout, 1)
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
  def __init__(self, stages, bottleneck, num_classes, width=64, preact=False, smoothing=False,
               mlp=False, groups=1, width_per_group=64, mcdo=False):
    super().__init__()
    self.layer0 = nn.Sequential(conv(3, width, 3, 1, 1)) if preact else nn.Sequential(
        conv(3, width, 3, 1, 1), nn.BatchNorm2d(width), nn.ReLU())
    cin, exp = width, 4 if bottleneck else 1
    for i, n in enumerate(stages, start=1):
      blocks = []
      for j in range(n):
        blocks.append(Block(cin, width * 2 ** (i - 1), 2 if i > 1 and j == 0 else 1, bottleneck,
                            preact, groups, width_per_group, mcdo))
        cin = width * 2 ** (i - 1) * exp
      setattr(self, f"layer{i}", nn.Sequential(*blocks))
      smooth = smoothing and not (preact and i == len(stages))
      setattr(self, f"smooth{i}", nn.Sequential(TanhBlur()) if smooth else nn.Sequential())
    if mlp:
      self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d((7, 7)), MLP(49 * cin, num_classes))
    else:
      self.classifier = nn.Sequential(GAP(cin, num_classes, bn=preact))

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
    for i, (n, w) in enumerate(zip(stages, widths, strict=False)):
      layers = [nn.MaxPool2d(2, 2)] if i > 0 else []
      for _ in range(n):
        layers.append(VGGBlock(cin, w, preact))
        cin = w
      setattr(self, f"layer{i}", nn.Sequential(*layers))
      setattr(self, f"smooth{i}", nn.Sequential(TanhBlur()) if smoothing else nn.Sequential())
    self.classifier = nn.Sequential(nn.MaxPool2d(2, 2), nn.AdaptiveAvgPool2d((7, 7)),
                                    MLP(49 * cin, num_classes))

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
    self.classifier = nn.Sequential(nn.MaxPool2d(2, 2), nn.AdaptiveAvgPool2d((2, 2)),
                                    MLP(4 * 4 * w, num_classes))

  def forward(self, x):
    return self.classifier(self.layer2(self.layer1(self.layer0(x))))


class WideBasic(nn.Module):
  def __init__(self, cin, planes, stride):
    super().__init__()
    self.bn1 = nn.BatchNorm2d(cin)
    self.conv1 = nn.Conv2d(cin, planes, 3, padding=1, bias=True)
    self.bn2 = nn.BatchNorm2d(planes)
    self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=True)
    self.shortcut = (nn.Conv2d(cin, planes, 1, stride=stride, bias=True)
                     if stride != 1 or cin != planes else nn.Identity())

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


# ------------------------------------------------------------------------ HV self-attention models

class Attention(nn.Module):
  """HV ``Attention1d`` (``mask``: additive logits) / ``Attention2d`` with k=1 on flattened
  windows."""
  def __init__(self, dim_in, dim_out, heads, dim_head):
    super().__init__()
    self.heads, self.scale = heads, dim_head ** -0.5
    self.to_qkv = nn.Linear(dim_in, heads * dim_head * 3, bias=False)
    self.to_out = nn.Linear(heads * dim_head, dim_out)

  def forward(self, x, mask=None):
    b, n, _ = x.shape
    q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2)
               for t in self.to_qkv(x).chunk(3, dim=-1))
    dots = q @ k.transpose(-1, -2) * self.scale
    if mask is not None:
      dots = dots + mask
    attn = dots.softmax(dim=-1)
    return self.to_out((attn @ v).transpose(1, 2).reshape(b, n, -1)), attn


class LocalAttention(nn.Module):
  """HV ``LocalAttention`` on NCHW maps: non-overlapping windows + a (2w−1)² relative position
  table."""
  def __init__(self, dim_in, dim_out, heads, dim_head, window_size):
    super().__init__()
    self.attn, self.p = Attention(dim_in, dim_out, heads, dim_head), window_size
    i = torch.tensor([[x, y] for x in range(window_size) for y in range(window_size)])
    self.rel_index = i[None, :, :] - i[:, None, :] + window_size - 1
    self.pos_embedding = nn.Parameter(torch.randn(2 * window_size - 1, 2 * window_size - 1) * 0.02)

  def forward(self, x):
    b, c, h, w = x.shape
    p = self.p
    mask = self.pos_embedding[self.rel_index[:, :, 0], self.rel_index[:, :, 1]]
    x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(-1, p * p, c)
    x, _ = self.attn(x, mask)
    x = x.reshape(b, h // p, w // p, p, p, -1).permute(0, 5, 1, 3, 2, 4).reshape(b, -1, h, w)
    return x


class TransformerBlock(nn.Module):
  def __init__(self, dim, heads, dim_head, mlp_dim):
    super().__init__()
    self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, dim, heads, dim_head)
    self.norm2 = nn.LayerNorm(dim)
    self.ff = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

  def forward(self, x):
    x = self.attn(self.norm1(x))[0] + x
    return self.ff(self.norm2(x)) + x


class ViT(nn.Module):
  """HV ``vit.py``: linear patch embedding ((p1 p2 c) order), CLS token, absolute positions,
  CLS→LN→Linear."""
  def __init__(self, image_size, patch_size, num_classes, depth, dim, heads, mlp_dim, dim_head=64):
    super().__init__()
    self.p = patch_size
    self.embedding = nn.Linear(3 * patch_size ** 2, dim)
    self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
    num_patches = (image_size // patch_size) ** 2
    self.pos_embedding = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
    self.transformers = nn.Sequential(*[TransformerBlock(dim, heads, dim_head, mlp_dim)
                                        for _ in range(depth)])
    self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

  def forward(self, x):
    b, c, h, w = x.shape
    p = self.p
    x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, p * p * c)
    x = torch.cat([self.cls_token.expand(b, -1, -1), self.embedding(x)], dim=1) + self.pos_embedding
    return self.head(self.norm(self.transformers(x)[:, 0]))


class AttentionBlockB(nn.Module):
  """HV pre-activation MSA block: BN-GELU → conv1×1 → BN → LocalAttention (+ 1×1 shortcut
  on a shape change)."""
  def __init__(self, cin, channels, heads, dim_head, window_size, expansion=4):
    super().__init__()
    cout, width = channels * expansion, cin // expansion
    self.shortcut = nn.Sequential(*([conv(cin, cout, 1)] if cin != cout else []))
    self.norm1, self.conv = nn.BatchNorm2d(cin), conv(cin, width, 1)
    self.norm2 = nn.BatchNorm2d(width)
    self.attn = LocalAttention(width, cout, heads, dim_head, window_size)

  def forward(self, x):
    pre = nn.functional.gelu(self.norm1(x))
    skip = self.shortcut(pre) if len(self.shortcut) else x
    return skip + self.attn(self.norm2(self.conv(pre)))


class AlterNet(nn.Module):
  """HV ``AlterNet`` (StemB without pooling on CIFAR, pre-act Conv blocks, MSA blocks at stage
  ends, BNGAP)."""
  def __init__(self, stages, msas, heads, num_classes, bottleneck=True, width=64, dim_head=64,
               window_size=4):
    super().__init__()
    exp = 4 if bottleneck else 1
    self.layer0 = nn.Sequential(conv(3, width, 3, 1, 1))
    cin = width
    for i, (n, m) in enumerate(zip(stages, msas, strict=True), start=1):
      channels, blocks = width * 2 ** (i - 1), []
      for j, alt in enumerate([False] * (n - 2 * m) + [False, True] * m):
        if alt:
          blocks.append(AttentionBlockB(cin, channels, heads[i - 1], dim_head, window_size, exp))
        else:
          blocks.append(Block(cin, channels, 2 if i > 1 and j == 0 else 1, bottleneck, True))
        cin = channels * exp
      setattr(self, f"layer{i}", nn.Sequential(*blocks))
    self.classifier = nn.Sequential(GAP(cin, num_classes, bn=True))

  def forward(self, x):
    x = self.layer0(x)
    for i in range(1, 5):
      x = getattr(self, f"layer{i}")(x)
    return self.classifier(x)


def torchmetrics_calibration_error(confidences, accuracies, n_bins: int) -> float:
  """torchmetrics' l1 calibration error of ``binary_calibration_error`` once its inputs are
  formatted (``_ce_compute`` with ``_binning_bucketize``), transcribed from
  Lightning-AI/torchmetrics at v1.9.0-28-gdab033394
  (commit dab033394560ab3ce05e3d14c13f32e4cde6b351),
  ``src/torchmetrics/functional/classification/calibration_error.py``: the edges
  ``torch.linspace(0, 1, n_bins + 1)`` in the confidences' dtype, bins [lo, hi) by
  ``torch.bucketize(right=True)``, and a confidence of 1.0 in a bin of its own (index n_bins)."""
  confidences = torch.as_tensor(confidences)
  accuracies = torch.as_tensor(accuracies).to(dtype=confidences.dtype)
  bin_boundaries = torch.linspace(0, 1, n_bins + 1, dtype=confidences.dtype)
  acc_bin = torch.zeros(len(bin_boundaries), dtype=confidences.dtype)
  conf_bin = torch.zeros(len(bin_boundaries), dtype=confidences.dtype)
  count_bin = torch.zeros(len(bin_boundaries), dtype=confidences.dtype)
  indices = torch.bucketize(confidences, bin_boundaries, right=True) - 1
  count_bin.scatter_add_(dim=0, index=indices, src=torch.ones_like(confidences))
  conf_bin.scatter_add_(dim=0, index=indices, src=confidences)
  conf_bin = torch.nan_to_num(conf_bin / count_bin)
  acc_bin.scatter_add_(dim=0, index=indices, src=accuracies)
  acc_bin = torch.nan_to_num(acc_bin / count_bin)
  prop_bin = count_bin / count_bin.sum()
  return float(torch.sum(torch.abs(acc_bin - conf_bin) * prop_bin))


# ------------------------------------------------------------- the iBNN repository's own BNN-VI
# Transcribed from trungtrinh44/ibnn at commit 665ba40a9f41646635103687e8b52849ad87df52:
# ``models/utils.py`` (``BayesianLinear``, ``BayesianConv2d``: lines 179–269), ``models/vgg.py``
# (``make_bayes_layers``, ``BayesianVGG``, ``BayesianVGG16``: lines 49–62, 140–181, 281–283) and
# ``models/resnet.py`` (``conv3x3``, ``BayesianWideBasic``, ``BayesianWideResNet``,
# ``BayesianWideResNet28x10``: lines 19–22, 58–78, 211–279).  Layouts and parameter names are the
# reference's; ``IBNN_VGG16`` is its ``cfg[16]``.

class _Bayesian:
  """What the reference's two Bayesian layers share: a σ = softplus(ρ) per weight and per bias,
  ρ = log(expm1(|N(0.015, 0.001²)|)) (``weight_std`` / ``bias_std``); the fixed prior
  N(prior_mean, prior_std²) as two parameters with ``requires_grad=False``; one ``rsample`` of
  the weights and biases per forward call, shared by the whole batch; the KL summed over both."""

  def _posterior_init(self, prior_mean, prior_std):
    def rho_like(tensor):
      rho = nn.Parameter(torch.zeros_like(tensor))
      nn.init.normal_(rho, 0.015, 0.001)
      rho.data.abs_().expm1_().log_()
      return rho
    self.weight_std = rho_like(self.weight)
    if self.bias is not None:
      self.bias_std = rho_like(self.bias)
    self.prior_mean = nn.Parameter(torch.tensor(prior_mean), requires_grad=False)
    self.prior_std = nn.Parameter(torch.tensor(prior_std), requires_grad=False)

  def posterior(self) -> list:
    """The Normal posteriors of the weights and (if any) the biases."""
    dists = [torch.distributions.Normal(self.weight, nn.functional.softplus(self.weight_std))]
    if self.bias is not None:
      dists.append(torch.distributions.Normal(self.bias, nn.functional.softplus(self.bias_std)))
    return dists

  def sample(self):
    """``(weight, bias)``: one reparameterised draw (bias None without one)."""
    draws = [d.rsample() for d in self.posterior()]
    return draws[0], (draws[1] if len(draws) > 1 else None)

  def kl(self):
    prior = torch.distributions.Normal(self.prior_mean, self.prior_std)
    return sum(torch.distributions.kl_divergence(d, prior).sum() for d in self.posterior())


class BayesianLinear(nn.Linear, _Bayesian):
  def __init__(self, in_features, out_features, bias=True, prior_mean=0.0, prior_std=1.0):
    super().__init__(in_features, out_features, bias)
    self._posterior_init(prior_mean, prior_std)

  def forward(self, x):
    weight, bias = self.sample()
    return nn.functional.linear(x, weight, bias)


class BayesianConv2d(nn.Conv2d, _Bayesian):
  def __init__(self, in_channels, out_channels, kernel_size, prior_mean=0.0, prior_std=1.0,
               stride=1, padding=0, bias=True):
    super().__init__(in_channels, out_channels, kernel_size, stride, padding, bias=bias)
    self._posterior_init(prior_mean, prior_std)

  def forward(self, x):
    weight, bias = self.sample()
    return nn.functional.conv2d(x, weight, bias, self.stride, self.padding)


IBNN_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512,
              "M")


class BayesianVGG16(nn.Module):
  """No BatchNorm, no dropout; convs N(0, 2 / (k²·C_out)) with zero biases, the 512-512-C head at
  PyTorch's default initialisation.  ``forward`` returns the logits of one sample."""

  def __init__(self, num_classes, prior_mean, prior_std):
    super().__init__()
    layers, cin = [], 3
    for v in IBNN_VGG16:
      if v == "M":
        layers.append(nn.MaxPool2d(2, 2))
      else:
        layers += [BayesianConv2d(cin, v, 3, prior_mean, prior_std, padding=1), nn.ReLU()]
        cin = v
    self.features = nn.Sequential(*layers)
    self.classifier = nn.Sequential(
        BayesianLinear(512, 512, True, prior_mean, prior_std), nn.ReLU(),
        BayesianLinear(512, 512, True, prior_mean, prior_std), nn.ReLU(),
        BayesianLinear(512, num_classes, True, prior_mean, prior_std))
    for m in self.modules():
      if isinstance(m, BayesianConv2d):
        m.weight.data.normal_(0, (2.0 / (m.kernel_size[0] * m.kernel_size[1]
                                         * m.out_channels)) ** 0.5)
        m.bias.data.zero_()

  def kl(self):
    return sum(m.kl() for m in self.modules() if isinstance(m, _Bayesian))

  def forward(self, x):
    return self.classifier(self.features(x).flatten(1))


class BayesianWideBasic(nn.Module):
  def __init__(self, cin, planes, stride, prior_mean, prior_std):
    super().__init__()
    self.bn1 = nn.BatchNorm2d(cin)
    self.conv1 = BayesianConv2d(cin, planes, 3, prior_mean, prior_std, padding=1)
    self.bn2 = nn.BatchNorm2d(planes)
    self.conv2 = BayesianConv2d(planes, planes, 3, prior_mean, prior_std, stride=stride, padding=1)
    self.shortcut = (BayesianConv2d(cin, planes, 1, prior_mean, prior_std, stride=stride)
                     if stride != 1 or cin != planes else nn.Identity())

  def forward(self, x):
    out = self.conv1(torch.relu(self.bn1(x)))
    out = self.conv2(torch.relu(self.bn2(out)))
    return out + self.shortcut(x)


class BayesianWideResNet28x10(nn.Module):
  """The stem a plain (deterministic) ``conv3x3`` with bias; every block conv, 1×1 shortcut and the
  classifier Bayesian, with biases; the stride on a block's second conv; PyTorch's default
  initialisation throughout."""

  def __init__(self, num_classes=10, prior_mean=0.0, prior_std=1.0, depth=28, k=10):
    super().__init__()
    n = (depth - 4) // 6
    self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=True)
    cin = 16
    for i, planes in enumerate((16 * k, 32 * k, 64 * k), start=1):
      blocks = []
      for j in range(n):
        blocks.append(BayesianWideBasic(cin, planes, 2 if i > 1 and j == 0 else 1, prior_mean,
                                        prior_std))
        cin = planes
      setattr(self, f"layer{i}", nn.Sequential(*blocks))
    self.bn1 = nn.BatchNorm2d(cin, momentum=0.9)
    self.linear = BayesianLinear(cin, num_classes, True, prior_mean, prior_std)

  def kl(self):
    return sum(m.kl() for m in self.modules() if isinstance(m, _Bayesian))

  def forward(self, x):
    x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
    return self.linear(torch.relu(self.bn1(x)).mean(dim=(2, 3)))
