"""The corruption types of the -C test sets (Hendrycks & Dietterich 2019) by their canonical
names (the paper's, SS's and Hendrycks' file names): what dataset names parse
(:mod:`~smoothing_jax.data.datasets`) and the configs of our CIFAR-100-C TFDS builder
(:mod:`~smoothing_jax.data.cifar100_corrupted`).  No TensorFlow."""

CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
               "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
               "elastic_transform", "pixelate", "jpeg_compression")
EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
