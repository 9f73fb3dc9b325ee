"""leat-sampler-xtc: the XTC ("exclude top choices") sampler stage."""
