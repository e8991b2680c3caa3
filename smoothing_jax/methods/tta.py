"""Test-time augmentation (Krizhevsky et al. 2012; as an ensemble, Ashukha et al. 2020): the base
method's predictive on A views of each image, averaged in probability space, so N = A × the
base's draws.  It wraps any method (``config.tta.augmentations`` non-empty), trains as the base
does, and a deep ensemble of it (``deep_ensemble.members`` > 1) runs it on each member.

The views: the image itself (always draw 0, so N = 1 is the base's own prediction), then those
``config.tta.augmentations`` lists, each ``"flip"`` (horizontal), ``"shift:<dy>,<dx>"`` (the
image moved by dy rows and dx columns, the pixels moved in zero: the crop at that offset of the
zero-padded image, as the training's random crop takes), or ``"flip+shift:<dy>,<dx>"``.  Zero is
in the model's normalised input, i.e. the dataset's mean colour.

Draw d = s·A + a is the base's draw s on view a (the base's draw s uses the same key on every
view), so the first A draws are one base draw on every view; the nested sizes reported are 1 and
A × each of the base's.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from smoothing_jax.methods.base import Method, setting
from smoothing_jax.passes import map_in_chunks

_SHIFT = re.compile(r"^(flip\+)?shift:(-?\d+),(-?\d+)$")


def check_augmentation(name: str) -> str:
  """``name`` if it names a view, else ValueError (one line) with the forms."""
  if name == "flip" or _SHIFT.match(str(name)):
    return name
  raise ValueError(f"Unknown test-time augmentation {name!r}: use 'flip', 'shift:<dy>,<dx>' or "
                   "'flip+shift:<dy>,<dx>' (e.g. 'shift:4,0').")


def augment(images, name: str):
  """View ``name`` of ``images [..., H, W, C]`` (``"identity"``, or a
  :func:`check_augmentation` name)."""
  if name == "identity":
    return images
  if name.startswith("flip"):
    images = images[..., :, ::-1, :]
  match = _SHIFT.match(name)
  if match is None:
    return images
  dy, dx = int(match[2]), int(match[3])
  h, w = images.shape[-3:-1]
  py, px = abs(dy), abs(dx)
  padded = jnp.pad(images, [(0, 0)] * (images.ndim - 3) + [(py, py), (px, px), (0, 0)])
  return padded[..., py + dy:py + dy + h, px + dx:px + dx + w, :]


@dataclasses.dataclass(frozen=True)
class TestTimeAugmentation(Method):
  """The ``base`` method's predictive on the identity and each view of ``augmentations``."""
  __test__ = False  # not a pytest class
  name = "tta"
  settings = {
      # The views besides the image itself (empty: no test-time augmentation), e.g.
      # ("flip", "shift:4,0", "shift:-4,0", "shift:0,4", "shift:0,-4").
      "augmentations": (),
  }
  base: Method | None = None
  augmentations: tuple = ()

  @classmethod
  def wrap(cls, base: Method, config=None, augmentations: Sequence[str] | None = None
           ) -> Method:
    """``base`` on the views of ``augmentations`` (default ``config.tta.augmentations``);
    ``base`` itself where there are none."""
    if augmentations is None:
      augmentations = setting(config, "tta.augmentations", ())
    if not augmentations:
      return base
    views = ("identity",) + tuple(check_augmentation(a) for a in augmentations)
    return cls(base.model, chunk_size=base.chunk_size, base=base, augmentations=views)

  def describe(self) -> str:
    return f"{self.base.describe()} with test-time augmentation ({len(self.augmentations)} views)"

  # --- The predictive: the base's on every view.
  @property
  def stochastic(self) -> bool:
    return self.base.stochastic

  @property
  def num_draws(self) -> int:
    return len(self.augmentations) * self.base.num_draws

  def with_samples(self, num_samples: int) -> TestTimeAugmentation:
    views = len(self.augmentations)
    return dataclasses.replace(self, base=self.base.with_samples(-(-num_samples // views)))

  def nested(self, requested: Sequence[int] = ()) -> tuple:
    base, sizes = self.base.nested(requested)
    views = len(self.augmentations)
    return dataclasses.replace(self, base=base), tuple(sorted({1} | {views * n for n in sizes}))

  def _views(self, images):
    return jnp.stack([augment(images, name) for name in self.augmentations])

  def _on_views(self, draws, views):
    """``draws(view [..])`` ``[S, ...]`` of every view ``views [A, ..]`` as ``[S·A, ...]``, draw
    s·A + a the base's draw s on view a."""
    out = map_in_chunks(draws, views, self.chunk_size)  # [A, S, ...]
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:]), out)

  def sample_log_probs(self, variables, images, rng):
    return self._on_views(lambda x: self.base.sample_log_probs(variables, x, rng),
                          self._views(images))

  def sample_outputs(self, variables, images, rng):
    if images.ndim == 5:  # [S·A, B, ...], draw s·A + a on its own image: view a of draws s
      views = len(self.augmentations)
      per_view = jnp.swapaxes(images.reshape((-1, views) + images.shape[1:]), 0, 1)
      per_view = jnp.stack([augment(x, name) for x, name in zip(per_view, self.augmentations,
                                                                  strict=True)])
    else:
      per_view = self._views(images)
    return self._on_views(lambda x: self.base.sample_outputs(variables, x, rng), per_view)

  def for_training_eval(self) -> Method:
    return self.base.for_training_eval()

  @property
  def predicts_per_member(self) -> bool:
    return True

  # --- What it cannot be, and everything else: the base's.
  def check(self, config) -> TestTimeAugmentation:
    self.base.check(config)
    return self

  def as_member(self, config=None) -> TestTimeAugmentation:
    return dataclasses.replace(self, base=self.base.as_member(config))

  def one_model(self, what: str, workdir: str = "") -> TestTimeAugmentation:
    self.base.one_model(what, workdir)
    return self

  def frame_probs(self, variables, frame, rng):
    return self.base.frame_probs(variables, frame, rng)

  def one_network(self, batch_size: int) -> dict:
    return self.base.one_network(batch_size)

  def tile(self, *arrays) -> tuple:
    return self.base.tile(*arrays)

  def loss(self, config, **kwargs):
    return self.base.loss(config, **kwargs)

  def optimizer(self, config, schedule):
    return self.base.optimizer(config, schedule)

  def weight_decay(self, config):
    return self.base.weight_decay(config)

  def update_scaling(self, config):
    return self.base.update_scaling(config)

  def warm_start(self, config):
    return self.base.warm_start(config)

  def load_warm_start(self, variables, loaded):
    return self.base.load_warm_start(variables, loaded)

  def init_state(self, variables):
    return self.base.init_state(variables)

  def after_step(self, method_state, variables, clock):
    return self.base.after_step(method_state, variables, clock)

  def schedule(self, config, schedule, **kwargs):
    return self.base.schedule(config, schedule, **kwargs)

  @property
  def fit_name(self):
    return self.base.fit_name

  def fit(self, variables, batches):
    return self.base.fit(variables, batches)

  def prediction_variables(self, variables, data):
    return self.base.prediction_variables(variables, data)

  @property
  def needs_training_data(self) -> bool:
    return self.base.needs_training_data

  @property
  def prepares_variables(self) -> bool:
    return self.base.prepares_variables

  @property
  def per_member(self) -> Method:
    return self.base.per_member

  @property
  def members(self) -> int:
    return self.base.members

  def init_train_state(self, config, init_one, devices=()):
    return self.base.init_train_state(config, init_one, devices)

  def train_keys(self, config):
    return self.base.train_keys(config)

  def train_pipelines(self, config, pipeline):
    return self.base.train_pipelines(config, pipeline)

  def train_step(self, step, state, member_batch, rngs, *, shared: bool):
    return self.base.train_step(step, state, member_batch, rngs, shared=shared)

  def train_scalars(self, prefix: str, means: dict) -> dict:
    return self.base.train_scalars(prefix, means)
