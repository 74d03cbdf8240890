"""Choosing a schedule and a layout: the cost model, the auto choice, the memory and layout
model, and the planned-against-measured ticks.

`costs` (cost files, predicted step time and memory), `auto` (`pipeline.schedule=auto`'s
ranking) and `layout` (the layout planner's model) are pure Python and numpy over the schedule IR;
`ticks` reads a profile of the compiled step (JAX, imported where it is used). What measures a
model's stage costs on the devices, and what applies a choice to a training config, live in
`jaxpipe.training` (`stage_timing`, `plan`), above this package.
"""
