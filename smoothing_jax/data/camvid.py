"""TFDS builder for CamVid (Brostow et al. 2008): 11-class road-scene segmentation with video
context.

Reads the standard release from ``manual_dir``:

* ``701_StillsRaw_full/<seq>_<frame>.png`` — the 701 labelled 960×720 stills
  (e.g. ``0001TP_006690.png``, ``0006R0_f00930.png``, ``Seq05VD_f00000.png``);
* ``LabeledApproved_full/<seq>_<frame>_L.png`` — their colour-coded label maps
  (32 classes, ``label_colors.txt``);
* ``sequences/`` (only for the ``clips`` config) — the 30 Hz video frames,
  extracted from the released videos, named like the stills (``0001TP_006686.png``;
  sub-folders allowed).

Images are resized bilinearly to 360×480 (paper Appendix A.2), label maps by
nearest neighbour.  The 32 colours are merged into the 11 classes of SegNet /
Kendall & Gal (temporal-smoothing reference grouping, :data:`CLASS_GROUPS`);
``Void`` and unknown colours become :data:`VOID` (= 11, outside ``[0, 11)``),
which every loss and metric masks out.  Splits are SegNet's 367/101/233
(train / validation / test), defined by sequence and frame number
(:func:`split_of`).  Configs:

* ``camvid/labeled`` (default): ``image`` [360, 480, 3], ``label`` [360, 480, 1], ``name``;
* ``camvid/clips``: the same plus ``frames`` [6, 360, 480, 3], the labelled
  frame and the 5 frames before it at 30 Hz (oldest first; the reference's
  ``offset=(5, 0)``), for temporal smoothing and consistency.  A still less than
  5 frames after the start of its video (``Seq05VD_f00000``) repeats the video's
  first frame in place of the frames that do not exist.
"""
from __future__ import annotations

import os
import re

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

CLASSES = ("sky", "building", "pole", "road", "pavement", "tree", "sign_symbol", "fence", "car",
           "pedestrian", "bicyclist")
VOID = len(CLASSES)
IMAGE_SIZE = (360, 480)
CLIP_LENGTH = 6
STILLS_DIR, LABELS_DIR, SEQUENCES_DIR = "701_StillsRaw_full", "LabeledApproved_full", "sequences"

# label_colors.txt: RGB → CamVid class, grouped into the 11 classes (anything else is void).
CLASS_GROUPS = {
    "sky": {
        "Sky": (128, 128, 128)
    },
    "building": {
        "Building": (128, 0, 0),
        "Bridge": (0, 128, 64),
        "Wall": (64, 192, 0),
        "Tunnel": (64, 0, 64),
        "Archway": (192, 0, 128)
    },
    "pole": {
        "Column_Pole": (192, 192, 128),
        "TrafficCone": (0, 0, 64)
    },
    "road": {
        "Road": (128, 64, 128),
        "LaneMkgsDriv": (128, 0, 192),
        "LaneMkgsNonDriv": (192, 0, 64)
    },
    "pavement": {
        "Sidewalk": (0, 0, 192),
        "ParkingBlock": (64, 192, 128),
        "RoadShoulder": (128, 128, 192)
    },
    "tree": {
        "Tree": (128, 128, 0),
        "VegetationMisc": (192, 192, 0)
    },
    "sign_symbol": {
        "SignSymbol": (192, 128, 128),
        "Misc_Text": (128, 128, 64),
        "TrafficLight": (0, 64, 64)
    },
    "fence": {
        "Fence": (64, 64, 128)
    },
    "car": {
        "Car": (64, 0, 128),
        "SUVPickupTruck": (64, 128, 192),
        "Train": (192, 64, 128),
        "Truck_Bus": (192, 128, 192),
        "OtherMoving": (128, 64, 64)
    },
    "pedestrian": {
        "Pedestrian": (64, 64, 0),
        "Child": (192, 128, 64),
        "CartLuggagePram": (64, 0, 192),
        "Animal": (64, 128, 64)
    },
    "bicyclist": {
        "Bicyclist": (0, 128, 192),
        "MotorcycleScooter": (192, 0, 192)
    },
}
_FILE = re.compile(r"^(?P<sequence>[0-9A-Za-z]+)_(?P<frame>f?\d+)(?:_L)?\.png$")


def colour_lookup() -> np.ndarray:
  """``[2^24]`` uint8 table from packed RGB (r·65536 + g·256 + b) to class index; void
  elsewhere."""
  table = np.full(1 << 24, VOID, np.uint8)
  for index, name in enumerate(CLASSES):
    for r, g, b in CLASS_GROUPS[name].values():
      table[(r << 16) | (g << 8) | b] = index
  return table


def colours_to_labels(rgb: np.ndarray, table: np.ndarray | None = None) -> np.ndarray:
  """Colour-coded label map ``[H, W, 3]`` uint8 → class indices ``[H, W]`` uint8 (void = 11)."""
  rgb = np.asarray(rgb, np.int64)
  table = colour_lookup() if table is None else table
  return table[(rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]]


def parse_name(filename: str) -> tuple[str, int, str]:
  """``"0006R0_f00930.png"`` → ``("0006R0", 930, "f00930")``; a clear error for other names."""
  match = _FILE.match(os.path.basename(filename))
  if not match:
    raise ValueError(
        f"Not a CamVid frame name: {filename!r} (expected <sequence>_<frame>[_L].png).")
  frame = match["frame"]
  return match["sequence"], int(frame.lstrip("f")), frame


def split_of(sequence: str, frame: int) -> str:
  """SegNet's split: test = 0001TP from frame 8550 on and Seq05VD; validation = 0016E5 frames
  7959–8159 (the 15 Hz part); train = every other still (367 / 101 / 233 of the 701)."""
  if sequence == "Seq05VD" or (sequence == "0001TP" and frame >= 8550):
    return "test"
  if sequence == "0016E5" and 7959 <= frame <= 8159:
    return "validation"
  return "train"


def resize_image(image: np.ndarray, size=IMAGE_SIZE) -> np.ndarray:
  """Bilinear resize of a uint8 ``[H, W, 3]`` image to ``size`` (rounded back to uint8)."""
  if tuple(image.shape[:2]) == tuple(size):
    return np.asarray(image, np.uint8)
  resized = tf.image.resize(tf.cast(image, tf.float32), size, method="bilinear").numpy()
  return np.clip(np.round(resized), 0, 255).astype(np.uint8)


def resize_labels(labels: np.ndarray, size=IMAGE_SIZE) -> np.ndarray:
  """Nearest-neighbour resize of class indices ``[H, W]`` to ``size``."""
  if tuple(labels.shape[:2]) == tuple(size):
    return labels
  return tf.image.resize(labels[..., None], size, method="nearest").numpy()[..., 0].astype(np.uint8)


def _read_rgb(path: str) -> np.ndarray:
  return tf.io.decode_png(tf.io.read_file(path), channels=3).numpy()


class CamvidConfig(tfds.core.BuilderConfig):
  def __init__(self, *, clip_length: int, **kwargs):
    super().__init__(**kwargs)
    self.clip_length = clip_length


class Camvid(tfds.core.GeneratorBasedBuilder):
  """CamVid at 360×480 with 11 classes (+ void = 11), SegNet splits, optional 30 Hz clips."""
  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Download CamVid (http://mi.eng.cam.ac.uk/research/projects/VideoRec/CamVid/): the stills "
      "(701_StillsRaw_full.zip) and labels (LabeledApproved_full.zip) into "
      f"manual_dir/{STILLS_DIR} and manual_dir/{LABELS_DIR}. For camvid/clips also extract the "
      f"30 Hz frames of the videos into manual_dir/{SEQUENCES_DIR}, named like the stills "
      "(e.g. 0001TP_006686.png, Seq05VD_f00001.png)."
  )
  BUILDER_CONFIGS = [
      CamvidConfig(name="labeled", clip_length=0, description="Labelled stills."),
      CamvidConfig(
          name="clips",
          clip_length=CLIP_LENGTH,
          description=f"Labelled stills with the {CLIP_LENGTH - 1} preceding 30 Hz video frames."),
  ]

  def _info(self):
    features = {"image": tfds.features.Image(shape=IMAGE_SIZE + (3,)),
                "label": tfds.features.Image(shape=IMAGE_SIZE + (1,)),
                "name": tfds.features.Text()}
    if self.builder_config.clip_length:
      features["frames"] = tfds.features.Sequence(tfds.features.Image(shape=IMAGE_SIZE + (3,)),
                                                  length=self.builder_config.clip_length)
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(features), supervised_keys=("image", "label"),
        homepage="http://mi.eng.cam.ac.uk/research/projects/VideoRec/CamVid/")

  def _split_generators(self, dl_manager):
    root = dl_manager.manual_dir
    stills_dir = os.path.join(root, STILLS_DIR)
    if not os.path.isdir(stills_dir):
      raise FileNotFoundError(f"CamVid stills not found: {stills_dir} does not exist. "
                              f"{self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    splits = {"train": [], "validation": [], "test": []}
    for filename in sorted(os.listdir(stills_dir)):
      if filename.endswith(".png"):
        sequence, frame, _ = parse_name(filename)
        splits[split_of(sequence, frame)].append(filename)
    frames = self._sequence_frames(root) if self.builder_config.clip_length else {}
    return {split: self._generate_examples(root, names, frames) for split, names in splits.items()}

  def _sequence_frames(self, root):
    """``{(sequence, frame number): path}`` of every extracted video frame."""
    sequences_dir = os.path.join(root, SEQUENCES_DIR)
    if not os.path.isdir(sequences_dir):
      raise FileNotFoundError(f"camvid/clips needs the video frames in {sequences_dir}. "
                              f"{self.MANUAL_DOWNLOAD_INSTRUCTIONS}")
    frames = {}
    for directory, _, files in sorted(os.walk(sequences_dir)):
      for filename in files:
        if filename.endswith(".png"):
          sequence, frame, _ = parse_name(filename)
          frames[(sequence, frame)] = os.path.join(directory, filename)
    return frames

  def _generate_examples(self, root, names, frames):
    table = colour_lookup()
    first_frame = {}  # each video's first frame number
    for sequence, number in frames:
      first_frame[sequence] = min(number, first_frame.get(sequence, number))
    for filename in names:
      stem = filename[:-len(".png")]
      label_path = os.path.join(root, LABELS_DIR, stem + "_L.png")
      if not os.path.exists(label_path):
        label_path = os.path.join(root, LABELS_DIR, filename)
      if not os.path.exists(label_path):
        raise FileNotFoundError(
            f"No label map for still {filename} in {os.path.join(root, LABELS_DIR)}.")
      image = resize_image(_read_rgb(os.path.join(root, STILLS_DIR, filename)))
      labels = resize_labels(colours_to_labels(_read_rgb(label_path), table))
      example = {"image": image, "label": labels[..., None], "name": stem}
      if self.builder_config.clip_length:
        sequence, frame, _ = parse_name(filename)
        first = min(first_frame.get(sequence, frame), frame)
        clip = []
        for previous in range(frame - self.builder_config.clip_length + 1, frame):
          previous = max(previous, first)  # before the video starts: repeat its first frame
          if previous == frame:
            clip.append(image)
            continue
          if (sequence, previous) not in frames:
            raise FileNotFoundError(
                f"Video frame {previous} of sequence {sequence} (before still {filename}) "
                f"is missing from {os.path.join(root, SEQUENCES_DIR)}.")
          clip.append(resize_image(_read_rgb(frames[(sequence, previous)])))
        example["frames"] = np.stack(clip + [image])
      yield stem, example


def num_examples(config: str, split: str, data_dir: str | None = None) -> int:
  """Examples in split ``split`` of ``camvid/<config>`` (all processes together)."""
  return tfds.builder(f"camvid/{config}", data_dir=data_dir).info.splits[split].num_examples


def load_clips(split: str = "test", data_dir: str | None = None):
  """This process's share of ``camvid/clips``: ``(frames uint8 [N, T, H, W, 3],
  labels int32 [N, H, W], names [N])``; the label map belongs to the last frame of each clip
  (void = 11)."""
  builder = tfds.builder("camvid/clips", data_dir=data_dir)
  if not builder.is_prepared():
    raise FileNotFoundError(
        f"camvid/clips is not prepared in {builder.data_dir_root}: run "
        f"`tfds build smoothing_jax/data/camvid.py --config=clips --manual_dir=<CamVid release> "
        f"--data_dir=<dir>` first. {Camvid.MANUAL_DOWNLOAD_INSTRUCTIONS}")
  ds = builder.as_dataset(split=tfds.split_for_jax_process(split), shuffle_files=False)
  frames, labels, names = [], [], []
  for example in tfds.as_numpy(ds):
    frames.append(example["frames"])
    labels.append(example["label"][..., 0])
    names.append(example["name"].decode())
  return np.stack(frames), np.stack(labels).astype(np.int32), names


def palette() -> np.ndarray:
  """``[12, 3]`` uint8 display colours: each class's CamVid colour, then black for void."""
  return np.asarray([next(iter(CLASS_GROUPS[name].values())) for name in CLASSES] + [(0, 0, 0)],
                    np.uint8)


def prepare(manual_dir: str, data_dir: str | None = None, configs=("labeled", "clips")):
  """Build ``camvid/<config>`` for each of ``configs`` from the release in ``manual_dir``."""
  for name in configs:
    tfds.builder(f"camvid/{name}", data_dir=data_dir).download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))


if __name__ == "__main__":
  import argparse
  parser = argparse.ArgumentParser(
      description="Prepare the CamVid TFDS datasets from the downloaded release.")
  parser.add_argument("--manual_dir",
                      required=True,
                      help="folder with 701_StillsRaw_full/, LabeledApproved_full/ "
                      "and (for clips) sequences/")
  parser.add_argument("--data_dir",
                      default=None,
                      help="TFDS data_dir (default: ~/tensorflow_datasets)")
  parser.add_argument("--configs", default="labeled,clips", help="comma-separated: labeled, clips")
  args = parser.parse_args()
  prepare(args.manual_dir, args.data_dir, args.configs.split(","))
