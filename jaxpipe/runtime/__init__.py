"""Run infrastructure that knows no model: process set-up, hosts, signals, checkpoints, metrics.

The ground floor: nothing here imports another jaxpipe package, and `process` and `files` import
no JAX at all (so `process.use_host_devices()` can run before JAX starts).
"""
