"""One model of the spatial-smoothing paper's CIFAR-10 table, trained and evaluated in one command
(issue 57, item 4): the SS recipe of ``configs/cifar_resnet.py`` (SGD 0.1, momentum 0.9, weight
decay 5e-4, batch 128, 1 warm-up epoch + 200 epochs, lr × 0.2 at epochs 60/130/160 counted after
the warm-up, random crop + flip) in bfloat16 (``half_precision``) on the device-resident data path
(``config.steps_per_call`` steps per host call; one call per epoch here), then the
``ensemble_sizes`` evaluator on the 10,000 test images at N = 1 and N = 50 (N = 50 for the MC
dropout models only: a deterministic model has one prediction).

  python experiments/reproduce_gpu.py resnet_mcdo_smoothing_18 --data DIR --out DIR
  python experiments/reproduce_gpu.py resnet_dnn_18 --smoke          # CPU, 2 epochs, seconds
  python experiments/reproduce_gpu.py MODEL --budget-min 9           # stop training in time

MODEL: ``resnet_dnn_18``, ``resnet_dnn_smoothing_18``, ``resnet_mcdo_18`` or
``resnet_mcdo_smoothing_18``.  ``--data``: the compact CIFAR-10 copy ``cifar10_jpeg/``
(``train.npz`` and ``test.npz``, each with ``jpeg`` (uint8, the JPEG files back to back),
``offsets`` (int64 [N+1]) and ``labels`` (int64 [N])); default ``.devdata/cifar10_jpeg`` in the
repository, else ``../shared/data/cifar10_jpeg``.  The images are decoded with Pillow (in
``--decode-workers`` processes) and handed to the library as an ``npz:`` folder (``--cache``,
default a temporary one).  Normalisation: the paper's CIFAR-10 constants (what the recipe uses on
TFDS ``cifar10``), not the statistics of the training split that ``npz:`` data gets by default
(``--normalization data``).

Writes ``<out>/reproduce_gpu_<MODEL>[_smoke].json`` (rewritten after every epoch, so a run cut
short leaves its curve): the per-epoch curve (the TensorBoard scalars the loop writes: training
loss and accuracy of each epoch, test NLL/accuracy/ECE every ``--eval-every`` epochs at N = 1,
with the wall time and images/s of each epoch), the final metrics at N = 1 and N = 50, the SS
Table E.1 row of the model next to them, wall times (total, data, training, evaluation), the
device, versions, date and git commit, and the projected time on an H200 from the first device
check (``experiments/results/device_check_h200_2026-11-28.json``).  Progress lines (epoch,
images/s, time left) go to stderr.

The data: ``cifar10_jpeg`` re-encodes the shared ``cifar10/`` arrays as JPEG (quality 75); its
pixels differ from those arrays by 0.16 on average (0–255 scale; 92% equal, largest 66).  But
``cifar10/`` is itself decoded from JPEG copies (quality 75, 4:2:0 chroma) of the original
CIFAR-10, so both differ from the original pixels by a JPEG round trip: about 6 per pixel value
on average (what the same round trip does to CIFAR-100's lossless sample), and training and test
images carry the same artefacts.  The numbers may therefore sit a little below the paper's; this
script cannot measure by how much (no lossless CIFAR-10 is at hand).

The device machine has no TensorFlow, ml_collections, clu or dm-pix: carry the wheels of
``experiments/fetch_device_wheels.sh`` (``.whl``) and the data (``.devdata``), as for
``device_check.py`` (see experiments/README.md).

Only the standard library, numpy and Pillow are imported at the top: the decoding workers
(spawned processes) import this file.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import glob
import importlib.util
import io
import json
import multiprocessing
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("resnet_dnn_18", "resnet_dnn_smoothing_18", "resnet_mcdo_18", "resnet_mcdo_smoothing_18")
# SS (Park & Kim, "Blurs Behave Like Ensembles: Spatial Smoothings to Improve Accuracy,
# Uncertainty, and Robustness", ICML 2022), Table E.1, CIFAR-10: NLL, accuracy, ECE; the MC dropout
# rows at N = 50.
REFERENCE_SOURCE = "SS (Park & Kim, ICML 2022) Table E.1, CIFAR-10"
REFERENCE = {
    "resnet_dnn_18": {"ensemble_size": 1, "nll": 0.182, "acc": 0.952, "ece": 0.0275},
    "resnet_dnn_smoothing_18": {"ensemble_size": 1, "nll": 0.173, "acc": 0.954, "ece": 0.0231},
    "resnet_mcdo_18": {"ensemble_size": 50, "nll": 0.157, "acc": 0.952, "ece": 0.0114},
    "resnet_mcdo_smoothing_18": {"ensemble_size": 50, "nll": 0.144, "acc": 0.955, "ece": 0.0104},
}
CONFIG_FILE = os.path.join(ROOT, "configs", "cifar_resnet.py")
DEVICE_CHECK = os.path.join(ROOT, "experiments", "results", "device_check_h200_2026-11-28.json")
DEFAULT_DATA = (os.path.join(ROOT, ".devdata", "cifar10_jpeg"),
                os.path.join(ROOT, "..", "shared", "data", "cifar10_jpeg"))
SMOKE = {"train_images": 1000, "test_images": 300, "epochs": 2, "width": 8}
EVAL_BATCH = 1000  # evaluation batch (10 batches of the test split; N = 50: 10 samples a pass)
DATA_CAVEAT = (
    "cifar10_jpeg re-encodes the shared cifar10/ arrays as JPEG quality 75 (decoded, 0.16 per "
    "pixel value from them on average, 92% of pixels equal, largest 66; shared/data/README.md); "
    "cifar10/ itself is decoded from quality-75 JPEG copies of CIFAR-10 (YoongiKim/CIFAR-10-"
    "images), so both differ from the original pixels by a JPEG round trip (about 6 per pixel "
    "value on average: the same round trip on the lossless CIFAR-100 sample), in training and "
    "test images alike. Expect NLL and accuracy a little worse than on the original CIFAR-10; "
    "not measured (no lossless CIFAR-10 at hand).")


def log(message: str) -> None:
  print(f"[reproduce_gpu] {message}", file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


# ----------------------------------------------------------------------------- data

def decode_jpegs(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
  """uint8 ``[N, H, W, 3]`` RGB of the JPEG files ``blob[offsets[i]:offsets[i+1]]`` (as the
  folder's ``decode.py`` does)."""
  from PIL import Image
  return np.stack([np.asarray(Image.open(io.BytesIO(blob[a:b].tobytes())).convert("RGB"))
                   for a, b in zip(offsets[:-1], offsets[1:], strict=True)])


def read_jpeg_split(path: str, limit: int | None = None, workers: int = 1):
  """``(images uint8 [N,32,32,3], labels int32 [N])`` of one ``cifar10_jpeg`` file, the first
  ``limit`` images (None: all), decoded in ``workers`` spawned processes (1: here)."""
  with np.load(path) as data:
    missing = {"jpeg", "offsets", "labels"} - set(data.files)
    if missing:
      raise ValueError(f"{path}: not a cifar10_jpeg file (no {', '.join(sorted(missing))}; it "
                       f"has {', '.join(sorted(data.files))}).")
    blob, offsets, labels = data["jpeg"], data["offsets"], data["labels"]
  count = len(labels) if limit is None else min(limit, len(labels))
  offsets = offsets[:count + 1]
  blob = blob[:offsets[-1]]
  if workers <= 1 or count < 2000:
    images = decode_jpegs(blob, offsets)
  else:
    edges = np.linspace(0, count, workers + 1).astype(int)
    bounds = list(zip(edges[:-1], edges[1:], strict=True))
    context = multiprocessing.get_context("spawn")  # JAX's threads make fork unsafe
    try:
      with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        parts = pool.map(decode_jpegs, [blob[offsets[a]:offsets[b]] for a, b in bounds],
                         [offsets[a:b + 1] - offsets[a] for a, b in bounds])
        images = np.concatenate(list(parts))
    except concurrent.futures.process.BrokenProcessPool as error:  # e.g. no __main__ file
      log(f"decoding in {workers} processes failed ({error}); decoding here")
      images = decode_jpegs(blob, offsets)
  if images.shape[1:] != (32, 32, 3):
    raise ValueError(f"{path}: decoded images of shape {images.shape[1:]}, not 32×32×3.")
  return images, labels[:count].astype(np.int32)


def prepare_data(source: str, cache: str, train_limit, test_limit, workers: int) -> dict:
  """Decode ``source`` (a ``cifar10_jpeg`` folder) into ``<cache>/{train,test}.npz`` (uint8
  ``images``, int32 ``labels``: an ``npz:`` dataset); what was read."""
  for split in ("train", "test"):
    if not os.path.isfile(os.path.join(source, f"{split}.npz")):
      raise FileNotFoundError(
          f"{source} has no {split}.npz: --data names the cifar10_jpeg folder (train.npz and "
          "test.npz with jpeg, offsets and labels; ../shared/data/cifar10_jpeg).")
  os.makedirs(cache, exist_ok=True)
  counts = {}
  for split, limit in (("train", train_limit), ("test", test_limit)):
    images, labels = read_jpeg_split(os.path.join(source, f"{split}.npz"), limit, workers)
    np.savez(os.path.join(cache, f"{split}.npz"), images=images, labels=labels)
    counts[f"{split}_images"] = len(labels)
    counts[f"{split}_classes"] = int(len(np.unique(labels)))
  return counts


@contextlib.contextmanager
def paper_normalization(enabled: bool):
  """While open, ``npz:`` data is normalised with the paper's CIFAR-10 constants
  (``dataset_spec.NORMALIZATION["cifar10"]``, what the recipe uses on TFDS ``cifar10``) instead of
  its training split's statistics."""
  from smoothing_jax.data import pipeline as pipeline_lib
  from smoothing_jax.data.dataset_spec import NORMALIZATION
  original = pipeline_lib.normalization
  if enabled:
    pipeline_lib.normalization = lambda spec, train_images=None: NORMALIZATION["cifar10"]
  try:
    yield
  finally:
    pipeline_lib.normalization = original


# ----------------------------------------------------------------------------- records

def read_scalars(logdir: str) -> dict:
  """``{step: {tag: value}}`` of the TensorBoard event files in ``logdir`` (records: length,
  its CRC, the event, its CRC; a record still being written at the end is skipped)."""
  from tensorboard.compat.proto import event_pb2
  scalars: dict = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    position = 0
    while position + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[position:position + 8])
      start, end = position + 12, position + 12 + length
      if end + 4 > len(data):
        break
      event = event_pb2.Event.FromString(data[start:end])
      position = end + 4
      for value in event.summary.value:
        scalars.setdefault(int(event.step), {})[value.tag] = float(value.simple_value)
  return scalars


def git_commit() -> str:
  try:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else "unknown"


def environment() -> dict:
  import flax
  import jax
  import jaxlib
  import optax
  device = jax.devices()[0]
  return {"device_kind": device.device_kind, "platform": device.platform,
          "num_devices": jax.device_count(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
          "numpy": np.__version__, "python": platform.python_version(),
          "host_cpus": os.cpu_count()}


def write_json(path: str, result: dict) -> None:
  """``result`` to ``path`` at once (a reader never sees half a file)."""
  partial = f"{path}.partial"
  with open(partial, "w") as f:
    json.dump(result, f, indent=1, default=float)
    f.write("\n")
  os.replace(partial, path)


# ----------------------------------------------------------------------------- projection

def h200_projection(model: str, epochs: int = 201, train_images: int = 50_000,
                    batch_size: int = 128, eval_every: int = 1, path: str = DEVICE_CHECK):
  """Projected minutes of the full run of ``model`` on the H200 of the first device check
  (``path``): training at the measured end-to-end rate (before K steps per call: the pessimistic
  bound) and at the bare bf16 step's rate (the optimistic one), plus the fixed costs (estimated
  where not measured); None without the file."""
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    check = json.load(f)
  bare = {r["model"]: r["jax_bfloat16"]["images_per_s"] for r in check["train_step"]
          if r["batch_size"] == batch_size}
  e2e = check["end_to_end"]
  # Bare steps measured for resnet_dnn_18 and resnet_mcdo_smoothing_18: a smoothing model is
  # taken at the second's rate, MC dropout alone at the first's (dropout costs little).
  measured_as = "resnet_mcdo_smoothing_18" if "smoothing" in model else "resnet_dnn_18"
  bare_rate = bare[measured_as]
  loop_ratio = e2e["images_per_s"] / bare["resnet_dnn_18"]  # the loop's share, one step a call
  images = epochs * (train_images // batch_size) * batch_size  # the last partial batch dropped
  mc = "mcdo" in model
  fixed = {  # seconds
      "train_compile_and_setup": e2e["first_run_seconds"] - float(np.mean(e2e["one_step_seconds"])),
      "per_epoch_evaluations": 0.1 * (epochs // eval_every),  # estimate: 0.1 s per N = 1 pass
      "final_evaluation": (check["mc_evaluation"]["compile_seconds"]
                           + check["mc_evaluation"]["seconds"]) if mc else 5.0,
      "data_and_jax_start": 15.0,  # estimate: decoding 60,000 JPEGs, loading, CUDA start
  }
  rates = {"pessimistic": bare_rate * loop_ratio, "optimistic": bare_rate}
  training = {k: images / r for k, r in rates.items()}
  return {
      "source": os.path.relpath(path, ROOT), "device": check.get("device_kind"),
      "training_images": images, "bare_bf16_step_images_per_s": bare_rate,
      "bare_step_measured_for": measured_as,
      "end_to_end_over_bare_step_one_step_per_call": loop_ratio,
      "training_images_per_s": rates, "training_seconds": training,
      "fixed_seconds": fixed,
      "total_minutes": {k: (t + sum(fixed.values())) / 60 for k, t in training.items()},
      "arithmetic": (f"{epochs} epochs × {train_images // batch_size} steps × {batch_size} = "
                     f"{images:,} images / images/s + fixed costs; pessimistic: the loop at "
                     f"{loop_ratio:.3f} × the bare step (measured with one step a call), "
                     "optimistic: at the bare step (K steps a call removing the per-step host "
                     "work)"),
  }


# ----------------------------------------------------------------------------- training

def build_config(args, data_dir: str, steps_per_epoch: int, test_images: int):
  from smoothing_jax.experiment import config as config_lib
  config = config_lib.from_file(CONFIG_FILE, args.model)
  epochs = args.epochs or (config.warmup_epochs + config.num_epochs)
  warmup = min(config.warmup_epochs, epochs - 1)
  overrides = {
      "input.dataset": f"npz:{data_dir}", "num_classes": 10,
      "half_precision": args.precision == "bfloat16",
      "input.data_pipeline": "resident", "warmup_epochs": warmup, "num_epochs": epochs - warmup,
      "eval_every_epochs": args.eval_every,
      "eval_batch_size": min(EVAL_BATCH, test_images),  # a smoke run pads no 1000-image batch
      # One call of K steps an epoch: the training scalars are the epoch's means.
      "log_every_steps": steps_per_epoch, "checkpoint_every_steps": 10 ** 9,  # at the end only
      "ensemble_sizes": (1, 50) if "mcdo" in args.model else (1,), "seed": args.seed,
  }
  if "steps_per_call" in config:
    overrides["steps_per_call"] = args.steps_per_call
  if args.width:
    overrides["model_kwargs.width"] = args.width
  return config_lib.with_overrides(config, overrides)


def recipe_record(config, steps_per_epoch: int, normalization: str) -> dict:
  keys = ("model", "optimizer", "learning_rate", "momentum", "nesterov", "weight_decay",
          "warmup_epochs", "num_epochs", "lr_schedule", "lr_milestones", "lr_decay",
          "half_precision", "seed", "eval_every_epochs", "eval_batch_size", "ensemble_sizes")
  record = {k: config[k] for k in keys}
  steps_per_call = config.get("steps_per_call", 0) or config.log_every_steps
  return {"config": "configs/cifar_resnet.py", **record,
          "epochs": config.warmup_epochs + config.num_epochs,
          "batch_size": config.input.batch_size, "steps_per_epoch": steps_per_epoch,
          "data_pipeline": config.input.data_pipeline, "steps_per_call": steps_per_call,
          "width": config.model_kwargs.get("width"), "normalization": normalization,
          # half_precision computes the evaluations in bfloat16 too (the model's dtype)
          "evaluation_dtype": "bfloat16" if config.half_precision else "float32"}


class EpochProgress:
  """A training callback: at every epoch end, waits for the step, measures the epoch (from the
  dispatch of its first call: the device idles while the host evaluates), prints a progress line,
  rewrites the JSON, and with a budget asks the loop to stop when the next epoch would not end in
  time."""

  def __init__(self, steps_per_epoch, num_steps, batch_size, started, budget_s, reserve_s,
               on_epoch):
    self.steps_per_epoch, self.num_steps, self.batch_size = steps_per_epoch, num_steps, batch_size
    self.started, self.budget_s, self.reserve_s = started, budget_s, reserve_s
    self.on_epoch = on_epoch
    self.epochs: list = []
    self.first_dispatch = None  # the first call of this epoch, once dispatched
    self.last_ready = None
    self.train_started = None
    self.stop = False

  def on_start(self, step, state):
    self.train_started = time.perf_counter()

  def on_step(self, step, state):
    import jax
    now = time.perf_counter()
    if self.first_dispatch is None:
      self.first_dispatch = now
    if step % self.steps_per_epoch and step != self.num_steps:
      return
    jax.block_until_ready(state.step)
    ready = time.perf_counter()
    epoch = -(-step // self.steps_per_epoch)
    train_s = ready - self.first_dispatch
    row = {"epoch": epoch, "step": step, "train_seconds": train_s,
           "images_per_s": self.steps_per_epoch * self.batch_size / train_s,
           # compilation (first epoch), or the evaluation and host work after the last epoch
           "before_seconds": self.first_dispatch - (self.last_ready or self.train_started),
           "elapsed_seconds": ready - self.started}
    self.epochs.append(row)
    self.first_dispatch, self.last_ready = None, ready
    recent = self.epochs[1:][-10:] or self.epochs
    per_epoch = float(np.mean([r["train_seconds"] + r["before_seconds"] for r in recent]))
    left = (self.num_steps - step) / self.steps_per_epoch
    eta = left * per_epoch + self.reserve_s
    row["eta_seconds"] = eta
    log(f"epoch {epoch}/{self.num_steps // self.steps_per_epoch}: {row['images_per_s']:,.0f} "
        f"images/s ({train_s:.2f} s; {row['before_seconds']:.2f} s before it), elapsed "
        f"{duration(row['elapsed_seconds'])}, ETA {duration(eta)} (end at "
        f"{duration(row['elapsed_seconds'] + eta)})")
    if self.budget_s and step < self.num_steps:
      self.stop = row["elapsed_seconds"] + per_epoch + self.reserve_s > self.budget_s
    self.on_epoch()

  def should_stop(self, step):
    return self.stop

  def on_checkpoint(self, step):
    pass

  def close(self):
    pass


def curve(scalars: dict, epochs: list, steps_per_epoch: int) -> list:
  """Per epoch: the timing of :class:`EpochProgress` and the TensorBoard scalars at its last
  step (``train_*`` every epoch; ``eval_*`` every ``eval_every_epochs``)."""
  rows = []
  for row in epochs:
    values = scalars.get(row["step"], {})
    rows.append({**row, **{k: v for k, v in sorted(values.items())
                           if k.startswith(("train_", "eval_"))}})
  return rows


def final_metrics(rows: list) -> dict:
  """``{"n1": {...}, "n50": {...} or None}`` of the evaluator's rows."""
  keep = ("count", "nll", "acc", "ece", "brier", "top5")
  by_size = {int(r["ensemble_size"]): {k: float(r[k]) for k in keep if k in r} for r in rows}
  return {"n1": by_size.get(1), "n50": by_size.get(50)}


def versus_reference(model: str, final: dict) -> dict | None:
  reference = REFERENCE[model]
  ours = final[f"n{reference['ensemble_size']}"]
  if ours is None:
    return None
  return {"ensemble_size": reference["ensemble_size"],
          **{f"{k}_ours_minus_reference": ours[k] - reference[k] for k in ("nll", "acc", "ece")}}


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("model", choices=MODELS)
  parser.add_argument("--data", default=None,
                      help="the cifar10_jpeg folder (default: .devdata/cifar10_jpeg, else "
                           "../shared/data/cifar10_jpeg)")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results"),
                      help="folder of the JSON (default experiments/results)")
  parser.add_argument("--smoke", action="store_true",
                      help=f"{SMOKE['epochs']} epochs on {SMOKE['train_images']} training and "
                           f"{SMOKE['test_images']} test images, width {SMOKE['width']}: a CPU "
                           "check")
  parser.add_argument("--width", type=int, default=None, help="stem width (default: the model's)")
  parser.add_argument("--epochs", type=int, default=None,
                      help="epochs in all, warm-up included (default: the recipe's 201)")
  parser.add_argument("--eval-every", type=int, default=1,
                      help="test NLL/accuracy/ECE (N = 1) every this many epochs (default 1)")
  parser.add_argument("--steps-per-call", type=int, default=0,
                      help="config.steps_per_call (0: log_every_steps, one epoch a call)")
  parser.add_argument("--budget-min", type=float, default=0.0,
                      help="stop training (then evaluate) when the next epoch would end later "
                           "than this many minutes after the start, less --reserve-s (0: off)")
  parser.add_argument("--reserve-s", type=float, default=None,
                      help="seconds kept for the final evaluation (default 40 for MC dropout "
                           "models, 15 otherwise)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--precision", choices=("bfloat16", "float32"), default="bfloat16",
                      help="the computation's dtype (config.half_precision; default bfloat16, the "
                           "issue's; float32: a CPU check in a hurry)")
  parser.add_argument("--normalization", choices=("paper", "data"), default="paper",
                      help="paper: SS's CIFAR-10 mean/std (the recipe's on TFDS cifar10); data: "
                           "the training split's statistics (the npz: default)")
  parser.add_argument("--decode-workers", type=int, default=None,
                      help="processes decoding the JPEGs (default min(8, CPUs); smoke 1)")
  parser.add_argument("--cache", default=None,
                      help="folder for the decoded npz: dataset (default: a temporary one)")
  parser.add_argument("--workdir", default=None,
                      help="training workdir (default: a temporary one, removed)")
  parser.add_argument("--git-commit", default=None,
                      help="recorded commit (default: git rev-parse HEAD, else 'unknown')")
  args = parser.parse_args(argv)
  if args.data is None:
    args.data = next((d for d in DEFAULT_DATA if os.path.isdir(d)), DEFAULT_DATA[-1])
  if args.smoke:
    args.epochs = args.epochs or SMOKE["epochs"]
    args.width = args.width or SMOKE["width"]
  if args.decode_workers is None:
    args.decode_workers = 1 if args.smoke else min(8, os.cpu_count() or 1)
  if args.reserve_s is None:
    args.reserve_s = 40.0 if "mcdo" in args.model else 15.0
  if args.epochs is not None and args.epochs < 1 or args.eval_every < 1:
    parser.error("--epochs and --eval-every must be at least 1")
  return args


def main(argv=None) -> dict:
  started = time.perf_counter()
  args = parse_args(argv)
  if importlib.util.find_spec("smoothing_jax") is None:  # not installed (the device machine)
    sys.path.insert(0, ROOT)
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  name = f"reproduce_gpu_{args.model}{'_smoke' if args.smoke else ''}.json"
  os.makedirs(args.out, exist_ok=True)
  out_path = os.path.join(args.out, name)
  with contextlib.ExitStack() as stack:
    temporary = lambda prefix: stack.enter_context(  # noqa: E731
        tempfile.TemporaryDirectory(prefix=prefix))
    cache = args.cache or temporary("reproduce_gpu_data_")
    workdir = args.workdir or temporary("reproduce_gpu_workdir_")
    return run(args, started, date, out_path, cache, workdir)


def run(args, started, date, out_path, cache, workdir) -> dict:
  limits = ((SMOKE["train_images"], SMOKE["test_images"]) if args.smoke else (None, None))
  log(f"decoding {args.data} (in up to {args.decode_workers} processes)")
  data = prepare_data(args.data, cache, *limits, args.decode_workers)
  data_s = time.perf_counter() - started

  import jax  # after the decoding: its workers are spawned before JAX starts its threads

  from smoothing_jax.evaluators import ensemble_sizes
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.training import train
  from smoothing_jax.training.callbacks import Preempted
  from smoothing_jax.training.writers import show_only_our_info_lines

  show_only_our_info_lines()
  batch_size = 128
  steps_per_epoch = data["train_images"] // batch_size
  if steps_per_epoch < 1:
    raise ValueError(f"{data['train_images']} training images: fewer than one batch of 128.")
  config = build_config(args, cache, steps_per_epoch, data["test_images"])
  assert config.input.batch_size == batch_size, config.input.batch_size
  epochs = config.warmup_epochs + config.num_epochs
  num_steps = epochs * steps_per_epoch
  result = {
      "script": "experiments/reproduce_gpu.py", "model": args.model,
      "mode": "smoke" if args.smoke else "full", "status": "training", "date": date,
      "git_commit": args.git_commit or git_commit(), "environment": environment(),
      "recipe": recipe_record(config, steps_per_epoch, args.normalization),
      "data": {"source": os.path.abspath(args.data), "format": "cifar10_jpeg (JPEG quality 75, "
               "decoded with Pillow into an npz: folder)", **data, "caveat": DATA_CAVEAT},
      "reference": {"source": REFERENCE_SOURCE, **REFERENCE[args.model]},
      "projection_h200": h200_projection(args.model, eval_every=args.eval_every),
  }
  if not args.smoke and result["projection_h200"]:
    minutes = result["projection_h200"]["total_minutes"]
    log(f"projected on the H200 of the device check: {minutes['optimistic']:.1f} to "
        f"{minutes['pessimistic']:.1f} min")
  log(f"{args.model} on {jax.devices()[0].device_kind}: {epochs} epochs of {steps_per_epoch} "
      f"steps, {args.precision}, evaluation every {args.eval_every} epoch(s)")

  def save(status=None):
    if status:
      result["status"] = status
    result["curve"] = curve(read_scalars(workdir), progress.epochs, steps_per_epoch)
    write_json(out_path, result)

  progress = EpochProgress(steps_per_epoch, num_steps, batch_size, started,
                           args.budget_min * 60, args.reserve_s, save)
  train_started = time.perf_counter()
  with paper_normalization(args.normalization == "paper"):
    opened = Run.from_config(config, workdir)
  with opened as the_run:
    assert the_run.pipeline.steps_per_epoch == steps_per_epoch, the_run.pipeline.steps_per_epoch
    try:
      train.train(the_run, callbacks=[progress])
      status = "complete"
    except Preempted:  # our budget stopped it after a checkpoint
      status = "stopped_by_budget"
    train_s = time.perf_counter() - train_started
    log(f"training: {duration(train_s)} ({status}); evaluating N = "
        f"{', '.join(map(str, config.ensemble_sizes))} on {data['test_images']} test images")
    eval_started = time.perf_counter()
    rows = ensemble_sizes.evaluate(the_run, os.path.join(workdir, "results"),
                                   sizes=config.ensemble_sizes)
    eval_s = time.perf_counter() - eval_started
    trained_steps = the_run.step
  final = final_metrics(rows)
  epochs_rows = progress.epochs
  steady = [r["images_per_s"] for r in epochs_rows[1:]] or [r["images_per_s"] for r in epochs_rows]
  train_steps_s = sum(r["train_seconds"] for r in epochs_rows)
  result.update({
      "trained_steps": trained_steps, "trained_epochs": trained_steps / steps_per_epoch,
      "final": final, "versus_reference": versus_reference(args.model, final),
      "images_per_s": {"median_epoch_after_first": float(np.median(steady)),
                       "mean_all_epochs": len(epochs_rows) * steps_per_epoch * batch_size
                       / train_steps_s if train_steps_s else None},
      "wall_seconds": {
          "total": time.perf_counter() - started, "data": data_s,
          "training": train_s,  # train(): building the run, compiling, every epoch, checkpoint
          "training_steps": train_steps_s,  # the epochs' device time, from their first dispatch
          "first_epoch_compile_and_setup": epochs_rows[0]["before_seconds"] if epochs_rows
                                           else None,
          "between_epochs": sum(r["before_seconds"] for r in epochs_rows[1:]),  # evals, host
          "evaluation": eval_s},  # ensemble_sizes at N = 1 (and 50), compilation included
  })
  save(status)
  n1, n50 = final["n1"], final["n50"]
  summary = f"N=1 NLL {n1['nll']:.4f} acc {100 * n1['acc']:.2f}% ECE {100 * n1['ece']:.2f}%"
  if n50:
    summary += (f"; N=50 NLL {n50['nll']:.4f} acc {100 * n50['acc']:.2f}% ECE "
                f"{100 * n50['ece']:.2f}%")
  reference = REFERENCE[args.model]
  print(f"{args.model}: {summary} (SS N={reference['ensemble_size']}: NLL {reference['nll']}, "
        f"acc {100 * reference['acc']:.1f}%, ECE {100 * reference['ece']:.2f}%); "
        f"{duration(result['wall_seconds']['total'])} in all; {out_path}", flush=True)
  return result


if __name__ == "__main__":
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.INFO)  # the loop's per-epoch scalars and progress lines
  main()
