"""Pipeline schedules as data (no JAX) and the scan executor that runs them (JAX, imported lazily)."""
from jaxpipe.pipeline.ir import Action, Op, Overlap, Placement, Schedule
from jaxpipe.pipeline.schedules import SCHEDULE_NAMES, make_schedule
from jaxpipe.pipeline.validate import ScheduleError, validate
