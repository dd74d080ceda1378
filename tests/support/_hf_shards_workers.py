"""Targets for tests/interop/test_hf_shards.py run in several jax processes
(see _multiprocess)."""

import numpy as np

SPECS = {  # mesh (data=2 over the processes, model=2 within each)
    "rows": ("data",),  # each process its rows
    "cols": (None, "data"),  # each process a column block: a run per row
    "both": ("data", "model"),
    "inner": ("model",),  # replicated over data: process 0 writes it all
}
SHAPES = {"rows": (8, 6), "cols": (5, 8), "both": (6, 4), "inner": (4, 6)}


def full_values() -> dict:
    rng = np.random.default_rng(11)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def save_hf(ctx, directory: str):
    """A manager save with hf_shards from every process; the bytes this process's
    shards item wrote and those its replica-0 regions hold."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    full = full_values()
    tree = {
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(ctx.mesh, P(*SPECS[k])), lambda idx, v=v: v[idx]
        )
        for k, v in full.items()
    }
    hf = fop.HFShards(every_steps=1, transposes=["both"], max_shard_bytes=200)
    with fop.CheckpointManager(directory, hf_shards=hf) as mngr:
        mngr.save(1, {"params": tree})
        mngr.wait()
    pending = hf.save(fop.Location.from_path(f"{directory}/direct-{ctx.process_id}"), tree)
    mine = sum(
        s.data.nbytes for v in tree.values() for s in v.addressable_shards if s.replica_id == 0
    )
    return {"written": pending.wait().bytes_written, "mine": mine}
