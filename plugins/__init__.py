"""Built-in autotune plugins; each sub-package registers through the ``autotune`` entry-point group."""
