"""jaxpipe: pipeline, expert and context parallel LLM training in JAX."""

__version__ = "0.1.0"


def __getattr__(name):
  # Lazy so that `jaxpipe.pipeline` (schedule IR, no JAX) imports without JAX.
  if name == "Trainer":
    from jaxpipe.training.trainer import Trainer

    return Trainer
  if name == "resolve":
    from jaxpipe.training.resolve import resolve

    return resolve
  raise AttributeError(name)
