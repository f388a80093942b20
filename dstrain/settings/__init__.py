"""What a run is told: the trainer config (config: typed sections, recipes, key=value overrides,
validation) and the batch arithmetic it checks (ramp: global = micro x accumulation x ranks, the
batch-size ramp's stages). Imports only dstrain.core."""
