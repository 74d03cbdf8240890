"""Single-device array ops the layers are built from: attention backends, FP8 GEMMs,
varying-axes helpers.

Nothing here knows of meshes beyond the axis names it is handed, nor of models.
"""
