"""Training: the run's config, mesh and data, the train state and optimizer, the losses on each
parallel path, the `Trainer`, its workdir, and stage-cost measurement for `schedule=auto`."""
