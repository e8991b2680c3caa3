"""MC dropout (Gal & Ghahramani 2016): N stochastic passes, p̄(y|x) = (1/N) Σ_n softmax(f_n(x)),
pass n with the dropout key ``split(key, N)[n]`` (``<family>_mcdo[_smoothing]_<depth>``, and
any model with dropout kept on at evaluation).  The evaluators report the nested ensembles of
the first N passes for each N of ``config.ensemble_sizes``."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax

from smoothing_jax.methods.base import Method, check_num_samples, nested_samples
from smoothing_jax.passes import log_probs, map_in_chunks, pass_outputs


@functools.partial(jax.jit, static_argnames=("model", "num_samples", "chunk_size"))
def mc_log_probs(model, variables, images, rng, num_samples: int, chunk_size: int | None = None):
  """``[N, B, ..., C]`` log-probabilities of N passes, pass ``i`` with key ``split(rng, N)[i]``
  (in chunks of ``chunk_size`` passes, :func:`map_in_chunks`)."""
  keys = jax.random.split(rng, num_samples)
  if num_samples == 1:  # one plain pass: a vmap over one key only adds work
    return log_probs(model, variables, images, keys[0])[None]
  return map_in_chunks(lambda key: log_probs(model, variables, images, key), keys, chunk_size)


@dataclasses.dataclass(frozen=True)
class MCDropout(Method):
  """``num_samples`` passes with independent dropout masks, in chunks of ``chunk_size``."""
  name = "mc_dropout"


  @property
  def stochastic(self) -> bool:
    return True

  @property
  def num_draws(self) -> int:
    return self.num_samples

  def with_samples(self, num_samples: int) -> MCDropout:
    return dataclasses.replace(self, num_samples=check_num_samples(num_samples))

  def nested(self, requested: Sequence[int] = ()) -> tuple:
    return nested_samples(self, requested)

  def sample_log_probs(self, variables, images, rng):
    return mc_log_probs(self.model, variables, images, rng, self.num_samples, self.chunk_size)

  def sample_outputs(self, variables, images, rng):
    keys = jax.random.split(rng, self.num_samples)  # as mc_log_probs: pass n with key n
    if images.ndim == 5:  # draw n on images[n]
      return map_in_chunks(lambda a: pass_outputs(self.model, variables, a[1], a[0]),
                           (keys, images), self.chunk_size)
    return map_in_chunks(lambda key: pass_outputs(self.model, variables, images, key), keys,
                         self.chunk_size)
