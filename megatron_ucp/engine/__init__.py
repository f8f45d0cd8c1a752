"""The checkpoint engine: save plans, the collective save and load (async, read-once),
ownership of a save folder, agreement across ranks. Imports the format and the megatron glue."""
