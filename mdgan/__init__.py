"""mdgan, the library: one GAN trained over data spread across workers (MD-GAN and four others).

    import mdgan
    config = mdgan.TrainingConfig(workers=4, iterations=200)
    summary = mdgan.simulate(config, mdgan.DataConfig("synthetic"), "runs/x")   # the whole run, in this process
    run = mdgan.load_run("runs/x")                 # its generator, config and scores
    images, labels = run.sample(16, classes=[3])   # (16, 784) in [-1, 1], and the labels (16,)

docs/API.md has the examples (each run by a test); docs/ALGORITHMS.md the layout of the package.
"""

# Loaded when first used (PEP 562): `import mdgan.config` (the health checks' path) must stay light.
_API = {"DataConfig": "mdgan.config", "ModelSpec": "mdgan.config", "TrainingConfig": "mdgan.config",
        "Run": "mdgan.sampling", "load_run": "mdgan.sampling", "simulate": "mdgan.simulation"}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'mdgan' has no attribute {name!r}")
