"""Pipeline schedules as data (no JAX) and the scan executor that runs them
(JAX, imported lazily)."""

from jaxpipe.pipeline.ir import (
    SCHEDULE_NAMES,
    Action,
    Op,
    Overlap,
    Placement,
    Schedule,
    ScheduleError,
    make_schedule,
    validate,
)

__all__ = [
    "Action",
    "Op",
    "Overlap",
    "PipelineSharding",
    "Placement",
    "Schedule",
    "SCHEDULE_NAMES",
    "make_schedule",
    "ScheduleError",
    "validate",
    "value_and_grad",
    "layered",
]


def __getattr__(name):
  # JAX only when the executor is asked for, so the schedule IR imports without it.
  if name == "value_and_grad":
    from jaxpipe.pipeline.api import value_and_grad

    return value_and_grad
  if name == "PipelineSharding":
    from jaxpipe.pipeline.sharding import PipelineSharding

    return PipelineSharding
  if name == "layered":
    from jaxpipe.pipeline.executor import layered

    return layered
  raise AttributeError(f"module 'jaxpipe.pipeline' has no attribute {name!r}")
