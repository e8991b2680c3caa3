"""U-Net for semantic segmentation, with MC dropout and spatial smoothing (paper Appendix A.2).

"Following Bayesian SegNet, Bayesian U-Net contains six MC dropout layers.  We
add spatial smoothing before each subsampling layer in U-Net encoder."  The
layout is the temporal-smoothing reference's U-Net (Park et al. 2021, TS
``models/unet.py``): five levels with 4 down-samplings, encoder widths
64/128/256/512/1024 with 2/2/3/3/3 convolutions, conv–ReLU–BN blocks, 2×2 max
pooling (ceil rounding), 3×3 stride-2 transposed convolutions, skip connections
*added* to the up-sampled maps, decoder blocks of 3/3/3/2 convolutions and a
1×1 convolution to the class logits.  Stages are numbered 1 … 2·depth+1 (encoder
levels, bottleneck, decoder levels); MC dropout follows the middle six
(3–8 for depth 4): in encoder stages after the skip connection is taken.
"""
from __future__ import annotations

import flax.linen as nn

from smoothing_jax.models.cnn import CNN, check_images


class UNet(CNN):
  """U-Net: per-pixel logits ``[B, H, W, num_classes]`` for images ``[B, H, W, 3]`` of any size.

  Level l (0-based) has ``width·2^l`` channels.  Encoder level l: ``encoder_convs[l]``
  × (3×3 conv–ReLU–BN), skip connection, [MC dropout], ``Smooth`` (``smoothing``
  models), 2×2 max pool; the last entry of ``encoder_convs`` is the bottleneck
  (no pooling).  Decoder level l: 3×3 transposed conv (stride 2)–ReLU–BN cropped
  to the skip's size, + skip, ``decoder_convs`` × (3×3 conv–ReLU–BN), [MC dropout].

  Attributes:
    width: channels of the first level (64 in the reference).
    encoder_convs: convolutions per encoder level, bottleneck last; depth = len − 1.
    decoder_convs: convolutions per decoder level, deepest first (len = depth).
    dropout_stages: 1-based stages (of 2·depth+1) ending in MC dropout when
      ``dropout_rate`` > 0; None = the middle six (3–8 for depth 4).
  """
  width: int = 64
  encoder_convs: tuple = (2, 2, 3, 3, 3)
  decoder_convs: tuple = (3, 3, 3, 2)
  dropout_stages: tuple | None = None

  @property
  def depth(self) -> int:
    return len(self.encoder_convs) - 1

  def stages_with_dropout(self) -> tuple:
    """The 1-based stages followed by MC dropout."""
    stages = 2 * self.depth + 1
    if self.dropout_stages is None:
      middle = self.depth + 1
      return tuple(s for s in range(middle - 2, middle + 4) if 1 <= s <= stages)
    bad = [s for s in self.dropout_stages if not 1 <= s <= stages]
    if bad:
      raise ValueError(
          f"dropout_stages {bad} out of range: a depth-{self.depth} U-Net has stages 1..{stages}.")
    return tuple(self.dropout_stages)

  def conv_block(self, x, features: int, train: bool, name: str):
    """3×3 conv (with bias) → ReLU → BatchNorm, as the reference's ``ConvBlock``."""
    x = self.conv(x, None, features, 3, padding=1, bias=True, name=f"{name}_conv")
    return self.bn(train, f"{name}_bn")(nn.relu(x))

  def check_layout(self):
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}.")
    if self.num_components:
      raise ValueError("UNet has no iBNN variant (num_components must be 0).")
    if self.depth < 1 or self.width < 1 or min(self.encoder_convs) < 1:
      raise ValueError(
          f"UNet needs width >= 1 and at least two encoder levels of >= 1 conv, got width "
          f"{self.width}, encoder_convs {self.encoder_convs}.")
    if len(self.decoder_convs) != self.depth or min(self.decoder_convs) < 1:
      raise ValueError(f"decoder_convs {self.decoder_convs} must give >= 1 conv for each of the "
                       f"{self.depth} decoder levels (encoder_convs {self.encoder_convs}).")

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_images(x)
    self.check_layout()
    dropout_after = self.stages_with_dropout()
    x = x.astype(self.dtype)
    skips = []
    for level, convs in enumerate(self.encoder_convs):
      for i in range(convs):
        x = self.conv_block(x, self.width * 2 ** level, train, f"down{level + 1}_{i}")
      if level == self.depth:  # bottleneck
        x = self.dropout(x) if level + 1 in dropout_after else x
        break
      skips.append(x)
      x = self.dropout(x) if level + 1 in dropout_after else x
      x = self.smooth(x, f"smooth{level + 1}")
      pad = ((0, x.shape[1] % 2), (0, x.shape[2] % 2)
            )  # ceil mode ("SAME"): odd maps keep their last row
      x = nn.max_pool(x, (2, 2), (2, 2), padding=pad)
    levels_and_convs = zip(reversed(range(self.depth)), self.decoder_convs, strict=True)
    for stage, (level, convs) in enumerate(levels_and_convs, start=self.depth + 2):
      skip = skips[level]
      features = self.width * 2 ** level
      x = nn.ConvTranspose(features, (3, 3), strides=(2, 2), padding="SAME", dtype=self.dtype,
                           name=f"up{level + 1}_upconv")(x)
      x = self.bn(train, f"up{level + 1}_upbn")(nn.relu(x))
      x = x[:, :skip.shape[1], :skip.shape[2]] + skip
      for i in range(convs):
        x = self.conv_block(x, features, train, f"up{level + 1}_{i}")
      x = self.dropout(x) if stage in dropout_after else x
    return nn.Conv(self.num_classes, (1, 1), dtype=self.dtype, name="logits")(x)
