"""Run infrastructure that knows no model: process set-up, command lines, hosts, signals,
checkpoints, metrics.

The ground floor: nothing here imports another jaxpipe package, and `process`, `files` and `cli`
(the runners' absl command lines) import no JAX at all (so `process.use_host_devices()` can run
before JAX starts, and `python -m jaxpipe.schedule` runs without it).
"""
