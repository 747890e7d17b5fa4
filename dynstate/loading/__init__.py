"""Loading: the map-style dataset over one version, its shard cache and batch assembly, the
sampler and its position, and checkpoint inspection. Exact resume lives here; nothing here
writes to a store except through :class:`dynstate.Store`."""
