"""Dataset sources: each form of ``config.input.dataset`` is read by one
:class:`~smoothing_jax.data.sources.base.Source`.

A new source is one file here and one line in :data:`REGISTRY` (its ``<prefix>:``, or for the
sources of names without one, their name).  :func:`smoothing_jax.data.datasets.parse_dataset`
asks the source that a name's prefix names, or, for a name without one, the one source whose
``built_in`` names hold it.
"""
from smoothing_jax.data.sources.digits import Digits
from smoothing_jax.data.sources.folder import Folder
from smoothing_jax.data.sources.npz import Npz
from smoothing_jax.data.sources.synthetic import Synthetic
from smoothing_jax.data.sources.tfds import TFDS

REGISTRY = {  # key: the source's prefix (a DatasetSpec's ``source``)
    "tfds": TFDS(),
    "folder": Folder(),
    "npz": Npz(),
    "synthetic": Synthetic(),
    "digits": Digits(),
}
