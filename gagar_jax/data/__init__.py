"""TFDS builders for task pools (``gagar_jax.data.tfds_builders``; needs the ``data`` extra).

Import the builders module explicitly: it imports tensorflow_datasets, which the core install
does not need.
"""
