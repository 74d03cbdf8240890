"""The schedule IR: pipeline schedules as data, in pure Python and numpy (no JAX).

`schedule` (actions, placements, `Schedule`), `schedules/` (one generator per published
schedule), `validate` and `deps` (dependencies), `simulate` and `formulas` (bubbles and memory
against the papers), `export` (text, CSV, Perfetto, PNG), `lower` (integer tick tables for the
executor). Pricing and choosing schedules is `jaxpipe.planning`'s.
"""

from jaxpipe.pipeline.ir.schedule import Action, Op, Overlap, Placement, Schedule
from jaxpipe.pipeline.ir.schedules import SCHEDULE_NAMES, make_schedule
from jaxpipe.pipeline.ir.validate import ScheduleError, validate

__all__ = [
    "Action",
    "Op",
    "Overlap",
    "Placement",
    "Schedule",
    "SCHEDULE_NAMES",
    "make_schedule",
    "ScheduleError",
    "validate",
]
